"""Least-squares refit of the output projections after structured pruning (`--refit`).

Beyond DDP's paper, which keeps every weight frozen. Removing heads or MLP channels leaves
o_proj / down_proj with only the kept columns, and those were fitted to work beside the removed
ones. For each block in turn, on the calibration windows as the already refitted blocks before
it pass them on, `Refit` finds the kept columns that best reproduce the projection's *unpruned*
output on the same inputs:

    W'_K = argmin Σ_t ‖W h_t − W'_K h_{t,K}‖² + δ ‖W'_K − W_K S‖²
         = (W G[:, K] + δ W_K S) (G[K, K] + δ I)⁻¹,        G = Σ_t h_t h_tᵀ

h is the projection's full input (every head / channel), K the kept ones, S the mask's scales
(a learned DDP gate value, else 1), and δ = `damp` × mean diag G[K, K] a ridge toward the
masked model's own weights. With every unit kept the answer is W itself. Attention is refitted
before the MLP of the same block, since it changes the MLP's inputs.

The target is local (this projection on the inputs it now sees), not the dense model's stream:
a scratch probe fitting to the dense stream was not clearly better, and the local target needs no
second pass through the dense model. Memory: one block's Gram matrices ([in, in], fp32) and the
calibration hidden states, as in `sequential`.

A smaller error for every projection does not guarantee a better model: the refit can also
reproduce what the method chose to drop. So the pipeline (`structured.refit`) keeps it only if the
held-out calibration loss goes down.

`refit_masks` returns new `Masks` whose blocks carry the refitted columns (scales folded in);
`surgery.masked` and `surgery.prune` both use them, so the masked model and the exported one
still give the same logits.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from optimizer.adapters import DecoderAdapter
from optimizer.sequential import StopForward, block_inputs, block_output
from optimizer.masks import BlockMask, Masks
from optimizer.surgery import block_hooks, unit_columns, unit_scale


class Refit:
    """One projection: observe its full inputs (`add_batch`), then solve for the kept columns."""

    def __init__(self, linear: torch.nn.Linear, keep: torch.Tensor, scale: torch.Tensor | float = 1.0):
        self.linear, self.keep, self.scale = linear, keep, scale
        self.gram = torch.zeros(linear.in_features, linear.in_features)
        self.tokens = 0

    def add_batch(self, inputs: torch.Tensor) -> None:
        h = inputs.detach().float().reshape(-1, self.gram.shape[0])
        self.gram.addmm_(h.T, h)
        self.tokens += h.shape[0]

    def solve(self, damp: float) -> torch.Tensor:
        """The kept columns' new weights, [out, len(keep)], in the projection's dtype."""
        G, K = self.gram.double(), self.keep
        w = self.linear.weight.detach()
        g_kk = G[K][:, K]
        delta = damp * g_kk.diagonal().mean().clamp_min(1e-12)
        rhs = w.double() @ G[:, K] + delta * (w[:, K] * self.scale).double()
        a = g_kk + delta * torch.eye(len(K), dtype=torch.float64)
        return torch.linalg.solve(a, rhs.T).T.to(w.dtype)  # a is symmetric


def _observe(block, inputs, kwargs, linear, fit: Refit) -> None:
    """Feed `linear`'s inputs to `fit`; the rest of the block is not run (its output is unused)."""
    def grab(_mod, args):
        fit.add_batch(args[0])
        raise StopForward

    handle = linear.register_forward_pre_hook(grab)
    try:
        for x in inputs:
            try:
                block_output(block, x, kwargs)
            except StopForward:
                pass
    finally:
        handle.remove()


@torch.no_grad()
def refit_masks(model, adapter: DecoderAdapter, masks: Masks, windows: torch.Tensor, damp: float = 0.1) -> Masks:
    """`masks` with every kept o_proj / down_proj column refitted on `windows` (module doc).

    Blocks whose attention or MLP is removed entirely keep nothing to refit there."""
    config = model.config
    d = adapter.head_dim(config)
    every_channel = list(range(adapter.dense_shape(config).intermediate_size))
    inputs, kwargs = block_inputs(model, adapter, windows)
    blocks = []
    for block, bm in tqdm(list(zip(adapter.blocks(model), masks.blocks)), desc="refit", unit="block"):
        o_proj, down = adapter.attention(block).o, adapter.mlp(block).down
        new = BlockMask(bm.heads, bm.kv_heads, bm.channels)
        if bm.heads:
            fit = Refit(o_proj, unit_columns(bm.heads, d), unit_scale(bm.head_scale, d, o_proj.weight))
            _observe(block, inputs, kwargs, o_proj, fit)  # the block unpruned: every head's input
            new.o_proj_columns = fit.solve(damp)
        if bm.channels:
            fit = Refit(down, torch.tensor(bm.channels), unit_scale(bm.channel_scale, 1, down.weight))
            attention_only = BlockMask(bm.heads, bm.kv_heads, every_channel, o_proj_columns=new.o_proj_columns)
            with block_hooks(block, adapter, config, attention_only):
                _observe(block, inputs, kwargs, down, fit)
            new.down_columns = fit.solve(damp)
        with block_hooks(block, adapter, config, new):
            inputs = [block_output(block, x, kwargs) for x in inputs]
        blocks.append(new)
    return Masks(blocks)
