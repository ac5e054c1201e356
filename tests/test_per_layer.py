"""Per-layer layouts (DDP's natural result): masked == prune_per_layer == package reloaded by
transformers, the DeciLM-or-plugin choice, the package's files, and the CLI end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM

from core.manifest import Engine, Manifest, Target
from exporters import per_layer
from optimizer.adapters import BlockShape, get_adapter
from optimizer.cli import optimize
from optimizer.methods.ddp import DDP, DDPConfig, UnitCosts
from optimizer.masks import BlockMask, Masks
from optimizer.surgery import check_masks_per_layer, masked, prune_per_layer
from tests.conftest import FAMILIES, tiny_model

# TINY: 8 query heads in 2 KV groups of 4, 96 channels, 2 layers.
CASES = {
    # query heads differ per layer (4 vs 3) → only the plugin format holds it
    "heads": [BlockMask([0, 1, 4, 5], [0, 1], list(range(0, 96, 3)), [0.5, 1.2, 0.8, 1.1],
                        [0.7 + i / 64 for i in range(32)]),
              BlockMask([5, 6, 7], [1], list(range(10, 50)), [1.5, 0.3, 0.9], None)],
    # 4 query heads everywhere, KV groups 2 vs 1, widths 32 vs 40 → DeciLM
    "kv": [BlockMask([0, 1, 4, 5], [0, 1], list(range(0, 96, 3)), [0.5, 1.2, 0.8, 1.1], None),
           BlockMask([4, 5, 6, 7], [1], list(range(10, 50)), None, [0.4 + i / 50 for i in range(40)])],
    # a removed MLP in layer 0 and a removed attention block in layer 1 → DeciLM no_op blocks
    "removed": [BlockMask([0, 4], [0, 1], [], [1.3, 0.6], None),
                BlockMask([], [], list(range(0, 96, 2)), None, [0.9] * 48)],
}


def _x():
    return torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(5))


def _manifest(fmt: str, name: str) -> Manifest:
    """What per_layer.write_package reads of a manifest: the target, the engine, the format (its report section)."""
    return Manifest(target=Target(kind="cpu"), engine=Engine.from_dict(per_layer.engine_section(fmt, "cpu", 256, name)),
                    method={"format": fmt, "format_reason": "test", "layer_shapes": []})


def _write(tmp_path, model, tok=None, name="pkg"):
    """The package as the pipeline writes it (fp32 here, so logits compare at 1e-5)."""
    fmt, _ = per_layer.choose(model, llama_layout=model.config.model_type == "llama_per_layer")
    model = per_layer.convert(model, fmt)
    tmp = tmp_path / f".{name}.tmp"
    tmp.mkdir()
    manifest = _manifest(fmt, name)
    tok = tok or _NoTokenizer()
    return fmt, per_layer.write_package(tmp, tmp_path / name, model, tok, manifest, "# report\n", fmt,
                                        dtype=torch.float32)


class _NoTokenizer:
    def save_pretrained(self, _d):
        pass


@pytest.mark.parametrize("family,case", [("llama", c) for c in CASES] + [(f, "heads") for f in FAMILIES[1:] if not f.startswith("gemma")])
def test_masked_equals_pruned_equals_reloaded(family, case, tmp_path):
    model = tiny_model(family)
    adapter = get_adapter(model.config)
    masks = Masks(CASES[case])
    x = _x()
    with torch.inference_mode():
        dense = model(x).logits
    with torch.inference_mode(), masked(model, adapter, masks):
        ref = model(x).logits
    assert not torch.allclose(ref, dense, atol=1e-3), "masking must change something"
    pruned = prune_per_layer(model, adapter, masks)
    with torch.inference_mode():
        torch.testing.assert_close(pruned(x).logits, ref, atol=1e-5, rtol=1e-5)
    # physically smaller, each layer its own shape
    for layer, b in zip(pruned.model.layers, masks.blocks):
        if b.heads:
            assert layer.self_attn.q_proj.out_features == len(b.heads) * 8
            assert layer.self_attn.k_proj.out_features == len(b.kv_heads) * 8
        if b.channels:
            assert layer.mlp.gate_proj.out_features == len(b.channels)
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in model.parameters())

    fmt, pkg = _write(tmp_path, pruned)
    assert fmt == ("decilm" if family == "llama" and case != "heads" else "plugin")
    # this process has the tool's classes registered; test_shipped_code_... covers trust_remote_code
    again = AutoModelForCausalLM.from_pretrained(pkg, dtype=torch.float32).eval()
    assert type(again).__module__ == "exporters.plugin.modeling_per_layer"
    with torch.inference_mode():
        torch.testing.assert_close(again(x).logits, ref, atol=1e-5, rtol=1e-5)
    # generation runs through the cache (removed attention blocks keep its length in step)
    with torch.inference_mode(), masked(model, adapter, masks):
        want = model.generate(x[:1, :6], max_new_tokens=6, do_sample=False)
    assert torch.equal(again.generate(x[:1, :6], max_new_tokens=6, do_sample=False), want)


@pytest.mark.slow
def test_shipped_code_loads_the_packages_without_this_tool(tmp_path):
    """A fresh interpreter that never imports this tool: transformers runs the package's own code."""
    refs = {}
    for family, case in (("llama", "removed"), ("qwen2", "heads")):
        model = tiny_model(family)
        adapter = get_adapter(model.config)
        masks = Masks(CASES[case])
        with torch.inference_mode(), masked(model, adapter, masks):
            refs[family] = model(_x()).logits
        _write(tmp_path, prune_per_layer(model, adapter, masks), name=family)
    torch.save({"x": _x(), **refs}, tmp_path / "refs.pt")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "r = torch.load('refs.pt')\n"
        "for f in ('llama', 'qwen2'):\n"
        "    m = AutoModelForCausalLM.from_pretrained(f, trust_remote_code=True, dtype=torch.float32).eval()\n"
        "    assert type(m).__module__.startswith('transformers_modules'), type(m).__module__\n"
        "    with torch.inference_mode():\n"
        "        torch.testing.assert_close(m(r['x']).logits, r[f], atol=1e-5, rtol=1e-5)\n"
        "    print(f, type(m).__name__)\n"
        "assert not any(k.startswith('exporters') for k in sys.modules)\n")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf_modules"), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["llama", "DeciLMForCausalLM", "qwen2", "PerLayerQwen2ForCausalLM"]


