"""The heal stage: distil the pruned model from the dense one, and keep the result only where the
held-out KL to the dense model fell.

    heal(student, teacher, text, settings, ...) -> (student, HealReport)

Weights change; shapes and held zeros never do. The algorithm is `methods/distill.py`
(`Distillation`), the text `heal_data.py`; this module adds what makes it safe to run unattended:
a retry at a lower peak learning rate where the default one raised the held-out KL, the unhealed
weights put back where no attempt lowered it, checkpoints and resume (`training.Trainer`), and the
account the manifest carries. Student and teacher train on `settings.device` and come back to the
CPU, where the stages after this one expect them.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from optimizer import distributed
from optimizer.config import HealSettings
from optimizer.heal_data import HealText, chat_check
from optimizer.methods.distill import OPTIMIZER_LR, Distillation, HealConfig, kd_eval, zero_masks
from optimizer.resources import peak_rss_gib
from optimizer.sequential import calibration_dtype

# A heal at the default peak that raises the held-out KL is retried once at peak / this (Gemma-3-270M
# at retain 0.7: 3e-4 raised it, 1e-4 lowered it; bench/results/heal-select/2026-12-04-gemma-lr).
RETRY_LR_DIVISOR = 3


@dataclass
class HealReport:
    """What the heal did: the manifest's "heal" section (`as_dict`)."""
    data: str
    tokens_requested: int
    tokens: int
    steps: int
    steps_planned: int
    seq_len: int
    batch: int
    processes: int
    time_cap_s: float | None
    stopped_by_time: bool
    kept_unhealed: bool
    config: dict
    attempts: list[dict]
    zeros_held: int
    before: dict
    after: dict
    memory_bytes: dict
    peak_rss_gib: float
    device: str
    peak_device_gib: float | None
    wall_s: float
    resumed_from_step: int
    final: dict
    checkpoint: str
    chat: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        if d["peak_device_gib"] is None:  # a CPU heal: no device memory to report
            del d["peak_device_gib"]
        return d


def heal_device(name: str) -> torch.device:
    """--heal-device: 'auto' is CUDA where torch sees it, else the CPU; CUDA is the first device, or
    with several processes (optimizer/distributed.py) each one's LOCAL_RANK's."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and distributed.launched() > 1:
        return torch.device("cuda", distributed.local_rank())
    return torch.device(name)


def heal(student, teacher, text: HealText | None, s: HealSettings, *, held_out: torch.Tensor, trainer,
         checkpoint: Callable[[str, list], Path], adapter, tok, hold_zeros: bool = False, seed: int = 0,
         calib_dtype: str = "auto", log: Callable = print) -> tuple[torch.nn.Module, HealReport]:
    """Distil `student` from `teacher` on `text` (rank 0's; None on the other ranks, which receive
    it) for `s.tokens` tokens (at most `s.time_s` seconds). `held_out`: the calibration window the
    keep-or-undo decision reads; `trainer` steps and checkpoints it (`checkpoint(kind, run)` names the
    file); `hold_zeros`: a semi-structured student's zeros stay zero."""
    device = heal_device(s.device)
    student.to(device)
    if s.memory == "lean":  # the teacher only runs forward passes: bf16 halves it (cast
        teacher.to(torch.bfloat16)  # before the move, so that no fp32 copy reaches the GPU)
    teacher.to(device)
    try:
        return _heal(student, teacher, text, s, device, held_out=held_out, trainer=trainer, checkpoint=checkpoint,
                     adapter=adapter, tok=tok, hold_zeros=hold_zeros, seed=seed, calib_dtype=calib_dtype, log=log)
    finally:
        student.to("cpu")
        teacher.to("cpu")


