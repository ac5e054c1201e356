"""One-shot expert importance for MoE models, REAP-style (router-weighted expert activation).

Observe: on calibration text, for every token the router sends to routed expert e of an MoE
layer, the expert's output norm times the router weight the token gives it,
g_e(x) · ‖f_e(x)‖₂; the score is its mean over the tokens routed to e (REAP, Lasby et al. 2025:
an expert that is rarely chosen, or chosen with little weight, or whose output is small,
contributes little to the layer's output). An expert no calibration token reached scores 0.

Decide: `decide(n_keep)` → `ExpertMasks` keeping, in every MoE layer, the `n_keep` experts with
the highest scores (ascending indices; no scales), for `moe_surgery.prune_experts`.

Channels, when `--retain` asks for fewer parameters than top-k whole experts give
(`moe_surgery.expert_width_to_keep`): `ChannelImportance`, observed with the removed experts
already masked (so each kept expert sees the tokens it will get), scores channel c of expert e
by the output energy it adds, ‖down_e[:, c]‖² · Σ_t (g_e(x_t) · h_t,c)², h = act(gate x) · up x
over the tokens routed to e (Wanda's |W|·‖X‖ for the expert's down projection, with the router
weight); `decide(width)` keeps the `width` highest in every kept expert.

The statistics come from a forward pre-hook on the fused experts module, which receives the
hidden states, the top-k index and the top-k weights the family's router computed: the expert
outputs are recomputed from the 3-D weight tensors, so the score does not depend on which
kernel the experts module dispatches to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.errors import UserError
from optimizer.masks import ExpertMasks
from optimizer.methods.base import Method
from optimizer.moe_surgery import as_moe_adapter, moe_parts


def expert_inner(experts, hidden: torch.Tensor, expert: int) -> torch.Tensor:
    """act(gate x) · up x of one routed expert: the input of its down projection [T, I]."""
    gate, up = F.linear(hidden, experts.gate_up_proj[expert]).chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def expert_outputs(experts, hidden: torch.Tensor, expert: int) -> torch.Tensor:
    """f_e(hidden) for one routed expert of a fused experts module (no router weight)."""
    return F.linear(expert_inner(experts, hidden, expert), experts.down_proj[expert])


class _RoutedStatistics(Method):
    """Statistics of the tokens the router hands each routed expert, from a forward pre-hook on
    every fused experts module: `add(layer, experts, e, hidden, weights)` gets expert e's tokens
    [T_e, H] and their router weights [T_e]. Observing is a plain forward."""

    def __init__(self, model, adapter):
        self.model, self.adapter = model, as_moe_adapter(adapter)
        self.parts = moe_parts(model, self.adapter)
        self._handles = [p.experts.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                         for i, p in enumerate(self.parts)]

    def _hook(self, layer: int):
        def hook(experts, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            weights = args[2] if len(args) > 2 else kwargs["top_k_weights"]
            for e in index.unique().tolist():
                token, slot = torch.where(index == e)
                self.add(layer, experts, e, hidden[token], weights[token, slot].float())
        return hook

    def add(self, layer: int, experts, e: int, hidden: torch.Tensor, weights: torch.Tensor) -> None:
        raise NotImplementedError

    # --- observe --------------------------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, input_ids: torch.Tensor) -> dict:
        self.model(input_ids)
        return {}


class ExpertImportance(_RoutedStatistics):
    def __init__(self, model, adapter):
        super().__init__(model, adapter)
        self.n = self.adapter.num_experts(model.config)
        self.k = self.adapter.experts_per_token(model.config)
        self.weighted_norm = torch.zeros(len(self.parts), self.n, dtype=torch.float64)
        self.tokens = torch.zeros(len(self.parts), self.n, dtype=torch.long)

    def add(self, layer, experts, e, hidden, weights):
        norm = expert_outputs(experts, hidden, e).float().norm(dim=-1)
        self.weighted_norm[layer, e] += (weights * norm).sum().double().item()
        self.tokens[layer, e] += len(hidden)

    def scores(self) -> torch.Tensor:
        """[MoE layers, E]: mean router-weighted output norm over the tokens routed to each expert."""
        return self.weighted_norm / self.tokens.clamp(min=1)

    # --- decide ---------------------------------------------------------------------------------
    def decide(self, n_keep: int) -> ExpertMasks:
        if not self.k <= n_keep <= self.n:
            raise UserError(f"keep {n_keep} experts per layer: must be between top-k {self.k} and {self.n}")
        keep = [sorted(s.topk(n_keep).indices.tolist()) for s in self.scores()]
        return ExpertMasks(keep, None)


class ChannelImportance(_RoutedStatistics):
    """Per MoE layer and routed expert, the output energy of each intermediate channel."""

    def __init__(self, model, adapter):
        super().__init__(model, adapter)
        n, width = self.adapter.num_experts(model.config), self.adapter.expert_intermediate(model.config)
        self.energy = torch.zeros(len(self.parts), n, width, dtype=torch.float64)

    def add(self, layer, experts, e, hidden, weights):
        h = expert_inner(experts, hidden, e).float() * weights[:, None]
        self.energy[layer, e] += h.square().sum(0).double().cpu()

    def scores(self) -> torch.Tensor:
        """[MoE layers, E, I]: ‖down_e[:, c]‖² · Σ_t (g_e(x_t) h_t,c)² over the tokens routed to e."""
        down = torch.stack([p.experts.down_proj.detach().double().square().sum(1).cpu() for p in self.parts])
        return self.energy * down

    # --- decide ---------------------------------------------------------------------------------
    def decide(self, keep: list[list[int]], width: int) -> list[list[list[int]]]:
        """Per MoE layer and kept expert, its `width` highest-scoring channels (ascending)."""
        full = self.energy.shape[-1]
        if not 1 <= width <= full:
            raise UserError(f"keep {width} channels per expert: must be between 1 and {full}")
        scores = self.scores()
        return [[sorted(scores[i, e].topk(width).indices.tolist()) for e in kept] for i, kept in enumerate(keep)]