def test_decilm_config_holds_what_vllm_reads(tmp_path):
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    masks = Masks(CASES["kv"][:1] + CASES["removed"][1:])
    fmt, pkg = _write(tmp_path, prune_per_layer(model, adapter, masks))
    assert fmt == "decilm"
    raw = json.loads((pkg / "config.json").read_text())
    assert raw["model_type"] == "nemotron-nas" and raw["architectures"] == ["DeciLMForCausalLM"]
    assert raw["num_attention_heads"] == 4 and raw["head_dim"] == 8
    assert raw["auto_map"]["AutoConfig"] == "configuration_per_layer.DeciLMConfig"
    assert raw["block_configs"][0]["attention"] == {"no_op": False, "n_heads_in_group": 2, "replace_with_linear": False}
    assert raw["block_configs"][0]["ffn"] == {"no_op": False, "intermediate_size": 32, "replace_with_linear": False}
    assert raw["block_configs"][1]["attention"]["no_op"] and not raw["block_configs"][1]["ffn"]["no_op"]
    # what vllm/model_executor/models/nemotron_nas.py does with the loaded config
    cfg = AutoConfig.from_pretrained(pkg, trust_remote_code=True)
    b0, b1 = cfg.block_configs
    assert cfg.num_attention_heads // b0.attention.n_heads_in_group == 2
    assert not hasattr(b0.ffn, "ffn_mult") and b0.ffn.intermediate_size == 32 and b1.attention.no_op
    assert {k for k in raw if "ffn_mult" in k} == set()
    assert (pkg / "modeling_per_layer.py").is_file() and not (pkg / "vllm_plugin").exists()
    m = json.loads((pkg / "manifest.json").read_text())
    assert "--trust-remote-code" in m["engine"]["args"]


