"""vLLM models for per-layer packages (`<family>_per_layer` configs), registered by `register()`.

vLLM's own layers already take per-layer sizes: `LlamaDecoderLayer(vllm_config, prefix, config=...)`
builds `LlamaAttention(num_heads, num_kv_heads)` and `LlamaMLP(intermediate_size)` from the
config it is handed, and `Qwen3DecoderLayer(config, ...)` likewise. So each layer here is vLLM's
own layer built from a copy of the model config carrying that layer's head counts and MLP width
(`config.layer_shapes[i]`); weight names, fused qkv / gate_up loading, RoPE, KV cache and
attention backends are vLLM's. vLLM's KV-cache manager sizes each attention layer's cache
from its own head count.

  llama, mistral, qwen2  → vLLM's Llama layers (Qwen2: q/k/v bias without o_proj bias via
                           `qkv_bias`; Mistral: its sliding window on every layer, as transformers
                           does, via `layer_types`)
  qwen3                  → vLLM's Qwen3 layers (per-head q/k norms)

A removed attention block (0 heads) or MLP (0 channels) is skipped, as vLLM's DeciLM does;
supported for the Llama-based families.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index, maybe_prefix


def layer_config(config, i: int):
    """A copy of the model config with layer i's shape (0 → placeholder 1; the layer skips it)."""
    s = config.layer_shapes[i]
    c = copy.copy(config)
    c.num_attention_heads = s["num_heads"] or 1
    c.num_key_value_heads = s["num_kv_heads"] or 1
    c.intermediate_size = s["intermediate_size"] or 1
    if config.model_type == "qwen2_per_layer":
        c.qkv_bias, c.attention_bias = True, False
    if config.model_type == "mistral_per_layer" and getattr(config, "sliding_window", None) \
            and not getattr(config, "layer_types", None):
        c.layer_types = ["sliding_attention"] * config.num_hidden_layers
    return c


class PerLayerLlamaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None, **kwargs):
        base = config or vllm_config.model_config.hf_config
        shape = base.layer_shapes[extract_layer_index(prefix)]
        cfg = layer_config(base, extract_layer_index(prefix))
        if shape["num_heads"] and shape["intermediate_size"]:
            super().__init__(vllm_config, prefix, config=cfg, **kwargs)
            return
        # A block without attention or without MLP: the parts that remain, as vLLM's DeciLM builds them.
        nn.Module.__init__(self)
        self.hidden_size = cfg.hidden_size
        self.self_attn = self.mlp = None
        bias = getattr(cfg, "attention_bias", False)
        if shape["num_heads"]:
            self.self_attn = LlamaAttention(
                config=cfg, hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
                quant_config=vllm_config.quant_config, bias=getattr(cfg, "qkv_bias", bias), bias_o_proj=bias,
                cache_config=vllm_config.cache_config, prefix=f"{prefix}.self_attn")
            self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if shape["intermediate_size"]:
            self.mlp = LlamaMLP(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                                hidden_act=cfg.hidden_act, quant_config=vllm_config.quant_config,
                                bias=getattr(cfg, "mlp_bias", False), prefix=f"{prefix}.mlp")
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        if self.self_attn is not None:
            if residual is None:
                residual = hidden_states
                hidden_states = self.input_layernorm(hidden_states)
            else:
                hidden_states, residual = self.input_layernorm(hidden_states, residual)
            hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        if self.mlp is not None:
            if residual is None:
                residual = hidden_states
                hidden_states = self.post_attention_layernorm(hidden_states)
            else:
                hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class PerLayerLlamaForCausalLM(LlamaForCausalLM):
    """Also serves `mistral_per_layer` and `qwen2_per_layer` (see layer_config)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", layer_type=PerLayerLlamaDecoderLayer):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class PerLayerQwen3DecoderLayer(Qwen3DecoderLayer):
    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = "", **kwargs):
        i = extract_layer_index(prefix)
        shape = config.layer_shapes[i]
        if not (shape["num_heads"] and shape["intermediate_size"]):
            raise ValueError(f"layer {i}: removing a whole attention block or MLP is not supported for Qwen3")
        super().__init__(layer_config(config, i), cache_config, quant_config, prefix, **kwargs)


class PerLayerQwen3Model(Qwen3Model):
    decoder_layer_type = PerLayerQwen3DecoderLayer


class PerLayerQwen3ForCausalLM(Qwen3ForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        # Qwen3ForCausalLM.__init__ with our model class (building its own first would register
        # every attention layer twice).
        nn.Module.__init__(self)
        from vllm.distributed import get_pp_group
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        config = vllm_config.model_config.hf_config
        self.config, self.vllm_config, self.quant_config = config, vllm_config, vllm_config.quant_config
        self.model = PerLayerQwen3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=self.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

