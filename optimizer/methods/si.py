"""SI — Sparsity Induction (Jiang et al., 2026): reshape each block before a one-shot pruner.

Per block, before the pruner observes it (the `prepare` hook of sequential.prune_blockwise):
  1. one dense pass caches each Linear's per-input-channel Σx, Σx², n;
  2. robust init of the per-channel scales s and shifts δ (absorb.py's four points) from those
     statistics: δ = channel mean (for a fixed mask the pruning error (W − Ŵ)(x − δ) is smallest
     in L2 at the mean), s = RMS of x − δ (then magnitude on W' = W·s ranks like Wanda on the
     centred input). Identity is evaluated too and the better one is the starting point;
  3. a few Adam steps on s, δ only (weights frozen) minimise the block-output error between the
     dense block and the transformed-and-pruned block, plus a spectral-norm penalty on the error
     matrix. The mask is recomputed from the transformed weights every step with the base
     pruner's metric and is not differentiated (straight-through): magnitude |W'|, Wanda
     |W'|·‖x'‖ from the fast update below. SparseGPT uses the Wanda score as its surrogate:
     its own mask needs H'⁻¹ of the transformed inputs (a Cholesky per layer per step) and its
     weight updates are not differentiable cheaply; its OBS saliency, like Wanda, is invariant
     to the input scale, so the shift is what SI changes for it;
  4. the best of (start, learned), by block reconstruction error, is absorbed exactly
     (absorb.absorb), and the runner's pruner then observes and prunes the transformed block.
     The shift hooks are folded into biases at the next prepare() or at finish().

Scale invariance, worth knowing when reading results: Wanda's and SparseGPT's masks and
pruned outputs do not change under an input scale (|W_ij s_j|·‖x_j/s_j‖ = |W_ij|·‖x_j‖), so
for them SI acts through the shifts; magnitude is where the scales matter.

Fast importance update: with cached Σx_j, Σx_j² (Wanda keeps both), the input norm after a
transform is Σx'_j² = (Σx_j² − 2δ_jΣx_j + nδ_j²)/s_j², O(d_in) per layer and no forward pass.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch.func import functional_call

from optimizer import absorb as ab
from optimizer.methods.magnitude import Magnitude
from optimizer.sequential import prune_blockwise
from optimizer.sparsity import Sparsity


@dataclass
class SIConfig:
    steps: int = 20               # Adam steps per block (SmolLM2 has 30 blocks; wall time matters)
    lr: float = 0.02              # on log-scale and on the shift in units of the channel RMS
    spectral_weight: float = 0.2  # weight of σ_max(E)² relative to ‖E‖²_F (both per element)
    tokens: int = 512             # prefix of one calibration window per step (causal: prefixes are exact)
    windows: int = 8              # calibration windows SI learns from (the pruner still sees all)
    power_iters: int = 3          # per step, warm-started across steps
    seed: int = 0
    shift: bool = True            # False: scales only (no biases added to the model)


@dataclass
class ChannelStats:
    sum: torch.Tensor     # Σ x_j over tokens (float64)
    sq_sum: torch.Tensor  # Σ x_j²
    n: int


def fast_sq_norm(sum, sq_sum, n, scale=None, shift=None) -> torch.Tensor:
    """Σ x'_j² for x' = (x − δ)/s from the untransformed Σx_j, Σx_j², n."""
    sq = sq_sum
    if shift is not None:
        shift = shift.detach().to(sq.dtype)
        sq = sq - 2 * shift * sum + n * shift * shift
    if scale is not None:
        sq = sq / scale.detach().to(sq.dtype).pow(2)
    return sq.clamp_min(0)  # cancellation can dip a hair below zero


def fast_wanda_scores(weight, sum, sq_sum, n, scale=None, shift=None) -> torch.Tensor:
    """Wanda scores |W'_ij|·‖x'_j‖ of the *transformed* weight W' = W diag(s), without a forward pass."""
    norm = fast_sq_norm(sum, sq_sum, n, scale, shift).sqrt()
    return weight.detach().float().abs() * norm.float().to(weight.device)[None, :]


def _out(block, x, kwargs, params=None):
    y = block(x, **kwargs) if params is None else functional_call(block, params, (x,), kwargs)
    return y[0] if isinstance(y, tuple) else y


@torch.no_grad()
def input_stats(block, adapter, inputs, kwargs) -> dict[str, ChannelStats]:
    """Σx, Σx², n of every Linear's input over `inputs` (one pass, float64, on the inputs' device)."""
    stats, handles = {}, []

    def hook(name):
        def add(module, args, _):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            st = stats.setdefault(name, ChannelStats(torch.zeros_like(x[0]), torch.zeros_like(x[0]), 0))
            st.sum += x.sum(0)
            st.sq_sum += (x * x).sum(0)
            st.n += x.shape[0]
        return add

    for name, lin in adapter.linears(block).items():
        handles.append(lin.register_forward_hook(hook(name)))
    try:
        for x in inputs:
            _out(block, x, kwargs)
    finally:
        for h in handles:
            h.remove()
    return stats


