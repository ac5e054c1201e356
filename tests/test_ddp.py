"""DDP on tiny random models: gates train, the budget is met, and the export is exact."""

from __future__ import annotations

import pytest
import torch

from optimizer import budget
from optimizer.adapters import get_adapter
from optimizer.methods.ddp import DDP, DDPConfig, UnitCosts
from optimizer.masks import BlockMask, Masks
from optimizer.surgery import check_masks, masked, prune, prune_per_layer
from tests.conftest import tiny_model


def _trained(family="llama", retain=0.5, steps=30, seed=0):
    model = tiny_model(family)
    adapter = get_adapter(model.config)
    torch.manual_seed(seed)
    ddp = DDP(model, adapter, DDPConfig(retain=retain, steps=steps, batch=2, lr=0.1, seed=seed),
              UnitCosts.params(adapter, model.config))
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, model.config.vocab_size, (8, 32), generator=g)
    log = [ddp.step(data[(2 * i) % 8:(2 * i) % 8 + 2]) for i in range(steps)]
    return model, adapter, ddp, log, data


def _baseline_masks(model, adapter, data, retain):
    """The one-shot activation method's masks for the first uniform shape meeting `retain`."""
    from optimizer.methods.activation import ActivationImportance
    imp = ActivationImportance(model, adapter)
    imp.add_batch(model, data)
    imp.remove_hooks()
    return imp.decide(budget.uniform_candidates(adapter, model.config, retain)[0])