def test_plugin_package_carries_shapes_code_and_an_installable_plugin(tmp_path):
    model = tiny_model("qwen3")
    adapter = get_adapter(model.config)
    pruned = prune_per_layer(model, adapter, Masks(CASES["kv"]))  # uniform heads, but not LLaMA
    fmt, why = per_layer.choose(pruned, adapter.llama_layout)
    assert fmt == "plugin" and "qwen3" in why
    fmt, pkg = _write(tmp_path, pruned)
    raw = json.loads((pkg / "config.json").read_text())
    assert raw["model_type"] == "qwen3_per_layer" and raw["architectures"] == ["PerLayerQwen3ForCausalLM"]
    assert raw["layer_shapes"] == [{"num_heads": 4, "num_kv_heads": 2, "intermediate_size": 32},
                                   {"num_heads": 4, "num_kv_heads": 1, "intermediate_size": 40}]
    assert raw["num_attention_heads"] == 8 and raw["head_dim"] == 8  # globals stay dense
    plugin = pkg / "vllm_plugin"
    assert 'per_layer_package = "per_layer_vllm:register"' in (plugin / "pyproject.toml").read_text()
    assert {p.name for p in (plugin / "per_layer_vllm").iterdir()} >= {
        "__init__.py", "vllm_models.py", "configuration_per_layer.py", "modeling_per_layer.py"}
    assert "RUN pip install --no-cache-dir --no-deps /package/vllm_plugin" in (pkg / "Dockerfile").read_text()
    assert all(p.stat().st_mode & 0o111 for p in [plugin, plugin / "per_layer_vllm"])  # directories traversable


def test_llama_with_per_layer_query_heads_goes_to_the_plugin():
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    fmt, why = per_layer.choose(prune_per_layer(model, adapter, Masks(CASES["heads"])), adapter.llama_layout)
    assert fmt == "plugin" and "query heads differ per layer (3, 4)" in why


def test_per_layer_masks_are_checked():
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    full = list(range(96))
    for blocks in ([BlockMask([], [0], full)] * 2,                 # KV group without query heads
                   [BlockMask([0, 1, 4], [0, 1], full)] * 2,       # 2 heads in group 0, 1 in group 1
                   [BlockMask([0, 4], [0], full)] * 2,             # head 4's group removed
                   [BlockMask([0], [0], full)]):                   # one mask for two layers
        with pytest.raises(ValueError):
            check_masks_per_layer(adapter, model.config, Masks(blocks))
    qwen3 = tiny_model("qwen3")
    with pytest.raises(ValueError, match="Qwen3"):
        prune_per_layer(qwen3, get_adapter(qwen3.config), Masks(CASES["removed"]))


def test_ddp_budget_masks_export_exactly():
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    ddp = DDP(model, adapter, DDPConfig(retain=0.5, steps=12, batch=2, lr=0.1), UnitCosts.params(adapter, model.config))
    data = torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(0))
    for i in range(12):
        ddp.step(data[(2 * i) % 8:(2 * i) % 8 + 2])
    ddp.remove_hooks()
    masks = ddp.budget_masks()
    assert any(s != 1.0 for b in masks.blocks for s in b.channel_scale)
    with torch.inference_mode(), masked(model, adapter, masks):
        ref = model(data[:2]).logits
    with torch.inference_mode():
        torch.testing.assert_close(prune_per_layer(model, adapter, masks)(data[:2]).logits, ref, atol=1e-5, rtol=1e-5)


