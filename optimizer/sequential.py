"""Block-by-block calibration: each block sees the outputs of the already-changed blocks before it.

The runner captures the hidden states entering block 0 once, then for every block in turn:
  1. optional `prepare(block, inputs, kwargs)` (SI learns and absorbs its transforms here),
  2. observe: one pass with hooks feeding each Linear's input to its pruner's add_batch,
  3. decide: every pruner prunes its layer in place and returns the keep-mask,
  4. one more pass through the now-pruned block gives the next block's inputs.
Only one block's statistics exist at a time, so peak memory is one block, its pruners and
the calibration hidden states (n × seq × hidden), not the model; on a GPU only the current
block needs to be on the device (`device`), the rest can stay in host memory.

Speed: Linears that read the same tensor (q/k/v, gate/up) share one set of statistics,
collected once; the passes can run under bf16 autocast (`dtype`), which halves their cost
where the hardware has bf16 arithmetic while statistics stay fp32; a pruner that needs no
data (magnitude) gets no passes at all.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from tqdm import tqdm

from optimizer.masks import SparseMasks
from optimizer.sparsity import Sparsity


class StopForward(Exception):
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
        raise StopForward

    handle = first.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for w in windows:
            try:
                model(w[None], use_cache=False)
            except StopForward:
                pass
    finally:
        handle.remove()
    kwargs.pop("past_key_values", None)
    kwargs["use_cache"] = False
    return inputs, kwargs


def block_output(block, x, kwargs):
    y = block(x, **kwargs)
    return y[0] if isinstance(y, tuple) else y


def fast_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether bf16 matmuls are native here: CUDA with bf16, or a CPU with AVX512-BF16 or AMX.
    oneDNN also runs bf16 on a plain AVX-512 CPU (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`
    says yes there), but by emulation, about 2.5× slower than fp32 (measured on an Ice Lake
    Xeon), so the CPU's own flags decide."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86 Linux's /proc/cpuinfo; empty elsewhere, ARM's `Features` line
    included, so bf16 stays off there even on chips that have it: a safe default, not a measured one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def calibration_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """'auto' → bf16 where it is native, else fp32; or 'float32' / 'bfloat16' as asked."""
    if name == "auto":
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[name]


@torch.no_grad()
def observe_block(block, inputs, kwargs, pruners: dict, autocast) -> None:
    """One pass over `inputs` feeding each Linear's input to its pruner's add_batch.

    Linears whose input is the very same tensor (q/k/v read one normed hidden state, gate/up
    another) would collect identical statistics: the first one collects, the others adopt
    its statistics afterwards (each pruner class names them in `statistics`)."""
    followers = {}  # pruner -> the pruner that collects for it
    seen = {}       # per window: (address, shape) -> (collecting pruner, the tensor, kept alive
                    # so that its address cannot be reused by another tensor in the same pass)

    def hook(p, x):
        first = seen.setdefault((x.data_ptr(), tuple(x.shape), x.dtype), (p, x))[0]
        if first is p:
            p.add_batch(x.detach())
        else:
            followers[p] = first

    handles = [p.layer.register_forward_hook(lambda m, a, y, p=p: hook(p, a[0])) for p in pruners.values()]
    try:
        for x in inputs:
            with autocast:
                block_output(block, x, kwargs)
            seen.clear()
    finally:
        for h in handles:
            h.remove()
    for p, first in followers.items():
        for name in p.statistics:
            setattr(p, name, getattr(first, name))


def run_blockwise(model, adapter, windows: torch.Tensor, make_observer: Callable, decide: Callable,
                  prepare: Callable | None = None, device: str | torch.device = "cpu",
                  desc: str = "calibrating blocks", dtype: torch.dtype = torch.float32) -> list[dict]:
    """The runner: for every block in turn, one observer per Linear (`make_observer(linear)`, an
    object with the SparseGPT shape: `add_batch`, `statistics`, `free`) sees the block's inputs,
    then `decide(observer)` changes its layer in place; returns what `decide` returned, one dict
    {linear name: result} per block. `dtype` is the autocast dtype of the calibration passes
    (`prepare` runs outside them). Pruning (prune_blockwise) and GPTQ (optimizer/gptq.py) run on it."""
    blocks = adapter.blocks(model)
    device = torch.device(device)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())
    inputs, kwargs = block_inputs(model, adapter, windows)
    results = []
    for i, block in enumerate(tqdm(blocks, desc=desc, unit="block")):
        home = next(block.parameters()).device
        block.to(device)
        inputs = [x.to(device) for x in inputs]
        if prepare is not None:
            prepare(block, inputs, kwargs)
        observers = {name: make_observer(lin) for name, lin in adapter.linears(block).items()}
        if getattr(make_observer, "needs_data", True):
            observe_block(block, inputs, kwargs, observers, autocast)
        results.append({name: decide(o) for name, o in observers.items()})
        for o in observers.values():
            o.free()
        if i + 1 < len(blocks):  # the next block's inputs; the last block's outputs are not needed
            with torch.no_grad(), autocast:
                inputs = [block_output(block, x, kwargs).to(x.dtype) for x in inputs]
        block.to(home)
    return results


def prune_blockwise(model, adapter, windows: torch.Tensor, make_pruner: Callable, sparsity: Sparsity,
                    prepare: Callable | None = None, device: str | torch.device = "cpu",
                    desc: str = "pruning blocks", dtype: torch.dtype = torch.float32) -> SparseMasks:
    """Prune every block's Linears in place; return the keep-masks, one dict per block."""
    for block in adapter.blocks(model):
        for name, lin in adapter.linears(block).items():
            sparsity.check_shape(lin.in_features, name)
    if not getattr(make_pruner, "needs_data", True) and prepare is None:
        return SparseMasks([{name: make_pruner(lin).prune(sparsity) for name, lin in adapter.linears(b).items()}
                            for b in adapter.blocks(model)])
    return SparseMasks(run_blockwise(model, adapter, windows, make_pruner, lambda p: p.prune(sparsity),
                                     prepare=prepare, device=device, desc=desc, dtype=dtype))
