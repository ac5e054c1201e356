"""Magnitude pruning: keep the largest |W|. Needs no calibration data (add_batch is a no-op),
but has the same two-phase shape as Wanda and SparseGPT so the block runner treats all alike."""

from __future__ import annotations

import torch

from optimizer.methods.base import LinearPruner
from optimizer.sparsity import Sparsity


class Magnitude(LinearPruner):
    needs_data = False
    statistics = ()  # what add_batch collects; a Linear reading the same input adopts them

    def add_batch(self, inp: torch.Tensor) -> None:
        pass

    def scores(self) -> torch.Tensor:
        return self.layer.weight.detach().float().abs()

    @torch.no_grad()
    def prune(self, sparsity: Sparsity) -> torch.Tensor:
        keep = sparsity.mask(self.scores())
        self.layer.weight.mul_(keep)
        return keep

