"""What a method decides, as typed results: the only currency between methods and surgery.

- `Masks` (structured): per block, the query heads, KV groups and MLP channels kept, with the
  optional scales and refitted columns that surgery folds in. `surgery.prune` removes the rest.
- `SparseMasks` (semi-structured, N:M or unstructured): per block, one boolean keep-mask per
  Linear, the same shape as its weight. The zeros are applied in place; shapes never change.
- `ExpertMasks` (MoE): per MoE layer, the routed experts kept, their learned scales and (when
  the budget narrows the experts) each kept expert's channels, for
  `moe_surgery.prune_experts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from optimizer.adapters import BlockShape


@dataclass
class BlockMask:
    """Indices a block keeps, ascending. Query head h belongs to KV group h // (H / KV).

    Optional scales (one per kept head / channel) multiply the unit's output; a learned
    gate's value lands here and surgery folds it into o_proj / down_proj columns.
    Optional columns ([out, kept inputs], from `optimizer.refit`) replace the kept columns of
    o_proj / down_proj outright (scales already folded in); surgery writes them as they are.
    """
    heads: list[int]
    kv_heads: list[int]
    channels: list[int]
    head_scale: list[float] | None = None
    channel_scale: list[float] | None = None
    o_proj_columns: torch.Tensor | None = None
    down_columns: torch.Tensor | None = None

    def shape(self) -> BlockShape:
        return BlockShape(len(self.heads), len(self.kv_heads), len(self.channels))


@dataclass
class Masks:
    blocks: list[BlockMask]

    def uniform_shape(self) -> BlockShape | None:
        shapes = {b.shape() for b in self.blocks}
        return shapes.pop() if len(shapes) == 1 else None

    def summary(self) -> list[dict]:
        return [{"heads": b.heads, "kv_heads": b.kv_heads, "channels_kept": len(b.channels)}
                for b in self.blocks]


@dataclass
class SparseMasks:
    """Per block, {Linear name inside the block: bool keep-mask shaped like its weight}.
    Iterates, indexes and measures like the list of blocks it holds."""
    blocks: list[dict[str, torch.Tensor]]

    def __iter__(self):
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.blocks[i]

    def kept_fraction(self) -> float:
        kept = sum(int(m.sum()) for b in self.blocks for m in b.values())
        return kept / max(1, sum(m.numel() for b in self.blocks for m in b.values()))


class ExpertMasks(NamedTuple):
    """Per MoE layer, the kept routed experts (ascending) and the scale each ships with (None:
    the one-shot importance keeps experts as they are); and per kept expert its kept channels
    (None: experts keep their full width)."""
    keep: list[list[int]]
    scales: list[torch.Tensor] | None = None
    channels: list[list[list[int]]] | None = None
