"""--refit: least-squares refit of the kept o_proj / down_proj columns (optimizer/refit.py)."""

from __future__ import annotations

import pytest
import torch

from optimizer.adapters import BlockShape, get_adapter
from optimizer.refit import RefitStatistics, refit_masks
from optimizer.masks import BlockMask, Masks
from optimizer.surgery import masked, prune, prune_per_layer
from tests.conftest import FAMILIES, tiny_model
from tests.test_per_layer import CASES
from tests.test_surgery import _importance


def _windows(n=3, seq=32, seed=3):
    return torch.randint(0, 512, (n, seq), generator=torch.Generator().manual_seed(seed))


def _refit(model, adapter, masks, windows, damp=0.1):
    """The refit as the pipeline runs it: statistics from one pass of the dense model, then the solve."""
    stats = RefitStatistics(model, adapter)
    with torch.inference_mode():
        model(windows)
    stats.close()
    return refit_masks(stats, model, adapter, masks, damp)


def test_keeping_every_unit_gives_back_the_original_weights():
    """With nothing removed and no scales, the least-squares answer is W itself, whatever the
    ridge; so refit_masks leaves such projections as they are."""
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    stats = RefitStatistics(model, adapter)
    with torch.inference_mode():
        model(_windows())
    stats.close()
    for gram in stats.o + stats.down:
        every = torch.arange(gram.linear.in_features)
        torch.testing.assert_close(gram.solve(every, 1.0, damp=0.5), gram.linear.weight, atol=1e-5, rtol=1e-4)
    everything = BlockMask(list(range(8)), [0, 1], list(range(96)))
    refitted = refit_masks(stats, model, adapter, Masks([everything] * 2), damp=0.5)
    assert all(bm.o_proj_columns is None and bm.down_columns is None for bm in refitted.blocks)
    assert stats.tokens == 3 * 32


def test_the_refit_reproduces_the_unpruned_projection_better():
    """Block 0 sees the same calibration inputs either way, so there the refitted o_proj must
    come closer to the unpruned o_proj's output than the masked one (the ridge objective's
    minimum is at most its value at the masked weights)."""
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    masks = _importance(model, adapter).decide(BlockShape(4, 2, 40))
    masks.blocks[0].head_scale = [0.9, 1.1, 1.0, 0.8]  # a DDP-like scale, folded into the target's start
    windows = _windows()
    refitted = _refit(model, adapter, masks, windows)
    block0 = adapter.blocks(model)[0]
    o_proj = adapter.attention(block0).o
    captured = {}
    handle = o_proj.register_forward_hook(lambda _m, _a, y: captured.__setitem__("y", y))
    errors = {}
    try:
        with torch.inference_mode():
            model(windows)
            dense = captured["y"]
            for name, m in (("masked", masks), ("refit", refitted)):
                with masked(model, adapter, m):
                    model(windows)
                errors[name] = (captured["y"] - dense).pow(2).sum().item()
    finally:
        handle.remove()
    assert errors["refit"] < 0.9 * errors["masked"], errors


@pytest.mark.parametrize("family", FAMILIES)
def test_refitted_masked_model_equals_the_pruned_one(family):
    model = tiny_model(family)
    adapter = get_adapter(model.config)
    masks = _refit(model, adapter, _importance(model, adapter).decide(BlockShape(4, 1, 40)), _windows())
    x = _windows(2, 24, seed=7)
    with torch.inference_mode():
        plain = model(x).logits
        with masked(model, adapter, masks):
            ref = model(x).logits
        got = prune(model, adapter, masks)(x).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():  # the hooks are gone and the source model untouched
        torch.testing.assert_close(model(x).logits, plain)


@pytest.mark.parametrize("case", list(CASES))
def test_refitted_per_layer_masks_equal_the_pruned_model(case):
    """Per-layer shapes, learned scales and removed attention / MLP blocks (nothing to refit there)."""
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    masks = _refit(model, adapter, Masks(CASES[case]), _windows())
    for bm in masks.blocks:
        assert (bm.o_proj_columns is None) == (not bm.heads) and (bm.down_columns is None) == (not bm.channels)
        assert bm.head_scale is None and bm.channel_scale is None  # folded into the columns
    x = _windows(2, 20, seed=5)
    with torch.inference_mode():
        with masked(model, adapter, masks):
            ref = model(x).logits
        got = prune_per_layer(model, adapter, masks)(x).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_optimize_with_refit_writes_a_package_that_matches_its_masked_model(tiny_dirs, text_file, tmp_path):
    """The pipeline's own check (masked == pruned) runs on the refitted masks; the manifest and
    the report say what the refit did; --refit is refused where it does not apply."""
    from optimizer.errors import UserError
    from optimizer.pipeline import DataConfig, HealSettings, OptimizeConfig, RefitSettings, optimize
    common = dict(model=str(tiny_dirs["llama"]), target="a100", heal=HealSettings(tokens=0), quant="none",
                  data=DataConfig(calib=str(text_file), eval=str(text_file), calib_windows=8, eval_windows=1, seq_len=128))
    quiet = dict(log=lambda *_: None)
    plain = optimize(OptimizeConfig(method="activation", retain=0.6, out=str(tmp_path / "plain"),
                                    refit=RefitSettings(on=False), **common), **quiet)
    res = optimize(OptimizeConfig(method="activation", retain=0.6, out=str(tmp_path / "refit"), refit=RefitSettings(),
                                  **common), **quiet)
    m, r = res["manifest"], res["manifest"].method["refit"]
    # A random tiny model sits at chance (loss ≈ ln vocab), so whether the refit helps it is
    # noise; the applied path's equivalence is tested above, the guard's refusal below.
    assert r["tokens"] == 8 * 128 and {"held_out_loss_before", "held_out_loss_after", "applied"} <= set(r)
    assert m.checks["masked_vs_pruned_max_abs_logit_diff"] < 1e-3
    assert m.method["shape"] == plain["manifest"].method["shape"]
    changed = m.perplexity["pruned"] != plain["manifest"].perplexity["pruned"]
    assert changed == r["applied"]
    assert "- refit: " in (tmp_path / "refit" / "report.md").read_text()
    with pytest.raises(UserError, match="refit.on=true: the refit applies to structured"):
        optimize(OptimizeConfig(method="wanda", refit=RefitSettings(on=True), out=str(tmp_path / "no"), **common),
                 **quiet)
    with pytest.raises(UserError, match="must be > 0"):
        optimize(OptimizeConfig(method="activation", refit=RefitSettings(damp=0.0), out=str(tmp_path / "no"), **common),
                 **quiet)


@pytest.mark.slow
def test_a_refit_that_raises_the_held_out_loss_is_not_applied(tiny_dirs, text_file, tmp_path, monkeypatch):
    """The pipeline keeps the refit only if the held-out calibration loss goes down."""
    import optimizer.refit
    from optimizer.pipeline import DataConfig, HealSettings, OptimizeConfig, RefitSettings, optimize

    def harmful(stats, model, adapter, masks, damp):
        good = refit_masks(stats, model, adapter, masks, damp)
        for bm in good.blocks:
            bm.down_columns = bm.down_columns * 50
        return good

    monkeypatch.setattr(optimizer.refit, "refit_masks", harmful)
    common = dict(model=str(tiny_dirs["llama"]), target="a100", method="activation", retain=0.6,
                  heal=HealSettings(tokens=0), quant="none", data=DataConfig(calib=str(text_file), eval=str(text_file), calib_windows=2, eval_windows=1, seq_len=64))
    plain = optimize(OptimizeConfig(out=str(tmp_path / "plain"), refit=RefitSettings(on=False), **common),
                     log=lambda *_: None)["manifest"]
    tried = optimize(OptimizeConfig(out=str(tmp_path / "tried"), refit=RefitSettings(), **common),
                     log=lambda *_: None)["manifest"]
    r = tried.method["refit"]
    assert not r["applied"] and r["held_out_loss_after"] > r["held_out_loss_before"]
    assert tried.perplexity["pruned"] == plain.perplexity["pruned"]
    assert "tried and not applied" in (tmp_path / "tried" / "report.md").read_text()


@pytest.mark.parametrize("args, refits", [([], True), (["--set", "refit.on=false"], False)])
@pytest.mark.slow
def test_the_refit_is_on_by_default_and_off_with_no_refit(tiny_dirs, text_file, tmp_path, args, refits):
    from click.testing import CliRunner
    from optimizer.cli import optimize
    out = tmp_path / "pkg"
    r = CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--target", "a100", "--retain", "0.6", "--calib",
                                      str(text_file), "--eval", str(text_file), "--set", "data.seq_len=64",
                                      "--set", "data.calib_windows=2",
                                      "--set", "data.eval_windows=1", "--no-heal", "--quant", "none", "-o", str(out),
                                      *args])
    assert r.exit_code == 0, r.output
    import json
    assert ("refit" in json.loads((out / "manifest.json").read_text())["method"]) == refits


@pytest.mark.parametrize("args", [["--method", "wanda", "--set", "refit.on=true"],
                                  ["--method", "sparsegpt", "--set", "refit.on=true", "--set", "refit.damp=0.2"],
                                  ["--target", "h100", "--set", "engine_version=0.18.0", "--set", "refit.on=true"]])
def test_a_refit_asked_for_a_semi_structured_plan_is_refused(tiny_dirs, tmp_path, args):
    """The default refit is skipped quietly where it does not apply; one asked for is refused."""
    from click.testing import CliRunner
    from optimizer.cli import optimize
    out = tmp_path / "pkg"
    base = [str(tiny_dirs["llama"]), "-o", str(out)] + ([] if "--target" in args else ["--target", "a100"])
    r = CliRunner().invoke(optimize, base + args)
    assert r.exit_code == 2 and "refit.on=true: the refit applies to structured methods" in r.output, r.output
    assert not out.exists()
