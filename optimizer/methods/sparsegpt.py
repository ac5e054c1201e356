"""SparseGPT (Frantar & Alistarh, 2023): prune with second-order weight updates.

add_batch accumulates the layer-input Hessian H = 2/n · Σ x xᵀ. prune() walks the columns in
blocks: inside a block it chooses what to drop by the OBS saliency w² / [H⁻¹]_jj² (per N:M
group as it reaches it, or per row for an unstructured fraction) and spreads each dropped
weight's error onto the columns not yet visited, using the upper Cholesky factor of H⁻¹.
"""

from __future__ import annotations

import torch
from torch import nn

from optimizer.sparsity import Sparsity


class SparseGPT:
    needs_data = True

    def __init__(self, layer: nn.Linear, block_size: int = 128, damp: float = 0.01):
        self.layer = layer
        self.block_size = block_size
        self.damp = damp  # fraction of mean(diag H) added to the diagonal: keeps H invertible
        self.H = torch.zeros(layer.in_features, layer.in_features, dtype=torch.float32)
        self.tokens = 0

    def add_batch(self, inp: torch.Tensor) -> None:
        x = inp.reshape(-1, inp.shape[-1]).float()
        n = x.shape[0]
        self.H *= self.tokens / (self.tokens + n)   # running mean keeps H's scale fixed
        self.tokens += n
        x = x * (2 / self.tokens) ** 0.5
        self.H += x.t() @ x

    def _hinv_upper(self, W: torch.Tensor) -> torch.Tensor:
        H = self.H.clone()
        dead = torch.diag(H) == 0          # inputs that were always zero: their weights are free
        H[dead, dead] = 1
        W[:, dead] = 0
        H += self.damp * torch.diag(H).mean() * torch.eye(H.shape[0])
        Hinv = torch.cholesky_inverse(torch.linalg.cholesky(H))
        return torch.linalg.cholesky(Hinv, upper=True)

    def scores(self) -> torch.Tensor:
        """The OBS saliency of every weight with the full inverse (a prior for RoI)."""
        W = self.layer.weight.detach().float().clone()
        d = torch.diag(self._hinv_upper(W))
        return W.pow(2) / d.pow(2)[None, :]

    @torch.no_grad()
    def prune(self, sparsity: Sparsity) -> torch.Tensor:
        W = self.layer.weight.detach().float().clone()
        rows, cols = W.shape
        Hinv = self._hinv_upper(W)
        keep = torch.ones_like(W, dtype=torch.bool)
        # An N:M group must not straddle two blocks.
        bs = max(sparsity.m, self.block_size // sparsity.m * sparsity.m) if sparsity.is_nm else self.block_size
        for b0 in range(0, cols, bs):
            b1 = min(b0 + bs, cols)
            W1, Hinv1 = W[:, b0:b1].clone(), Hinv[b0:b1, b0:b1]
            d = torch.diag(Hinv1)
            Q1, Err1 = torch.zeros_like(W1), torch.zeros_like(W1)
            keep1 = torch.ones_like(W1, dtype=torch.bool)
            if not sparsity.is_nm:
                keep1 = sparsity.mask(W1.pow(2) / d.pow(2)[None, :])
            for i in range(b1 - b0):
                if sparsity.is_nm and i % sparsity.m == 0:
                    g = slice(i, i + sparsity.m)
                    keep1[:, g] = sparsity.mask(W1[:, g].pow(2) / d[g].pow(2)[None, :])
                w = W1[:, i]
                q = w * keep1[:, i]
                Q1[:, i] = q
                err = (w - q) / d[i]
                W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
                Err1[:, i] = err
            W[:, b0:b1] = Q1
            keep[:, b0:b1] = keep1
            W[:, b1:] -= Err1 @ Hinv[b0:b1, b1:]
        self.layer.weight.copy_(W.to(self.layer.weight.dtype))
        return keep

    def free(self) -> None:
        self.H = None
