"""SparseGPT (Frantar & Alistarh, 2023): prune with second-order weight updates.

add_batch accumulates the layer-input Hessian H = 2/n · Σ x xᵀ. prune() walks the columns in
blocks: inside a block it chooses what to drop by the OBS saliency w² / [H⁻¹]_jj² (per N:M
group as it reaches it, or per row for an unstructured fraction) and spreads each dropped
weight's error onto the columns not yet visited, using the upper Cholesky factor of H⁻¹.
"""

from __future__ import annotations

import torch
from torch import nn

from optimizer.methods.base import LinearPruner
from optimizer.sparsity import Sparsity


class SparseGPT(LinearPruner):
    needs_data = True
    statistics = ("H", "tokens")

    def __init__(self, layer: nn.Linear, block_size: int = 128, damp: float = 0.01):
        self.layer = layer
        self.block_size = block_size
        self.damp = damp  # fraction of mean(diag H) added to the diagonal: keeps H invertible
        self.H = torch.zeros(layer.in_features, layer.in_features, dtype=torch.float32)
        self.tokens = 0

    def add_batch(self, inp: torch.Tensor) -> None:
        x = inp.reshape(-1, inp.shape[-1]).float()
        total = self.tokens + x.shape[0]
        # fp32 even under the runner's bf16 autocast (addmm_ in place is not autocast): a bf16
        # xᵀx loses positive-definiteness next to the few huge outlier channels LLMs have.
        # Running mean keeps H's scale fixed: H ← H·tokens/total + 2/total · xᵀx.
        _add_gram(self.H, x, beta=self.tokens / total, alpha=2 / total)
        self.tokens = total

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
    def prune(self, sparsity: Sparsity, keep_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Prune to `sparsity` with OBS updates; with `keep_mask` ([out, in] bool, e.g. RoI's
        learned mask) that mask is imposed instead of chosen, and the sweep only reconstructs."""
        W = self.layer.weight.detach().float().clone()
        Hinv = self._hinv_upper(W)
        # Work on Wᵀ: one column of W is then one contiguous row, and each step of the sweep
        # below is two vector ops (the error, and a rank-1 update of the columns left).
        Wt = W.t().contiguous()
        given = keep_mask is not None
        keep = keep_mask.t().contiguous().clone() if given else torch.ones_like(Wt, dtype=torch.bool)
        cols = Wt.shape[0]
        # An N:M group must not straddle two blocks.
        bs = max(sparsity.m, self.block_size // sparsity.m * sparsity.m) if sparsity.is_nm else self.block_size
        for b0 in range(0, cols, bs):
            b1 = min(b0 + bs, cols)
            W1, keep1, Hinv1 = Wt[b0:b1], keep[b0:b1], Hinv[b0:b1, b0:b1]
            d = torch.diag(Hinv1)[:, None]
            err_scale = torch.zeros_like(W1)   # 1/[H⁻¹]_jj where a weight is dropped, else 0
            Err1 = torch.empty_like(W1)
            if not sparsity.is_nm and not given:
                keep1.copy_(sparsity.mask((W1.pow(2) / d.pow(2)).t()).t())
            if given or not sparsity.is_nm:  # the whole block's mask is known now
                err_scale = (~keep1) / d
            # Columns go in small groups (an N:M group, else 16): inside a group each column's
            # error reaches the group's later columns at once (column i itself becomes w·keep);
            # the rest of the block gets the whole group's errors in one matmul.
            step = sparsity.m if sparsity.is_nm else 16
            for g0 in range(0, b1 - b0, step):
                g1 = min(g0 + step, b1 - b0)
                if sparsity.is_nm and not given:
                    keep1[g0:g1] = sparsity.mask((W1[g0:g1].pow(2) / d[g0:g1].pow(2)).t()).t()
                    err_scale[g0:g1] = (~keep1[g0:g1]) / d[g0:g1]
                for i in range(g0, g1):
                    err = torch.mul(W1[i], err_scale[i], out=Err1[i])
                    W1[i:g1].addr_(Hinv1[i, i:g1], err, alpha=-1)
                W1[g1:].addmm_(Hinv1[g0:g1, g1:].t(), Err1[g0:g1], alpha=-1)
            W1.mul_(keep1)  # exact zeros where the update left rounding residue
            Wt[b1:] -= Hinv[b0:b1, b1:].t() @ Err1
        self.layer.weight.copy_(Wt.t().to(self.layer.weight.dtype))
        return keep.t().contiguous()

    def free(self) -> None:
        self.H = None


def _add_gram(H: torch.Tensor, x: torch.Tensor, beta: float, alpha: float) -> None:
    """H ← beta·H + alpha·xᵀx in place. xᵀx is symmetric, so for wide inputs only the tiles on
    and above the diagonal are multiplied (10 of 16) and the others mirrored: this is most of
    the calibration time of a layer as wide as down_proj's input."""
    n = x.shape[1]
    parts = 4 if n >= 512 else 1
    edges = [round(i * n / parts) for i in range(parts + 1)]
    tiles = [slice(a, b) for a, b in zip(edges, edges[1:])]
    for i, a in enumerate(tiles):
        for b in tiles[i:]:
            H[a, b].addmm_(x[:, a].t(), x[:, b], beta=beta, alpha=alpha)
            if b != a:
                H[b, a] = H[a, b].t()

