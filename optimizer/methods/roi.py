"""RoI — Reservoir of Importance: learned N:M masks by differentiable subset sampling
(seed 002; methods.md §2).

Only mask logits train; the weights stay frozen. One logit φ per weight (the shape of every
prunable Linear weight, O(M) per group of M — MaskLLM needs C(M, N) per group). Choosing N of
the M weights of a group without replacement with probability ∝ exp(λφ) is the top-N of the
Gumbel-perturbed keys r = λφ + g (weighted reservoir sampling ≡ Gumbel-top-k). Relaxation,
per group, in z = r / τ:

    khot = 0;  for i = 1..N:  p_i = softmax(z);  khot += p_i;  z ← z + 2·log(1 − p_i)

The forward uses the hard top-N of the keys, the backward the gradient of the soft khot
(straight-through: mask = hard + khot − khot.detach(), exactly 0/1 in the forward).

Why `z ← z + 2·log(1 − p)` and not the spec's `r ← r + log(1 − p)` (i.e. z += log(1−p)/τ):
with the spec's update khot leaves [0, 1] for every τ ≠ 0.5 (measured on random keys, 2:4:
max khot 1.50 at τ = 1, 1.48 at τ = 0.01 — an element picked "twice"), and the two agree at
τ = 0.5. With a fixed z-space factor 2 the second pick is p_j(1−p_j)² / Σ_k p_k(1−p_k)², for
which khot_j ≤ 1 is provable (1 − p_k ≥ p_j for k ≠ j), so for N ≤ 2 (2:4, 2:8, 1:4) the soft
mask lies in [0, 1] at every τ and sums to N. For N ≥ 3 near-ties can still push an entry
above 1 (no sequential softmax with finite suppression can prevent it), so the soft mask used
for the gradient is clamped to [0, 1]; the forward is the hard mask either way. log(1 − p) of
a group's leading entry is computed in log space (p rounds to 1 in fp32 once the gap in z
exceeds ~17, and a clamp would let it be picked again).

τ anneals high → low (soft gradient sharper) and λ low → high (sampling from exploratory to
deterministic), geometrically over cfg.steps; the exported mask is the deterministic top-N of
φ per group (`decide`).

Objective: KL(teacher ‖ student) on the logits (knowledge distillation). The teacher is the
same frozen model with the masks switched off under no_grad — no second copy of the weights.
KD rather than next-token CE: the target is "behave like the dense model", its soft targets
carry far more signal per token than one label, and it needs no labels beyond the input ids.

Initialisation from a one-shot prior (`init_from_scores`, e.g. `wanda_prior`): per group,
φ = init_scale · standardised log-score, so the prior's top-N is the initial argmax and the
margins are a few units (at λ = scale_start the Gumbel noise still flips near-ties).

Masks act through a torch parametrization on each Linear's `weight` (weight = W ⊙ mask in
the forward; the frozen W is not copied). Modes: "off" (dense teacher), "sample" (training),
"hard" (deterministic top-N of φ, to evaluate the learned mask before `apply`).

Memory: φ is fp32, one per prunable weight, plus Adam's two moments: 3× the prunable fp32
weights (SmolLM2-135M: 106M → 0.42 GB + 0.85 GB). φ could be kept in bf16 later (its range
is small and only its per-group order matters at export), halving the logits; keep the Adam
moments fp32. `state_bytes()` reports the figure.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

from optimizer.adapters import DecoderAdapter
from optimizer.masks import SparseMasks
from optimizer.methods.base import TrainedMethod
from optimizer.sparsity import Sparsity


@dataclass
class RoIConfig:
    steps: int = 200
    lr: float = 0.05            # Adam on φ; φ spans a few units per group, so ~0.05/step lets a
                                # near-tie flip within tens of steps while the prior's clear
                                # choices (gaps of several units) survive noisy batches
    tau_start: float = 1.0      # relaxation temperature (z = r / τ), annealed geometrically
    tau_end: float = 0.1
    scale_start: float = 1.0    # logit scale λ in r = λφ + g, annealed geometrically
    scale_end: float = 10.0
    init_scale: float = 3.0     # φ = init_scale · per-group standardised log prior score
    checkpoint: bool = True     # eager path: recompute the relaxation in the backward (saves
                                # ~N·M-fold activation memory of the soft masks; keeps only g)
    compile: bool = True        # fuse noise → mask → W ⊙ mask into one torch.compile kernel for
                                # the large weights (far fewer passes over memory; same forward;
                                # the compiler picks what to keep for the backward)
    seed: int = 0


# --- the relaxation ---------------------------------------------------------------------------

def _log1m_softmax(z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """log(1 − p) for p = softmax(z) along the last dim, accurate also where p rounds to 1."""
    top = z.argmax(-1, keepdim=True)
    rest = torch.logsumexp(z.scatter(-1, top, float("-inf")), -1, keepdim=True) - z.gather(-1, top)
    # Only the leading entry can exceed 1/2; the others use log1p(−p) (accurate for p ≤ 1/2).
    # For the leading one: 1 − p = S / (1 + S) with S = Σ_{k≠top} exp(z_k − z_top).
    return torch.log1p(-p.scatter(-1, top, 0.0)).scatter(-1, top, -F.softplus(-rest))


def relaxed_khot(keys: torch.Tensor, n: int, tau: float) -> torch.Tensor:
    """Soft k-hot over the last dim (groups of M): sums to n; in [0, 1] for n ≤ 2 (module doc)."""
    z = keys.float() / tau
    khot = torch.zeros_like(z)
    for i in range(n):
        p = torch.softmax(z, -1)
        khot = khot + p
        if i + 1 < n:
            z = z + 2.0 * _log1m_softmax(z, p)
    return khot


def hard_topn(keys: torch.Tensor, n: int) -> torch.Tensor:
    """0/1 float mask of the top-n over the last dim."""
    out = torch.zeros_like(keys, dtype=torch.float32)
    return out.scatter_(-1, keys.topk(n, dim=-1).indices, 1.0)


def _soft(phi: torch.Tensor, g: torch.Tensor, n: int, m: int, tau: float, scale: float) -> torch.Tensor:
    keys = (scale * phi + g).reshape(phi.shape[0], -1, m)
    return relaxed_khot(keys, n, tau).clamp(0.0, 1.0).reshape(phi.shape)


def sample_mask(phi: torch.Tensor, g: torch.Tensor, n: int, m: int, tau: float, scale: float,
                use_checkpoint: bool = False) -> torch.Tensor:
    """Straight-through N:M mask: hard top-n of λφ + g per group in the forward, soft gradient."""
    with torch.no_grad():
        hard = hard_topn((scale * phi + g).reshape(phi.shape[0], -1, m), n).reshape(phi.shape)
    if use_checkpoint and phi.requires_grad:
        soft = checkpoint(_soft, phi, g, n, m, tau, scale, use_reentrant=False)
    else:
        soft = _soft(phi, g, n, m, tau, scale)
    return hard + (soft - soft.detach())  # exactly `hard` in the forward


def gumbel(shape, generator: torch.Generator, device=None) -> torch.Tensor:
    return gumbel_from_uniform(torch.rand(shape, generator=generator, device=device))


def gumbel_from_uniform(u: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(u.clamp(1e-10, 1.0 - 1e-7)))


# --- the fused path -----------------------------------------------------------------------------
# On SmolLM2 the per-weight mask ops (noise, relaxation, their backward) took most of a step in
# eager mode: a dozen passes over 106M logits. torch.compile fuses them, with the product W ⊙ mask,
# into one kernel each way. Only for weights this large: a compile costs seconds per shape, which
# tiny models (the tests) never win back.
COMPILE_MIN_NUMEL = 1 << 18


def _rank_topn(keys: torch.Tensor, n: int) -> torch.Tensor:
    """0/1 top-n over the last dim by counting larger keys (ties go to the lower index) — the
    compiler fuses this, where it would call out to topk."""
    m = keys.shape[-1]
    before = torch.ones(m, m, dtype=torch.bool, device=keys.device).tril(-1)  # [k, i]: i < k
    a, b = keys[..., :, None], keys[..., None, :]
    rank = ((b > a) | ((b == a) & before)).sum(-1)
    return (rank < n).to(torch.float32)


def masked_weight(w: torch.Tensor, phi: torch.Tensor, u: torch.Tensor, n: int, m: int, tau: float,
                  scale: float) -> torch.Tensor:
    """W ⊙ straight-through mask from uniform noise u (what `sample_mask` gives, in one function
    for torch.compile)."""
    keys = (scale * phi + gumbel_from_uniform(u)).reshape(phi.shape[0], -1, m)
    hard = _rank_topn(keys.detach(), n)
    soft = relaxed_khot(keys, n, tau).clamp(0.0, 1.0)
    return w * (hard + (soft - soft.detach())).reshape(phi.shape).to(w.dtype)


_compiled_masked_weight = None


def fused_masked_weight(w, phi, u, n, m, tau, scale):
    """`masked_weight` compiled; falls back to eager (once, with a warning) where torch.compile
    cannot build a kernel, e.g. without a C++ compiler."""
    global _compiled_masked_weight
    if _compiled_masked_weight is None:
        _compiled_masked_weight = torch.compile(masked_weight, dynamic=False)
    if _compiled_masked_weight is not masked_weight:
        try:  # τ and λ as 0-dim tensors: the compiler specialises on Python floats (one kernel per step)
            return _compiled_masked_weight(w, phi, u, n, m, torch.tensor(tau), torch.tensor(scale))
        except Exception as e:  # noqa: BLE001 — any compiler failure: the eager path is exact
            warnings.warn(f"RoI: torch.compile unavailable ({type(e).__name__}); mask ops run eagerly")
            _compiled_masked_weight = masked_weight
    return masked_weight(w, phi, u, n, m, tau, scale)


def prior_logits(scores: torch.Tensor, m: int, init_scale: float) -> torch.Tensor:
    """φ from a one-shot score (higher = keep): per-group standardised log-score × init_scale.
    Monotone within each group, so the prior's top-N is φ's top-N."""
    x = torch.log(scores.detach().float().clamp_min(torch.finfo(torch.float32).tiny))
    g = x.reshape(x.shape[0], -1, m)
    g = (g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-6)
    return (init_scale * g).reshape(x.shape)


# --- Wanda prior -------------------------------------------------------------------------------

@torch.no_grad()
def wanda_prior(model, adapter: DecoderAdapter, windows: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Wanda scores |W_ij|·‖x_j‖₂ for every prunable Linear, from ONE pass of the (dense) model
    over `windows` [n, seq] (unlike the block runner, later blocks see dense inputs). Call it
    before building RoI, or with `roi.mode = "off"`."""
    sq, handles = [], []
    for block in adapter.blocks(model):
        d = {}
        for name, lin in adapter.linears(block).items():
            d[name] = torch.zeros(lin.in_features, dtype=torch.float64, device=lin.weight.device)

            def hook(_m, args, _y, name=name, d=d):
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                d[name] += (x * x).sum(0)
            handles.append(lin.register_forward_hook(hook))
        sq.append(d)
    try:
        for w in windows:
            model(w[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [{name: lin.weight.detach().float().abs() * d[name].sqrt().float()[None, :]
             for name, lin in adapter.linears(block).items()}
            for block, d in zip(adapter.blocks(model), sq)]


# --- the method --------------------------------------------------------------------------------

class _Mask(nn.Module):
    """Parametrization weight → weight ⊙ mask, computed by the owning RoI in its current mode."""

    def __init__(self, roi: "RoI", block: int, name: str):
        super().__init__()
        self.__dict__["roi"] = roi  # a plain reference: φ must not become a model parameter
        self.block, self.name = block, name

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return self.roi._masked(self.block, self.name, w)


class RoI(TrainedMethod):
    def __init__(self, model, adapter: DecoderAdapter, sparsity: Sparsity, cfg: RoIConfig):
        if not sparsity.is_nm:
            raise ValueError(f"RoI learns N:M masks; got {sparsity}")
        self.model, self.adapter, self.sparsity, self.cfg = model, adapter, sparsity, cfg
        self.n, self.m = sparsity.n, sparsity.m
        self.step_count = 0
        self.mode = "sample"
        self._noise: list[dict[str, torch.Tensor]] | None = None  # this step's, in 'sample' mode
        self._schedule = (cfg.tau_start, cfg.scale_start)
        self._requires_grad = {id(p): p.requires_grad for p in model.parameters()}
        for p in model.parameters():
            p.requires_grad_(False)
        self.linears = [adapter.linears(b) for b in adapter.blocks(model)]
        self.phi: list[dict[str, nn.Parameter]] = []
        for i, lins in enumerate(self.linears):
            d = {}
            for name, lin in lins.items():
                sparsity.check_shape(lin.in_features, name)
                d[name] = nn.Parameter(torch.zeros(lin.weight.shape, dtype=torch.float32, device=lin.weight.device))
            self.phi.append(d)
        self.params = [p for d in self.phi for p in d.values()]
        self.opt = torch.optim.Adam(self.params, lr=cfg.lr)
        self.gen = torch.Generator(device=self.params[0].device).manual_seed(cfg.seed)
        for i, lins in enumerate(self.linears):
            for name, lin in lins.items():
                parametrize.register_parametrization(lin, "weight", _Mask(self, i, name), unsafe=True)
        self._attached = True

    # --- masks in the forward --------------------------------------------------------------------
    def _masked(self, block: int, name: str, w: torch.Tensor) -> torch.Tensor:
        if self.mode == "off":
            return w
        phi = self.phi[block][name]
        if self.mode == "hard":
            return w * self.sparsity.mask(phi.detach()).to(w.dtype)
        if self._noise is None:
            raise RuntimeError("RoI in 'sample' mode outside step(); set roi.mode = 'hard' or 'off'")
        u, (tau, scale) = self._noise[block][name], self._schedule
        if self.cfg.compile and phi.numel() >= COMPILE_MIN_NUMEL:
            return fused_masked_weight(w, phi, u, self.n, self.m, tau, scale)
        mask = sample_mask(phi, gumbel_from_uniform(u), self.n, self.m, tau, scale, self.cfg.checkpoint)
        return w * mask.to(w.dtype)

    def _draw_noise(self) -> list[dict[str, torch.Tensor]]:
        # Uniform noise, drawn in a fixed order (block, then Linear) from the seeded generator.
        return [{name: torch.rand(phi.shape, generator=self.gen, device=phi.device) for name, phi in d.items()}
                for d in self.phi]

    # --- schedule ---------------------------------------------------------------------------------
    def _t(self) -> float:
        return min(1.0, self.step_count / max(1, self.cfg.steps - 1))

    def tau(self) -> float:
        c = self.cfg
        return c.tau_start * (c.tau_end / c.tau_start) ** self._t()

    def scale(self) -> float:
        c = self.cfg
        return c.scale_start * (c.scale_end / c.scale_start) ** self._t()

    # --- init ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_from_scores(self, scores: list[dict[str, torch.Tensor]]) -> None:
        """φ from one-shot scores (same shapes as the weights, higher = keep)."""
        for d, s in zip(self.phi, scores):
            for name, phi in d.items():
                phi.copy_(prior_logits(s[name].to(phi.device), self.m, self.cfg.init_scale))

    # --- observe: one optimisation step ---------------------------------------------------------------
    def kd_loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        """KL(teacher ‖ student) per token, student under the current mode."""
        mode = self.mode
        with torch.no_grad():
            self.mode = "off"
            teacher = F.log_softmax(self.model(input_ids, use_cache=False).logits.float(), dim=-1)
            self.mode = mode
        student = F.log_softmax(self.model(input_ids, use_cache=False).logits.float(), dim=-1)
        return F.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction="batchmean")

    def step(self, input_ids: torch.Tensor) -> dict:
        tau, scale = self.tau(), self.scale()
        self.mode = "sample"
        self._noise, self._schedule = self._draw_noise(), (tau, scale)
        try:
            loss = self.kd_loss(input_ids)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
        finally:
            self._noise = None
        self.opt.step()
        self.step_count += 1
        return {"loss": loss.item(), "tau": tau, "scale": scale, "step": self.step_count}

    @torch.no_grad()
    def eval_loss(self, input_ids: torch.Tensor, mode: str = "hard") -> float:
        """KD loss of the deterministic mask (mode 'hard') without training."""
        old, self.mode = self.mode, mode
        try:
            return self.kd_loss(input_ids).item()
        finally:
            self.mode = old

    # --- decide / apply ------------------------------------------------------------------------------
    @torch.no_grad()
    def decide(self) -> SparseMasks:
        """Keep-masks per block: the deterministic top-N of φ in every group of M."""
        return SparseMasks([{name: self.sparsity.mask(phi.detach()) for name, phi in d.items()} for d in self.phi])

    def close(self) -> None:
        """Detach from the model (weights back as they were, dense), restore requires_grad."""
        if not self._attached:
            return
        for lins in self.linears:
            for lin in lins.values():
                parametrize.remove_parametrizations(lin, "weight", leave_parametrized=False)
        for p in self.model.parameters():
            p.requires_grad_(self._requires_grad.get(id(p), p.requires_grad))
        self._attached = False

    @torch.no_grad()
    def apply(self) -> SparseMasks:
        """Zero the pruned weights in place, remove the parametrizations; returns the masks."""
        masks = self.decide()
        self.close()
        for lins, keep in zip(self.linears, masks):
            for name, lin in lins.items():
                lin.weight.mul_(keep[name].to(lin.weight.device))
        return masks

    # --- memory figure ---------------------------------------------------------------------------------
    def state_bytes(self) -> dict:
        """Trainable-state bytes (φ + Adam moments) and their ratio to the model's bytes.
        Adam's moments are allocated at the first step; before that they are projected."""
        logits = sum(p.numel() * p.element_size() for p in self.params)
        st = [self.opt.state.get(p, {}) for p in self.params]
        adam = sum(v.numel() * v.element_size() for s in st for k, v in s.items()
                   if torch.is_tensor(v) and k in ("exp_avg", "exp_avg_sq"))
        if adam == 0:
            adam = 2 * logits
        model = sum(p.numel() * p.element_size() for p in self.model.parameters())
        prunable = sum(p.numel() for p in self.params)
        return {"logits": logits, "adam": adam, "total": logits + adam, "model": model,
                "ratio": (logits + adam) / model, "logits_per_prunable_weight": logits / prunable / 4,
                "prunable_weights": prunable}

    # --- checkpoint / resume ---------------------------------------------------------------------------
    def identity(self) -> dict:
        return {"config": asdict(self.cfg), "sparsity": str(self.sparsity)}

    def state(self) -> dict:
        return {"phi": [{k: v.detach().cpu() for k, v in d.items()} for d in self.phi],
                "opt": self.opt.state_dict(), "step": self.step_count, "gen": self.gen.get_state()}

    def restore(self, state: dict) -> None:
        with torch.no_grad():
            for d, s in zip(self.phi, state["phi"]):
                for name, phi in d.items():
                    phi.copy_(s[name])
        self.opt.load_state_dict(state["opt"])
        self.step_count = state["step"]
        self.gen.set_state(state["gen"])


def bytes_str(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


__all__ = ["RoI", "RoIConfig", "wanda_prior", "relaxed_khot", "sample_mask", "hard_topn", "prior_logits",
           "bytes_str"]
