"""The one interface every method follows: observe, then decide (SparseGPT's `add_batch` /
`fasterprune`).

    observe(input_ids) -> dict   one calibration batch: accumulate statistics (one-shot
                                 methods), or take one optimisation step (trained methods);
                                 returns what a progress bar shows (may be empty)
    decide(...)        -> masks  a typed result from `optimizer.masks`: `Masks` (structured),
                                 `SparseMasks` (N:M / unstructured), `ExpertMasks` (MoE)
    close()                      detach the hooks observe needed; the model is as it was

Methods never edit shapes (surgery does) and never import exporters or serve. The per-Linear
pruners that the block-by-block runner drives (`magnitude`, `wanda`, `sparsegpt`: `LinearPruner`)
are the same pair one level down: `add_batch(inp)` per Linear, `prune(sparsity)` → that Linear's
keep-mask. Which method is which kind of job: `optimizer/registry.py`.

A trained method (`TrainedMethod`) also has a step counter and a checkpoint: `state()` holds
everything a resume needs, `identity()` what must match for a checkpoint to be this run's.
The training loop (`training.Trainer`) steps it, checkpoints it and resumes it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


class Method:
    def observe(self, input_ids: torch.Tensor) -> dict:
        raise NotImplementedError

    def decide(self, *args, **kwargs):
        raise NotImplementedError

    def close(self) -> None:
        """Remove the hooks `observe` needed (those a method keeps in `self._handles`)."""
        for h in getattr(self, "_handles", ()):
            h.remove()
        self._handles = []

    def remove_hooks(self) -> None:
        self.close()


class LinearPruner:
    """The per-Linear interface the block-by-block runner (`sequential.prune_blockwise`) drives:
    `add_batch(inp)` for each calibration batch of the Linear's input, then `prune(sparsity)`
    zeroes the Linear's weights in place and returns its keep-mask; `free()` drops the statistics.
    `needs_data`: whether add_batch reads anything (no calibration passes otherwise); `statistics`:
    the attributes add_batch fills, which a Linear reading the same input may adopt."""
    needs_data = True
    statistics: tuple[str, ...] = ()

    def __init__(self, layer: torch.nn.Linear):
        self.layer = layer

    def add_batch(self, inp: torch.Tensor) -> None:
        raise NotImplementedError

    def prune(self, sparsity) -> torch.Tensor:
        raise NotImplementedError

    def free(self) -> None:
        pass


class TrainedMethod(Method):
    step_count: int = 0

    def step(self, input_ids: torch.Tensor) -> dict:
        raise NotImplementedError

    def observe(self, input_ids: torch.Tensor) -> dict:
        return self.step(input_ids)

    # --- checkpoint / resume ---------------------------------------------------------------
    def identity(self) -> dict:
        """What a checkpoint must match to resume this run (configuration, algorithm version)."""
        raise NotImplementedError

    def state(self) -> dict:
        """The training state, without `identity()` (save adds it)."""
        raise NotImplementedError

    def restore(self, state: dict) -> None:
        raise NotImplementedError

    def save(self, path: Path | str) -> None:
        """Atomically: a kill mid-write leaves the previous checkpoint, never half of one; a write
        stopped by an exception (a second Ctrl-C) leaves no half-written file (tens of GB at 8B)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        try:
            torch.save({**self.state(), **self.identity()}, tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def load(self, path: Path | str) -> bool:
        """Resume from `path` if it holds a checkpoint of this very run; False otherwise."""
        path = Path(path)
        if not path.is_file():
            return False
        state = torch.load(path, weights_only=False, map_location="cpu")  # restore() copies onto the model's device
        if any(state.get(k) != v for k, v in self.identity().items()):
            return False
        self.restore(state)
        return True
