"""The heal stage: distil the pruned model from the dense one, and keep the result only where the
held-out KL to the dense model fell.

    heal(student, teacher, text, settings, ...) -> (student, HealReport)

Weights change; shapes and held zeros never do. The algorithm is `methods/distill.py`
(`Distillation`), the text `heal_data.py`; this module adds what makes it safe to run unattended
on a model nobody tuned it for: a peak learning rate scaled to the student's weights, a short probe
of that rate and a lower one that picks the rate (or skips a heal that would not pay), the unhealed
weights put back where the heal raised the held-out KL, checkpoints and resume
(`training.Trainer`), and the account the manifest carries. Student and teacher train on
`settings.device` and come back to the CPU, where the stages after this one expect them.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from optimizer import distributed
from optimizer.config import HealSettings
from optimizer.heal_data import HealText, chat_check
from optimizer.methods.distill import (OPTIMIZER_LR, Distillation, HealConfig, digest, kd_eval,
                                       trained_parameters, zero_masks)
from optimizer.resources import peak_rss_gib
from optimizer.sequential import calibration_dtype
from optimizer.training import batch_indices, stop_if_terminated

# AdamW moves every weight by about its learning rate a step, whatever the weight's size, so a rate
# selected on one model is too high for a model with smaller weights: the default peak (3e-4, selected
# on SmolLM2-135M, whose blocks' linear weights have a median RMS of 0.19) is scaled by the student's
# own median RMS (Gemma-3-270M's is 0.040: 6.2e-5, where 3e-4 raised its held-out KL and 1e-4 lowered
# it; bench/results/heal-select/2026-12-04-gemma-lr). Adafactor's step is relative already.
REFERENCE_WEIGHT_RMS = 0.19
# Before the full heal, each of these multiples of that peak heals a short whole schedule (a cosine
# over PROBE_SHARE of the steps) from the unhealed weights; the one that lowers the held-out KL most
# heals in full, and where none lowers it the heal is skipped: the budget is spent only where the
# probe says it pays.
PROBE_PEAKS = (1.0, 1 / 3)
PROBE_SHARE = 1 / 8
MIN_PROBE_STEPS, MAX_PROBE_STEPS = 4, 64  # a probe finds an unstable rate, not the heal's full gain


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
    peak_rule: str = ""           # how the peak learning rate was set
    probe: list[dict] = field(default_factory=list)    # the learning-rate probe: one record a rate
    skipped_by_probe: bool = False  # no probed rate lowered the held-out KL: nothing trained
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


def median_weight_rms(params: dict[str, torch.Tensor]) -> float:
    """The median RMS of the trained matrices (the blocks' linear weights; norms are vectors)."""
    rms = sorted(float(p.detach().float().pow(2).mean().sqrt()) for p in params.values() if p.dim() == 2)
    return rms[len(rms) // 2] if rms else REFERENCE_WEIGHT_RMS


def _kl_or_inf(kl: float) -> float:
    """A diverged heal's NaN KL, ranked last."""
    return float("inf") if math.isnan(kl) else kl


def default_peak(optimizer: str, params: dict[str, torch.Tensor]) -> tuple[float, str]:
    """This student's default peak learning rate, and how it was set (in the report's words)."""
    lr, _ = OPTIMIZER_LR[optimizer]
    if optimizer != "adamw":
        return lr, f"{optimizer}'s default, relative to each weight's size"
    rms = median_weight_rms(params)
    return float(f"{lr * rms / REFERENCE_WEIGHT_RMS:.2g}"), \
        f"{lr:g} × the weights' median RMS {rms:.3f} / {REFERENCE_WEIGHT_RMS:g}"


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
    dtype = str(calibration_dtype(calib_dtype, device)).removeprefix("torch.")
    keep = zero_masks(student, adapter) if hold_zeros else None
    held_out = held_out[:, :1024]
    before = {"held_out_kd": kd_eval(student, teacher, held_out)}
    started = time.time()
    # the heal text's content, not only its description: the teacher's sampled chat answers
    # can differ between machines and thread counts, and a checkpoint must be of this very data
    data_digest = hashlib.sha256(chunks.numpy().tobytes()).hexdigest()[:16]

    params = trained_parameters(student)
    # the unhealed weights, on the CPU (the size of the student's blocks): a heal that makes the
    # held-out KL worse is not shipped, and every probe starts from them (so they share one digest)
    unhealed = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
    start_digest = digest(unhealed)

    def heal_config(peak: float, n_steps: int) -> HealConfig:
        return HealConfig(steps=n_steps, lr=peak, lr_end=peak * lr_end / lr, seed=seed, dtype=dtype,
                          optimizer=optimizer, checkpointing=s.memory == "lean")

    def distillation(peak: float, n_steps: int) -> Distillation:
        return Distillation(student, teacher, heal_config(peak, n_steps), keep, blocks=adapter.blocks(student),
                            start_digest=start_digest)

    def restore() -> None:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(unhealed[n])

    if s.lr is not None:
        peak, peak_rule = s.lr, "heal.lr"
    else:
        peak, peak_rule = default_peak(optimizer, params)
    probe_steps = min(MAX_PROBE_STEPS, max(MIN_PROBE_STEPS, round(steps * PROBE_SHARE)))
    # under a time cap, the probes share its PROBE_SHARE (a probe it stops compares fewer steps)
    probe_time = None if s.time_s is None else s.time_s * PROBE_SHARE / len(PROBE_PEAKS)
    probes = []
    if s.lr is None and steps >= 2 * probe_steps:  # a rate the user set is not probed
        for multiple in PROBE_PEAKS:
            rate = float(f"{peak * multiple:.2g}")
            probe = distillation(rate, probe_steps)
            t0 = time.time()
            for k in tqdm(range(probe_steps), desc=f"probing lr {rate:.1e}", unit="step", disable=not main):
                probe.step(chunks[batch_indices(len(chunks), batch, k, seed)])
                stop_if_terminated()  # nothing to checkpoint: a resumed run probes again (seeded)
                if probe_time is not None and distributed.all_agree(time.time() - t0 >= probe_time):
                    break
            probe.close()
            probes.append({"lr": rate, "steps": probe.step_count, "held_out_kd": kd_eval(student, teacher, held_out),
                           "wall_s": round(time.time() - t0, 1)})
            restore()
        best = min(probes, key=lambda p: _kl_or_inf(p["held_out_kd"]))
        peak = distributed.broadcast_object(best["lr"])  # rank 0's choice
        log("learning-rate probe, held-out KL to the dense model " + f"{before['held_out_kd']:.4f} unhealed: " +
            ", ".join(f"{p['held_out_kd']:.4f} at {p['lr']:.1e}" for p in probes) + f" ({probe_steps} steps each)")
    attempts, run = [], {"final": {}, "resumed_from_step": 0, "checkpoint": ""}
    skipped = bool(probes) and distributed.all_agree(not _kl_or_inf(best["held_out_kd"]) < before["held_out_kd"])
    if skipped:
        log(f"no probed learning rate lowered the held-out KL in {probe_steps} steps: healing skipped, the "
            "package keeps the unhealed weights (--set heal.lr=RATE heals at a rate of your choice)")
        after, kept_unhealed, done = dict(before), True, 0
        config, memory = vars(heal_config(peak, steps)), probe.state_bytes()  # what a probe held
    else:
        time_left = None if s.time_s is None else s.time_s - (time.time() - started)
        distil = distillation(peak, steps)
        ckpt = checkpoint("heal", [vars(distil.cfg), seq, batch, source, distil.start_digest, data_digest])
        run = trainer.train(distil, chunks, steps, batch, ckpt, "healing",
                            lambda st: {"kd": f"{st['kd']:.3f}", "lr": f"{st['lr']:.1e}"}, max_time_s=time_left)
        distil.close()
        done, config, memory = distil.step_count, vars(distil.cfg), distil.state_bytes()
        after = {"held_out_kd": kd_eval(student, teacher, held_out)}
        attempts.append({"lr": peak, "steps": done, "wall_s": run["wall_s"], "held_out_kd": after["held_out_kd"]})
        log(f"healed at lr {peak:.1e}: {done} steps, {done * batch * seq:,} tokens of {source} in "
            f"{run['wall_s']:.0f} s; held-out KL to the dense model {before['held_out_kd']:.4f} → "
            f"{after['held_out_kd']:.4f}")
        # every rank alike; a NaN (a diverged heal) is worse too
        kept_unhealed = distributed.all_agree(not after["held_out_kd"] <= before["held_out_kd"])
        if kept_unhealed:
            restore()
            log("healing made the held-out KL worse: the package keeps the unhealed weights (another heal.lr "
                "or other heal.data may heal this model)")
    if world > 1:
        log(f"healed on {world} processes, {batch // world} sequence(s) each a step")
    del unhealed
    report = HealReport(
        data=source, tokens_requested=s.tokens, tokens=done * batch * seq, steps=done, steps_planned=steps,
        seq_len=seq, batch=batch, processes=world, time_cap_s=s.time_s, stopped_by_time=0 < done < steps,
        kept_unhealed=kept_unhealed, config=config, attempts=attempts, zeros_held=len(keep or {}),
        before=before, after=after, memory_bytes=memory, peak_rss_gib=round(peak_rss_gib(), 2),
        device=str(device),
        peak_device_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        wall_s=round(time.time() - started, 1), resumed_from_step=run["resumed_from_step"], final=run["final"],
        checkpoint=run["checkpoint"], peak_rule=peak_rule, probe=probes, skipped_by_probe=skipped,
        chat=chat_check(teacher, student, tok) if main else [])
    return student, report
