"""Sparsity patterns for the semi-structured family: N:M (2:4, 4:8, 2:8, ...) or unstructured.

A pattern turns a score matrix (same shape as a Linear weight `[out, in]`, higher = keep)
into a boolean keep-mask. N:M groups are M consecutive weights along the *input* dimension
of one output row: that is the layout sparse tensor cores and cuSPARSELt compress. An
unstructured fraction is applied per output row (Wanda's comparison group; it keeps every
row equally dense, which suits all three pruners and makes their masks comparable).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from core.errors import UserError


@dataclass(frozen=True)
class Sparsity:
    n: int | None = None            # keep n of every m (N:M)...
    m: int | None = None
    fraction: float | None = None   # ...or prune this fraction of each row (unstructured)

    @property
    def is_nm(self) -> bool:
        return self.m is not None

    @property
    def density(self) -> float:
        return self.n / self.m if self.is_nm else 1.0 - self.fraction

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.is_nm else f"{self.fraction:g}"

    def check_shape(self, in_features: int, name: str = "layer") -> None:
        if self.is_nm and in_features % self.m:
            raise UserError(f"{name}: {in_features} input features do not split into groups of {self.m} "
                            f"for {self}; choose an M that divides every layer's input size")

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """Keep-mask (bool, like `scores`) that keeps the highest scores under this pattern."""
        rows, cols = scores.shape
        if self.is_nm:
            groups = scores.reshape(rows, cols // self.m, self.m)
            keep = torch.zeros_like(groups, dtype=torch.bool)
            keep.scatter_(2, groups.topk(self.n, dim=2).indices, True)
            return keep.reshape(rows, cols)
        n_prune = int(round(cols * self.fraction))
        keep = torch.ones_like(scores, dtype=torch.bool)
        if n_prune:
            keep.scatter_(1, scores.topk(n_prune, dim=1, largest=False).indices, False)
        return keep

    def complies(self, weight: torch.Tensor) -> bool:
        """True when the zeros of `weight` satisfy the pattern (at most n non-zeros per group)."""
        nz = weight != 0
        if self.is_nm:
            return bool((nz.reshape(weight.shape[0], -1, self.m).sum(-1) <= self.n).all())
        return bool((nz.sum(1) <= weight.shape[1] - int(round(weight.shape[1] * self.fraction))).all())


_NM = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse(text: str) -> Sparsity:
    """'2:4' → N:M; '0.5' or '50%' → unstructured fraction pruned. One-line error otherwise."""
    text = str(text).strip()
    m = _NM.match(text)
    if m:
        n, mm = int(m.group(1)), int(m.group(2))
        if not (1 <= n < mm) or mm > 64:
            raise UserError(f"sparsity={text}: an N:M pattern needs 1 <= N < M <= 64 (e.g. 2:4, 4:8, 2:8)")
        return Sparsity(n=n, m=mm)
    try:
        frac = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise UserError(f"sparsity='{text}': expected N:M (e.g. 2:4) or a fraction in (0, 1) (e.g. 0.5)") from None
    if not 0 < frac < 1:
        raise UserError(f"sparsity={text}: the pruned fraction must be in (0, 1)")
    return Sparsity(fraction=frac)
