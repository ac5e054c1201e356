"""What the peer scripts (bench/peer_llmcompressor.py, bench/peer_quant.py) share. They run inside
.venv-peer, where the product is not installed: this imports torch, transformers, datasets and
llm-compressor, never `optimizer`."""

import time

import torch


def load(model_dir: str, windows_path: str, threads: int):
    """The dense model (fp32), its tokenizer, and the exact calibration token windows our side used
    (a torch file [n, seq]) as a datasets.Dataset. Returns (model, tokenizer, windows, dataset)."""
    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    windows = torch.load(windows_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ds = Dataset.from_dict({"input_ids": windows.tolist(), "attention_mask": torch.ones_like(windows).tolist()})
    return model, tok, windows, ds


def oneshot(model, ds, windows, recipe) -> float:
    """llm-compressor's `oneshot` over every window at its full length; the wall seconds it took alone."""
    from llmcompressor import oneshot as run

    started = time.time()
    run(model=model, dataset=ds, recipe=recipe, max_seq_length=windows.shape[1], num_calibration_samples=len(windows))
    return time.time() - started
