"""Gemma 2 (`gemma2`, e.g. Gemma-2-2B / 9B): Gemma 3's block without the per-head q/k norms.

What it shares with Gemma 3 (adapters/gemma3.py): four (1 + w) RMSNorms a block, the input and
pre-feedforward ones feeding the projections; attention scaled by query_pre_attn_scalar, so
dropping query heads leaves the others' scores alone; alternating sliding-window and global
layers; GeGLU MLP; scaled embeddings; tied head. What it adds, untouched by pruning: softcapping
of the attention logits (per head, head_dim unchanged) and of the final logits. vLLM's
Gemma2ForCausalLM reads config.head_dim. Refused before any work, as for Gemma 3: the per-layer
layout and ONNX.
"""

from optimizer.adapters.gemma3 import Gemma3Adapter


class Gemma2Adapter(Gemma3Adapter):
    model_types = ("gemma2",)
    gguf_architectures = ("gemma2",)
    family = "gemma2"
    vllm_head_module = False  # vLLM's Gemma2ForCausalLM computes its logits from embed_tokens (no lm_head)

    def fixed_block_params(self, config) -> int:
        return 4 * config.hidden_size  # the four block norms; no q/k norms

    def per_layer_refusal(self, config, shapes: list[dict]) -> str | None:
        return "Gemma 2 has no per-layer model class: use the uniform layout"
