"""Mixtral (model_type 'mixtral') and the MoE layout the Qwen MoE families share with it.

What transformers 5.x builds (checked in models/mixtral|qwen2_moe|qwen3_moe/modeling_*.py):

- A decoder layer is `self_attn` (the LLaMA q/k/v/o layout, so heads and KV groups are as in
  `DecoderAdapter`) plus `mlp`, which is a sparse MoE block:
    - `mlp.gate`: a *router module* (`MixtralTopKRouter`, `Qwen2MoeTopKRouter`, ...) holding
      one Parameter `weight` [E, H] (no bias). Its forward returns
      `(router_logits [T, E], top_k_weights [T, k], top_k_index [T, k])`: softmax over all E
      experts in float32, top-k of the probabilities, then renormalised over the k chosen.
      Mixtral always renormalises and keeps the weights in float32; Qwen renormalises only
      when `config.norm_topk_prob` and casts them back to the logits' dtype.
    - `mlp.experts`: *one fused module* (not a ModuleList) with 3-D Parameters
      `gate_up_proj` [E, 2I, H] (gate rows first, then up rows) and `down_proj` [E, H, I], no
      biases. Its forward is `experts(hidden [T, H], top_k_index, top_k_weights)` and adds
      `top_k_weights[t, j] * down_e(act(gate_e x) * up_e x)` over the chosen experts; the
      `@use_experts_implementation` decorator may dispatch it to grouped_mm / batched_mm
      kernels that read the 3-D tensors directly, so per-expert changes must act on the
      arguments (index, weights) or on the tensors, never on per-expert submodules.
    - Qwen2-MoE only: `mlp.shared_expert` (a dense gated MLP of
      `shared_expert_intermediate_size`) and `mlp.shared_expert_gate` (Linear [1, H]); the
      output is routed sum + sigmoid(shared_expert_gate(x)) * shared_expert(x). Every token
      goes through it, so it is never a candidate for removal.
- Config fields: Mixtral `num_local_experts` (alias `num_experts`), expert width
  `intermediate_size`; Qwen2-MoE `num_experts`, Qwen3-MoE `num_local_experts` (alias
  `num_experts`), expert width `moe_intermediate_size`, dense-layer width `intermediate_size`;
  all `num_experts_per_tok` (top-k). Qwen layers are MoE when
  `i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0`,
  otherwise a dense MLP; Mixtral layers are all MoE.
- In memory the experts are fused; `save_pretrained` converts back to the per-expert
  checkpoint layout the Hub models (and vLLM's loaders) use: Mixtral
  `block_sparse_moe.experts.{e}.w1|w2|w3.weight` + `block_sparse_moe.gate.weight`, Qwen MoE
  `mlp.experts.{e}.gate_proj|up_proj|down_proj.weight` + `mlp.gate.weight`, and fuses again
  on load. Expert e of the pruned model is the e-th kept expert.

Removing an expert = its router row and its slices of both 3-D tensors; a kept expert's scale
folds into its `down_proj` slice (no bias, so exact). Narrowing the experts = per kept expert,
gate row c, up row I + c and down column c go together; the config's expert width changes. The structured head/channel path of
`DecoderAdapter` (dense MLP channels) does not apply to MoE blocks and raises a UserError.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.errors import UserError
from optimizer.adapters.base import BlockShape, DecoderAdapter


@dataclass(frozen=True)
class MoEParts:
    """Where one MoE block keeps its routed experts, its router and its shared expert(s)."""
    router: nn.Module                   # .weight [E, H]; forward -> (logits, top-k weights, top-k index)
    experts: nn.Module                  # .gate_up_proj [E, 2I, H], .down_proj [E, H, I]
    shared: tuple[nn.Module, ...] = ()  # always kept (Qwen2-MoE: shared_expert, shared_expert_gate)


class MoEAdapter(DecoderAdapter):
    """A decoder whose MLPs are (partly) sparse MoE blocks; attention as in DecoderAdapter."""

    experts_key = "num_local_experts"   # the config field holding E
    onnx_export = False                 # the functional ONNX decoder has no MoE block
    per_layer = False                   # expert removal is uniform: one expert count in the config
    expert_width_key = "intermediate_size"

    # --- where things live -------------------------------------------------------------
    def is_moe_layer(self, config, i: int) -> bool:
        return True

    def moe_layers(self, config) -> list[int]:
        """Indices of the decoder layers whose MLP is a sparse MoE block."""
        return [i for i in range(config.num_hidden_layers) if self.is_moe_layer(config, i)]

    def moe(self, block) -> MoEParts:
        m = block.mlp
        return MoEParts(m.gate, m.experts)

    def num_experts(self, config) -> int:
        return getattr(config, self.experts_key)

    def experts_per_token(self, config) -> int:
        return config.num_experts_per_tok

    def expert_intermediate(self, config) -> int:
        return getattr(config, self.expert_width_key)

    def expert_params(self, config) -> int:
        """Parameters one routed expert removes: gate/up/down slices plus its router row."""
        return 3 * config.hidden_size * self.expert_intermediate(config) + config.hidden_size

    def route(self, router, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights, top-k index) from router logits, as the family's router computes them."""
        probs = F.softmax(logits.float(), dim=-1)
        top, idx = torch.topk(probs, router.top_k, dim=-1)
        return top / top.sum(dim=-1, keepdim=True), idx

    def pruned_moe_config(self, config, n_experts: int, expert_width: int | None = None):
        new = copy.deepcopy(config)
        setattr(new, self.experts_key, n_experts)
        if expert_width is not None:
            setattr(new, self.expert_width_key, expert_width)
        return new

    # --- the dense head/channel path does not cover MoE blocks yet ------------------------
    def _unsupported(self, what: str):
        raise UserError(f"{self.family}: {what} is not supported for MoE models yet; "
                        f"MoE models are pruned by removing whole experts and narrowing the kept ones "
                        f"(optimizer.moe_surgery)")

    def mlp(self, block):
        self._unsupported("MLP channel pruning")

    def dense_shape(self, config) -> BlockShape:
        self._unsupported("structured head/channel pruning")

    def unit_params(self, config):
        self._unsupported("structured head/channel pruning")

    def block_params(self, config, shape: BlockShape) -> int:
        self._unsupported("structured head/channel pruning")

    def pruned_config(self, config, shape: BlockShape):
        self._unsupported("structured head/channel pruning")

    def input_widths(self, config) -> dict[str, int]:
        self._unsupported("semi-structured (N:M) pruning")

    def linears(self, block):
        self._unsupported("semi-structured (N:M) pruning")


class MixtralAdapter(MoEAdapter):
    model_types = ("mixtral",)
    family = "mixtral"
    o_bias_key = None
