"""Qwen3-MoE (model_type 'qwen3_moe', e.g. Qwen3-30B-A3B): Qwen3 attention (per-head q/k
RMSNorms, no biases) and MoE blocks without a shared expert.

transformers 5.x: `mlp.gate` is `Qwen3MoeTopKRouter` (same routing rule as Qwen2-MoE:
renormalise only if `config.norm_topk_prob`), `mlp.experts` the fused `Qwen3MoeExperts`
(I = `moe_intermediate_size`). E lives in `num_local_experts` (`num_experts` is an alias);
`mlp_only_layers` / `decoder_sparse_step` choose the dense layers as for Qwen2-MoE.
"""

from optimizer.adapters.mixtral import MoEParts
from optimizer.adapters.qwen2_moe import Qwen2MoeAdapter


class Qwen3MoeAdapter(Qwen2MoeAdapter):
    model_types = ("qwen3_moe",)
    gguf_architectures = ("qwen3moe",)
    family = "qwen3_moe"
    qkv_bias = False
    engine_reads_head_dim = True
    o_bias_key = "attention_bias"
    experts_key = "num_local_experts"

    def moe(self, block) -> MoEParts:
        m = block.mlp
        return MoEParts(m.gate, m.experts)

    def fixed_block_params(self, config) -> int:
        return 2 * config.hidden_size + 2 * self.head_dim(config)
