"""Per-layer LLaMA models in NVIDIA's DeciLM layout (`nemotron-nas`), which stock vLLM serves.

What vLLM 0.32's `nemotron_nas.py` (DeciLMForCausalLM) reads, per layer i:
  block_configs[i].attention.no_op             no attention and no input_layernorm in this block
  block_configs[i].attention.n_heads_in_group  KV heads = num_attention_heads // n_heads_in_group
  block_configs[i].ffn.no_op                   no MLP and no post_attention_layernorm
  block_configs[i].ffn.intermediate_size       (or ffn_mult, DeciLM's rounded multiplier; never written here)
plus the LLaMA globals: hidden_size, num_attention_heads (query heads of *every* attention
block), head_dim, rope_parameters, rms_norm_eps, attention_bias, mlp_bias, hidden_act (SiLU
only), tie_word_embeddings; weight names are LLaMA's. Its attention is LlamaAttention, so the
per-layer KV-head count goes straight to vLLM's KV-cache manager.

So the layout holds per-layer KV groups, MLP widths and removed blocks, but one query-head
count for all attention blocks: it applies when every block that keeps attention keeps the
same number of query heads (not necessarily the dense number), on a LLaMA-family model.
Anything else goes to the plugin format (exporters/per_layer.py).

transformers (5.19) has no DeciLM / nemotron-nas class and vLLM has no config class for it,
so the package carries ours (exporters/plugin/{configuration,modeling}_per_layer.py) named in
`auto_map`: vLLM needs `--trust-remote-code` to read the config, as for NVIDIA's own Nemotron-NAS
checkpoints; transformers loads it with `trust_remote_code=True`, or natively once this tool
is imported.
"""

from __future__ import annotations

import torch

from exporters.plugin.configuration_per_layer import DeciLMConfig, decilm_block
from exporters.plugin.modeling_per_layer import DeciLMForCausalLM

ARCHITECTURE = "DeciLMForCausalLM"


def why_not(model, llama_layout: bool = True) -> str | None:
    """None when the per-layer model can be written as DeciLM; otherwise the reason, in one line.
    `llama_layout`: the family's blocks are LLaMA's exactly (its adapter says so)."""
    config = model.config
    if not llama_layout:
        return f"DeciLM is a LLaMA layout and this is a {config.model_type.removesuffix('_per_layer')} model"
    if config.hidden_act != "silu":
        return f"vLLM's DeciLM supports SiLU MLPs only (this model: {config.hidden_act})"
    heads = sorted({s["num_heads"] for s in config.layer_shapes if s["num_heads"]})
    if len(heads) > 1:
        return (f"query heads differ per layer ({', '.join(map(str, heads))}); DeciLM keeps one "
                "query-head count for every attention block")
    return None


def to_decilm(model, llama_layout: bool = True):
    """The same weights under a DeciLMConfig / our DeciLMForCausalLM (loaded strictly)."""
    reason = why_not(model, llama_layout)
    if reason:
        raise ValueError(f"cannot write DeciLM: {reason}")
    config = model.config
    shapes = config.layer_shapes
    attn = [s for s in shapes if s["num_heads"]]
    heads = attn[0]["num_heads"] if attn else config.num_attention_heads
    d = {k: v for k, v in config.to_dict().items()
         if k not in ("model_type", "architectures", "auto_map", "transformers_version", "layer_shapes")}
    new_config = DeciLMConfig.from_dict({
        **d, "num_attention_heads": heads,
        # vLLM's nemotron-nas reads KV heads per block; this global is the first attention block's, as vLLM reports it
        "num_key_value_heads": attn[0]["num_kv_heads"] if attn else config.num_key_value_heads,
        "block_configs": [decilm_block(s, heads) for s in shapes], "architectures": [ARCHITECTURE]})
    if new_config.layer_shapes != shapes:
        raise AssertionError(f"DeciLM config describes {new_config.layer_shapes}, not {shapes}")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(model.dtype)
    try:
        new = DeciLMForCausalLM(new_config)
    finally:
        torch.set_default_dtype(prev)
    sd = {k: v for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = new.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"DeciLM weights do not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        new.tie_weights()
    return new.eval()
