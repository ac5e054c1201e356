"""SI (sparsity induction): exact absorption, fast Wanda update, composition with the pruners."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_model
from optimizer import absorb as ab
from optimizer.adapters import get_adapter
from optimizer.methods.magnitude import Magnitude
from optimizer.methods.si import (SIConfig, SparsityInduction, fast_wanda_scores, input_stats, prune_with_si,
                                  time_wanda_update)
from optimizer.methods.sparsegpt import SparseGPT
from optimizer.methods.wanda import Wanda
from optimizer.sequential import block_inputs, prune_blockwise
from optimizer.sparsity import Sparsity

torch.set_num_threads(1)
TWO_FOUR = Sparsity(n=2, m=4)


def _windows(n=3, seq=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n, seq), generator=g)


def _random_transform(block, adapter, points, seed=0) -> ab.Transform:
    g = torch.Generator().manual_seed(seed)
    q, k, v, o = adapter.attention(block)
    gate, up, down = adapter.mlp(block)
    sizes = {"attn": q.in_features, "o": v.out_features, "mlp": gate.in_features, "down": down.in_features}
    t = ab.Transform()
    for p, n in sizes.items():
        t.scale[p] = (0.5 * torch.randn(n, generator=g)).exp().double()
        if p in points:
            t.shift[p] = (0.3 * torch.randn(n, generator=g)).double()
    return t


def _logits(model, windows):
    with torch.no_grad():
        return model(windows).logits


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_absorbed_model_is_equivalent_and_round_trips(family, tmp_path):
    from transformers import AutoModelForCausalLM
    model = tiny_model(family).double()
    adapter = get_adapter(model.config)
    windows = _windows()
    before = _logits(model, windows)
    points = {p for p, ok in ab.shift_support(model, adapter).items() if ok}
    assert points == {"llama": {"attn", "o", "mlp"}, "mistral": set(), "qwen2": {"attn"},
                      "qwen3": {"attn", "o"}}[family]
    ab.enable_biases(model, adapter, {p: True for p in points})
    pending = [ab.absorb(b, adapter, _random_transform(b, adapter, points, seed=i))
               for i, b in enumerate(adapter.blocks(model))]
    torch.testing.assert_close(_logits(model, windows), before, rtol=1e-9, atol=1e-9)  # hooked
    for p in pending:
        p.fold()
    torch.testing.assert_close(_logits(model, windows), before, rtol=1e-9, atol=1e-9)  # folded
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    torch.testing.assert_close(_logits(again, windows), before, rtol=1e-9, atol=1e-9)
    if family == "llama":
        assert again.config.attention_bias and again.config.mlp_bias


@pytest.mark.parametrize("base", [Magnitude, Wanda])
def test_training_forward_equals_absorbed_then_pruned(base):
    """What SI optimises (transform, mask, fold in one functional pass) is exactly what the runner
    produces: absorb, observe the hooked block, prune it, fold the shifts."""
    model = tiny_model("llama").double()
    adapter = get_adapter(model.config)
    si = SparsityInduction(model, adapter, base, TWO_FOUR, SIConfig(steps=0))
    inputs, kwargs = block_inputs(model, adapter, _windows())
    block = adapter.blocks(model)[0]
    t = _random_transform(block, adapter, si.shift_points)
    lay = ab.layout(block, adapter)
    stats = input_stats(block, adapter, inputs, kwargs)
    params = {n: p.detach() for n, p in ab.block_params(block, lay).items()}
    with torch.no_grad():
        pruned = si._pruned_params(block, lay, params, stats, t)
        expect = [torch.func.functional_call(block, pruned, (x,), kwargs) for x in inputs]
    pending = ab.absorb(block, adapter, t)
    pruners = {n: base(lin) for n, lin in adapter.linears(block).items()}
    hooks = [p.layer.register_forward_hook(lambda m, a, y, p=p: p.add_batch(a[0])) for p in pruners.values()]
    with torch.no_grad():
        for x in inputs:
            block(x, **kwargs)
    for h in hooks:
        h.remove()
    for p in pruners.values():
        p.prune(TWO_FOUR)
    pending.fold()
    with torch.no_grad():
        got = [block(x, **kwargs) for x in inputs]
    for g, e in zip(got, expect):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)


def test_fast_wanda_update_equals_recomputation():
    model = tiny_model("llama").double()
    adapter = get_adapter(model.config)
    points = {"attn", "o", "mlp"}
    ab.enable_biases(model, adapter, {p: True for p in points})
    inputs, kwargs = block_inputs(model, adapter, _windows())
    block = adapter.blocks(model)[1]
    t = _random_transform(block, adapter, points, seed=3)
    lay = ab.layout(block, adapter)
    cached = input_stats(block, adapter, inputs, kwargs)
    new, _ = ab.transform_tensors({n: p.detach() for n, p in ab.block_params(block, lay).items()}, t, lay)
    fast = {n: fast_wanda_scores(new[f"{n}.weight"], cached[n].sum, cached[n].sq_sum, cached[n].n, *tr)
            for n, tr in ab.input_transforms(t, lay).items()}
    copy_ = copy.deepcopy(block)
    ab.absorb(copy_, adapter, t)  # hooked: every Linear sees its transformed input
    fresh = input_stats(copy_, adapter, inputs, kwargs)
    for n, lin in adapter.linears(copy_).items():
        recomputed = lin.weight.detach().float().abs() * fresh[n].sq_sum.sqrt().float()[None, :]
        torch.testing.assert_close(fast[n], recomputed, rtol=1e-5, atol=1e-6)
    timing = time_wanda_update(block, adapter, inputs, kwargs, t, repeats=1)
    assert timing["recompute_s"] > 0 and timing["fast_s"] > 0


@pytest.mark.parametrize("family,base", [("llama", Magnitude), ("llama", Wanda), ("llama", SparseGPT),
                                         ("qwen2", Wanda), ("mistral", Magnitude)])
def test_si_composes_with_pruners_and_keeps_2_4(family, base):
    model = tiny_model(family)
    adapter = get_adapter(model.config)
    masks, si = prune_with_si(model, adapter, _windows(), base, TWO_FOUR, SIConfig(steps=3, tokens=16))
    assert len(masks) == len(si.history) == len(adapter.blocks(model))
    for block in adapter.blocks(model):
        for name, lin in adapter.linears(block).items():
            assert TWO_FOUR.complies(lin.weight), name
            assert not lin._forward_pre_hooks, f"{name}: shift hook left unfolded"
    assert torch.isfinite(_logits(model, _windows(1))).all()


@pytest.mark.parametrize("base", [Magnitude, Wanda])
def test_si_does_not_increase_block_error(base):
    """Block 0 sees the same inputs with and without SI; its pruned output must be at least as close
    to the dense one (SI keeps the start point unless the learned transform is better)."""
    windows = _windows(seq=32)
    dense = tiny_model("llama")
    adapter = get_adapter(dense.config)
    inputs, kwargs = block_inputs(dense, adapter, windows)
    with torch.no_grad():
        target = [adapter.blocks(dense)[0](x, **kwargs) for x in inputs]

    def block0_error(prepare_model):
        model = tiny_model("llama")
        prepare_model(model)
        with torch.no_grad():
            outs = [adapter.blocks(model)[0](x, **kwargs) for x in inputs]
        return sum((o - t)[0, 1:].pow(2).mean().item() for o, t in zip(outs, target))

    plain = block0_error(lambda m: prune_blockwise(m, adapter, windows, base, TWO_FOUR))
    cfg = SIConfig(steps=15, tokens=32, lr=0.05)
    si = block0_error(lambda m: prune_with_si(m, adapter, windows, base, TWO_FOUR, cfg))
    assert si <= plain * (1 + 1e-6)
    assert si < plain  # and on this seed it is strictly better (magnitude ~0.65x, Wanda ~0.83x)
    print(f"{base.__name__}: block-0 error plain {plain:.4g}, SI {si:.4g}")
