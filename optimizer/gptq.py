"""GPTQ (Frantar et al., 2023): round weights to the quantization grid with second-order error
correction, block by block on the calibration runner (`sequential.run_blockwise`).

The statistics are SparseGPT's (the layer-input Hessian H = 2/n · Σ x xᵀ, `add_batch`); the
decision walks the columns, rounds each to its grid point and spreads the rounding error onto the
columns not yet visited through the upper Cholesky factor of H⁻¹ — SparseGPT's sweep with
"drop" replaced by "round". The grid is the layer's compressed-tensors scheme: per output
channel, its scale fixed beforehand from the weights (`quantize.weight_scales`), or per group of
columns, each group's scale taken from the already-corrected weights when the sweep reaches it
(GPTQ's rule). The layer's weight becomes exactly scale × integer, so compressing it later
reproduces the integers GPTQ chose.
"""

from __future__ import annotations

import torch

from optimizer.methods.sparsegpt import SparseGPT
from optimizer.quantize import weight_scales


class GPTQ(SparseGPT):
    """One Linear's GPTQ: `add_batch` (inherited) observes, `quantize()` decides in place."""

    @torch.no_grad()
    def quantize(self) -> dict:
        layer = self.layer
        args = layer.quantization_scheme.weights
        W = layer.weight.detach().float().clone()
        H = self.H.clone()
        group = args.group_size if args.strategy == "group" else None
        lo, hi = _grid(args)
        rtn = _rtn(W, layer.weight_scale.detach().float(), group, lo, hi)
        Hinv = self._hinv_upper(W)
        scale = layer.weight_scale.detach().float().clone()      # [out, 1] or [out, in / group]
        Wt = W.t().contiguous()                                   # column i of W = row i of Wt
        cols = Wt.shape[0]
        Q = torch.empty_like(Wt)
        bs = self.block_size if group is None else max(group, self.block_size // group * group)
        for b0 in range(0, cols, bs):
            b1 = min(b0 + bs, cols)
            W1, Hinv1 = Wt[b0:b1], Hinv[b0:b1, b0:b1]
            Err1 = torch.empty_like(W1)
            for i in range(b1 - b0):
                col = b0 + i
                if group is not None and col % group == 0:        # this group's scale, from the corrected weights
                    g = col // group
                    scale[:, g] = weight_scales(Wt[col:col + group].t(), args)[0][:, 0]
                s = scale[:, 0] if group is None else scale[:, col // group]
                q = torch.clamp(torch.round(W1[i] / s), lo, hi) * s
                Q[col] = q
                err = (W1[i] - q) / Hinv1[i, i]
                Err1[i] = err
                W1[i + 1:].addr_(Hinv1[i, i + 1:], err, alpha=-1)
            Wt[b1:] -= Hinv[b0:b1, b1:].t() @ Err1
        layer.weight.copy_(Q.t().to(layer.weight.dtype))
        layer.weight_scale.copy_(scale.to(layer.weight_scale.dtype))
        return {"rtn_error": _output_error(W, rtn, H), "gptq_error": _output_error(W, Q.t(), H)}


def _grid(args) -> tuple[float, float]:
    """The integer grid of a symmetric int scheme (fp8 has no integer grid: GPTQ is int-only here)."""
    if args.type != "int":
        raise ValueError(f"GPTQ rounds to an integer grid; the scheme's weights are {args.type}")
    return -(2 ** (args.num_bits - 1)), 2 ** (args.num_bits - 1) - 1


def _rtn(W: torch.Tensor, scale: torch.Tensor, group, lo, hi) -> torch.Tensor:
    s = scale if group is None else scale.repeat_interleave(group, dim=1)[:, :W.shape[1]]
    return torch.clamp(torch.round(W / s), lo, hi) * s


def _output_error(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> float:
    """The layer's output error on the calibration inputs relative to its output,
    ‖(W - Q) X‖² / ‖W X‖² = tr(E H Eᵀ) / tr(W H Wᵀ): the objective GPTQ lowers."""
    E = W - Q
    return float(((E @ H) * E).sum() / ((W @ H) * W).sum().clamp(min=1e-12))
