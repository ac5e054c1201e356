"""What every model-family adapter says: where the prunable units of a block live.

All four supported families are LLaMA-style decoders (q/k/v/o attention with grouped KV
heads, gated MLP gate/up/down), so one base class carries the slicing rules and each family
file only states what differs (biases, per-head norms, how its engine reads head_dim).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn


@dataclass(frozen=True)
class BlockShape:
    """The size of one decoder block: query heads, KV heads, MLP channels."""
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    def __post_init__(self):
        if min(self.num_heads, self.num_kv_heads, self.intermediate_size) < 1:
            raise ValueError(f"a block keeps at least one unit of each kind: {self}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"query heads must split evenly over KV heads: {self}")


class Attention(NamedTuple):
    """A block's attention projections: q/k/v rows are per head, o's columns per head."""
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear


class MLP(NamedTuple):
    """A block's gated MLP: gate/up rows and down's columns are per channel."""
    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear


class Norms(NamedTuple):
    """The RMSNorms in front of attention and of the MLP."""
    attention: nn.Module
    mlp: nn.Module


class DecoderAdapter:
    """A LLaMA-style decoder. Subclasses set the class attributes for their family."""

    model_types: tuple[str, ...] = ()
    # `general.architecture` in a GGUF file of this family (llama.cpp's names): a GGUF is refused
    # from its metadata, before de-quantising, when no adapter names its architecture
    gguf_architectures: tuple[str, ...] = ()
    family: str = ""
    qkv_bias: bool = False        # q/k/v projections carry a bias (Qwen2)
    o_bias_key: str | None = None # config flag that would give o_proj a bias
    # vLLM's implementation of some families derives head_dim as hidden // heads and
    # ignores config.head_dim; their models cannot lose query heads under their own
    # architecture name, see pruned_checkpoint().
    engine_reads_head_dim: bool = True
    # transformers' LlamaConfig rejects hidden_size % num_attention_heads != 0 even when
    # head_dim is explicit, so such shapes would not load back in transformers.
    heads_divide_hidden: bool = False
    # ONNX export traces exporters/decoder.py, a LLaMA-shaped functional decoder (per-head q/k
    # norms included); a family it does not describe is refused before any work
    onnx_export: bool = True
    # our per-layer model classes (exporters/plugin) exist for this family
    per_layer: bool = True
    # vLLM's model class has an LM head of its own (a ParallelLMHead named `lm_head`, tied only when the
    # config says so), so a package may quantize it (quant_head); False where vLLM always computes the
    # logits from the embedding
    vllm_head_module: bool = True
    # RMSNorm multiplies by (offset + w): 0 for LLaMA's w, 1 for Gemma's (1 + w); a scale absorbed
    # into a norm weight is applied to (offset + w)
    norm_offset: float = 0.0
    # The blocks are LLaMA's exactly (no biases, no per-head norms): a per-layer model of this
    # family can be written as DeciLM, which stock vLLM serves.
    llama_layout: bool = False

    # --- where things live -------------------------------------------------------------
    def blocks(self, model) -> nn.ModuleList:
        return model.model.layers

    def attention(self, block) -> Attention:
        a = block.self_attn
        return Attention(a.q_proj, a.k_proj, a.v_proj, a.o_proj)

    def mlp(self, block) -> MLP:
        m = block.mlp
        return MLP(m.gate_proj, m.up_proj, m.down_proj)

    def norms(self, block) -> Norms:
        """The RMSNorms feeding attention and the MLP (SI folds input scales into their weights)."""
        return Norms(block.input_layernorm, block.post_attention_layernorm)

    def final_norm(self, model) -> nn.Module:
        """The RMSNorm after the last block, the LM head's input (a quantized head's smoothing folds into it)."""
        return model.get_decoder().norm

    def input_widths(self, config) -> dict[str, int]:
        """Input features of the block's Linears, from the config alone (N:M checks before loading)."""
        return {"q/k/v/gate/up_proj": config.hidden_size,
                "o_proj": config.num_attention_heads * self.head_dim(config),
                "down_proj": config.intermediate_size}

    def linears(self, block) -> dict[str, nn.Linear]:
        """The block's prunable matmuls by their name inside the block (N:M pruning acts on these)."""
        names = {id(m): n for n, m in block.named_modules()}
        return {names[id(m)]: m for m in (*self.attention(block), *self.mlp(block))}

    # --- shapes ------------------------------------------------------------------------
    def head_dim(self, config) -> int:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def dense_shape(self, config) -> BlockShape:
        return BlockShape(config.num_attention_heads,
                          getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                          config.intermediate_size)

    def unit_params(self, config) -> tuple[int, int, int, int]:
        """Parameters of one query head, one KV group, one MLP channel, and the fixed rest."""
        d, h = self.head_dim(config), config.hidden_size
        head = 2 * h * d + (d if self.qkv_bias else 0)          # q rows + o columns
        kv = 2 * h * d + (2 * d if self.qkv_bias else 0)        # k rows + v rows
        mlp_bias = getattr(config, "mlp_bias", False)
        channel = 3 * h + (2 if mlp_bias else 0)                # gate/up rows + down column
        fixed = self.fixed_block_params(config) + (h if mlp_bias else 0)
        return head, kv, channel, fixed

    def block_params(self, config, shape: BlockShape) -> int:
        """Parameters of one block of this shape (weights, biases, norms)."""
        head, kv, channel, fixed = self.unit_params(config)
        return fixed + shape.num_heads * head + shape.num_kv_heads * kv + shape.intermediate_size * channel

    def fixed_block_params(self, config) -> int:
        """Parameters pruning never touches: the two RMSNorms (plus per-head norms)."""
        return 2 * config.hidden_size

    def pruned_config(self, config, shape: BlockShape):
        """A copy of the config describing blocks of `shape` (same shape every layer)."""
        new = copy.deepcopy(config)
        new.head_dim = self.head_dim(config)  # keep it explicit: hidden // heads changes
        new.num_attention_heads = shape.num_heads
        new.num_key_value_heads = shape.num_kv_heads
        new.intermediate_size = shape.intermediate_size
        return new

    def loadable(self, config, shape: BlockShape) -> bool:
        """Can a checkpoint of this shape be saved under a config transformers and vLLM accept?"""
        return not self.heads_divide_hidden or config.hidden_size % shape.num_heads == 0

    def pruned_checkpoint(self, config, shape: BlockShape, state_dict: dict, model):
        """(config, state dict) of the uniformly pruned model as it is saved: the family's own
        architecture by default; a family whose engine cannot hold `shape` under its own name
        saves as another architecture here (Qwen2)."""
        return self.pruned_config(config, shape), state_dict

    def per_layer_refusal(self, config, shapes: list[dict]) -> str | None:
        """Why these per-layer shapes cannot be written as our per-layer model, or None."""
        return None

    # --- families whose checkpoint fuses projections (Phi-3) ------------------------------------
    def working_model(self, model):
        """The model the job prunes, heals and quantizes: `model` itself, or for a family whose
        checkpoint fuses projections the same function with LLaMA's separate Linears."""
        return model

    def finish_checkpoint(self, directory, source_config: dict) -> None:
        """Rewrite the working model's checkpoint written in `directory` as this family's own
        (fused tensors, the source's config); nothing to do for most families."""
