"""Configs of decoders whose layers have different shapes (shipped inside packages as remote code).

Self-contained on purpose: a package carries a copy of this file (and modeling_per_layer.py),
named in config.json's `auto_map`, so `from_pretrained(..., trust_remote_code=True)` works
without this tool; with the tool installed the same classes are registered with transformers'
Auto classes (and vLLM's config parser) by `exporters.plugin.register`.

Two formats:
  * `<family>_per_layer` (PerLayer*Config): the family's own config plus
    `layer_shapes = [{"num_heads", "num_kv_heads", "intermediate_size"}, ...]`, one per layer
    (0 heads = attention removed, 0 channels = MLP removed). The global `num_attention_heads`,
    `num_key_value_heads`, `intermediate_size` stay the dense ones; `head_dim` is explicit.
    Served in vLLM by our model classes (vllm.general_plugins entry point).
  * `nemotron-nas` (DeciLMConfig): NVIDIA's DeciLM layout that stock vLLM loads
    (vllm/model_executor/models/nemotron_nas.py): `block_configs[i].attention.{no_op,
    n_heads_in_group}` (KV heads = num_attention_heads // n_heads_in_group; query heads are
    global) and `block_configs[i].ffn.{no_op, intermediate_size}`. vLLM reads these by
    attribute, so they are objects here and plain dicts in config.json; transformers has no
    DeciLM class (5.19), hence this one. vLLM needs `--trust-remote-code` to read it.

transformers 5.19's `per_layer_config` (HeterogeneousConfigMixin) can describe per-layer
overrides, but only the config side exists: a stock LlamaForCausalLM built from such a config
raises AmbiguousGlobalPerLayerAttributeError (its layers read the global values), and vLLM does
not read it, so it is not used here.
"""

from __future__ import annotations

import copy

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

SHAPE_KEYS = ("num_heads", "num_kv_heads", "intermediate_size")


class _PerLayerMixin:
    """What every per-layer config adds: per-layer shapes and configs."""

    def layer_shape(self, i: int) -> dict:
        raise NotImplementedError

    def layer_config(self, i: int):
        """A shallow copy of this config with layer i's head counts and MLP width.

        Removed parts (0 heads / 0 channels) get a placeholder of 1: the model replaces them.
        """
        s = self.layer_shape(i)
        c = copy.copy(self)
        c.num_attention_heads = s["num_heads"] or 1
        c.num_key_value_heads = s["num_kv_heads"] or 1
        c.intermediate_size = s["intermediate_size"] or 1
        return c

    def validate_architecture(self):
        # head_dim is explicit; LlamaConfig's hidden_size % num_attention_heads rule does not apply.
        return None


def _per_layer_config(base):
    @strict
    class PerLayerConfig(_PerLayerMixin, base):
        model_type = base.model_type + "_per_layer"
        layer_shapes: list | None = None

        def __post_init__(self, **kwargs):
            super().__post_init__(**kwargs)
            if self.layer_shapes is not None:
                if len(self.layer_shapes) != self.num_hidden_layers:
                    raise ValueError(f"{len(self.layer_shapes)} layer_shapes for {self.num_hidden_layers} layers")
                self.layer_shapes = [{k: int(s[k]) for k in SHAPE_KEYS} for s in self.layer_shapes]

        def layer_shape(self, i: int) -> dict:
            return self.layer_shapes[i]

    PerLayerConfig.__name__ = PerLayerConfig.__qualname__ = "PerLayer" + base.__name__
    return PerLayerConfig


PerLayerLlamaConfig = _per_layer_config(LlamaConfig)
PerLayerMistralConfig = _per_layer_config(MistralConfig)
PerLayerQwen2Config = _per_layer_config(Qwen2Config)
PerLayerQwen3Config = _per_layer_config(Qwen3Config)
PER_LAYER_CONFIGS = {c.model_type: c for c in (PerLayerLlamaConfig, PerLayerMistralConfig, PerLayerQwen2Config,
                                                PerLayerQwen3Config)}


class _Section:
    """A block_configs entry: attribute access for vLLM, a dict in config.json.

    Only the keys given exist as attributes: vLLM checks `hasattr(ffn, "ffn_mult")`.
    """

    def __init__(self, **fields):
        for k, v in fields.items():
            setattr(self, k, _Section(**v) if isinstance(v, dict) else v)

    def to_dict(self) -> dict:
        return {k: v.to_dict() if isinstance(v, _Section) else v for k, v in self.__dict__.items()}

    def __eq__(self, other):
        return isinstance(other, _Section) and self.to_dict() == other.to_dict()

    def __repr__(self):
        return f"_Section({self.to_dict()})"


@strict
class DeciLMConfig(_PerLayerMixin, LlamaConfig):
    model_type = "nemotron-nas"
    block_configs: list | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.block_configs is not None:
            if len(self.block_configs) != self.num_hidden_layers:
                raise ValueError(f"{len(self.block_configs)} block_configs for {self.num_hidden_layers} layers")
            self.block_configs = [b if isinstance(b, _Section) else _Section(**b) for b in self.block_configs]

    def layer_shape(self, i: int) -> dict:
        b = self.block_configs[i]
        heads = 0 if b.attention.no_op else self.num_attention_heads
        kv = 0 if b.attention.no_op else self.num_attention_heads // b.attention.n_heads_in_group
        if b.ffn.no_op:
            width = 0
        elif hasattr(b.ffn, "ffn_mult"):  # DeciLM's rounding, as vLLM does it
            width = int(2 * b.ffn.ffn_mult * self.hidden_size / 3)
            width += (256 - width % 256) % 256
        else:
            width = b.ffn.intermediate_size
        return {"num_heads": heads, "num_kv_heads": kv, "intermediate_size": width}

    @property
    def layer_shapes(self) -> list[dict]:
        return [self.layer_shape(i) for i in range(self.num_hidden_layers)]

    def to_dict(self) -> dict:
        d = super().to_dict()
        if d.get("block_configs") is not None:
            d["block_configs"] = [b.to_dict() if isinstance(b, _Section) else b for b in d["block_configs"]]
        return d


def decilm_block(shape: dict, num_attention_heads: int) -> dict:
    """The block_configs entry for one layer shape (query heads must be `num_attention_heads` or 0)."""
    heads, kv, width = (shape[k] for k in SHAPE_KEYS)
    if heads and (heads != num_attention_heads or heads % kv):
        raise ValueError(f"DeciLM keeps {num_attention_heads} query heads in every attention block, got {shape}")
    return {"attention": {"no_op": heads == 0, "replace_with_linear": False,
                          "n_heads_in_group": heads // kv if heads else None},
            "ffn": {"no_op": width == 0, "replace_with_linear": False,
                    **({"intermediate_size": width} if width else {})}}


__all__ = ["DeciLMConfig", "PER_LAYER_CONFIGS", "PerLayerLlamaConfig", "PerLayerMistralConfig",
           "PerLayerQwen2Config", "PerLayerQwen3Config", "decilm_block"]
