"""Qwen2 / Qwen2.5: LLaMA layout with biases on q/k/v.

vLLM's Qwen2Attention computes head_dim = hidden_size // num_heads and ignores
config.head_dim, so a Qwen2 model with fewer query heads would load with the wrong head
size. Such a model is saved as LlamaForCausalLM with attention_bias=true instead: that
architecture has q/k/v biases too (plus an o_proj bias, which surgery sets to zero), and
both transformers and vLLM read its head_dim from the config. Qwen2's sliding-window
variant has no LLaMA equivalent, so heads stay whole there.
"""

import torch
from transformers import LlamaConfig

from optimizer.adapters.base import BlockShape, DecoderAdapter

# The config fields a LLaMA config takes over from Qwen2's when the model is saved as LLaMA.
_LLAMA_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                 "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters",
                 "rope_theta", "rope_scaling", "initializer_range")


class Qwen2Adapter(DecoderAdapter):
    model_types = ("qwen2",)
    gguf_architectures = ("qwen2",)
    family = "qwen2"
    qkv_bias = True
    engine_reads_head_dim = False

    def loadable(self, config, shape: BlockShape) -> bool:
        if shape.num_heads == config.num_attention_heads:
            return True
        # Saved as LLaMA, so LLaMA's rule applies; sliding windows have no LLaMA equivalent.
        return config.hidden_size % shape.num_heads == 0 and not getattr(config, "use_sliding_window", False)

    def pruned_checkpoint(self, config, shape: BlockShape, state_dict: dict, model):
        new = self.pruned_config(config, shape)
        if shape.num_heads == config.num_attention_heads:
            return new, state_dict
        # LLaMA with attention_bias has q/k/v *and* o_proj biases; o_proj's is zero.
        llama = LlamaConfig(**{k: getattr(new, k) for k in _LLAMA_FIELDS if hasattr(new, k)},
                            attention_bias=True, mlp_bias=False, architectures=["LlamaForCausalLM"])
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        for block in self.blocks(model):
            o = self.attention(block).o
            state_dict[names[id(o.weight)].removesuffix("weight") + "bias"] = torch.zeros(o.out_features,
                                                                                         dtype=o.weight.dtype)
        return llama, state_dict

    def per_layer_refusal(self, config, shapes: list[dict]) -> str | None:
        if getattr(config, "use_sliding_window", False):
            return "Qwen2 with sliding-window layers has no per-layer model class"
        return None
