"""Gemma 3 text (`gemma3_text`, e.g. Gemma-3-270M / 1B): LLaMA's projections, with what differs:

- four RMSNorms a block: input (before attention), post-attention (on attention's output, before
  the residual add), pre-feedforward (before the MLP) and post-feedforward; the two that feed the
  projections are input and pre-feedforward;
- every RMSNorm multiplies by (1 + w), so a per-channel scale s absorbed into one turns w into
  (1 + w) / s − 1 (`norm_offset`);
- per-head RMSNorms on q and k (head_dim wide, kept whole, as Qwen3's);
- attention scaled by query_pre_attn_scalar, not by the head count, so dropping query heads
  leaves the others' scores as they were; sliding-window and global layers alternate by
  `layer_types`, which pruning does not touch; GeGLU MLP; embeddings scaled by √hidden inside
  the model; tied head.
vLLM's Gemma3ForCausalLM reads config.head_dim. Refused before any work: the per-layer layout (no
per-layer class) and ONNX (the functional decoder is LLaMA's block).
"""

from optimizer.adapters.base import DecoderAdapter, Norms


class Gemma3Adapter(DecoderAdapter):
    model_types = ("gemma3_text",)
    gguf_architectures = ("gemma3",)
    family = "gemma3"
    o_bias_key = "attention_bias"
    norm_offset = 1.0
    onnx_export = False   # four norms a block and (1 + w): not the functional decoder's block
    per_layer = False

    def norms(self, block) -> Norms:
        return Norms(block.input_layernorm, block.pre_feedforward_layernorm)

    def fixed_block_params(self, config) -> int:
        return 4 * config.hidden_size + 2 * self.head_dim(config)

    def per_layer_refusal(self, config, shapes: list[dict]) -> str | None:
        return "Gemma 3 has no per-layer model class: use the uniform layout"