def _prefix(kwargs: dict, length: int, seq: int) -> dict:
    """Block kwargs for the first `length` tokens (rotary tables, masks, positions)."""
    if length == seq:
        return kwargs
    out = {}
    for k, v in kwargs.items():
        if k == "position_embeddings" and isinstance(v, tuple):
            v = tuple(t[..., :length, :] for t in v)
        elif k == "attention_mask" and torch.is_tensor(v):
            v = v[..., :length, :length]
        elif k in ("position_ids", "cache_position") and torch.is_tensor(v):
            v = v[..., :length]
        out[k] = v
    return out


class SparsityInduction:
    """`prepare` for prune_blockwise. Adds zero biases (and sets config.attention_bias /
    config.mlp_bias) at construction where the family can hold the shifts; call finish()
    after prune_blockwise so the last block's shifts become biases (prune_with_si does both)."""

    def __init__(self, model, adapter, base, sparsity: Sparsity, config: SIConfig | None = None):
        self.adapter, self.base, self.sparsity = adapter, base, sparsity
        self.config = config or SIConfig()
        self.magnitude = base is Magnitude or not getattr(base, "needs_data", True)
        support = ab.shift_support(model, adapter) if self.config.shift else {}
        self.shift_points = {p for p, ok in support.items() if ok}
        ab.enable_biases(model, adapter, {p: True for p in self.shift_points})
        self.history: list[dict] = []  # per block: reconstruction errors and the choice made
        self._pending: ab.Pending | None = None

    def prepare(self, block, inputs, kwargs) -> None:
        self.finish()  # the previous block has been pruned by now: fold its shifts
        t = self.learn(block, inputs, kwargs)
        self._pending = ab.absorb(block, self.adapter, t)

    def finish(self) -> None:
        if self._pending is not None:
            self._pending.fold()
            self._pending = None

    # --- learning ------------------------------------------------------------------------
    def initial(self, stats: dict[str, ChannelStats], lay: ab.Layout) -> tuple[ab.Transform, dict]:
        """Robust start from calibration statistics, and each shift's step unit (channel RMS)."""
        t, unit = ab.Transform(), {}
        for point, name in (("attn", lay.q), ("o", lay.o), ("mlp", lay.gate), ("down", lay.down)):
            st = stats[name]
            mean, sq = st.sum / st.n, st.sq_sum / st.n
            if point == "o":  # one value per v channel: average over the query heads reading it
                fold = lambda a: a.view(-1, lay.group, lay.head_dim).mean(1).reshape(-1)  # noqa: E731
                mean, sq = fold(mean), fold(sq)
            d = mean if point in self.shift_points else torch.zeros_like(mean)
            s = (sq - 2 * d * mean + d * d).clamp_min(0).sqrt()
            s = s / s.clamp_min(1e-12).log().mean().exp()    # geometric mean 1: weights keep their size
            t.scale[point] = s.clamp(1e-2, 1e2).float()      # dead or outlier channels stay tame
            if point in self.shift_points:
                t.shift[point] = d.float()
                unit[point] = sq.sqrt().clamp_min(1e-6).float()
        return t, unit

    def _pruned_params(self, block, lay, params, stats, t: ab.Transform) -> dict:
        """The block's parameters transformed by t, pruned with the base metric, shifts folded."""
        new, shifts = ab.transform_tensors(params, t, lay)
        tr = ab.input_transforms(t, lay)
        eff = {n: p.detach() for n, p in block.named_parameters()}  # frozen: no grads into the model
        for n in (lay.attn_norm, lay.mlp_norm):
            eff[f"{n}.weight"] = new[f"{n}.weight"]
        for name in (lay.q, lay.k, lay.v, lay.o, lay.gate, lay.up, lay.down):
            w = new[f"{name}.weight"]
            with torch.no_grad():  # straight-through: the mask is a constant of this step
                st = stats[name]
                score = w.abs() if self.magnitude else fast_wanda_scores(w, st.sum, st.sq_sum, st.n, *tr[name])
                keep = self.sparsity.mask(score.float())
            w = w * keep
            eff[f"{name}.weight"] = w
            if f"{name}.bias" in new:
                b = new[f"{name}.bias"]
                eff[f"{name}.bias"] = ab.fold_shift(w, b, shifts[name]) if name in shifts else b
        return {n: v.to(block.get_parameter(n).dtype) for n, v in eff.items()}

    def _error(self, out, target):
        # Position 0 is dropped: LLaMA-style models give the first token outsized activations
        # (attention sink) that would dominate a squared error.
        e = (out - target)[0, 1:] if out.shape[1] > 1 else (out - target)[0]
        return e.float()

    def learn(self, block, inputs, kwargs) -> ab.Transform:
        cfg = self.config
        lay = ab.layout(block, self.adapter)
        stats = input_stats(block, self.adapter, inputs, kwargs)
        seq = inputs[0].shape[1]
        length = min(cfg.tokens, seq)
        kw = _prefix(kwargs, length, seq)
        xs = [x[:, :length] for x in inputs[: cfg.windows]]
        with torch.no_grad():
            targets = [_out(block, x, kw) for x in xs]
        dtype = torch.promote_types(next(block.parameters()).dtype, torch.float32)
        params = {n: p.detach().to(dtype) for n, p in ab.block_params(block, lay).items()}

        @torch.no_grad()
        def recon(t):  # mean squared block-output error over the SI windows
            errs = [self._error(_out(block, x, kw, self._pruned_params(block, lay, params, stats, t)), y)
                    for x, y in zip(xs, targets)]
            return sum(e.pow(2).mean().item() for e in errs) / len(errs)

        init, unit = self.initial(stats, lay)
        identity = ab.Transform({p: torch.ones_like(s) for p, s in init.scale.items()},
                                {p: torch.zeros_like(d) for p, d in init.shift.items()})
        err = {"identity": recon(identity), "init": recon(init)}
        start = init if err["init"] < err["identity"] else identity

        # s = s0·exp(θ), δ = δ0 + u·RMS: steps are relative, s stays positive.
        theta = {p: torch.zeros_like(s, requires_grad=True) for p, s in start.scale.items()}
        u = {p: torch.zeros_like(d, requires_grad=True) for p, d in start.shift.items()}
        current = lambda: ab.Transform({p: start.scale[p].to(dtype) * theta[p].to(dtype).exp() for p in theta},  # noqa: E731
                                       {p: start.shift[p].to(dtype) + u[p].to(dtype) * unit[p] for p in u})
        opt = torch.optim.Adam([*theta.values(), *u.values()], lr=cfg.lr)
        gen = torch.Generator().manual_seed(cfg.seed)
        v = None
        with torch.enable_grad():
            for _ in range(cfg.steps):
                i = int(torch.randint(len(xs), (1,), generator=gen))
                e = self._error(_out(block, xs[i], kw, self._pruned_params(block, lay, params, stats, current())),
                                targets[i])
                e2 = e.reshape(-1, e.shape[-1])
                loss = e2.pow(2).mean()
                if cfg.spectral_weight:
                    with torch.no_grad():  # power iteration for the top right singular vector of E
                        if v is None:
                            v = torch.randn(e2.shape[1], generator=gen).to(e2)
                        for _ in range(cfg.power_iters):
                            v = e2.T @ (e2 @ v)
                            v = v / v.norm().clamp_min(1e-30)
                    loss = loss + cfg.spectral_weight * (e2 @ v).pow(2).sum() / e2.numel()
                opt.zero_grad()
                loss.backward()
                opt.step()
        chosen, result = ("init", init) if start is init else ("identity", identity)
        if cfg.steps:
            with torch.no_grad():
                learned = current()
            err["learned"] = recon(learned)
            if err["learned"] < err[chosen]:  # never worse than where it started
                chosen, result = "learned", learned
        self.history.append({**err, "chosen": chosen})
        return result


