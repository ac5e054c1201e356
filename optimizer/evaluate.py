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


def head_logits(model, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The logits `model` gives for its last hidden states: the head, then the final softcapping
    some configs add after it (Gemma 2: cap · tanh(logits / cap)). `weight`: the head's weight
    already cast (a frozen head under autocast would be cast again at every call)."""
    head = model.get_output_embeddings()
    logits = head(hidden) if weight is None else F.linear(hidden, weight, head.bias)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(cfg, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def logits_decoder(model, probe: torch.Tensor):
    """The model without its head, where the model's logits are `head_logits` of its last hidden
    states — checked once on the first 64 tokens of `probe` against the model's own forward pass
    (some architectures scale the logits after the head); None where they are not, or the model
    has no separate decoder: then the full logits it is."""
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or head is None or decoder is model:
        return None
    ids = probe[None, :64]
    ref = model(ids, use_cache=False).logits.float()
    got = head_logits(model, decoder(ids, use_cache=False).last_hidden_state).float()
    return decoder if torch.allclose(got, ref, atol=1e-3 * (ref.abs().max().item() + 1), rtol=0) else None


def window_nll(model, w: torch.Tensor, decoder) -> float:
    """Summed next-token negative log-likelihood of one window [T] (T - 1 predictions); with
    `decoder` (`logits_decoder`'s), the logits of LOGIT_CHUNK positions at a time."""
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
    decoder = logits_decoder(model, windows[0].to(device))
    for w in tqdm(windows, desc=desc, leave=False, unit="win"):
        nll += window_nll(model, w.to(device), decoder)
        count += w.numel() - 1
    return math.exp(nll / count)


@torch.inference_mode()
def mean_loss(model, windows: torch.Tensor) -> float:
    """The mean of the windows' mean next-token loss (what a model's own `labels=` loss gives)."""
    device = next(model.parameters()).device
    decoder = logits_decoder(model, windows[0].to(device))
    return sum(window_nll(model, w.to(device), decoder) / (w.numel() - 1) for w in windows) / len(windows)
