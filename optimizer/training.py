"""The training loop every trained stage shares (DDP gates, RoI masks, the heal): seeded and
resumable batches, checkpoints by elapsed time, a SIGTERM or Ctrl-C honoured after the step under
way, and the checkpoints removed once the package they were for is in place.

`Trainer` knows nothing of models or packages: it steps a `TrainedMethod`
(`optimizer/methods/base.py`) and remembers which checkpoint files it wrote, so that the job can
remove them after success (`remove_checkpoints`), or keep them where the user asks.

Signals: `staged` (optimizer/job.py) turns SIGTERM into `Terminated` while a job runs; during a
training step `StopAfterStep` holds it (and Ctrl-C) instead, so the step finishes and is
checkpointed first. The flag below survives a `Terminated` that something swallowed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from optimizer import distributed
from core.errors import Terminated

CHECKPOINT_EVERY_S = 120      # seconds of training between checkpoints (a kill loses at most this): by
                              # time, not steps, since writing one (the weights and AdamW's two moments)
                              # takes seconds, which a count of steps would charge however short they are


@dataclass
class Trainer:
    resume: bool = False      # continue from the checkpoint of the same run, where there is one
    seed: int = 0             # the batches' order
    log: Callable = print
    written: list[Path] = field(default_factory=list)   # checkpoints this job's training wrote or resumed

    def train(self, method, chunks: torch.Tensor, steps: int, batch: int, ckpt: Path, desc: str,
              postfix: Callable[[dict], dict], max_time_s: float | None = None) -> dict:
        """Step a `TrainedMethod` to `steps`, `batch` chunks a step in a seeded order (resumable),
        checkpointing every CHECKPOINT_EVERY_S seconds and at the end; `resume` continues from the
        checkpoint; `max_time_s` stops it early (checkpointed). SIGTERM or Ctrl-C stops it after the
        step under way, checkpointed too (`StopAfterStep`). Returns the last step's stats, where it
        resumed from, and the wall time."""
        resumed = self.resume and method.load(ckpt)
        distributed.same_on_every_rank(method.step_count, "resumed at step")  # else the ranks' steps part ways
        if self.resume and not resumed:
            self.log(f"--resume: no checkpoint of this exact run at {ckpt}; starting from step 0")
        start_step, started, stats = method.step_count, time.time(), {}
        saved, saved_step = started, start_step  # the checkpoint it resumed (if any) holds start_step
        main = distributed.is_main()  # the one process that writes checkpoints and shows progress
        if main and ckpt not in self.written:
            self.written.append(ckpt)

        def save() -> None:
            nonlocal saved, saved_step
            if main and method.step_count != saved_step:  # never the same step twice (tens of GB at 8B)
                method.save(ckpt)
            saved, saved_step = time.time(), method.step_count

        bar = tqdm(total=steps, initial=method.step_count, desc=desc, unit="step", disable=not main)
        try:
            with StopAfterStep() as stop:
                # every rank asks whether any rank was signalled (or saw a swallowed SIGTERM), so all stop alike
                while method.step_count < steps and not distributed.all_agree(stop.requested()):
                    stats = method.step(chunks[batch_indices(len(chunks), batch, method.step_count, self.seed)])
                    bar.set_postfix(**postfix(stats))
                    bar.update(1)
                    out_of_time = max_time_s is not None and distributed.all_agree(time.time() - started >= max_time_s)
                    if time.time() - saved >= CHECKPOINT_EVERY_S or method.step_count == steps or out_of_time:
                        save()
                    if out_of_time:
                        self.log(f"{desc}: stopped by the time cap after {method.step_count} of {steps} steps")
                        break
                if distributed.all_agree(stop.requested()):  # a signal during the loop or after its last check
                    save()
                    bar.close()
                    self.log(f"{desc}: stopped by {stop.name()} " + (
                        f"after step {method.step_count} of {steps}, checkpointed: the same command with "
                        "--resume continues from there" if method.step_count > 0 else "before its first step"))
                    stop.reraise()
            if stop.signal is not None:  # after the last check (this rank alone: training is over, the
                stop.reraise()          # last step checkpointed; torchrun signals every rank anyway)
        finally:
            bar.close()
        stop_if_terminated()
        return {"final": stats, "resumed_from_step": start_step, "wall_s": round(time.time() - started, 1),
                "checkpoint": str(ckpt)}

    def remove_checkpoints(self) -> int:
        """Delete the checkpoints this job's training wrote (the package they were for is in place,
        so nothing is left to resume); returns the bytes freed."""
        freed = 0
        for ckpt in self.written:
            if ckpt.is_file():
                freed += ckpt.stat().st_size
                ckpt.unlink()
        self.written.clear()
        return freed


def batch_indices(n: int, batch: int, step: int, seed: int) -> torch.Tensor:
    """Batch `step` of a seeded reshuffle per pass over the data: deterministic and resumable."""
    idx = []
    for k in range(step * batch, (step + 1) * batch):
        epoch, pos = divmod(k, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        idx.append(int(perm[pos]))
    return torch.tensor(idx)


# --- signals -------------------------------------------------------------------------------------

_termination_requested = False


def terminated(signum, frame):
    """The SIGTERM handler while a job runs (`job.staged`): raise `Terminated`, and remember it.
    Python runs the handler at the next bytecode of the main thread, which can be inside a finaliser
    or a callback that swallows exceptions; the flag lets the long loops re-raise it."""
    global _termination_requested
    _termination_requested = True
    raise Terminated()


def clear_termination() -> None:
    """A new job starts without an old job's request."""
    global _termination_requested
    _termination_requested = False


def stop_if_terminated() -> None:
    """Re-raise a SIGTERM whose `Terminated` something swallowed: `Trainer.train` at its end (its loop
    stops, checkpointed, on the same flag: `StopAfterStep.requested`), `Job.run` before the package
    goes into place."""
    if _termination_requested:
        raise Terminated()


class StopAfterStep:
    """While training: the first SIGTERM or Ctrl-C only sets `signal` (and says so on stderr), so
    the step under way ends and `Trainer.train` checkpoints whole steps before it stops (--resume then
    continues the same run); a second one stops at once. A SIGKILL while the checkpoint is written
    leaves the previous one (`TrainedMethod.save` is atomic). A signal the process ignores (SIGINT
    in a job started with `&`) stays ignored; outside the main thread, where Python delivers no
    signals, nothing changes."""

    DEFAULT = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}

    def __init__(self):
        self.signal, self.previous = None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler if handler is not None else self.DEFAULT[sig])

    def _handle(self, signum, frame):
        if self.signal is not None:
            self.signal = signum
            self.reraise()
        self.signal = signum
        again = "press it again" if signum == signal.SIGINT else "send it again"
        try:  # os.write, not print: a handler can run inside another write to stderr
            os.write(2, f"\n{self.name()}: stopping after this training step ({again} to stop at once)\n".encode())
        except OSError:  # stderr closed (a pipe's reader gone): the stop goes on without the line
            pass

    def requested(self) -> bool:
        """A signal came, or a SIGTERM that `staged`'s handler raised before training was swallowed."""
        return self.signal is not None or _termination_requested

    def name(self) -> str:
        return "Ctrl-C" if self.signal == signal.SIGINT else "SIGTERM"

    def reraise(self):
        """The signal's exception (another rank's signal: Terminated), for the usual cleanup."""
        global _termination_requested
        if self.signal == signal.SIGINT:
            raise KeyboardInterrupt()
        _termination_requested = True  # `Job.run` checks it again before the package goes into place
        raise Terminated()
