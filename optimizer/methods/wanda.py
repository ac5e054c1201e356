"""Wanda (Sun et al., 2023): score each weight by |W_ij| · ‖x_j‖₂, the size of its input channel
over the calibration tokens. Statistics: one running sum of squares per input channel."""

from __future__ import annotations

import torch
from torch import nn

from optimizer.methods.magnitude import Magnitude


class Wanda(Magnitude):
    """Magnitude's prune() on a better score."""
    needs_data = True
    statistics = ("sq_sum", "sum", "tokens")

    def __init__(self, layer: nn.Linear):
        self.layer = layer
        self.sq_sum = torch.zeros(layer.in_features, dtype=torch.float64)  # Σ x_j² over tokens
        self.sum = torch.zeros(layer.in_features, dtype=torch.float64)     # Σ x_j (for SI's fast update)
        self.tokens = 0

    def add_batch(self, inp: torch.Tensor) -> None:
        x = inp.reshape(-1, inp.shape[-1]).double()
        self.sq_sum += (x * x).sum(0)
        self.sum += x.sum(0)
        self.tokens += x.shape[0]

    def scores(self) -> torch.Tensor:
        return self.layer.weight.detach().float().abs() * self.sq_sum.sqrt().float()[None, :]

    def free(self) -> None:
        self.sq_sum = self.sum = None