def test_training_moves_only_the_gates_and_keeps_the_budget():
    """From the baseline start (the default): weights frozen, gates learn, μ anneals, and the
    retention stays near the budget. (Tiny random
    models give almost no KD gradient, so only the budget's own dynamics are tested here;
    the real model's figures are in bench/results/ddp.)"""
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    data = torch.randint(0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    ddp = DDP(model, adapter, DDPConfig(retain=0.5, steps=40, batch=2, lr=0.1, warmup=0.0),
              UnitCosts.params(adapter, model.config))
    ddp.start_from(_baseline_masks(model, adapter, data, 0.5))
    log = [ddp.step(data[(2 * i) % 8:(2 * i) % 8 + 2]) for i in range(40)]
    before = dict(tiny_model("llama").named_parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # weights frozen
    assert abs(log[-1]["retain"] - 0.5) < 0.06 and max(x["retain"] for x in log) < 0.6  # held near the budget
    assert log[-1]["mu"] < log[0]["mu"]


def test_dense_start_prunes_towards_the_falling_target():
    model, adapter, ddp, log, _ = _trained(retain=0.5, steps=40)
    assert log[0]["retain"] > 0.9 and log[0]["target"] == 1.0 and log[-1]["target"] == 0.5
    assert min(x["retain"] for x in log) < 0.6
    assert not torch.allclose(ddp.gates.channel, torch.ones_like(ddp.gates.channel))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_gated_model_with_binarised_gates_equals_the_exported_model(family):
    model, adapter, ddp, _, data = _trained(family, retain=0.6, steps=10)
    ddp.remove_hooks()
    for shape in budget.uniform_candidates(adapter, model.config, 0.6)[:3]:
        masks = ddp.decide(shape)  # kept units carry their ReLU(z) as scales
        check_masks(adapter, model.config, masks)
        assert any(s != 1.0 for b in masks.blocks for s in b.channel_scale)
        with torch.inference_mode(), masked(model, adapter, masks):
            ref = model(data[:2]).logits
        with torch.inference_mode():
            got = prune(model, adapter, masks)(data[:2]).logits
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_gated_forward_equals_masked_forward_when_gates_are_binary():
    """The training-time gate hooks and surgery's masks agree on what a gate does."""
    model, adapter, ddp, _, data = _trained(steps=5)
    with torch.no_grad():
        ddp.gates.head.copy_(torch.where(torch.rand_like(ddp.gates.head) > 0.3, 1.3, -1.0))
        ddp.gates.channel.copy_(torch.where(torch.rand_like(ddp.gates.channel) > 0.5, 0.7, -1.0))
    with torch.inference_mode():
        gated = model(data[:2]).logits
    ddp.remove_hooks()
    heads, chans = ddp.unit_values()

    blocks = [BlockMask((h > 0).nonzero().flatten().tolist(), [0, 1], (c > 0).nonzero().flatten().tolist(),
                        h[h > 0].tolist(), c[c > 0].tolist()) for h, c in zip(heads, chans)]
    with torch.inference_mode(), masked(model, adapter, Masks(blocks)):
        torch.testing.assert_close(model(data[:2]).logits, gated, atol=1e-5, rtol=1e-5)


def test_budget_masks_meet_the_budget_exactly():
    """Training ends over the budget by a few units: the tie-break cuts the smallest gates
    until it fits, to within one unit (or one run of channels: widths stay multiples of
    budget.channel_multiple)."""
    model, adapter, ddp, _, _ = _trained(retain=0.5, steps=2)
    with torch.no_grad():  # 80% of every kind positive, at random scales: well over the budget
        for z in (ddp.gates.head, ddp.gates.channel):
            z.copy_(torch.where(torch.rand(z.shape, generator=torch.Generator().manual_seed(1)) < 0.8,
                                torch.rand(z.shape, generator=torch.Generator().manual_seed(2)) + 0.1, -1.0))
    masks = ddp.budget_masks()
    kept = sum(adapter.block_params(model.config, b.shape()) for b in masks.blocks)
    dense = model.config.num_hidden_layers * adapter.block_params(model.config, adapter.dense_shape(model.config))
    unit = adapter.unit_params(model.config)
    m = budget.channel_multiple(model.config.intermediate_size)
    assert all(len(b.channels) % m == 0 for b in masks.blocks)
    assert 0.5 * dense - max(2 * max(unit[:3]), m * unit[2]) < kept <= 0.5 * dense  # within one unit or run of m


def test_budget_masks_round_a_thin_layer_up_and_still_keep_the_budget():
    """A layer left with fewer channels than the kernels' multiple is lifted to one run of it;
    where that goes over the budget, the weakest runs elsewhere are cut."""
    model, adapter, ddp, _, _ = _trained(retain=0.5, steps=2)
    with torch.no_grad():  # every unit positive, layer 0's channels but 3: the tie-break cuts to the budget exactly
        ddp.gates.head.copy_(torch.rand(ddp.gates.head.shape, generator=torch.Generator().manual_seed(2)) + 0.1)
        ddp.gates.channel.copy_(torch.rand(ddp.gates.channel.shape, generator=torch.Generator().manual_seed(3)) + 0.1)
        ddp.gates.channel[0, 3:] = -1.0
    masks = ddp.budget_masks()
    m = budget.channel_multiple(model.config.intermediate_size)
    assert len(masks.blocks[0].channels) == m and all(len(b.channels) % m == 0 for b in masks.blocks)
    kept = sum(adapter.block_params(model.config, b.shape()) for b in masks.blocks)
    dense = model.config.num_hidden_layers * adapter.block_params(model.config, adapter.dense_shape(model.config))
    assert kept <= 0.5 * dense


def test_budget_masks_fill_a_training_that_ended_under_the_budget():
    """Training can end under the budget: the best removed channels by z fill it, in runs of
    budget.channel_multiple, those with no learned scale (z <= 0) at the dense model's scale 1."""
    model, adapter, ddp, _, data = _trained(retain=0.5, steps=2)
    with torch.no_grad():  # 30% of every kind positive: well under the budget
        for z in (ddp.gates.head, ddp.gates.channel):
            z.copy_(torch.where(torch.rand(z.shape, generator=torch.Generator().manual_seed(1)) < 0.3,
                                torch.rand(z.shape, generator=torch.Generator().manual_seed(2)) + 0.1,
                                -torch.rand(z.shape, generator=torch.Generator().manual_seed(3))))
    masks = ddp.budget_masks()
    kept = sum(adapter.block_params(model.config, b.shape()) for b in masks.blocks)
    dense = model.config.num_hidden_layers * adapter.block_params(model.config, adapter.dense_shape(model.config))
    unit = adapter.unit_params(model.config)
    m = budget.channel_multiple(model.config.intermediate_size)
    assert m > 1 and all(len(b.channels) % m == 0 for b in masks.blocks)  # widths the kernels take
    assert 0.5 * dense - m * unit[2] < kept <= 0.5 * dense  # filled to within one run of m channels
    z = ddp.gates.channel.detach()
    filled = [(layer, i) for layer, b in enumerate(masks.blocks) for i in b.channels if z[layer, i] <= 0]
    assert filled and all(b.channel_scale[b.channels.index(i)] == 1.0
                          for layer, i in filled for b in [masks.blocks[layer]])
    for layer, b in enumerate(masks.blocks):  # in each layer the best removed ones came back
        removed = [z[layer, i].item() for i in range(z.shape[1]) if i not in b.channels]
        assert not removed or min(z[layer, i].item() for i in b.channels) >= max(removed)
    ddp.remove_hooks()
    with torch.inference_mode(), masked(model, adapter, masks):
        ref = model(data[:2]).logits
    with torch.inference_mode():
        torch.testing.assert_close(prune_per_layer(model, adapter, masks)(data[:2]).logits, ref, atol=1e-5, rtol=1e-5)


def test_runs_are_deterministic_under_a_seed_and_resume_exactly(tmp_path):
    _, _, a, log_a, _ = _trained(steps=12, seed=3)
    _, _, b, log_b, _ = _trained(steps=12, seed=3)
    assert log_a == log_b and torch.equal(a.gates.channel, b.gates.channel)
    # interrupted after 6 steps, checkpointed, resumed in a fresh object: same result
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    cfg = DDPConfig(retain=0.5, steps=12, batch=2, lr=0.1, seed=3)
    data = torch.randint(0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(3))
    first = DDP(model, adapter, cfg, UnitCosts.params(adapter, model.config))
    for i in range(6):
        first.step(data[(2 * i) % 8:(2 * i) % 8 + 2])
    first.save(tmp_path / "ckpt.pt")
    first.remove_hooks()
    second = DDP(model, adapter, cfg, UnitCosts.params(adapter, model.config))
    assert second.load(tmp_path / "ckpt.pt") and second.step_count == 6
    for i in range(6, 12):
        second.step(data[(2 * i) % 8:(2 * i) % 8 + 2])
    torch.testing.assert_close(second.gates.channel, a.gates.channel)
    assert not DDP(model, adapter, DDPConfig(retain=0.4), UnitCosts.params(adapter, model.config)).load(
        tmp_path / "ckpt.pt"), "a checkpoint of another configuration must not be resumed"


def test_a_baseline_start_is_the_baseline_masked_model_and_removed_units_still_learn():
    """start_from puts the gates at a one-shot selection: the gated model then is that masked
    model, and a removed unit's gate still gets a KD gradient (relu_ste), so it can return."""
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    data = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    masks = _baseline_masks(model, adapter, data, 0.6)
    ddp = DDP(model, adapter, DDPConfig(retain=0.6, steps=4, warmup=0.0), UnitCosts.params(adapter, model.config))
    ddp.start_from(masks)
    with torch.no_grad():
        gated = model(data).logits
    ddp.remove_hooks()
    with torch.no_grad(), masked(model, adapter, masks):
        torch.testing.assert_close(model(data).logits, gated, atol=1e-5, rtol=1e-5)

    ddp = DDP(model, adapter, DDPConfig(retain=0.6, steps=4, warmup=0.0), UnitCosts.params(adapter, model.config))
    ddp.start_from(masks)
    assert ddp.target() == 0.6  # no warm-up from a start that already meets the budget
    from optimizer.methods.ddp import kd_loss
    kd_loss(model, ddp.gates, data).backward()
    removed = ddp.gates.channel.detach() < 0
    assert removed.any() and (ddp.gates.channel.grad[removed] != 0).any()


def test_the_kd_gradient_accumulated_a_sequence_at_a_time_is_the_whole_batch_s():
    """kd_backward bounds memory by one sequence; the gradient and the loss must be the batch's."""
    from optimizer.methods.ddp import kd_backward, kd_loss
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    data = torch.randint(0, model.config.vocab_size, (3, 32), generator=torch.Generator().manual_seed(0))
    ddp = DDP(model, adapter, DDPConfig(retain=0.6, steps=4, warmup=0.0), UnitCosts.params(adapter, model.config))
    ddp.start_from(_baseline_masks(model, adapter, data, 0.6))
    whole = kd_loss(model, ddp.gates, data)
    whole.backward()
    grads = [p.grad.clone() for p in ddp.gates.parameters()]
    ddp.gates.zero_grad(set_to_none=True)
    kd = kd_backward(model, ddp.gates, data)
    assert kd == pytest.approx(whole.item(), rel=1e-5)
    for p, g in zip(ddp.gates.parameters(), grads):
        assert g.abs().max() > 0
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-7)


def test_budget_masks_keep_equally_many_heads_in_every_kept_group():
    """Found on SmolLM2: trained gates left 2 heads in one KV group and 3 in another, which
    no engine (and not our surgery) can load; the per-layer masks must equalise them."""
    model, adapter, ddp, _, data = _trained(retain=0.97, steps=2)  # a loose budget: no tie-break
    group = ddp.gates.group
    with torch.no_grad():  # layer 0: group 0 loses one head, group 1 keeps all
        ddp.gates.head[0, 0] = -1.0
        ddp.gates.head[0, group:] = 2.0
    masks = ddp.budget_masks()
    for b in masks.blocks:
        per_group = {g: sum(1 for h in b.heads if h // group == g) for g in b.kv_heads}
        assert len(set(per_group.values())) == 1, per_group
    pruned = prune_per_layer(model, adapter, masks)  # loads without complaint
    with torch.no_grad():
        assert torch.isfinite(pruned(data[:1]).logits).all()


def test_a_layer_budget_presses_only_on_the_layer_over_the_shape():
    """--layout uniform with DDPConfig.layer_shape: one multiplier per layer and kind. A layer
    that takes back channels over the shape is pressed alone; the other layer, at the shape,
    keeps its units (with one model-wide budget both would be pressed)."""
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    data = torch.randint(0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    shape = budget.uniform_candidates(adapter, model.config, 0.6)[0]
    ddp = DDP(model, adapter, DDPConfig(retain=0.6, steps=30, batch=2, lr=0.1, warmup=0.0, layer_shape=dict(shape.__dict__)),
              UnitCosts.params(adapter, model.config))
    ddp.start_from(_baseline_masks(model, adapter, data, 0.6))
    with torch.no_grad():
        ddp.gates.channel[0] = 1.0  # layer 0 over the shape, layer 1 at it
    assert ddp.layer_excess(ddp.mu()).shape == (2 * ddp.layers,)
    lam = []
    for i in range(30):
        ddp.step(data[(2 * i) % 8:(2 * i) % 8 + 2])
        lam.append(ddp.lam.clone())
    channel_lam = torch.stack(lam)[:, ddp.layers:]  # [steps, layers]
    assert channel_lam[:, 0].max() > 0 and channel_lam[:, 1].max() == 0
    kept = (ddp.gates.channel > 0).sum(1)
    assert kept[0] < adapter.dense_shape(model.config).intermediate_size and kept[1] == shape.intermediate_size
    masks = ddp.decide(shape)  # the export: the same shape in every layer
    assert all(len(b.channels) == shape.intermediate_size for b in masks.blocks)


def test_beta_can_rise_geometrically_over_the_run():
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    ddp = DDP(model, adapter, DDPConfig(retain=0.5, steps=11, beta=50.0, beta_start=5.0), UnitCosts.params(adapter, model.config))
    assert ddp.beta() == pytest.approx(5.0)
    ddp.step_count = 10
    assert ddp.beta() == pytest.approx(50.0)
    assert DDP(model, adapter, DDPConfig(retain=0.5, beta=15.0), UnitCosts.params(adapter, model.config)).beta() == 15.0


def test_the_learning_rate_can_fall_along_a_cosine_to_its_end():
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    ddp = DDP(model, adapter, DDPConfig(retain=0.5, steps=5, batch=2, lr=0.1, lr_end=0.0), UnitCosts.params(adapter, model.config))
    data = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    lrs = []
    for _ in range(5):
        ddp.step(data)
        lrs.append(ddp.opt.param_groups[0]["lr"])  # what Adam stepped with
    assert lrs == pytest.approx([0.1, 0.1 * (1 + 2 ** -0.5) / 2, 0.05, 0.1 * (1 - 2 ** -0.5) / 2, 0.0])
    assert DDP(model, adapter, DDPConfig(retain=0.5, lr=0.1), UnitCosts.params(adapter, model.config)).lr() == 0.1


@pytest.mark.parametrize("field, value", [("beta", 0.0), ("lr", 0.0), ("lr_end", -0.01),
                                          ("seq_len", 0), ("batch", 0), ("steps", 0)])
def test_bad_ddp_settings_are_one_line_errors(field, value):
    """β divides the budget term and λ's step: 0 must fail at the edge, not as a ZeroDivisionError."""
    from optimizer.errors import UserError
    from optimizer.pipeline import DDPSettings, OptimizeConfig, validate
    with pytest.raises(UserError, match=r"ddp\."):
        validate(OptimizeConfig(target="a100", ddp=DDPSettings(**{field: value})))


@pytest.mark.slow
def test_a_run_at_another_training_length_gets_its_own_checkpoint(tiny_dirs, text_file, tmp_path, monkeypatch):
    """The checkpoint key covers everything that changes what the gates learn. Without the
    training sequence length, runs at two lengths once wrote (and resumed) one file."""
    from optimizer.pipeline import DataConfig, DDPSettings, HealSettings, OptimizeConfig, optimize
    monkeypatch.setenv("OPTIMIZER_CACHE", str(tmp_path / "cache"))
    ckpts = []
    for seq in (32, 64):
        res = optimize(OptimizeConfig(model=str(tiny_dirs["llama"]), target="a100", method="ddp", retain=0.6,
                                      out=str(tmp_path / f"p{seq}"),
                                      data=DataConfig(calib=str(text_file), eval=str(text_file), calib_windows=2,
                                                      eval_windows=1, seq_len=64),
                                      ddp=DDPSettings(steps=2, seq_len=seq), heal=HealSettings(tokens=0), quant="none"),
                               log=lambda *_: None)
        ddp = res["manifest"].method["ddp"]
        assert ddp["seq_len"] == seq and ddp["resumed_from_step"] == 0
        # the uniform layout's defaults (DDPSettings.by_layout)
        assert ddp["layer_shape"] and ddp["lr_end"] == ddp["lr"] / 10 and ddp["batch"] == 4
        ckpts.append(ddp["checkpoint"])
    assert ckpts[0] != ckpts[1]
