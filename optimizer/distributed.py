"""Several processes, one package: `torchrun --nproc-per-node N $(which optimize) MODEL ...`.

Every rank runs the job up to the end of the heal: it loads the model and prunes it (the methods
are deterministic, so every rank reaches the same shapes; rank 0's pruned weights and heal text
are then broadcast, so every rank starts the heal from the very same student and data) and heals
its share of every step's batch (`optimizer/heal.py`: gradients summed across ranks). Rank 0
alone writes: training checkpoints, the cached dense perplexity, the evaluations and the package
(quantize, evaluate, export). The other ranks return after the heal.

The process group comes from torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR):
NCCL where the heal trains on GPUs (one per process: LOCAL_RANK's), gloo on CPUs. A single
process (no WORLD_SIZE, or 1) never touches torch.distributed.
"""

from __future__ import annotations

import datetime
import os

from core.errors import UserError


# Ranks > 0 wait in a collective while rank 0 alone evaluates the dense model and writes the
# teacher's chat answers (and, after the heal, while it exports): hours for a large model on a slow
# machine, far beyond NCCL's 10-minute default. A rank that dies is noticed by torchrun, not by this.
WAIT = datetime.timedelta(hours=12)


def launched() -> int:
    """The number of processes torchrun started (WORLD_SIZE, with a LOCAL_RANK: a launcher that sets
    WORLD_SIZE alone, for its own purposes, is not a launch of this job): 1 if none."""
    if "LOCAL_RANK" not in os.environ:
        return 1
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def start(heal_device: str, threads: int | None = None) -> None:
    """Join the process group of a multi-process launch (nothing for a single process): NCCL when
    the heal trains on CUDA, gloo otherwise. Without --threads, each process takes its share of the
    node's cores (torchrun sets OMP_NUM_THREADS=1, which would run every stage on one core). Called
    once, before any work."""
    import torch
    import torch.distributed as dist
    if launched() == 1 or dist.is_initialized():
        return
    cuda = heal_device.startswith("cuda") or (heal_device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(local_rank())
    if not threads:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", launched()) or 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=WAIT)
    import atexit
    atexit.register(dist.destroy_process_group)  # ours to close: torch warns about a group left open


def rank_world() -> tuple[int, int]:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    """Rank 0 (or the only process): the one that writes."""
    return rank_world()[0] == 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def heal_batch(batch: int) -> int:
    """Sequences a heal step takes: --heal-batch rounded up to a multiple of the processes, so that
    every rank trains on as many sequences as the others (one process: `batch`)."""
    world = launched()
    return -(-batch // world) * world


def broadcast_object(obj):
    """Rank 0's `obj` on every rank (pickled; for small things: the heal text's token ids)."""
    import torch.distributed as dist
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_model(model) -> None:
    """Rank 0's parameters and buffers in every rank's `model`, after checking that every rank
    pruned to the same shapes (a rank that did not would train a different model)."""
    import torch
    import torch.distributed as dist
    if rank_world()[1] == 1:
        return
    tensors = list(model.state_dict(keep_vars=True).items())
    same_on_every_rank([(n, tuple(t.shape)) for n, t in tensors], "pruned shapes")
    with torch.no_grad():
        for _, t in tensors:
            dist.broadcast(t.data, src=0)


def same_on_every_rank(value, what: str) -> None:
    """A one-line error on a rank whose `value` differs from rank 0's (torchrun then stops the others)."""
    theirs = broadcast_object(value)
    if theirs != value:
        if isinstance(value, list) and isinstance(theirs, list) and len(value) == len(theirs):
            value, theirs = next((v, t) for v, t in zip(value, theirs) if v != t)  # one entry, one line
        raise UserError(f"rank {rank_world()[0]} has {what} {value!r} where rank 0 has {theirs!r}; "
                        "every rank must see the same model, data and cache")


def all_agree(flag: bool) -> bool:
    """True on every rank when any rank's `flag` is (a time cap reached on one rank stops all, at
    the same step, so no rank waits for a gradient that never comes)."""
    import torch
    import torch.distributed as dist
    if rank_world()[1] == 1:
        return flag
    t = torch.tensor([float(flag)])
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
