"""One-shot structured pruning from activations (Minitron-style), uniform per layer.

Observe: hooks on each block's o_proj and down_proj inputs accumulate, over calibration
tokens, how much each query head and each MLP channel *contributes to the block output*:
  head h:    Σ_t ‖W_o[:, h] x_{t,h}‖²   (exact, via the head's Gram matrix W_hᵀ W_h)
  channel j: Σ_t a_{t,j}² · ‖W_down[:, j]‖²
Minitron ranks by activation magnitude alone; weighting by the output projection makes
heads and channels whose large activations are projected away rank low, at no extra cost.

Decide: for one uniform BlockShape, keep per block the KV groups whose best query heads
score highest, the same number of best query heads inside each kept group (GQA stays
regular, so the result is a plain config), and the highest-scoring channels.
"""

from __future__ import annotations

import torch

from optimizer.adapters import BlockShape, DecoderAdapter
from optimizer.masks import BlockMask, Masks
from optimizer.methods.base import Method


class ActivationImportance(Method):
    def __init__(self, model, adapter: DecoderAdapter):
        self.model, self.adapter = model, adapter
        config = model.config
        self.dense = adapter.dense_shape(config)
        self.head_dim = adapter.head_dim(config)
        self.head_scores, self.channel_scores, self._handles = [], [], []
        self.tokens = 0
        for block in adapter.blocks(model):
            o_proj, down = adapter.attention(block).o, adapter.mlp(block).down
            w = o_proj.weight.detach().float().view(o_proj.out_features, self.dense.num_heads, self.head_dim)
            gram = torch.einsum("ohd,ohe->hde", w, w)  # [H, d, d]
            col_norm2 = down.weight.detach().float().pow(2).sum(0)  # [I]
            hs = torch.zeros(self.dense.num_heads)
            cs = torch.zeros(self.dense.intermediate_size)
            self.head_scores.append(hs)
            self.channel_scores.append(cs)
            self._handles.append(o_proj.register_forward_pre_hook(self._head_hook(gram, hs)))
            self._handles.append(down.register_forward_pre_hook(self._channel_hook(col_norm2, cs)))

    def _head_hook(self, gram, acc):
        def hook(_mod, args):
            x = args[0].detach().float().reshape(-1, self.dense.num_heads, self.head_dim)
            acc.add_(torch.einsum("nhd,hde,nhe->h", x, gram, x))
        return hook

    def _channel_hook(self, col_norm2, acc):
        def hook(_mod, args):
            a = args[0].detach().float().reshape(-1, acc.numel())
            acc.add_(a.pow(2).sum(0) * col_norm2)
        return hook

    # --- observe -------------------------------------------------------------------------
    @torch.inference_mode()
    def add_batch(self, model, input_ids: torch.Tensor) -> None:
        model(input_ids)
        self.tokens += input_ids.numel()

    def observe(self, input_ids: torch.Tensor) -> dict:
        self.add_batch(self.model, input_ids)
        return {}

    # --- decide --------------------------------------------------------------------------
    def decide(self, shape: BlockShape) -> Masks:
        return select_uniform(self.head_scores, self.channel_scores, self.dense, shape)


def select_uniform(head_scores, channel_scores, dense: BlockShape, shape: BlockShape) -> Masks:
    """Per block, the best units for one uniform shape, keeping GQA regular.

    Kept KV groups are those whose best `per_group` query heads score highest together;
    inside each kept group the `per_group` best heads stay; then the best channels.
    """
    group = dense.num_heads // dense.num_kv_heads
    per_group = shape.num_heads // shape.num_kv_heads
    if shape.num_heads % shape.num_kv_heads or per_group > group or shape.num_kv_heads > dense.num_kv_heads:
        raise ValueError(f"shape {shape} is not reachable from {dense}")
    blocks = []
    for hs, cs in zip(head_scores, channel_scores):
        best = hs.view(dense.num_kv_heads, group).topk(per_group, dim=1)
        kv_keep = best.values.sum(1).topk(shape.num_kv_heads).indices.sort().values
        heads = sorted(int(kv * group + best.indices[kv, j]) for kv in kv_keep for j in range(per_group))
        channels = cs.topk(shape.intermediate_size).indices.sort().values.tolist()
        blocks.append(BlockMask(heads, kv_keep.tolist(), channels))
    return Masks(blocks)
