"""MoE expert removal (Mixtral, Qwen2-MoE, Qwen3-MoE) and DDP expert gates on tiny random models.

Masked (hooks) == pruned (sliced weights, fewer experts in the config) == pruned after a
save/load round trip, with random kept subsets and random scales in every MoE layer.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimizer.adapters import MoEAdapter, get_adapter
from optimizer.errors import UserError
from optimizer.methods.ddp import DDPConfig
from optimizer.methods.ddp_experts import ExpertGates
from optimizer.moe_surgery import masked_experts, moe_parts, prune_experts
from tests.conftest import tiny_model

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
E, TOP_K = 6, 2
COMMON = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              num_hidden_layers=3, max_position_embeddings=64, num_experts_per_tok=TOP_K)


def tiny_moe_config(family: str, **overrides):
    """`overrides` replace COMMON's fields (a larger model for vLLM, the real tokenizer's vocabulary)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    common = {**COMMON, **overrides}
    width = common.pop("expert_width", 24)
    if family == "mixtral":
        cfg = MixtralConfig(intermediate_size=width, num_local_experts=E, **common)
    elif family == "qwen2_moe":  # layer 1 dense; top-k weights not renormalised (the default)
        cfg = Qwen2MoeConfig(intermediate_size=40, moe_intermediate_size=width, shared_expert_intermediate_size=16,
                             num_experts=E, mlp_only_layers=[1], norm_topk_prob=False, **common)
    else:  # layer 0 dense; renormalised top-k; tied embeddings
        cfg = Qwen3MoeConfig(intermediate_size=40, moe_intermediate_size=width, num_experts=E, mlp_only_layers=[0],
                             norm_topk_prob=True, **{"tie_word_embeddings": True, **common})
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return cfg


def tiny_moe(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(family, **overrides)).eval()
    with torch.no_grad():  # nothing trivially 1 or 0, and routers that really choose
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith("mlp.gate.weight") or "shared_expert_gate" in name:
                p.normal_(0, 1.0)
    return model


def _inputs(seed=1):
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def _random_keep(n_layers, n_keep, seed=0):
    g = torch.Generator().manual_seed(seed)
    keep = [sorted(torch.randperm(E, generator=g)[:n_keep].tolist()) for _ in range(n_layers)]
    scales = [torch.rand(n_keep, generator=g) + 0.5 for _ in range(n_layers)]
    return keep, scales


