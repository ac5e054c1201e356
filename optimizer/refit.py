"""Least-squares refit of the output projections after structured pruning (`--refit`, on by default).

Beyond DDP's paper, which keeps every weight frozen. Removing heads or MLP channels leaves
o_proj / down_proj with only the kept columns, and those were fitted to work beside the removed
ones. For each block, `refit_masks` finds the kept columns that best reproduce the projection's
*unpruned* output on the calibration inputs:

    W'_K = argmin Σ_t ‖W h_t − W'_K h_{t,K}‖² + δ ‖W'_K − W_K S‖²
         = (W G[:, K] + δ W_K S) (G[K, K] + δ I)⁻¹,        G = Σ_t h_t h_tᵀ

h is the projection's full input (every head / channel), K the kept ones, S the mask's scales
(a learned DDP gate value, else 1), and δ = `damp` × mean diag G[K, K] a ridge toward the
masked model's own weights. With every unit kept (and no scale) the answer is W itself, so such
a projection is left as it is.

The statistics: G for every block's o_proj and down_proj, gathered by `RefitStatistics` in the
same pass over the calibration windows that the one-shot importance reads (the dense model's
own stream), so the refit costs that pass's Gram products and one solve per block, not passes
of its own. An earlier version refitted block by block on the stream of the already-pruned
blocks: two more passes a block (245 s on SmolLM2 here, against about 20 s) for nearly the same
result (held-out KL to the dense model 1.464 against 1.477, bench/results/heal-select/
2026-12-03-probe). Memory: one [in, in] fp32 Gram a projection for every block, about the size
of the blocks' MLP weights (SmolLM2: 0.3 GB; LLaMA-3-8B: 28 GB), held until the decision (through
DDP's training with `--method ddp`); where that is more than a quarter of the memory available,
the job skips the refit and says so (`structured.observe_activation`).

A smaller error for every projection does not guarantee a better model: the refit can also
reproduce what the method chose to drop. So the pipeline (`structured.refit`) keeps it only if the
held-out calibration loss goes down.

`refit_masks` returns new `Masks` whose blocks carry the refitted columns (scales folded in);
`surgery.masked` and `surgery.prune` both use them, so the masked model and the exported one
still give the same logits.
"""

from __future__ import annotations

import torch

from optimizer.adapters import DecoderAdapter
from optimizer.masks import BlockMask, Masks
from optimizer.surgery import unit_columns, unit_scale


class Gram:
    """G = Σ_t h_t h_tᵀ of one projection's inputs (`add_batch`), and the refit's solve."""

    def __init__(self, linear: torch.nn.Linear):
        self.linear = linear
        self.gram = torch.zeros(linear.in_features, linear.in_features)
        self.tokens = 0

    def add_batch(self, inputs: torch.Tensor) -> None:
        h = inputs.detach().float().reshape(-1, self.gram.shape[0])
        self.gram.addmm_(h.T, h)
        self.tokens += h.shape[0]

    def solve(self, keep: torch.Tensor, scale: torch.Tensor | float, damp: float) -> torch.Tensor:
        """The kept columns' new weights, [out, len(keep)], in the projection's dtype."""
        G, K = self.gram.double(), keep
        w = self.linear.weight.detach()
        g_kk = G[K][:, K]
        delta = damp * g_kk.diagonal().mean().clamp_min(1e-12)
        rhs = w.double() @ G[:, K] + delta * (w[:, K] * scale).double()
        a = g_kk + delta * torch.eye(len(K), dtype=torch.float64)
        return torch.linalg.solve(a, rhs.T).T.to(w.dtype)  # a is symmetric


class RefitStatistics:
    """Hooks on every block's o_proj and down_proj inputs: whatever runs the model through them
    (the importance's calibration pass) fills their Grams. `close()` removes the hooks."""

    def __init__(self, model, adapter: DecoderAdapter):
        self.o, self.down, self._handles = [], [], []
        for block in adapter.blocks(model):
            for linear, grams in ((adapter.attention(block).o, self.o), (adapter.mlp(block).down, self.down)):
                gram = Gram(linear)
                grams.append(gram)
                self._handles.append(linear.register_forward_pre_hook(lambda _m, args, g=gram: g.add_batch(args[0])))

    @staticmethod
    def bytes_needed(model, adapter: DecoderAdapter) -> int:
        """What the Grams take: an [in, in] fp32 matrix for every block's o_proj and down_proj."""
        return sum(4 * (lin.in_features ** 2) for block in adapter.blocks(model)
                   for lin in (adapter.attention(block).o, adapter.mlp(block).down))

    @property
    def tokens(self) -> int:
        return self.down[0].tokens if self.down else 0

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@torch.no_grad()
def refit_masks(stats: RefitStatistics, model, adapter: DecoderAdapter, masks: Masks, damp: float = 0.1) -> Masks:
    """`masks` with the kept o_proj / down_proj columns refitted from `stats` (module doc).

    Blocks whose attention or MLP is removed entirely keep nothing to refit there; a projection
    that keeps every column at its own scale keeps its weights (the refit's answer is W)."""
    config = model.config
    d = adapter.head_dim(config)
    dense = adapter.dense_shape(config)
    blocks = []
    for bm, o, down in zip(masks.blocks, stats.o, stats.down):
        new = BlockMask(bm.heads, bm.kv_heads, bm.channels)
        if bm.heads and (len(bm.heads) < dense.num_heads or bm.head_scale is not None):
            new.o_proj_columns = o.solve(unit_columns(bm.heads, d), unit_scale(bm.head_scale, d, o.linear.weight), damp)
        if bm.channels and (len(bm.channels) < dense.intermediate_size or bm.channel_scale is not None):
            new.down_columns = down.solve(torch.tensor(bm.channels), unit_scale(bm.channel_scale, 1, down.linear.weight),
                                          damp)
        blocks.append(new)
    return Masks(blocks)
