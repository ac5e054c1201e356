"""transformers models whose layers have different shapes (shipped inside packages as remote code).

Each class is the family's own transformers model with every decoder layer rebuilt from that
layer's config (`config.layer_config(i)`: the family's config with this layer's head counts and
MLP width), so the forward, RoPE, caches and weight names are transformers' own; only the
shapes differ. A removed attention block (0 heads) or MLP (0 channels) becomes a module that
adds nothing to the residual stream and has no weights, its norm too (as in DeciLM).

Self-contained apart from `.configuration_per_layer`, so a package can carry a copy.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from .configuration_per_layer import (DeciLMConfig, PerLayerLlamaConfig, PerLayerMistralConfig,
                                      PerLayerQwen2Config, PerLayerQwen3Config)


class RemovedAttention(nn.Module):
    """A removed attention block: contributes zero; keeps the KV cache's length in step."""

    def __init__(self, layer_idx: int, head_dim: int):
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, head_dim

    def forward(self, hidden_states, past_key_values=None, **kwargs):
        if past_key_values is not None:  # zero KV heads, but the cache still counts the tokens
            b, s = hidden_states.shape[:2]
            empty = hidden_states.new_zeros(b, 0, s, self.head_dim)
            past_key_values.update(empty, empty, self.layer_idx)
        return torch.zeros_like(hidden_states), None


class RemovedMLP(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


def _rebuild_layers(model, layer_cls) -> None:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = []
    for i in range(config.num_hidden_layers):
        shape = config.layer_shape(i)
        layer = layer_cls(config.layer_config(i), i)
        if shape["num_heads"] == 0:
            layer.self_attn, layer.input_layernorm = RemovedAttention(i, head_dim), nn.Identity()
        if shape["intermediate_size"] == 0:
            layer.mlp, layer.post_attention_layernorm = RemovedMLP(), nn.Identity()
        layers.append(layer)
    model.model.layers = nn.ModuleList(layers)


def _per_layer_model(base, layer_cls, config_cls, name):
    class PerLayerModel(base):
        def __init__(self, config):
            # The family builds dense-shaped layers first (from_pretrained does that on the meta
            # device, so it costs nothing there); they are replaced before weights are loaded.
            super().__init__(config)
            _rebuild_layers(self, layer_cls)
            self.post_init()

    PerLayerModel.config_class = config_cls
    PerLayerModel.__name__ = PerLayerModel.__qualname__ = name
    return PerLayerModel


PerLayerLlamaForCausalLM = _per_layer_model(LlamaForCausalLM, LlamaDecoderLayer, PerLayerLlamaConfig,
                                            "PerLayerLlamaForCausalLM")
PerLayerMistralForCausalLM = _per_layer_model(MistralForCausalLM, MistralDecoderLayer, PerLayerMistralConfig,
                                              "PerLayerMistralForCausalLM")
PerLayerQwen2ForCausalLM = _per_layer_model(Qwen2ForCausalLM, Qwen2DecoderLayer, PerLayerQwen2Config,
                                            "PerLayerQwen2ForCausalLM")
PerLayerQwen3ForCausalLM = _per_layer_model(Qwen3ForCausalLM, Qwen3DecoderLayer, PerLayerQwen3Config,
                                            "PerLayerQwen3ForCausalLM")
DeciLMForCausalLM = _per_layer_model(LlamaForCausalLM, LlamaDecoderLayer, DeciLMConfig, "DeciLMForCausalLM")

MODELS = {m.config_class: m for m in (PerLayerLlamaForCausalLM, PerLayerMistralForCausalLM, PerLayerQwen2ForCausalLM,
                                      PerLayerQwen3ForCausalLM, DeciLMForCausalLM)}

__all__ = ["DeciLMForCausalLM", "MODELS", "PerLayerLlamaForCausalLM", "PerLayerMistralForCausalLM",
           "PerLayerQwen2ForCausalLM", "PerLayerQwen3ForCausalLM"]
