"""DDP over MoE experts (methods.md §1): one gate logit z per routed expert per MoE layer.

Same two phases and the same objective as `ddp.DDP`, on the same base (`gates.GateTraining`):
the weights stay frozen; the forward multiplies each expert's output in the weighted expert
sum by ReLU(z_e); the budget acts on s_e = clip(z_e / μ_t, 0, 1) through the augmented
Lagrangian with dual ascent, plus the binarisation term; the loss is KL to the same model
with the gates switched off.

One thing experts need that heads and channels do not: an expert with ReLU(z) = 0 would
still be *chosen* by the router and take one of the token's top-k slots, so the gated model
would not be the model without that expert. The forward therefore also routes around
experts with z ≤ 0 (router logit -inf, as `moe_surgery.masked_experts` does) — the trained
model is then exactly the deployed one. That routing mask is a step function of z, but it
costs no gradient: ReLU(z) already has none for z < 0. If fewer than top-k experts of a layer
have z > 0, the highest-z ones stay routable (with gate 0) so routing remains defined.

The cost of an expert is its parameter count (gate/up/down slices + router row), the same for
every expert; retention is that of the routed experts (attention and shared experts are not
gated here, so they are not in the budget).

Observe = `step(batch)`; decide = `decide(n_keep)` → `ExpertMasks` (keep, scales) for
`moe_surgery.prune_experts` (same count in every MoE layer; the budget's count by default).
Heads and KV groups of MoE models are not gated together with experts yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.errors import UserError
from optimizer.masks import ExpertMasks
from optimizer.methods.ddp import DDPConfig, kd_backward
from optimizer.methods.gates import GateTraining
from optimizer.moe_surgery import as_moe_adapter, experts_to_keep, moe_parts, route_hook, scale_hook

ALGORITHM = "ddp-experts-1: routed-expert gates, relu, routed around at z <= 0, inequality AL"


class ExpertGates(GateTraining):
    def __init__(self, model, adapter, cfg: DDPConfig):
        self.model, self.adapter, self.cfg = model, as_moe_adapter(adapter), cfg
        config = model.config
        self.parts = moe_parts(model, self.adapter)
        self.n, self.k = self.adapter.num_experts(config), self.adapter.experts_per_token(config)
        self.z = nn.Parameter(torch.full((len(self.parts), self.n), cfg.init))
        self.costs = torch.full(self.z.shape, float(self.adapter.expert_params(config)))  # parameters
        self.dense_cost = self.costs.sum()
        self._init_training([self.z], torch.zeros(()))
        self.enabled = True
        for p in model.parameters():
            p.requires_grad_(False)
        self._handles = []
        for i, parts in enumerate(self.parts):
            self._handles.append(parts.router.register_forward_hook(route_hook(self.adapter, lambda i=i: self._routable(i))))
            self._handles.append(parts.experts.register_forward_pre_hook(
                scale_hook(lambda i=i: F.relu(self.z[i]) if self.enabled else None), with_kwargs=True))

    def _routable(self, layer: int) -> torch.Tensor | None:
        if not self.enabled:
            return None
        z = self.z[layer].detach()
        ok = z > 0
        if ok.sum() < self.k:
            ok[z.topk(self.k).indices] = True
        return None if ok.all() else ok

    def scores(self, mu: float) -> torch.Tensor:
        return (self.z / mu).clamp(0, 1)

    def expected_retention(self, mu: float) -> torch.Tensor:
        return (self.costs * self.scores(mu)).sum() / self.dense_cost

    # --- observe: one optimisation step per batch ---------------------------------------------
    def step(self, input_ids: torch.Tensor) -> dict:
        mu = self.mu()
        self.opt.zero_grad(set_to_none=True)
        return self.descend(kd_backward(self.model, self, input_ids, self.cfg.dtype), self.scores(mu), mu)

    # --- checkpoint / resume ------------------------------------------------------------------
    def algorithm(self) -> str:
        return ALGORITHM

    def gate_state(self) -> dict:
        return {"z": self.z.detach().clone()}

    def load_gate_state(self, state: dict) -> None:
        with torch.no_grad():
            self.z.copy_(state["z"])

    # --- decide -------------------------------------------------------------------------------
    def values(self) -> torch.Tensor:
        """[MoE layers, E]: the forward gates ReLU(z), i.e. the scales surgery folds."""
        return F.relu(self.z.detach())

    def budget_count(self) -> int:
        """Experts per MoE layer that fit the budget (all experts cost the same parameters)."""
        return experts_to_keep(self.adapter, self.model.config, self.cfg.retain)

    def decide(self, n_keep: int | None = None) -> ExpertMasks:
        """Per MoE layer, the `n_keep` experts with the largest z (ascending), their ReLU(z) as scales."""
        n_keep = self.budget_count() if n_keep is None else n_keep
        if not self.k <= n_keep <= self.n:
            raise UserError(f"keep {n_keep} experts per layer: must be between top-k {self.k} and {self.n}")
        z, v = self.z.detach(), self.values()
        keep = [sorted(zl.topk(n_keep).indices.tolist()) for zl in z]
        return ExpertMasks(keep, [vl[k] for vl, k in zip(v, keep)])
