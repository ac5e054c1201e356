"""Per-layer model classes for transformers and vLLM, and the vLLM plugin that registers them.

`register()` is the `vllm.general_plugins` entry point (pyproject.toml). vLLM runs every
general plugin in each of its processes (API server, engine core, workers) before it reads a
model's config, so after `pip install -e .` a per-layer package loads in stock vLLM:
  * the configs (`llama_per_layer`, `mistral_per_layer`, `qwen2_per_layer`, `qwen3_per_layer`)
    are registered with transformers' AutoConfig, which vLLM's config parser uses, so no
    `--trust-remote-code` (DeciLM packages need none of this: stock vLLM serves them);
  * the architectures (`PerLayerLlamaForCausalLM`, ...) are registered with vLLM's
    ModelRegistry, lazily ("module:Class"), so vLLM imports them only when it needs them.

`register_transformers()` registers the configs and models (DeciLM's too) with AutoConfig /
AutoModelForCausalLM; this tool calls it (exporters.per_layer, surgery.prune_per_layer), vLLM's
processes do not. A package also carries copies of
configuration_per_layer.py and modeling_per_layer.py named in config.json's `auto_map`, so
`AutoModelForCausalLM.from_pretrained(PKG, trust_remote_code=True)` works without this tool.

This directory uses relative imports only: packages ship a copy of it as an installable vLLM
plugin (`vllm_plugin/`, see exporters/per_layer.py) for images without this tool.
"""

from __future__ import annotations

_registered_hf = False

# architecture name in config.json → class in vllm_models.py (imported by vLLM only when used)
VLLM_ARCHITECTURES = {
    "PerLayerLlamaForCausalLM": "PerLayerLlamaForCausalLM",
    "PerLayerMistralForCausalLM": "PerLayerLlamaForCausalLM",  # Llama layers + sliding window
    "PerLayerQwen2ForCausalLM": "PerLayerLlamaForCausalLM",    # Llama layers + q/k/v bias
    "PerLayerQwen3ForCausalLM": "PerLayerQwen3ForCausalLM",
}


def register_transformers() -> None:
    global _registered_hf
    if _registered_hf:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from .modeling_per_layer import MODELS
    for config_cls, model_cls in MODELS.items():
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
    _registered_hf = True


def register() -> None:
    """vLLM general plugin: our configs for vLLM's config parser, our architectures for its registry."""
    from transformers import AutoConfig

    from .configuration_per_layer import PER_LAYER_CONFIGS
    # Not DeciLM's `nemotron-nas`: stock vLLM serves those packages with their own config class
    # (--trust-remote-code), and a registration here would override NVIDIA's for their checkpoints.
    for model_type, config_cls in PER_LAYER_CONFIGS.items():
        AutoConfig.register(model_type, config_cls, exist_ok=True)
    from vllm import ModelRegistry
    for arch, cls in VLLM_ARCHITECTURES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"{__name__}.vllm_models:{cls}")