def _cli(args):
    return CliRunner().invoke(optimize, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.slow
def test_cli_per_layer_end_to_end(tiny_dirs, text_file, tmp_path):
    out = tmp_path / "pkg"
    r = _cli([tiny_dirs["llama"], "--target", "cpu", "--method", "ddp", "--set", "layout=per-layer", "--retain", "0.6",
              "--calib", text_file, "--eval", text_file, "--set", "data.seq_len=64", "--set", "data.calib_windows=4",
              "--set", "data.eval_windows=2", "--set", "ddp.steps=5", "--no-heal", "-o", out])
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    meth = m["method"]
    assert meth["layout"] == "per-layer" and meth["format"] in ("decilm", "plugin") and meth["format_reason"]
    assert len(meth["layer_shapes"]) == 2 and 0.55 < meth["retain_achieved"] <= 0.6
    assert meth["ddp"]["lr_end"] is None  # per layer the learning rate stays constant (DDPSettings.by_layout)
    assert meth["ddp"]["batch"] == 1      # and a step takes one sequence (DDPSettings.by_layout)
    assert m["engine"]["package_format"] == meth["format"]
    assert m["checks"]["masked_vs_pruned_max_abs_logit_diff"] < 1e-3
    assert m["size"]["params_pruned"] < m["size"]["params_dense"]
    assert "## Per-layer layout" in (out / "report.md").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    shapes = [{"num_heads": layer.self_attn.q_proj.out_features // 8,
               "num_kv_heads": layer.self_attn.k_proj.out_features // 8,
               "intermediate_size": layer.mlp.gate_proj.out_features} for layer in reloaded.model.layers]
    assert shapes == meth["layer_shapes"]


@pytest.mark.slow
def test_cli_one_shot_per_layer_widths_keep_attention_uniform_and_write_decilm(tiny_dirs, text_file, tmp_path):
    """`--method structured --set layout=per-layer`: the one-shot importance's MLP widths per block (the
    uniform shape's channels in total, its attention in every block), masked == pruned, a DeciLM package."""
    out = tmp_path / "pkg"
    r = _cli([tiny_dirs["llama"], "--target", "cpu", "--method", "structured", "--set", "layout=per-layer",
              "--retain", "0.6", "--calib", text_file, "--eval", text_file, "--set", "data.seq_len=64",
              "--set", "data.calib_windows=4", "--set", "data.eval_windows=1", "--no-heal", "-o", out])
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    meth, shapes = m["method"], m["method"]["layer_shapes"]
    assert meth["layout"] == "per-layer" and meth["format"] == "decilm" and meth["name"] == "activation"
    assert len({(s["num_heads"], s["num_kv_heads"]) for s in shapes}) == 1
    alphas = [c for c in meth["candidates"] if "alpha" in c]
    assert [c["alpha"] for c in alphas] == [0.25, 0.5, 1.0]
    # chosen on the held-out window and the dense model's answers to the heal's instructions: the worst excess
    assert set(alphas[0]["excess_loss"]) == {"text", "chat"}
    assert meth["per_layer_alpha"] == min(alphas, key=lambda c: max(c["excess_loss"].values()))["alpha"]
    uniform = [c for c in meth["candidates"] if "shape" in c]
    best = min(uniform, key=lambda c: c["held_out_loss"])["shape"]
    assert sum(s["intermediate_size"] for s in shapes) == len(shapes) * best["intermediate_size"]
    assert m["checks"]["masked_vs_pruned_max_abs_logit_diff"] < 1e-3
    assert "per-layer MLP widths" in (out / "report.md").read_text()


@pytest.mark.slow
def test_cli_per_layer_int8_package_has_kernel_widths_and_reads_back_as_the_job_evaluated(tiny_dirs, text_file,
                                                                                          tmp_path):
    """`--layout per-layer --quant auto` on the CPU target: INT8 W8A8 in compressed-tensors' format, every
    block's MLP width a multiple of budget.channel_multiple, and the package reads back (load, evaluate)
    with the perplexity the job reported for the quantized model."""
    from optimizer import budget, data, evaluate, load
    out = tmp_path / "pkg"
    r = _cli([tiny_dirs["llama"], "--target", "cpu", "--method", "ddp", "--set", "layout=per-layer", "--retain", "0.6",
              "--quant", "auto", "--calib", text_file, "--eval", text_file, "--set", "data.seq_len=64",
              "--set", "data.calib_windows=4",
              "--set", "data.eval_windows=1", "--set", "ddp.steps=5", "--no-heal", "-o", out])
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["quantization"]["precision"] == "int8" and m["method"]["layout"] == "per-layer"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"
    mult = budget.channel_multiple(json.loads((tiny_dirs["llama"] / "config.json").read_text())["intermediate_size"])
    assert all(s["intermediate_size"] % mult == 0 for s in m["method"]["layer_shapes"])
    config = AutoConfig.from_pretrained(tiny_dirs["llama"])  # sizes count weights, not the quantization's scales
    assert m["size"]["block_params_pruned"] == sum(get_adapter(config).block_params(config, BlockShape(**s))
                                                   for s in m["method"]["layer_shapes"])
    model, tok = load.load_model(load.resolve(str(out)))
    windows = data.token_windows(tok, text_file.read_text(), 64, 1)
    assert evaluate.perplexity(model, windows) == pytest.approx(m["quality"]["perplexity"]["pruned"], rel=2e-2)


@pytest.mark.parametrize("args,msg", [
    (["--set", "layout=per-layer"], "needs --method structured (the one-shot widths per block) or ddp"),
    (["--set", "layout=per-layer", "--method", "depth"], "not --method depth"),
    (["--set", "layout=per-layer", "--method", "ddp", "--format", "onnx"], "vLLM packages only"),
    (["--set", "layout=diagonal", "--method", "ddp"], "unknown layout"),
])
def test_bad_layout_is_one_line_and_writes_nothing(tiny_dirs, tmp_path, args, msg):
    out = tmp_path / "x"
    r = CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--target", "cpu", *args, "-o", str(out)])
    assert r.exit_code == 2 and msg in r.output and len(r.output.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["kv", "heads"])
def test_int8_per_layer_package_reads_back_as_the_quantized_model(case, tmp_path):
    """Both per-layer formats take quantized blocks: a DeciLM ("kv") and a plugin ("heads") package quantized to INT8 W8A8 by
    the quantize stage's `apply` carry compressed-tensors' checkpoint, which transformers reads back
    as the model that was quantized."""
    from optimizer.quantize import apply
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    pruned = prune_per_layer(model, adapter, Masks(CASES[case]))
    fmt, _ = per_layer.choose(pruned, llama_layout=True)
    assert fmt == {"kv": "decilm", "heads": "plugin"}[case]
    pruned = per_layer.convert(pruned, fmt)
    assert apply(pruned, "int8") == 2 * 7
    with torch.inference_mode():
        want = pruned(_x()).logits
    tmp = tmp_path / ".pkg.tmp"
    tmp.mkdir()
    manifest = _manifest(fmt, "pkg")
    pkg = per_layer.write_package(tmp, tmp_path / "pkg", pruned, _NoTokenizer(), manifest, "# report\n", fmt,
                                  dtype=torch.float32)
    assert json.loads((pkg / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"
    reloaded = AutoModelForCausalLM.from_pretrained(pkg, dtype=torch.float32).eval()
    with torch.inference_mode():
        torch.testing.assert_close(reloaded(_x()).logits, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 1.0])
def test_per_layer_widths_keep_the_total_in_whole_tiles_and_alpha_one_is_the_global_ranking(alpha):
    """per_layer_widths: the uniform total, multiples of the tile, at least one tile and at most the dense
    width a block; alpha 0 is the uniform widths, 1 the global ranking of the channels (a block whose
    channels all outscore another's keeps more)."""
    from optimizer.methods.activation import per_layer_widths
    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(96, generator=g) * scale for scale in (10.0, 1.0, 0.1, 1.0)]
    widths = per_layer_widths(scores, 48, 96, 8, alpha)
    assert sum(widths) == 4 * 48 and all(w % 8 == 0 and 8 <= w <= 96 for w in widths)
    if alpha == 0.0:
        assert widths == [48] * 4
    if alpha == 1.0:
        assert widths[0] > widths[1] > widths[2] and widths[2] == 8
        tiles = [s.sort(descending=True).values.reshape(12, 8).sum(1) for s in scores]
        kept = [float(t) for ts, w in zip(tiles, widths) for t in ts[1:w // 8]]
        dropped = [float(t) for ts, w in zip(tiles, widths) for t in ts[w // 8:]]
        assert min(kept) >= max(dropped)  # every tile kept beyond a block's first outscores every one left out
    assert per_layer_widths(scores, 44, 96, 8, alpha) == [44] * 4  # not whole tiles: uniform
