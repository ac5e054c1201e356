"""Model-family adapters: the only code that knows module names like q_proj or mlp.

A new family is one new module here plus one line in _ADAPTERS.
"""

from __future__ import annotations

from core.errors import UserError
from optimizer.adapters.base import MLP, Attention, BlockShape, DecoderAdapter, Norms
from optimizer.adapters.gemma2 import Gemma2Adapter
from optimizer.adapters.gemma3 import Gemma3Adapter
from optimizer.adapters.llama import LlamaAdapter
from optimizer.adapters.mistral import MistralAdapter
from optimizer.adapters.mixtral import MixtralAdapter, MoEAdapter, MoEParts
from optimizer.adapters.phi3 import Phi3Adapter
from optimizer.adapters.qwen2 import Qwen2Adapter
from optimizer.adapters.qwen2_moe import Qwen2MoeAdapter
from optimizer.adapters.qwen3 import Qwen3Adapter
from optimizer.adapters.qwen3_moe import Qwen3MoeAdapter

_ADAPTERS: dict[str, DecoderAdapter] = {
    t: a() for a in (LlamaAdapter, MistralAdapter, Qwen2Adapter, Qwen3Adapter, Gemma2Adapter, Gemma3Adapter, Phi3Adapter,
                     MixtralAdapter, Qwen2MoeAdapter, Qwen3MoeAdapter) for t in a.model_types
}


def supported_model_types() -> list[str]:
    return sorted(_ADAPTERS)


def onnx_families() -> list[str]:
    return sorted({a.family for a in _ADAPTERS.values() if a.onnx_export and not isinstance(a, MoEAdapter)})


def supported_gguf_architectures() -> list[str]:
    return sorted({a for adapter in _ADAPTERS.values() for a in adapter.gguf_architectures})


def get_adapter(config) -> DecoderAdapter:
    model_type = getattr(config, "model_type", None)
    if model_type not in _ADAPTERS:
        raise UserError(f"unsupported architecture '{model_type}'; supported: {', '.join(supported_model_types())}")
    return _ADAPTERS[model_type]


__all__ = ["MLP", "Attention", "BlockShape", "DecoderAdapter", "Norms", "MoEAdapter", "MoEParts", "get_adapter", "onnx_families", "supported_gguf_architectures",
           "supported_model_types"]
