"""Phi-3 (`phi3`: Phi-3-mini / -medium, Phi-3.5-mini): LLaMA's block with two fused projections,
`qkv_proj` (rows [q; k; v]) and `gate_up_proj` (rows [gate; up]).

Every method, heal and quantize work on LLaMA-named Linears, so the job works on the model Phi-3
computes written with separate projections (`working_model`: a Mistral model, the LLaMA layout
that also has Phi-3's sliding window, holding the same weights split at the fused tensors' row
boundaries; the tests check it gives the same logits). The package is Phi-3 again
(`finish_checkpoint`): each fused tensor is the kept rows of its parts concatenated, quantization
scales included, under the source's config with the pruned shape, so vLLM's Phi3ForCausalLM and
transformers' Phi3 read it as they read the original.

Refused: a partial rotary embedding (Phi-4-mini's partial_rotary_factor 0.75: Mistral rotates the
whole head). No per-layer model class; ONNX is the LLaMA families' (best effort, not covered here).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from core.errors import UserError
from optimizer.adapters.base import DecoderAdapter

# The config fields the working Mistral model takes over from Phi-3's.
_MISTRAL_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range",
                   "rms_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
                   "rope_parameters", "sliding_window", "attention_dropout")
# The fused tensors and their parts, in row order, as module names inside a block.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


class Phi3Adapter(DecoderAdapter):
    model_types = ("phi3",)
    gguf_architectures = ("phi3",)
    family = "phi3"
    onnx_export = False   # the working model is Mistral-shaped, but the export path is not tested for it
    per_layer = False

    def per_layer_refusal(self, config, shapes: list[dict]) -> str | None:
        return "Phi-3 has no per-layer model class: use the uniform layout"

    # --- the working model ---------------------------------------------------------------------
    def working_model(self, model):
        """The Mistral model with `model`'s weights, the fused ones split (same dtype, eval mode)."""
        from transformers import MistralConfig, MistralForCausalLM
        c = model.config
        rotary = (getattr(c, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        if rotary != 1.0:
            raise UserError(f"phi3 with a partial rotary embedding (partial_rotary_factor {rotary}) is not "
                            f"supported: only Phi-3 models that rotate the whole head")
        fields = {k: getattr(c, k) for k in _MISTRAL_FIELDS if hasattr(c, k)}
        config = MistralConfig(**fields, head_dim=self.head_dim(c), architectures=["MistralForCausalLM"])
        if getattr(c, "original_max_position_embeddings", None):  # longrope reads it
            config.original_max_position_embeddings = c.original_max_position_embeddings
        sd = {}
        for name, tensor in model.state_dict().items():
            fused = next((f for f in FUSED if name.endswith(f"{f}.weight")), None)
            if fused is None:
                sd[name] = tensor
                continue
            prefix = name[: -len(f"{fused}.weight")]
            for part, rows in zip(FUSED[fused], tensor.split(self._part_rows(c)[fused])):
                sd[f"{prefix}{part}.weight"] = rows.clone()
        from optimizer.surgery import build_model
        return build_model(config, sd, model.dtype)

    def _part_rows(self, config) -> dict[str, list[int]]:
        d = self.head_dim(config)
        return {"self_attn.qkv_proj": [config.num_attention_heads * d, config.num_key_value_heads * d,
                                       config.num_key_value_heads * d],
                "mlp.gate_up_proj": [config.intermediate_size, config.intermediate_size]}

    # --- the package ---------------------------------------------------------------------------
    def finish_checkpoint(self, directory: Path, source_config: dict) -> None:
        """Rewrite the working model's checkpoint in `directory` as Phi-3: fused tensors (every
        tensor a part holds: weight, and with --quant its scales / packed weights) and the source's
        config with the pruned shape (and depth), dtype and quantization config."""
        from safetensors.torch import load_file, save_file
        files = sorted(directory.glob("*.safetensors"))
        sd = {k: v for f in files for k, v in load_file(f).items()}  # a layer's parts may sit in two shards
        for fused, parts in FUSED.items():
            for name in [n for n in sd if f".{parts[0]}." in n]:
                prefix, suffix = name.split(f".{parts[0]}.")
                pieces = [sd.pop(f"{prefix}.{p}.{suffix}") for p in parts]
                if suffix == "weight_shape":  # packed 4-bit weights record their [rows, columns]
                    sd[f"{prefix}.{fused}.{suffix}"] = torch.tensor(
                        [sum(int(p[0]) for p in pieces), int(pieces[0][1])], dtype=pieces[0].dtype)
                else:
                    sd[f"{prefix}.{fused}.{suffix}"] = torch.cat(pieces)
        for f in [*files, *directory.glob("*.safetensors.index.json")]:
            f.unlink()
        save_file(sd, directory / "model.safetensors", metadata={"format": "pt"})
        path = directory / "config.json"
        working = json.loads(path.read_text())
        config = {**source_config, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}
        for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim", "dtype",
                  "torch_dtype", "quantization_config", "transformers_version",
                  "tie_word_embeddings"):  # quant_head unties the head from the embedding
            if k in working:
                config[k] = working[k]
        config.pop("auto_map", None)  # the package is the library's Phi3, not remote code
        path.write_text(json.dumps(config, indent=2) + "\n")
