"""Quality measurements. Perplexity: mean next-token NLL over non-overlapping windows."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm import tqdm


@torch.inference_mode()
def perplexity(model, windows: torch.Tensor, desc: str = "perplexity") -> float:
    nll, count = 0.0, 0
    device = next(model.parameters()).device
    for w in tqdm(windows, desc=desc, leave=False, unit="win"):
        w = w.to(device)
        logits = model(w[None]).logits[0, :-1].float()
        nll += F.cross_entropy(logits, w[1:], reduction="sum").item()
        count += w.numel() - 1
    return math.exp(nll / count)
