"""Qwen2 / Qwen2.5: LLaMA layout with biases on q/k/v.

vLLM's Qwen2Attention computes head_dim = hidden_size // num_heads and ignores
config.head_dim, so a Qwen2 model with fewer query heads would load with the wrong head
size. Such a model is saved as LlamaForCausalLM with attention_bias=true instead: that
architecture has q/k/v biases too (plus an o_proj bias, which surgery sets to zero), and
both transformers and vLLM read its head_dim from the config. Qwen2's sliding-window
variant has no LLaMA equivalent, so heads stay whole there.
"""

from optimizer.adapters.base import BlockShape, DecoderAdapter


class Qwen2Adapter(DecoderAdapter):
    model_types = ("qwen2",)
    family = "qwen2"
    qkv_bias = True
    engine_reads_head_dim = False

    def loadable(self, config, shape: BlockShape) -> bool:
        if shape.num_heads == config.num_attention_heads:
            return True
        # Saved as LLaMA, so LLaMA's rule applies; sliding windows have no LLaMA equivalent.
        return config.hidden_size % shape.num_heads == 0 and not getattr(config, "use_sliding_window", False)

    def export_architecture(self, config, shape: BlockShape) -> str | None:
        return None if shape.num_heads == config.num_attention_heads else "LlamaForCausalLM"
