"""Qwen3 (dense): LLaMA layout plus per-head RMSNorms on q and k.

The q/k norms act on head_dim, which pruning never changes, so they are kept whole;
vLLM's Qwen3 reads config.head_dim.
"""

from optimizer.adapters.base import DecoderAdapter


class Qwen3Adapter(DecoderAdapter):
    model_types = ("qwen3",)
    gguf_architectures = ("qwen3",)
    family = "qwen3"
    o_bias_key = "attention_bias"

    def per_layer_refusal(self, config, shapes: list[dict]) -> str | None:
        if any(0 in s.values() for s in shapes):
            return "removing a whole attention block or MLP is supported for LLaMA-style families, not Qwen3"
        return None

    def fixed_block_params(self, config) -> int:
        return 2 * config.hidden_size + 2 * self.head_dim(config)
