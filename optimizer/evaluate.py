"""Quality measurements. Perplexity: mean next-token NLL over non-overlapping windows."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm import tqdm


# Positions whose logits exist at once: a window's full logits are tokens × vocabulary in fp32
# (2048 × 262k, Gemma 3's: 2.1 GB, and as much again for the log-softmax), its hidden states a
# vocabulary-th of that.
LOGIT_CHUNK = 256


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The logits `model` gives for its last hidden states: the head, then the final softcapping
    some configs add after it (Gemma 2: cap · tanh(logits / cap))."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def _decoder(model):
    """The model without its head, where its logits are `head_logits` of its last hidden states;
    None where they are something else (a logit scale) or the model has no separate decoder."""
    if getattr(model.config, "logit_scale", None):
        return None
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        return None
    return decoder if decoder is not None and decoder is not model and model.get_output_embeddings() else None


def window_nll(model, w: torch.Tensor) -> float:
    """Summed next-token negative log-likelihood of one window [T] (T - 1 predictions), the
    logits of LOGIT_CHUNK positions at a time."""
    decoder = _decoder(model)
    if decoder is None:
        logits = model(w[None], use_cache=False).logits[0, :-1].float()
        return F.cross_entropy(logits, w[1:], reduction="sum").item()
    hidden = decoder(w[None], use_cache=False).last_hidden_state[0, :-1]
    total = 0.0
    for i in range(0, hidden.shape[0], LOGIT_CHUNK):
        logits = head_logits(model, hidden[i:i + LOGIT_CHUNK]).float()
        total += F.cross_entropy(logits, w[1 + i:1 + i + LOGIT_CHUNK], reduction="sum").item()
    return total


@torch.inference_mode()
def perplexity(model, windows: torch.Tensor, desc: str = "perplexity") -> float:
    nll, count = 0.0, 0
    device = next(model.parameters()).device
    for w in tqdm(windows, desc=desc, leave=False, unit="win"):
        nll += window_nll(model, w.to(device))
        count += w.numel() - 1
    return math.exp(nll / count)


@torch.inference_mode()
def mean_loss(model, windows: torch.Tensor) -> float:
    """The mean of the windows' mean next-token loss (what a model's own `labels=` loss gives)."""
    device = next(model.parameters()).device
    return sum(window_nll(model, w.to(device)) / (w.numel() - 1) for w in windows) / len(windows)