def prune_with_si(model, adapter, windows, base, sparsity: Sparsity, config: SIConfig | None = None,
                  device="cpu", dtype: torch.dtype = torch.float32) -> tuple[list[dict], SparsityInduction]:
    """SI + `base` (Magnitude, Wanda or SparseGPT) over the whole model; returns the runner's
    masks and the SparsityInduction object (its .history has the per-block errors)."""
    si = SparsityInduction(model, adapter, base, sparsity, config)
    masks = prune_blockwise(model, adapter, windows, base, sparsity, prepare=si.prepare, device=device,
                            desc=f"SI + {base.__name__}", dtype=dtype)
    si.finish()
    return masks, si


def time_wanda_update(block, adapter, inputs, kwargs, t: ab.Transform, repeats: int = 3) -> dict:
    """Seconds to get every Linear's Wanda scores after transform t: recomputed (absorb into a
    copy, one forward pass over `inputs` for new statistics) vs the fast update from cached
    Σx, Σx². Both include transforming the weights. For the bench figure (paper: 22.65×)."""
    lay = ab.layout(block, adapter)
    stats = input_stats(block, adapter, inputs, kwargs)
    params = {n: p.detach() for n, p in ab.block_params(block, lay).items()}

    def recompute(b):
        pending = ab.absorb(b, adapter, t)
        st = input_stats(b, adapter, inputs, kwargs)
        pending.fold()
        return {n: lin.weight.detach().float().abs() * st[n].sq_sum.sqrt().float()[None, :]
                for n, lin in adapter.linears(b).items()}

    def fast():
        new, _ = ab.transform_tensors(params, t, lay)
        tr = ab.input_transforms(t, lay)
        return {n: fast_wanda_scores(new[f"{n}.weight"], stats[n].sum, stats[n].sq_sum, stats[n].n, *tr[n])
                for n in adapter.linears(block)}

    def best_of(fn, args_list):
        times = []
        for a in args_list:
            t0 = time.perf_counter()
            fn(*a)
            times.append(time.perf_counter() - t0)
        return min(times)

    with torch.no_grad():
        slow = best_of(recompute, [(copy.deepcopy(block),) for _ in range(repeats)])
        quick = best_of(fast, [() for _ in range(repeats)])
    return {"recompute_s": slow, "fast_s": quick, "speedup": slow / quick}
