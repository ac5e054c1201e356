"""DDP — deterministic differentiable structured pruning (seed 004; methods.md §1).

Only gates train; the weights stay frozen. One logit z per unit: query head, KV group, MLP
channel. The forward multiplies the unit's output by ReLU(z) — deterministic, so the model
that trains is the model that ships, and kept units learn a useful scale that surgery folds
into o_proj / down_proj columns. A query head's gate is ReLU(z_head) · ReLU(z_kv_group).

The budget acts on smooth retention scores s = clip(z / μ_t, 0, 1), not on the forward
gates; μ_t anneals geometrically from 1 so s approaches the step 1[z > 0]:
    c      = E[cost kept] / cost dense − ρ_t        (cost: parameters, or predicted latency;
                                                     ρ_t falls from 1 to ρ over a warm-up)
    L      = KL(teacher ‖ student) + λ c + β/2 c² + γ_t Σ s(1 − s) / n
    λ     ← λ + β c                                 (dual ascent, every step)
The teacher is the same frozen model with gates switched off (no second copy of weights).

Observe = `step(batch)` (one optimisation step); decide = `decide(shape)` for a uniform
shape, or `budget_masks()` for per-layer shapes meeting the budget exactly.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from optimizer.adapters import BlockShape, DecoderAdapter
from optimizer.methods.activation import select_uniform
from optimizer.surgery import BlockMask, Masks


@dataclass
class DDPConfig:
    retain: float
    steps: int = 200
    batch: int = 4
    lr: float = 0.05
    beta: float = 5.0          # augmented-Lagrangian penalty, also the dual step size
    gamma: float = 0.5         # binarisation weight at the end (ramped linearly from 0)
    mu_start: float = 1.0      # ramp width: s = clip(z / mu, 0, 1) = 1 at the dense start z = 1
    mu_end: float = 0.05
    init: float = 1.0          # ReLU(1) = 1: training starts from the dense model
    warmup: float = 0.5        # fraction of steps over which the target falls from 1 to retain
    prior_spread: float = 0.0  # >0: start z at init ± spread ordered by activation importance (init_from)
    seed: int = 0


@dataclass(frozen=True)
class UnitCosts:
    """Cost of one unit of each kind in a block, and the block's fixed cost."""
    head: float
    kv: float
    channel: float
    fixed: float

    @staticmethod
    def params(adapter: DecoderAdapter, config) -> "UnitCosts":
        return UnitCosts(*adapter.unit_params(config))

    def block(self, heads: float, kv: float, channels: float) -> float:
        return self.fixed + heads * self.head + kv * self.kv + channels * self.channel


class Gates(nn.Module):
    def __init__(self, layers: int, dense: BlockShape, init: float):
        super().__init__()
        self.dense = dense
        self.group = dense.num_heads // dense.num_kv_heads
        self.head = nn.Parameter(torch.full((layers, dense.num_heads), init))
        self.kv = nn.Parameter(torch.full((layers, dense.num_kv_heads), init))
        self.channel = nn.Parameter(torch.full((layers, dense.intermediate_size), init))
        self.enabled = True

    def head_gate(self) -> torch.Tensor:  # [L, H]
        return F.relu(self.head) * F.relu(self.kv).repeat_interleave(self.group, dim=1)

    def scores(self, mu: float):
        # A clipped linear ramp, not a sigmoid: a sigmoid saturates for z >> mu, so the budget
        # sees no response while every gate drifts down together, and then all cross at once.
        return tuple((z / mu).clamp(0, 1) for z in (self.head, self.kv, self.channel))