def _heal(student, teacher, text, s: HealSettings, device, *, held_out, trainer, checkpoint, adapter, tok,
          hold_zeros, seed, calib_dtype, log):
    main, world = distributed.is_main(), distributed.rank_world()[1]
    # every rank heals the same student on the same text: rank 0's (optimizer/distributed.py)
    chunks, source = distributed.broadcast_object(tuple(text) if main else None)
    distributed.broadcast_model(student)
    seq, batch = chunks.shape[1], distributed.heal_batch(s.batch)  # config.heal_seq_len
    steps = max(1, s.tokens // (batch * seq))
    optimizer = "adafactor" if s.memory == "lean" else "adamw"
    lr, lr_end = OPTIMIZER_LR[optimizer]
    # the default peak, then once RETRY_LR_DIVISOR times lower if that raised the held-out KL (a
    # --heal-lr is tried alone): bench/results/heal-select/2026-12-04-gemma-lr
    peaks = [s.lr] if s.lr is not None else [lr, lr / RETRY_LR_DIVISOR]
    dtype = str(calibration_dtype(calib_dtype, device)).removeprefix("torch.")
    keep = zero_masks(student, adapter) if hold_zeros else None
    held_out = held_out[:, :1024]
    before = {"held_out_kd": kd_eval(student, teacher, held_out)}
    started = time.time()
    # the heal text's content, not only its description: the teacher's sampled chat answers
    # can differ between machines and thread counts, and a checkpoint must be of this very data
    data_digest = hashlib.sha256(chunks.numpy().tobytes()).hexdigest()[:16]
    attempts = []
    for peak in peaks:
        time_left = None if s.time_s is None else s.time_s - (time.time() - started)
        time_left = distributed.broadcast_object(time_left)  # rank 0's clock: every rank retries or none
        if attempts and time_left is not None and time_left <= 0:
            break
        if attempts:
            log(f"trying a lower learning rate: {peak:.1e}")
        hcfg = HealConfig(steps=steps, lr=peak, lr_end=peak * lr_end / lr, seed=seed, dtype=dtype,
                          optimizer=optimizer, checkpointing=s.memory == "lean")
        distil = Distillation(student, teacher, hcfg, keep, blocks=adapter.blocks(student))
        ckpt = checkpoint("heal", [vars(hcfg), seq, batch, source, distil.start_digest, data_digest])
        if not attempts:  # the unhealed weights, on the CPU (the size of the student's blocks): a
            # heal that makes the held-out KL worse is not shipped
            unhealed = {n: p.detach().to("cpu", copy=True) for n, p in distil.params.items()}
        run = trainer.train(distil, chunks, steps, batch, ckpt, "healing" if not attempts else f"healing at lr {peak:.0e}",
                            lambda st: {"kd": f"{st['kd']:.3f}", "lr": f"{st['lr']:.1e}"}, max_time_s=time_left)
        distil.close()
        done = distil.step_count
        after = {"held_out_kd": kd_eval(student, teacher, held_out)}
        attempts.append({"lr": peak, "steps": done, "wall_s": run["wall_s"], "held_out_kd": after["held_out_kd"]})
        log(f"healed at lr {peak:.1e}: {done} steps, {done * batch * seq:,} tokens of {source} in "
            f"{run['wall_s']:.0f} s; held-out KL to the dense model {before['held_out_kd']:.4f} → "
            f"{after['held_out_kd']:.4f}")
        kept_unhealed = distributed.all_agree(after["held_out_kd"] > before["held_out_kd"])  # every rank alike
        if not kept_unhealed:
            break
        with torch.no_grad():
            for n, p in distil.params.items():
                p.copy_(unhealed[n])
        log(f"healing at lr {peak:.1e} made the held-out KL worse: back to the unhealed weights")
    if world > 1:
        log(f"healed on {world} processes, {batch // world} sequence(s) each a step")
    if kept_unhealed:
        log("healing made the held-out KL worse: the package keeps the unhealed weights (a lower heal.lr "
            "or other heal.data may heal this model)")
    del unhealed
    report = HealReport(
        data=source, tokens_requested=s.tokens, tokens=done * batch * seq, steps=done, steps_planned=steps,
        seq_len=seq, batch=batch, processes=world, time_cap_s=s.time_s, stopped_by_time=done < steps,
        kept_unhealed=kept_unhealed, config=vars(hcfg), attempts=attempts, zeros_held=len(keep or {}),
        before=before, after=after, memory_bytes=distil.state_bytes(), peak_rss_gib=round(peak_rss_gib(), 2),
        device=str(device),
        peak_device_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        wall_s=round(time.time() - started, 1), resumed_from_step=run["resumed_from_step"], final=run["final"],
        checkpoint=run["checkpoint"], chat=chat_check(teacher, student, tok) if main else [])
    return student, report