def _chosen_experts(model, adapter, x):
    """Per MoE layer, the set of expert indices the router handed to the experts module."""
    seen = [set() for _ in moe_parts(model, adapter)]
    hooks = [p.experts.register_forward_pre_hook(lambda _m, args, i=i: seen[i].update(args[1].flatten().tolist()))
             for i, p in enumerate(moe_parts(model, adapter))]
    with torch.inference_mode():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def test_adapters_know_the_moe_layout():
    expect = {"mixtral": [0, 1, 2], "qwen2_moe": [0, 2], "qwen3_moe": [1, 2]}
    for family in MOE_FAMILIES:
        model = tiny_moe(family)
        adapter = get_adapter(model.config)
        assert isinstance(adapter, MoEAdapter) and adapter.family == family
        assert adapter.num_experts(model.config) == E and adapter.experts_per_token(model.config) == TOP_K
        assert adapter.moe_layers(model.config) == expect[family]
        for parts in moe_parts(model, adapter):
            assert parts.router.weight.shape == (E, 32)
            assert parts.experts.gate_up_proj.shape == (E, 48, 32) and parts.experts.down_proj.shape == (E, 32, 24)
            assert len(parts.shared) == (2 if family == "qwen2_moe" else 0)
        assert adapter.expert_params(model.config) == 3 * 32 * 24 + 32
        q, k, v, o = adapter.attention(adapter.blocks(model)[0])  # attention knowledge as for dense families
        assert q.out_features == 32 and k.out_features == 16
        for call in (lambda: adapter.dense_shape(model.config), lambda: adapter.unit_params(model.config),
                     lambda: adapter.mlp(adapter.blocks(model)[0]), lambda: adapter.input_widths(model.config)):
            with pytest.raises(UserError, match="not supported for MoE"):
                call()
    # the dense families are untouched
    assert not isinstance(get_adapter(tiny_model("llama").config), MoEAdapter)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_keeping_every_expert_changes_nothing(family):
    """The router hook's re-implementation of the family's routing matches transformers'."""
    model, x = tiny_moe(family), _inputs()
    adapter = get_adapter(model.config)
    n = len(adapter.moe_layers(model.config))
    with torch.inference_mode():
        dense = model(x).logits
        with masked_experts(model, adapter, [list(range(E))] * n, [torch.ones(E)] * n):
            torch.testing.assert_close(model(x).logits, dense, atol=0, rtol=0)
        # a -inf mask that removes nothing still goes through adapter.route: same logits
        from optimizer.moe_surgery import route_hook
        hooks = [p.router.register_forward_hook(route_hook(adapter, lambda: torch.ones(E, dtype=torch.bool)))
                 for p in moe_parts(model, adapter)]
        try:
            torch.testing.assert_close(model(x).logits, dense, atol=1e-6, rtol=1e-6)
        finally:
            for h in hooks:
                h.remove()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_masked_equals_pruned(family, tmp_path):
    model, x = tiny_moe(family), _inputs()
    adapter = get_adapter(model.config)
    n_layers = len(adapter.moe_layers(model.config))
    with torch.inference_mode():
        dense = model(x).logits
    for n_keep, seed in ((4, 0), (TOP_K, 1), (E - 1, 2)):
        keep, scales = _random_keep(n_layers, n_keep, seed)
        with torch.inference_mode(), masked_experts(model, adapter, keep, scales):
            ref = model(x).logits
        assert not torch.allclose(ref, dense, atol=1e-3), "removing experts must change something"
        chosen = _chosen_experts(model, adapter, x)  # hooks are gone again: all experts in use
        assert any(len(c) > n_keep for c in chosen)
        with masked_experts(model, adapter, keep, scales):
            assert all(c <= set(k) for c, k in zip(_chosen_experts(model, adapter, x), keep))

        pruned = prune_experts(model, adapter, keep, scales)
        with torch.inference_mode():
            torch.testing.assert_close(pruned(x).logits, ref, atol=1e-5, rtol=1e-5)
        assert adapter.num_experts(pruned.config) == n_keep and pruned.config.num_experts == n_keep
        assert adapter.experts_per_token(pruned.config) == TOP_K
        assert adapter.num_experts(model.config) == E  # the source config is not modified
        for old, new, k, s in zip(moe_parts(model, adapter), moe_parts(pruned, adapter), keep, scales):
            assert new.router.weight.shape == (n_keep, 32)
            torch.testing.assert_close(new.router.weight, old.router.weight[k])
            torch.testing.assert_close(new.experts.gate_up_proj, old.experts.gate_up_proj[k])
            torch.testing.assert_close(new.experts.down_proj, old.experts.down_proj[k] * s.view(-1, 1, 1))
            for a, b in zip(old.shared, new.shared):  # the shared expert is untouched
                assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        removed = (E - n_keep) * n_layers * adapter.expert_params(model.config)
        assert sum(p.numel() for p in pruned.parameters()) == sum(p.numel() for p in model.parameters()) - removed

        # What is saved is what loads: same logits after a round trip through safetensors.
        pruned.save_pretrained(tmp_path / f"p{n_keep}")
        again = AutoModelForCausalLM.from_pretrained(tmp_path / f"p{n_keep}").eval()
        assert again.config.num_experts == n_keep
        with torch.inference_mode():
            torch.testing.assert_close(again(x).logits, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_masked_equals_pruned_with_narrowed_experts(family, tmp_path):
    """Experts removed *and* each kept expert narrowed to its own channels: the masked model
    (removed down_proj columns read zero) == the sliced model == its save/load round trip, and
    the masking leaves the weights as they were."""
    model, x = tiny_moe(family), _inputs()
    adapter = get_adapter(model.config)
    n_layers, full, width = len(adapter.moe_layers(model.config)), adapter.expert_intermediate(model.config), 16
    keep, scales = _random_keep(n_layers, TOP_K + 1, seed=3)
    g = torch.Generator().manual_seed(4)
    channels = [[sorted(torch.randperm(full, generator=g)[:width].tolist()) for _ in kept] for kept in keep]
    before = [p.experts.down_proj.clone() for p in moe_parts(model, adapter)]
    with torch.inference_mode():
        with masked_experts(model, adapter, keep, scales):
            experts_only = model(x).logits
        with masked_experts(model, adapter, keep, scales, channels):
            ref = model(x).logits
    assert not torch.allclose(ref, experts_only, atol=1e-3), "narrowing the experts must change something"
    assert all(torch.equal(b, p.experts.down_proj) for b, p in zip(before, moe_parts(model, adapter)))
    pruned = prune_experts(model, adapter, keep, scales, channels)
    with torch.inference_mode():
        torch.testing.assert_close(pruned(x).logits, ref, atol=1e-5, rtol=1e-5)
    assert adapter.expert_intermediate(pruned.config) == width and adapter.expert_intermediate(model.config) == full
    for old, new, k, ch in zip(moe_parts(model, adapter), moe_parts(pruned, adapter), keep, channels):
        assert new.experts.gate_up_proj.shape == (TOP_K + 1, 2 * width, 32)
        assert new.experts.down_proj.shape == (TOP_K + 1, 32, width)
        torch.testing.assert_close(new.experts.gate_up_proj[0, width:], old.experts.gate_up_proj[k[0], [full + c for c in ch[0]]])
    removed = n_layers * (E * 3 * 32 * full - (TOP_K + 1) * 3 * 32 * width + (E - TOP_K - 1) * 32)
    assert sum(p.numel() for p in pruned.parameters()) == sum(p.numel() for p in model.parameters()) - removed
    pruned.save_pretrained(tmp_path / "narrow")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "narrow").eval()
    with torch.inference_mode():
        torch.testing.assert_close(again(x).logits, ref, atol=1e-5, rtol=1e-5)
    uneven = [[list(range(width))] * TOP_K + [list(range(width - 1))] for _ in keep]
    with pytest.raises(UserError, match="channels per expert"):
        prune_experts(model, adapter, keep, None, uneven)
    with pytest.raises(UserError, match="ascending"):
        prune_experts(model, adapter, keep, None, [[[2, 1]] * (TOP_K + 1) for _ in keep])


