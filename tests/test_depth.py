"""--method depth: whole blocks removed (optimizer/depth.py)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimizer.adapters import get_adapter
from optimizer.depth import BlockInfluence, blocks_to_keep, remove_blocks, skipped
from optimizer.errors import UserError
from optimizer.pipeline import DataConfig, HealSettings, OptimizeConfig, optimize
from tests.conftest import random_norms_and_biases, tiny_config, tiny_model

LAYERS = 6
MIXED = ["sliding_attention", "full_attention"] * (LAYERS // 2)  # every other layer: slicing shows


def deep_tiny(family: str, vocab_size: int = 512):
    torch.manual_seed(0)
    cfg = tiny_config(family, vocab_size)
    cfg.num_hidden_layers = LAYERS
    if family.startswith("gemma"):
        cfg.layer_types = list(MIXED)
    elif getattr(cfg, "layer_types", None):  # computed for the default depth: one type a layer
        cfg.layer_types = cfg.layer_types[:1] * LAYERS
    return random_norms_and_biases(AutoModelForCausalLM.from_config(cfg).eval())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3", "gemma2"])
def test_the_model_without_the_removed_blocks_equals_the_dense_model_skipping_them(family, tmp_path):
    """Also after a save and a load (the package's config: layer count, sliced layer types)."""
    model = deep_tiny(family)
    adapter = get_adapter(model.config)
    keep, removed = [0, 2, 3, 5], [1, 4]
    pruned = remove_blocks(model, adapter, keep)
    ids = torch.randint(0, 512, (2, 40))  # longer than the Gemma sliding window (16): both layer kinds act
    with torch.no_grad(), skipped(model, adapter, removed):
        ref = model(ids, use_cache=False).logits
    with torch.no_grad():
        torch.testing.assert_close(pruned(ids, use_cache=False).logits, ref, atol=1e-5, rtol=1e-5)
    assert len(adapter.blocks(model)) == LAYERS  # the dense model is untouched
    pruned.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.num_hidden_layers == len(keep)
    if family.startswith("gemma"):
        assert loaded.config.layer_types == [MIXED[i] for i in keep]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, use_cache=False).logits, ref, atol=1e-5, rtol=1e-5)
        # generation uses the KV cache, indexed by the renumbered blocks
        out = loaded.generate(ids[:1, :8], max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert out.shape == (1, 14)


def test_block_influence_keeps_the_first_the_last_and_the_blocks_that_change_the_stream_most():
    model = tiny_model("llama")
    model.config.num_hidden_layers = 4
    model.model.layers.extend(tiny_model("llama", seed=1).model.layers)  # 4 blocks
    adapter = get_adapter(model.config)
    with torch.no_grad():  # block 2 does nothing (zero output projections): least influence
        for lin in (adapter.attention(model.model.layers[2]).o, adapter.mlp(model.model.layers[2]).down):
            lin.weight.zero_()
    stats = BlockInfluence(adapter.blocks(model))
    for seed in range(2):
        stats.add_batch(model, torch.randint(0, 512, (32,), generator=torch.Generator().manual_seed(seed)))
    stats.close()
    influence = stats.influence()
    assert influence[2] == pytest.approx(0, abs=1e-6) and min(influence[1], influence[3]) > 0
    assert stats.keep(3) == [0, 1, 3]
    assert stats.keep(2) == [0, 3]


def test_blocks_to_keep_rounds_and_keeps_at_least_the_first_and_last():
    assert blocks_to_keep(30, 0.7) == 21 and blocks_to_keep(30, 0.5) == 15 and blocks_to_keep(6, 0.1) == 2


def _deep_dir(tmp_path, tokenizer, family="llama"):
    src = tmp_path / "src"
    deep_tiny(family, vocab_size=len(tokenizer)).save_pretrained(src)
    tokenizer.save_pretrained(src)
    return src


@pytest.mark.slow
def test_optimize_depth_writes_a_healed_int8_package_with_fewer_blocks(tmp_path, tokenizer, text_file):
    from optimizer import load
    src = _deep_dir(tmp_path, tokenizer, "gemma3")
    heal_text = tmp_path / "heal.txt"
    heal_text.write_text(" ".join(f"word{i % 97} and more text number {i}." for i in range(3000)))
    out = tmp_path / "pkg"
    r = optimize(OptimizeConfig(model=str(src), target="a100", method="depth", retain=0.5, out=str(out),
                                data=DataConfig(calib=str(text_file), eval=str(text_file), calib_windows=2,
                                                eval_windows=1, seq_len=64),
                                heal=HealSettings(tokens=256, seq_len=64, batch=2, chat=0, data=[str(heal_text)])),
                 log=lambda *_: None)
    m = r["manifest"]
    blocks = m.method["blocks"]
    assert m.method["name"] == "depth" and len(blocks["kept"]) == 3 and blocks["kept"][0] == 0
    assert blocks["kept"][-1] == LAYERS - 1 and sorted(blocks["kept"] + blocks["removed"]) == list(range(LAYERS))
    assert m.method["retain_achieved"] == pytest.approx(0.5)
    assert m.quantization["precision"] == "int8" and m.heal["steps"] >= 1
    assert m.checks["masked_vs_pruned_max_abs_logit_diff"] < 1e-3
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["layer_types"] == [MIXED[i] for i in blocks["kept"]]
    assert "## Blocks" in (out / "report.md").read_text()
    assert m.plan.prediction["weight_bytes_ratio"] > 1
    model, _ = load.load_model(load.resolve(str(out)))  # the compressed-tensors package reads back
    assert len(model.model.layers) == 3


@pytest.mark.parametrize("args, message", [
    ({"layout": "per-layer"}, "layout=per-layer needs --method structured"),
    ({"retain": 0.95}, "keeps all 6 blocks"),
    ({"retain_by": "latency"}, "drop retain_by"),
])
def test_what_depth_does_not_do_is_refused_in_one_line_before_any_work(tmp_path, tokenizer, args, message):
    src = _deep_dir(tmp_path, tokenizer)
    cfg = OptimizeConfig(model=str(src), target="a100", method="depth", out=str(tmp_path / "pkg"),
                         **{"retain": 0.5, **args})
    with pytest.raises(UserError, match=message):
        optimize(cfg, log=lambda *_: None)
    assert not (tmp_path / "pkg").exists()


def test_the_roofline_of_fewer_blocks_counts_their_bytes_and_the_whole_lm_head():
    from optimizer import plan as planner
    from optimizer.profiles import load_profile
    cfg = tiny_config("llama")
    cfg.num_hidden_layers = LAYERS
    adapter = get_adapter(cfg)
    shape = adapter.dense_shape(cfg)
    block, head = adapter.block_params(cfg, shape), cfg.vocab_size * cfg.hidden_size
    p = planner.roofline(load_profile("a100"), adapter, cfg, shape, layers=3)
    assert p["weight_bytes_ratio"] == pytest.approx((LAYERS * block + head) / (3 * block + head))
    assert planner.roofline(load_profile("a100"), adapter, cfg, shape)["weight_bytes_ratio"] == pytest.approx(1)


def test_a_fixed_cost_per_block_makes_fewer_whole_blocks_faster_than_narrower_ones_at_batch_16():
    """On SmolLM2's shapes at retain 0.7: the cpu profile charges every kept block a decode step's fixed
    cost (block_step_overhead_ms), which lowers the narrower layout's predicted speedup (it keeps all 30
    blocks), and whole blocks removed stay ahead at batch 16 at about the same bytes, in 16-bit and INT8."""
    import dataclasses

    from transformers import AutoConfig

    from optimizer import budget, load
    from optimizer import plan as planner
    from optimizer.profiles import load_profile
    cfg = AutoConfig.from_pretrained(load.resolve(None).hf_dir)
    adapter = get_adapter(cfg)
    cpu = load_profile("cpu")
    free = dataclasses.replace(cpu, block_overhead_ms={})
    assert cpu.block_overhead_s(16) > cpu.block_overhead_s(8) > cpu.block_overhead_s(1) > 0
    assert cpu.block_overhead_s(64) == cpu.block_overhead_s(16) and load_profile("a100").block_overhead_s(16) == 0
    narrower, kept = budget.uniform_candidates(adapter, cfg, 0.7)[0], blocks_to_keep(cfg.num_hidden_layers, 0.7)
    for quant in ("none", "int8"):
        width, width_free = (planner.roofline(t, adapter, cfg, narrower, quant=quant) for t in (cpu, free))
        assert width["decode_speedup_b16"] < width_free["decode_speedup_b16"]  # the fixed cost stays with every block
        depth = planner.roofline(cpu, adapter, cfg, adapter.dense_shape(cfg), layers=kept, quant=quant)
        assert depth["decode_speedup_b16"] > width["decode_speedup_b16"]
        assert depth["weight_bytes_ratio"] == pytest.approx(width["weight_bytes_ratio"], rel=0.05)


@pytest.mark.parametrize("family, fmt, quant", [("phi3", "vllm", "none"), ("llama", "onnx", "none"),
                                                ("llama", "onnx", "int8")])
@pytest.mark.slow
def test_a_depth_package_of_phi3_and_an_onnx_one_load_back_with_fewer_blocks(tmp_path, tokenizer, text_file,
                                                                             family, fmt, quant):
    """Phi-3's checkpoint is rewritten fused from the working model (its config carries the layer
    count); the ONNX exporter traces the kept blocks and validates them against PyTorch (INT8: the
    graph quantized by onnxruntime, against the twin with its activation hooks)."""
    from optimizer import load
    if family == "phi3":
        from tests.test_phi3 import tiny_phi3
        src = tmp_path / "src"
        tiny_phi3(len(tokenizer), num_hidden_layers=LAYERS).save_pretrained(src)
        tokenizer.save_pretrained(src)
    else:
        src = _deep_dir(tmp_path, tokenizer, family)
    out = tmp_path / "pkg"
    m = optimize(OptimizeConfig(model=str(src), target="a100", method="depth", retain=0.5, out=str(out), format=fmt,
                                data=DataConfig(calib=str(text_file), eval=str(text_file), calib_windows=2,
                                                eval_windows=1, seq_len=64),
                                heal=HealSettings(tokens=0), quant=quant), log=lambda *_: None)["manifest"]
    kept = m.method["blocks"]["kept"]
    assert len(kept) == 3 and json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3
    if fmt == "vllm":
        model, _ = load.load_model(load.resolve(str(out)))
        assert type(model).__name__ == "Phi3ForCausalLM" and len(model.model.layers) == 3
    else:
        assert (out / "model.onnx").is_file() and "the dense model skipping the removed blocks" in (out / "report.md").read_text()
        assert m.onnx.get("int8_matmuls", 0) == (3 * 6 if quant == "int8" else 0)
