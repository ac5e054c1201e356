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

Decide per layer (`decide_per_layer`, the per-layer layout): the same attention in every block,
and the uniform shape's MLP channels in total, moved between blocks: a channel's contribution at each
token relative to that token's residual stream entering its block (the next norm divides by the
stream, token by token, so a channel that writes little into a loud stream matters little; per token,
so that the few tokens whose stream is huge, the attention sinks, do not set every block's scale) ranks
it against every block's.
`alpha` goes from the uniform widths (0) to that global ranking's (1).
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
        self.relative_scores = []  # per block, Σ_t a_{t,j}² ‖W_down[:, j]‖² / ‖x_t‖², x_t the stream entering it
        self.tokens = 0
        for block in adapter.blocks(model):
            stream = {}  # the block's input, per token: its channels' hook (later in the same forward) reads it
            self._handles.append(block.register_forward_pre_hook(self._stream_hook(stream), with_kwargs=True))
            o_proj, down = adapter.attention(block).o, adapter.mlp(block).down
            w = o_proj.weight.detach().float().view(o_proj.out_features, self.dense.num_heads, self.head_dim)
            gram = torch.einsum("ohd,ohe->hde", w, w)  # [H, d, d]
            col_norm2 = down.weight.detach().float().pow(2).sum(0)  # [I]
            hs = torch.zeros(self.dense.num_heads)
            cs = torch.zeros(self.dense.intermediate_size)
            self.head_scores.append(hs)
            self.channel_scores.append(cs)
            rel = torch.zeros(self.dense.intermediate_size)
            self.relative_scores.append(rel)
            self._handles.append(o_proj.register_forward_pre_hook(self._head_hook(gram, hs)))
            self._handles.append(down.register_forward_pre_hook(self._channel_hook(col_norm2, cs, rel, stream)))

    def _head_hook(self, gram, acc):
        def hook(_mod, args):
            x = args[0].detach().float().reshape(-1, self.dense.num_heads, self.head_dim)
            acc.add_(torch.einsum("nhd,hde,nhe->h", x, gram, x))
        return hook

    def _channel_hook(self, col_norm2, acc, relative, stream):
        def hook(_mod, args):
            a2 = args[0].detach().float().reshape(-1, acc.numel()).pow(2)
            acc.add_(a2.sum(0) * col_norm2)
            if "energy" in stream:  # the stream entering this block at the same tokens
                relative.add_((a2 / stream.pop("energy")[:, None]).sum(0) * col_norm2)
        return hook

    @staticmethod
    def _stream_hook(stream):
        def hook(_mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            stream["energy"] = x.detach().float().pow(2).sum(-1).reshape(-1).clamp_min(1e-12)
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

    def decide_per_layer(self, shape: BlockShape, alpha: float, multiple: int) -> Masks:
        """`shape`'s attention in every block and its MLP channels in total, each block's width a
        multiple of `multiple` (see the module's docstring)."""
        masks = self.decide(shape)
        widths = per_layer_widths(self.relative_scores, shape.intermediate_size, self.dense.intermediate_size, multiple, alpha)
        for block, cs, width in zip(masks.blocks, self.channel_scores, widths):
            block.channels = cs.topk(width).indices.sort().values.tolist()
        return masks


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


def per_layer_widths(scores: list[torch.Tensor], width: int, dense_width: int, multiple: int,
                     alpha: float) -> list[int]:
    """MLP widths, one a block, summing to len(scores) × `width`, each a multiple of `multiple` between
    `multiple` and `dense_width`: `alpha` of the way from `width` everywhere to the widths of one global
    ranking of the channels by `scores` (comparable across blocks), taken `multiple` at a time."""
    n, top = len(scores), dense_width // multiple
    if width % multiple or width >= top * multiple:
        return [width] * n  # no room to move whole tiles: the uniform widths
    total, uniform = n * width // multiple, width // multiple
    # the value of each block's k-th tile of channels, best first: descending within a block, so the
    # global ranking is the top `total - n` tiles beyond each block's first
    tiles = [s.sort(descending=True).values[: top * multiple].reshape(top, multiple).sum(1) for s in scores]
    rest = torch.cat([t[1:] for t in tiles])
    kept = torch.zeros(rest.numel(), dtype=torch.bool)
    kept[rest.topk(total - n).indices] = True
    ranked = [1 + int(k.sum()) for k in kept.split([top - 1] * n)]
    # between the two (both sum to `total` within [1, top]): floors, the remainder to the largest fractions
    ideal = [uniform + alpha * (r - uniform) for r in ranked]
    units = [int(u + 1e-9) for u in ideal]
    for i in sorted(range(n), key=lambda i: units[i] - ideal[i])[: total - sum(units)]:
        units[i] += 1
    return [u * multiple for u in units]
