"""Block-by-block calibration: each block sees the outputs of the already-pruned blocks before it.

The runner captures the hidden states entering block 0 once, then for every block in turn:
  1. optional `prepare(block, inputs, kwargs)` (SI learns and absorbs its transforms here),
  2. observe: one pass with hooks feeding each Linear's input to its pruner's add_batch,
  3. decide: every pruner prunes its layer in place and returns the keep-mask,
  4. one more pass through the now-pruned block gives the next block's inputs.
Only one block's statistics exist at a time, so peak memory is one block, its pruners and
the calibration hidden states (n × seq × hidden), not the model; on a GPU only the current
block needs to be on the device (`device`), the rest can stay in host memory.
"""

from __future__ import annotations

from typing import Callable

import torch
from tqdm import tqdm

from optimizer.sparsity import Sparsity


class _Captured(Exception):
    pass


@torch.no_grad()
def block_inputs(model, adapter, windows: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
    """Hidden states entering the first block for each window, and the keyword arguments
    (position embeddings, masks) the model passes to every block."""
    first = adapter.blocks(model)[0]
    inputs, kwargs = [], {}

    def grab(module, args, kw):
        inputs.append((args[0] if args else kw["hidden_states"]).detach())
        kwargs.update({k: v for k, v in kw.items() if k != "hidden_states"})
        raise _Captured

    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for w in windows:
            try:
                model(w[None], use_cache=False)
            except _Captured:
                pass
    finally:
        handle.remove()
    kwargs.pop("past_key_values", None)
    kwargs["use_cache"] = False
    return inputs, kwargs


def _out(block, x, kwargs):
    y = block(x, **kwargs)
    return y[0] if isinstance(y, tuple) else y


def prune_blockwise(model, adapter, windows: torch.Tensor, make_pruner: Callable, sparsity: Sparsity,
                    prepare: Callable | None = None, device: str | torch.device = "cpu",
                    desc: str = "pruning blocks") -> list[dict[str, torch.Tensor]]:
    """Prune every block's Linears in place; return the keep-masks, one dict per block."""
    for block in adapter.blocks(model):
        for name, lin in adapter.linears(block).items():
            sparsity.check_shape(lin.in_features, name)
    inputs, kwargs = block_inputs(model, adapter, windows)
    needs_data = getattr(make_pruner, "needs_data", True)
    masks = []
    for block in tqdm(adapter.blocks(model), desc=desc, unit="block"):
        home = next(block.parameters()).device
        block.to(device)
        inputs = [x.to(device) for x in inputs]
        if prepare is not None:
            prepare(block, inputs, kwargs)
        pruners = {name: make_pruner(lin) for name, lin in adapter.linears(block).items()}
        if needs_data:
            handles = [lin.register_forward_hook(lambda m, a, y, p=p: p.add_batch(a[0].detach()))
                       for lin, p in ((p.layer, p) for p in pruners.values())]
            with torch.no_grad():
                for x in inputs:
                    _out(block, x, kwargs)
            for h in handles:
                h.remove()
        masks.append({name: p.prune(sparsity) for name, p in pruners.items()})
        for p in pruners.values():
            p.free()
        with torch.no_grad():
            inputs = [_out(block, x, kwargs) for x in inputs]
        block.to(home)
    return masks
