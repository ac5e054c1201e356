"""RoI on tiny random models: the relaxation, N:M compliance, the prior init, training,
apply, checkpoint/resume and determinism."""

from __future__ import annotations

import pytest
import torch

from optimizer.adapters import get_adapter
from optimizer.methods import roi as roi_module
from optimizer.methods.roi import (RoI, RoIConfig, fused_masked_weight, gumbel, gumbel_from_uniform, hard_topn,
                                   relaxed_khot, sample_mask, wanda_prior)
from optimizer.sparsity import Sparsity
from tests.conftest import tiny_model


def _data(model, n=6, seq=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n, seq), generator=g)


def _roi(n=2, m=4, steps=10, seed=0, **kw):
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    data = _data(model)
    prior = wanda_prior(model, adapter, data[:2])
    cfg = RoIConfig(steps=steps, seed=seed, **kw)
    roi = RoI(model, adapter, Sparsity(n=n, m=m), cfg)
    roi.init_from_scores(prior)
    return model, adapter, roi, prior, data


@pytest.mark.parametrize("n,m", [(2, 4), (2, 8), (1, 4), (4, 8), (3, 4)])
@pytest.mark.parametrize("tau", [2.0, 1.0, 0.5, 0.1, 0.01])
def test_relaxed_khot_sums_to_n_and_is_bounded(n, m, tau):
    g = torch.Generator().manual_seed(0)
    for spread in (0.3, 3.0, 100.0):
        keys = torch.randn(2000, m, generator=g) * spread + gumbel((2000, m), g)
        k = relaxed_khot(keys, n, tau)
        assert torch.allclose(k.sum(-1), torch.full((2000,), float(n)), atol=1e-4)
        assert k.min() >= 0
        if n <= 2:  # provably ≤ 1 for N ≤ 2 (module docstring); N ≥ 3 is clamped in sample_mask
            assert k.max() <= 1 + 1e-5


def test_relaxation_gradient_is_finite_for_saturated_keys():
    phi = (torch.randn(8, 16) * 50).requires_grad_()
    g = gumbel(phi.shape, torch.Generator().manual_seed(0))
    mask = sample_mask(phi, g, 2, 4, 0.01, 10.0)
    (mask * torch.randn(8, 16)).sum().backward()
    assert torch.isfinite(phi.grad).all()


