"""Qwen2-MoE (model_type 'qwen2_moe'): Qwen2 attention (q/k/v biases) and MoE blocks with a
shared expert.

transformers 5.x: `mlp.gate` is `Qwen2MoeTopKRouter` (weight [E, H]; softmax in float32,
top-k, renormalised only if `config.norm_topk_prob`, weights cast back to the logits' dtype),
`mlp.experts` is the fused `Qwen2MoeExperts` (gate_up_proj [E, 2I, H], down_proj [E, H, I],
I = `moe_intermediate_size`), plus `mlp.shared_expert` (dense gated MLP of
`shared_expert_intermediate_size`) scaled by sigmoid(`mlp.shared_expert_gate`(x)). The shared
expert sees every token and is never removed. E is `config.num_experts`; layers listed in
`mlp_only_layers`, or not on the `decoder_sparse_step` grid, are dense Qwen2MoeMLPs of
`intermediate_size` and have no experts. See mixtral.py for the common layout.
"""

import torch
import torch.nn.functional as F

from optimizer.adapters.mixtral import MoEAdapter, MoEParts


class Qwen2MoeAdapter(MoEAdapter):
    model_types = ("qwen2_moe",)
    gguf_architectures = ("qwen2moe",)
    family = "qwen2_moe"
    qkv_bias = True
    engine_reads_head_dim = False
    experts_key = "num_experts"
    expert_width_key = "moe_intermediate_size"

    def is_moe_layer(self, config, i: int) -> bool:
        return (i not in (config.mlp_only_layers or []) and config.num_experts > 0
                and (i + 1) % config.decoder_sparse_step == 0)

    def moe(self, block) -> MoEParts:
        m = block.mlp
        return MoEParts(m.gate, m.experts, (m.shared_expert, m.shared_expert_gate))

    def route(self, router, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        top, idx = torch.topk(probs, router.top_k, dim=-1)
        if router.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), idx