def test_unequal_counts_simulate_but_do_not_export():
    model, x = tiny_moe("mixtral"), _inputs()
    adapter = get_adapter(model.config)
    keep = [[0, 1, 2, 3], [1, 2, 5], [0, 1, 2, 3, 4]]
    with masked_experts(model, adapter, keep):
        assert all(c <= set(k) for c, k in zip(_chosen_experts(model, adapter, x), keep))
    with pytest.raises(UserError, match="per-layer counts need"):
        prune_experts(model, adapter, keep)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bad_keep_lists_are_refused(family):
    model = tiny_moe(family)
    adapter = get_adapter(model.config)
    n = len(adapter.moe_layers(model.config))
    bad = {"fewer experts than top-k": [[3]] * n,
           "wrong number of layers": [[0, 1, 2]] * (n + 1),
           "not ascending": [[2, 1, 0]] * n,
           "out of range": [[0, 1, E]] * n}
    for why, keep in bad.items():
        for call in (lambda: prune_experts(model, adapter, keep), lambda: masked_experts(model, adapter, keep).__enter__()):
            with pytest.raises(UserError):
                call()
    with pytest.raises(UserError, match="at least 2"):
        prune_experts(model, adapter, [[3]] * n)
    with pytest.raises(UserError, match="scales"):
        prune_experts(model, adapter, [[0, 1, 2]] * n, [torch.ones(2)] * n)
    dense = tiny_model("llama")
    with pytest.raises(UserError, match="not an MoE model"):
        prune_experts(dense, get_adapter(dense.config), [[0, 1]])


# --- DDP expert gates ------------------------------------------------------------------------------

def _trained_gates(family="qwen2_moe", retain=0.5, steps=30, seed=0):
    model = tiny_moe(family)
    adapter = get_adapter(model.config)
    torch.manual_seed(seed)
    gates = ExpertGates(model, adapter, DDPConfig(retain=retain, steps=steps, batch=2, lr=0.1, seed=seed))
    data = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(seed))
    log = [gates.step(data[(2 * i) % 8:(2 * i) % 8 + 2]) for i in range(steps)]
    return model, adapter, gates, log, data


@pytest.mark.slow
def test_expert_gates_train_toward_the_budget():
    model, adapter, gates, log, _ = _trained_gates(retain=0.5, steps=30)
    before = dict(tiny_moe("qwen2_moe").named_parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # weights frozen
    assert log[0]["retain"] > 0.9 and abs(log[-1]["retain"] - 0.5) < abs(log[0]["retain"] - 0.5)
    assert max(x["lambda"] for x in log) > 0 and log[-1]["mu"] < log[0]["mu"] and log[0]["kd"] == 0
    assert not torch.allclose(gates.z, torch.ones_like(gates.z))
    keep, scales, _ = gates.decide()
    assert gates.budget_count() == 3 and all(len(k) == 3 for k in keep)
    assert all(torch.equal(s, gates.values()[i][k]) for i, (k, s) in enumerate(zip(keep, scales)))
    for k_keep in (TOP_K, E):
        assert all(len(k) == k_keep for k in gates.decide(k_keep)[0])
    with pytest.raises(UserError):
        gates.decide(TOP_K - 1)
    gates.remove_hooks()
    # 1 of 6 would be fewer than top-k: the gates keep top-k, and the experts are narrowed instead
    assert ExpertGates(model, adapter, DDPConfig(retain=0.2)).budget_count() == TOP_K


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_gated_model_with_binarised_gates_equals_the_pruned_model(family):
    """z > 0 or z < 0 in every layer, same count per layer: gated forward == prune_experts(decide())."""
    model, adapter, gates, _, data = _trained_gates(family, steps=4)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for row in gates.z:
            on = torch.randperm(E, generator=g)[:4]
            row.fill_(-0.5)
            row[on] = torch.rand(4, generator=g) + 0.3
    x = data[:2]
    with torch.inference_mode():
        gated = model(x).logits
    assert all(len(c) <= 4 for c in _chosen_experts(model, adapter, x))  # zero-gated experts are not routed
    keep, scales, _ = gates.decide(4)
    assert all(set(k) == set((row > 0).nonzero().flatten().tolist()) for k, row in zip(keep, gates.z))
    gates.enabled = False
    with torch.inference_mode():
        assert not torch.allclose(model(x).logits, gated, atol=1e-3)
    gates.remove_hooks()
    with torch.inference_mode(), masked_experts(model, adapter, keep, scales):
        torch.testing.assert_close(model(x).logits, gated, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(prune_experts(model, adapter, keep, scales)(x).logits, gated, atol=1e-5, rtol=1e-5)