@pytest.mark.parametrize("n,m", [(2, 4), (2, 8), (4, 8)])
def test_hard_forward_mask_complies(n, m):
    sp = Sparsity(n=n, m=m)
    g = torch.Generator().manual_seed(1)
    phi = torch.randn(16, 64, generator=g).requires_grad_()
    for tau, scale in ((1.0, 1.0), (0.1, 10.0)):
        mask = sample_mask(phi, gumbel(phi.shape, g), n, m, tau, scale, use_checkpoint=True)
        assert set(mask.detach().unique().tolist()) <= {0.0, 1.0}
        assert (mask.detach().reshape(16, -1, m).sum(-1) == n).all()
        assert sp.complies(torch.randn(16, 64) * mask.detach())
        mask.sum().backward()  # the soft gradient reaches φ


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8)])
@pytest.mark.slow
def test_the_compiled_mask_kernel_matches_the_eager_relaxation(n, m):
    """The fused path the real model trains with (weights ≥ COMPILE_MIN_NUMEL): same W ⊙ mask in
    the forward, same gradient on φ."""
    g = torch.Generator().manual_seed(0)
    w, phi = torch.randn(256, 1024, generator=g), torch.randn(256, 1024, generator=g).requires_grad_()
    u, upstream = torch.rand(256, 1024, generator=g), torch.randn(256, 1024, generator=g)
    eager = w * sample_mask(phi, gumbel_from_uniform(u), n, m, 0.3, 2.0)
    (grad_eager,) = torch.autograd.grad((eager * upstream).sum(), phi)
    fused = fused_masked_weight(w, phi, u, n, m, 0.3, 2.0)
    assert roi_module._compiled_masked_weight is not roi_module.masked_weight, "torch.compile fell back to eager"
    (grad_fused,) = torch.autograd.grad((fused * upstream).sum(), phi)
    assert torch.equal(fused, eager)
    torch.testing.assert_close(grad_fused, grad_eager, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n,m", [(2, 4), (2, 8), (4, 8)])
def test_training_forward_complies_and_weights_stay_frozen(n, m):
    model, adapter, roi, _, data = _roi(n, m, steps=2)
    before = {k: v.clone() for k, v in tiny_model("llama").state_dict().items()}
    seen = []
    lin = adapter.linears(adapter.blocks(model)[0])["mlp.down_proj"]
    h = lin.register_forward_pre_hook(lambda mod, a: seen.append(mod.weight.detach().clone()))
    roi.step(data[:2])
    h.remove()
    assert seen and all(Sparsity(n=n, m=m).complies(w) for w in seen[1:])  # [0] is the dense teacher
    assert torch.equal(seen[0], before["model.layers.0.mlp.down_proj.weight"])
    roi.close()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("n,m", [(2, 4), (2, 8)])
def test_zero_steps_reproduce_the_prior(n, m):
    _, _, roi, prior, _ = _roi(n, m, steps=0)
    sp = Sparsity(n=n, m=m)
    for got, scores in zip(roi.decide(), prior):
        for name, s in scores.items():
            assert torch.equal(got[name], sp.mask(s)), name


@pytest.mark.slow
def test_steps_reduce_kd_loss_and_apply_complies():
    # Random tokens on a random model: there is nothing to generalise, so the KD loss of the
    # deterministic mask is measured on the calibration batches it trained on.
    model, adapter, roi, prior, data = _roi(2, 4, steps=30, lr=0.1)
    before = roi.eval_loss(data[:4])
    log = [roi.step(data[(2 * i) % 4:(2 * i) % 4 + 2]) for i in range(30)]
    after = roi.eval_loss(data[:4])
    assert log[0]["tau"] > log[-1]["tau"] and log[0]["scale"] < log[-1]["scale"]
    assert after < 0.5 * before, (before, after)
    masks = roi.apply()
    sp = Sparsity(n=2, m=4)
    for block, keep in zip(adapter.blocks(model), masks):
        for name, lin in adapter.linears(block).items():
            assert sp.complies(lin.weight) and not hasattr(lin, "parametrizations")
            assert torch.equal(lin.weight != 0, keep[name] & (lin.weight != 0))
    assert all(p.requires_grad for p in model.parameters())  # restored
    # the learned mask moved away from the prior somewhere
    assert any(not torch.equal(k[name], sp.mask(s[name])) for k, s in zip(masks, prior) for name in k)


def test_save_load_resume_is_identical(tmp_path):
    _, _, a, _, data = _roi(2, 4, steps=6)
    for i in range(6):
        a.step(data[i % 3 * 2:i % 3 * 2 + 2])
    _, _, b, _, _ = _roi(2, 4, steps=6)
    for i in range(3):
        b.step(data[i % 3 * 2:i % 3 * 2 + 2])
    b.save(tmp_path / "roi.pt")
    _, _, c, _, _ = _roi(2, 4, steps=6)
    assert c.load(tmp_path / "roi.pt") and c.step_count == 3
    for i in range(3, 6):
        c.step(data[i % 3 * 2:i % 3 * 2 + 2])
    for pa, pc in zip(a.params, c.params):
        assert torch.equal(pa, pc)
    _, _, d, _, _ = _roi(2, 4, steps=7)  # another configuration does not resume
    assert not d.load(tmp_path / "roi.pt")


def test_same_seed_same_masks_other_seed_other_noise():
    runs = []
    for seed in (0, 0, 1):
        _, _, roi, _, data = _roi(2, 4, steps=5, seed=seed, lr=0.2)
        losses = [roi.step(data[:2])["loss"] for _ in range(5)]
        runs.append((roi.decide(), losses))
    (m0, l0), (m1, l1), (_, l2) = runs
    assert l0 == l1 and l0 != l2
    assert all(torch.equal(a[k], b[k]) for a, b in zip(m0, m1) for k in a)


def test_state_bytes_reports_logits_and_adam():
    model, _, roi, _, data = _roi(2, 4, steps=1)
    before = roi.state_bytes()
    roi.step(data[:2])
    sb = roi.state_bytes()
    assert sb["adam"] == 2 * sb["logits"] == before["adam"]
    assert sb["logits"] == 4 * sb["prunable_weights"]
    assert 0 < sb["ratio"] == sb["total"] / sb["model"]
    assert not any(p is q for p in roi.params for q in model.parameters())  # φ is not a model parameter


def test_hard_topn():
    k = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    assert hard_topn(k, 2).tolist() == [[1.0, 0.0, 1.0, 0.0]]
