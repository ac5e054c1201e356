"""Mistral: LLaMA layout (vLLM's MistralAttention is LlamaAttention, reads config.head_dim)."""

from optimizer.adapters.base import DecoderAdapter


class MistralAdapter(DecoderAdapter):
    model_types = ("mistral",)
    family = "mistral"
