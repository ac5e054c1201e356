"""genai_config.json: what onnxruntime-genai needs to run the exported decoder as is.

onnxruntime-genai allocates every layer's cache from one global num_key_value_heads and
head_size, so it can only run a graph whose layers all keep the same number of KV heads
(query heads and MLP widths are inside the graph and do not matter to it, but we require a
uniform layout anyway, as its config describes one). Our graph has the names it expects
(input_ids, attention_mask, position_ids, past_key_values.%d.key, present.%d.key, logits) and
concatenates past and new keys itself, hence `past_present_share_buffer: false`. The model
type is "llama" for every family: the graph carries the family's differences (biases, q/k
norms, windows), and that type selects genai's plain decoder-only loop.
"""

from __future__ import annotations

from exporters.decoder import LayerShape

FILENAME = "genai_config.json"


def unsupported_reason(shapes: list[LayerShape]) -> str | None:
    """None when genai can run the graph, else why not (for the manifest and report)."""
    kinds = {(s.num_heads, s.num_kv_heads) for s in shapes}
    if len(kinds) > 1:
        return ("per-layer head counts: onnxruntime-genai sizes every layer's KV cache from one global "
                "num_key_value_heads")
    return None


def genai_config(config, shapes: list[LayerShape], head_dim: int, max_model_len: int, eos_ids: list[int],
                 model_file: str, providers: list[str]) -> dict:
    s = shapes[0]
    eos = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad = getattr(config, "pad_token_id", None)
    provider_options = [{"cuda": {}}] if "CUDAExecutionProvider" in providers else []
    return {
        "model": {
            "bos_token_id": getattr(config, "bos_token_id", None) if getattr(config, "bos_token_id", None) is not None else eos_ids[0],
            "context_length": max_model_len,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": provider_options},
                "filename": model_file,
                "head_size": head_dim,
                "hidden_size": config.hidden_size,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "position_ids": "position_ids", "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": s.num_heads,
                "num_hidden_layers": len(shapes),
                "num_key_value_heads": s.num_kv_heads,
            },
            "eos_token_id": eos,
            "pad_token_id": pad if pad is not None else eos_ids[0],
            "type": "llama",
            "vocab_size": config.vocab_size,
        },
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                   "max_length": max_model_len, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
                   "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }
