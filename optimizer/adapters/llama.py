"""LLaMA family (LLaMA 2/3, SmolLM, TinyLlama...): model_type 'llama'. The base layout as is."""

from optimizer.adapters.base import DecoderAdapter


class LlamaAdapter(DecoderAdapter):
    model_types = ("llama",)
    gguf_architectures = ("llama",)  # Mistral and Mixtral GGUFs say "llama" too
    family = "llama"
    o_bias_key = "attention_bias"
    heads_divide_hidden = True
    llama_layout = True