class DDP:
    def __init__(self, model, adapter: DecoderAdapter, cfg: DDPConfig, costs: UnitCosts):
        self.model, self.adapter, self.cfg, self.costs = model, adapter, cfg, costs
        config = model.config
        self.dense = adapter.dense_shape(config)
        self.head_dim = adapter.head_dim(config)
        self.layers = config.num_hidden_layers
        self.gates = Gates(self.layers, self.dense, cfg.init)
        self.opt = torch.optim.Adam(self.gates.parameters(), lr=cfg.lr)
        self.lam = 0.0
        self.step_count = 0
        self.dense_cost = self.layers * costs.block(*self._dense_counts())
        for p in model.parameters():
            p.requires_grad_(False)
        self._handles = []
        for i, block in enumerate(adapter.blocks(model)):
            o_proj, down = adapter.attention(block)[3], adapter.mlp(block)[2]
            self._handles.append(o_proj.register_forward_pre_hook(self._gate_hook(i, "head")))
            self._handles.append(down.register_forward_pre_hook(self._gate_hook(i, "channel")))

    def _dense_counts(self):
        return self.dense.num_heads, self.dense.num_kv_heads, self.dense.intermediate_size

    def _gate_hook(self, layer: int, kind: str):
        def hook(_mod, args):
            if not self.gates.enabled:
                return None
            if kind == "head":
                g = self.gates.head_gate()[layer].repeat_interleave(self.head_dim)
            else:
                g = F.relu(self.gates.channel[layer])
            return (args[0] * g.to(args[0].dtype),) + tuple(args[1:])
        return hook

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # --- schedule and budget ----------------------------------------------------------------
    def mu(self) -> float:
        # Held during the warm-up, while the gates sort themselves under a falling target
        # (an annealed score is flat for z > mu, so the budget would see no response);
        # then annealed geometrically so the scores approach the step 1[z > 0].
        start = self.cfg.warmup * self.cfg.steps
        t = min(1.0, max(0.0, self.step_count - start) / max(1, self.cfg.steps - 1 - start))
        return self.cfg.mu_start * (self.cfg.mu_end / self.cfg.mu_start) ** t

    def target(self) -> float:
        # A moving target keeps c small while the gates sort themselves; a fixed one lets
        # λ wind up until every gate crosses zero at once (CoFi / Sheared-LLaMA do the same).
        t = min(1.0, self.step_count / max(1, self.cfg.warmup * self.cfg.steps))
        return 1.0 - (1.0 - self.cfg.retain) * t

    def expected_retention(self, mu: float) -> torch.Tensor:
        s_head, s_kv, s_chan = self.gates.scores(mu)
        s_head_eff = s_head * s_kv.repeat_interleave(self.gates.group, dim=1)
        c = self.costs
        kept = self.layers * c.fixed + c.head * s_head_eff.sum() + c.kv * s_kv.sum() + c.channel * s_chan.sum()
        return kept / self.dense_cost

    # --- observe: one optimisation step per batch ---------------------------------------------
    def step(self, input_ids: torch.Tensor) -> dict:
        mu = self.mu()
        kd = kd_loss(self.model, self.gates, input_ids)
        return self.descend(kd, torch.cat([x.flatten() for x in self.gates.scores(mu)]), mu)

    def descend(self, kd: torch.Tensor, s: torch.Tensor, mu: float) -> dict:
        """The rest of a step, shared by every kind of gate (ExpertGates borrows it): the
        augmented-Lagrangian budget on the scores `s`, the binarisation term, one Adam step
        on the gates, and dual ascent on λ."""
        cfg = self.cfg
        target = self.target()
        c = self.expected_retention(mu) - target
        gamma = cfg.gamma * min(1.0, self.step_count / max(1, cfg.steps - 1))
        loss = kd + self.lam * c + cfg.beta / 2 * c * c + gamma * (s * (1 - s)).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.lam += cfg.beta * c.item()
        self.step_count += 1
        return {"kd": kd.item(), "retain": c.item() + target, "target": target, "lambda": self.lam, "mu": mu}

    def init_from(self, head_scores: list[torch.Tensor], channel_scores: list[torch.Tensor]) -> None:
        """Break the gates' symmetry with a one-shot importance (ActivationImportance scores).

        Started all at `init`, every gate feels the same budget pull and the KD gradient alone
        must sort them; spreading them by ± prior_spread (standardised log-importance, squashed
        by tanh, across all layers per kind) makes the least important units reach zero first,
        so training refines the one-shot ordering instead of discovering one."""
        def spread(scores):
            x = torch.stack(scores).float().clamp_min(1e-30).log()
            return self.cfg.prior_spread * torch.tanh((x - x.mean()) / (x.std() + 1e-6))
        g = self.gates
        with torch.no_grad():
            g.head.copy_(self.cfg.init + spread(head_scores))
            kv = torch.stack(head_scores).view(self.layers, self.dense.num_kv_heads, g.group).sum(-1)
            g.kv.copy_(self.cfg.init + spread(list(kv)))
            g.channel.copy_(self.cfg.init + spread(channel_scores))

    # --- checkpoint / resume ------------------------------------------------------------------
    def state(self) -> dict:
        return {"gates": self.gates.state_dict(), "opt": self.opt.state_dict(), "lam": self.lam,
                "step": self.step_count, "config": asdict(self.cfg), "rng": torch.get_rng_state()}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(self.state(), tmp)
        os.replace(tmp, path)

    def load(self, path: Path) -> bool:
        """Resume from `path` if it holds a run with the same configuration."""
        if not path.is_file():
            return False
        state = torch.load(path, weights_only=False)
        if state["config"] != asdict(self.cfg):
            return False
        self.gates.load_state_dict(state["gates"])
        self.opt.load_state_dict(state["opt"])
        self.lam, self.step_count = state["lam"], state["step"]
        torch.set_rng_state(state["rng"])
        return True

    # --- decide -------------------------------------------------------------------------------
    def unit_values(self):
        """Per layer: effective head gates [H], channel gates [I] (the scales to fold)."""
        with torch.no_grad():
            return list(self.gates.head_gate()), list(F.relu(self.gates.channel))

    def decide(self, shape: BlockShape) -> Masks:
        """Uniform layout: the best units per block for `shape`, their gates as scales."""
        heads, chans = self.unit_values()
        masks = select_uniform(heads, chans, self.dense, shape)
        for b, h, c in zip(masks.blocks, heads, chans):
            b.head_scale = h[b.heads].tolist()
            b.channel_scale = c[b.channels].tolist()
        return masks

    def budget_masks(self) -> Masks:
        """Per-layer layout: units with z > 0, then the exact budget by gate value.

        KV groups are kept when their gate and at least one of their heads are positive; a
        removed group takes its query heads with it. Ties to the budget are broken by
        dropping the lowest-valued channels, then heads, until the cost fits; then every kept
        group of a layer is cut to the same number of query heads (GQA needs it) and the
        budget this frees goes back to the best removed channels.
        """
        heads, chans = self.unit_values()
        c, group = self.costs, self.gates.group
        keep_h = [h > 0 for h in heads]
        keep_c = [x > 0 for x in chans]
        kv_count = [kh.view(-1, group).sum(1) for kh in keep_h]  # kept heads per group

        def cost():
            return sum(c.block(kh.sum().item(), (kh.view(-1, group).sum(1) > 0).sum().item(), kc.sum().item())
                       for kh, kc in zip(keep_h, keep_c))
        total = cost()
        # Drop the units with the least gate value per unit of cost until the budget fits.
        ranked = sorted([(heads[l_][i].item() / c.head, 0, l_, i) for l_ in range(self.layers)
                         for i in keep_h[l_].nonzero().flatten().tolist()] +
                        [(chans[l_][i].item() / c.channel, 1, l_, i) for l_ in range(self.layers)
                         for i in keep_c[l_].nonzero().flatten().tolist()])
        budget = self.cfg.retain * self.dense_cost
        for _, kind, l_, i in ranked:
            if total <= budget:
                break
            if kind == 0 and keep_h[l_].sum() > 1:
                keep_h[l_][i] = False
                kv_count[l_][i // group] -= 1
                total -= c.head + (c.kv if kv_count[l_][i // group] == 0 else 0)
            elif kind == 1 and keep_c[l_].sum() > 1:
                keep_c[l_][i] = False
                total -= c.channel
        for kh, kc, h, x in zip(keep_h, keep_c, heads, chans):
            for keep, values in ((kh, h), (kc, x)):
                if not keep.any():  # a block keeps at least one unit of each kind
                    keep[values.argmax()] = True
            _equal_heads_per_group(kh, h, group)
        total = cost()
        # Heads dropped to equalise the groups leave budget over: the best channels the
        # tie-break removed (positive gates only; a zero gate contributes nothing) come back.
        spare = sorted(((chans[l_][i].item(), l_, i) for l_ in range(self.layers)
                        for i in (~keep_c[l_] & (chans[l_] > 0)).nonzero().flatten().tolist()), reverse=True)
        for _, l_, i in spare:
            if total + c.channel > budget:
                break
            keep_c[l_][i] = True
            total += c.channel
        blocks = []
        for kh, kc, h, x in zip(keep_h, keep_c, heads, chans):
            hi = kh.nonzero().flatten().tolist()
            ci = kc.nonzero().flatten().tolist()
            kv = sorted({i // group for i in hi})
            blocks.append(BlockMask(hi, kv, ci, h[hi].tolist(), x[ci].tolist()))
        return Masks(blocks)


def _equal_heads_per_group(keep: torch.Tensor, values: torch.Tensor, group: int) -> None:
    """GQA needs the same number of query heads in every kept KV group (every engine and our
    surgery assume it): keep in each kept group its best n heads, n = the smallest count
    among them. Only drops heads, so the budget still holds. In place on `keep` [H]."""
    k = keep.view(-1, group)
    counts = k.sum(1)
    if (counts > 0).sum() == 0:
        return
    n = int(counts[counts > 0].min())
    v = values.view(-1, group).masked_fill(~k, float("-inf"))
    for g in (counts > n).nonzero().flatten().tolist():
        k[g] = False
        k[g, v[g].topk(n).indices] = True


def kd_loss(model, gates, input_ids: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ student) per token; the teacher is the same model with `gates.enabled` off,
    run under no_grad, so no second copy of the weights exists."""
    with torch.no_grad():
        gates.enabled = False
        teacher = F.log_softmax(model(input_ids).logits.float(), dim=-1)
        gates.enabled = True
    student = F.log_softmax(model(input_ids).logits.float(), dim=-1)
    return F.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction="batchmean")


def peak_rss_gib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
