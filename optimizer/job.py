"""The one job skeleton: load → calibrate → method → surgery → (heal → quantize) → evaluate → export.

`Job` holds what every kind of run shares — the model and tokenizer, the calibration and
evaluation windows, the dense model's perplexity, the checkpointed training loop, the manifest
and the temporary package directory — and `Job.run(kind)` calls the stages of one *kind* of run
in order. The structured kind (`optimizer/structured.py`), the depth kind (`optimizer/depth.py`),
the semi-structured kind (`optimizer/semistructured.py`) and the expert kind (`optimizer/experts.py`)
are peers on it.

The stage contract. A kind is an object with four methods (and `edits_in_place`: whether its
method writes into job.model); each gets the job and what the previous stage returned:

    method(job)                 → Decision   observe the calibration windows (statistics, or a
                                             training run through `job.train`) and decide: typed
                                             masks (`optimizer.masks`) and the manifest's account
                                             of the method. May hook the model; must unhook it.
                                             Semi-structured methods zero weights in place.
    surgery(job, decision)      → model      the deployable model: units physically removed
                                             (structured) or the zeros checked against the
                                             pattern (semi-structured). Never changes job.model's
                                             weights where the kind keeps them as the teacher.
    describe(job, decision, m)  → dict       manifest sections only the kind knows: method,
                                             size, engine, checks (and "format").
    export(job, m, manifest)    → None       write the package into job.tmp and rename it to
                                             job.out (an exporter's write_package does both).
                                             `manifest` is a core.manifest.Manifest; the kind
                                             passes it and the report up to its plan
                                             (optimizer/report.py), and the exporter adds its
                                             own sections to both before writing each once.

Stages between surgery and evaluation take the deployable model and return it, same shapes:
  heal(job, model)     → model   (optimizer/heal.py, with --heal-tokens) distillation from
                                 job.teacher, the dense model (a copy where the kind edits
                                 job.model in place): weights change, shapes and zeros never do;
                                 trains through `job.train`; the manifest gains a "heal" section
  quantize(job, model) → model   (optimizer/quantize.py, with --quant) the block Linears to the
                                 plan's precision, fake-quantized from then on (evaluation
                                 measures the quantized model); the manifest gains a
                                 "quantization" section; the exporter compresses the weights
A stage that trains checkpoints through `job.train`, keyed by `job.checkpoint(...)`, which
hashes the model's and the calibration text's *content* with the stage's settings.

Output discipline: the package is written to a temporary directory beside the output
(`.NAME.tmp-PID-XXXX`), renamed into place only when complete, and removed on any failure,
Ctrl-C or SIGTERM; directories left by a SIGKILL are swept at the next start.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from core.errors import Terminated, UserError
from core.manifest import Engine, Manifest, Plan, Source, Target, Tool
from optimizer import data, distributed, evaluate, load
from optimizer.config import OptimizeConfig

TOOL_VERSION = "0.1.0"
MAX_MODEL_LEN = 2048          # the packages' --max-model-len
ZEROSHOT_TASKS = ("arc_easy", "piqa", "hellaswag")  # --zeroshot: where SmolLM2-135M is above chance
CHECKPOINT_EVERY_S = 120      # seconds of training between checkpoints (a kill loses at most this): by
                              # time, not steps, since writing one (the weights and AdamW's two moments)
                              # takes seconds, which a count of steps would charge however short they are


@dataclass
class Calibration:
    text: data.Text
    train: torch.Tensor       # [windows, seq_len]: what methods observe and train on
    held_out: torch.Tensor    # [1, seq_len]: the last window, for shape choice and checks


@dataclass
class Evaluation:
    description: str
    windows: torch.Tensor
    text: str = ""


@dataclass
class Decision:
    """What a kind's method stage returns: its typed masks and the manifest's account of it."""
    masks: object
    detail: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)   # anything the kind's later stages need


@dataclass
class Job:
    cfg: OptimizeConfig
    target: object            # profiles.Profile
    plan: object              # plan.Plan
    source: load.ModelSource
    adapter: object           # adapters.DecoderAdapter
    out: Path
    tmp: Path
    log: Callable = print
    started: float = field(default_factory=time.time)
    model: torch.nn.Module | None = None
    tok: object = None
    calib: Calibration | None = None
    evaluation: Evaluation | None = None
    dense_ppl: float | None = None
    teacher: torch.nn.Module | None = None   # the dense model healing distils from
    heal_detail: dict | None = None
    dense_zeroshot: dict | None = None       # --zeroshot
    heal_chat: str | None = None             # the teacher's chat answers (--heal-chat), written once
    heal_data: tuple | None = None           # (sequences, description), tokenized once by check_heal_data
    quant_detail: dict | None = None         # --quant: the quantize stage's account
    architecture: str = "?"                  # the source's, before adapter.working_model

    # --- the skeleton ------------------------------------------------------------------------
    def run(self, kind) -> dict:
        """{"plan", "manifest" (the package's, as written), "out"}."""
        main = distributed.is_main()   # several processes: only rank 0 evaluates and writes
        self.load()
        self.calibrate()
        if main:
            self.evaluate_dense()      # before any method: semi-structured ones edit in place
        heal = self.cfg.heal.tokens > 0
        if heal:
            # the teacher is the dense model: a copy where the method edits job.model in place
            self.teacher = copy.deepcopy(self.model) if kind.edits_in_place else self.model
            self.check_heal_data()     # too little heal text fails here, not after minutes of zero-shot
        if self.cfg.zeroshot and main:
            self.dense_zeroshot = self.zeroshot(self.model)
        decision = kind.method(self)
        model = kind.surgery(self, decision)
        if heal:
            from optimizer.heal import heal as heal_stage
            model = heal_stage(self, model)
        if not main:
            return {"plan": self.plan, "manifest": None, "out": None}
        unquantized_ppl = None
        if self.plan.quant != "none":
            from optimizer.quantize import quantize
            if self.evaluation is not None:  # what quantizing costs, apart from what pruning and healing did
                unquantized_ppl = evaluate.perplexity(model, self.evaluation.windows, "perplexity (unquantized)")
            model = quantize(self, model)
        quality = self.quality(model, unquantized_ppl)
        manifest = self.manifest(kind.describe(self, decision, model), quality)
        stop_if_terminated()  # a SIGTERM something swallowed: no package goes into place
        kind.export(self, model, manifest)
        self.log(f"package: {self.out.resolve()}  (serve it: serve {self.out})")
        return {"plan": self.plan, "manifest": manifest, "out": self.out}

    # --- load, calibrate, evaluate ------------------------------------------------------------
    def load(self) -> None:
        """Threads and seed set, then the model and tokenizer."""
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        torch.manual_seed(self.cfg.seed)
        self.model, self.tok = load.load_model(self.source)
        self.architecture = (self.model.config.architectures or ["?"])[0]
        self.model = self.adapter.working_model(self.model)  # Phi-3: its fused projections split

    def calibrate(self) -> Calibration:
        """The calibration text and its windows; the last window is held out."""
        d = self.cfg.data
        text = data.read_text_file(d.calib, "calibration file") if d.calib else data.builtin_text("calib")
        if text is None:
            text = data.self_generated_text(self.model, self.tok, (d.calib_windows + 1) * d.seq_len, self.cfg.seed)
        windows = data.token_windows(self.tok, text.text, d.seq_len)
        train, held_out = (windows[:-1], windows[-1:]) if len(windows) > 1 else (windows, windows)
        self.log(f"calibration: {text.description}, {train.numel()} tokens available")
        self.calib = Calibration(text, train, held_out)
        return self.calib

    def evaluate_dense(self) -> None:
        """The evaluation windows (read and tokenized once) and the dense model's perplexity."""
        d = self.cfg.data
        text = data.read_text_file(d.eval, "evaluation file") if d.eval else data.builtin_text("eval")
        if text is None:
            self.log("perplexity: skipped (no --eval file and no built-in corpus)")
            return
        self.evaluation = Evaluation(text.description, data.token_windows(self.tok, text.text, d.seq_len, d.eval_windows),
                                     text.text)
        self.dense_ppl = dense_perplexity(self.model, self.evaluation.windows, self.source)

    def zeroshot(self, model) -> dict:
        """--zeroshot: the zero-shot tasks' scores of `model` on cfg.zeroshot seeded documents each."""
        from optimizer import zeroshot
        r = zeroshot.evaluate(model, self.tok, list(ZEROSHOT_TASKS), self.cfg.zeroshot)
        return {"mean": r["mean"], "tasks": {k: v["score"] for k, v in r["tasks"].items()}}

    def check_heal_data(self) -> None:
        """The heal text, tokenized before pruning (too little is a one-line error now, not after),
        and never the evaluation text: heal data that holds it is refused, a trace warned of."""
        from optimizer.heal import default_heal_samples, eval_overlap, heal_chunks, heal_files_text
        if not distributed.is_main():
            return  # rank 0's heal text is broadcast to the others (heal._heal)
        files = self.cfg.heal.data
        files_text = heal_files_text(files, self.tok) if files else None  # read once: checked, then tokenized
        if self.evaluation is not None:
            if files:
                text, what = files_text, "--heal-data"
            else:
                text = "\n".join([self.calib.text.text, *default_heal_samples(self).values()])
                what = "the default heal data (the calibration text and built-in samples)"
            share = eval_overlap(text, self.evaluation.text)
            if share > 0.05:
                raise UserError(f"{what} contains {share:.0%} of the evaluation text's lines; healing on it would "
                                f"make the reported perplexity a memory test: use other heal data or another --eval")
            if share > 0:
                self.log(f"warning: {what} contains {share:.1%} of the evaluation text's lines")
        self.heal_data = heal_chunks(self, files_text)

    def quality(self, model, unquantized_ppl: float | None = None) -> dict:
        """The manifest's quality: perplexity (and with --zeroshot the zero-shot scores), dense
        against the deployable model; where it is quantized, also its 16-bit perplexity."""
        z = {}
        if self.cfg.zeroshot:
            from optimizer import zeroshot
            z = {"tasks": list(ZEROSHOT_TASKS), "limit": self.cfg.zeroshot, "seed": zeroshot.DEFAULT_SEED,
                 "dense": self.dense_zeroshot, "pruned": self.zeroshot(model)}
            self.log(f"zero-shot mean: dense {z['dense']['mean']:.3f} → pruned {z['pruned']['mean']:.3f}")
        out = {"zeroshot": z} if z else {}
        if self.evaluation is None:
            return out
        q = {"eval": self.evaluation.description, "windows": len(self.evaluation.windows),
             "seq_len": self.cfg.data.seq_len, "dense": self.dense_ppl,
             "pruned": evaluate.perplexity(model, self.evaluation.windows, "perplexity (pruned)")}
        if unquantized_ppl is not None:
            q["pruned_unquantized"] = unquantized_ppl
        self.log(f"perplexity: dense {q['dense']:.3f} → pruned {q['pruned']:.3f} "
                 + (f"({unquantized_ppl:.3f} before quantizing) " if unquantized_ppl is not None else "")
                 + f"({q['windows']} windows of {q['seq_len']})")
        return {"perplexity": q, **out}

    # --- training -----------------------------------------------------------------------------
    def checkpoint(self, kind: str, run: list) -> Path:
        """One checkpoint per exact run: the model's and the calibration text's content, and
        `run`, everything else that changes what training learns."""
        key = hashlib.sha256(json.dumps([load.fingerprint(self.source.hf_dir),
                                         hashlib.sha256(self.calib.text.text.encode()).hexdigest(),
                                         self.cfg.data.seq_len, run], default=str).encode()).hexdigest()[:16]
        return load.cache_dir() / "runs" / f"{kind}-{key}.pt"

    def train(self, method, chunks: torch.Tensor, steps: int, batch: int, ckpt: Path, desc: str,
              postfix: Callable[[dict], dict], max_time_s: float | None = None) -> dict:
        """Step a `TrainedMethod` to `steps`, `batch` chunks a step in a seeded order (resumable),
        checkpointing every CHECKPOINT_EVERY_S seconds and at the end; --resume continues from the
        checkpoint; `max_time_s` stops it early (checkpointed). SIGTERM or Ctrl-C stops it after the
        step under way, checkpointed too (`StopAfterStep`). Returns the last step's stats, where it
        resumed from, and the wall time."""
        resumed = self.cfg.resume and method.load(ckpt)
        distributed.same_on_every_rank(method.step_count, "resumed at step")  # else the ranks' steps part ways
        if self.cfg.resume and not resumed:
            self.log(f"--resume: no checkpoint of this exact run at {ckpt}; starting from step 0")
        start_step, started, stats = method.step_count, time.time(), {}
        saved, saved_step = started, start_step  # the checkpoint it resumed (if any) holds start_step
        main = distributed.is_main()  # the one process that writes checkpoints and shows progress

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
                    stats = method.step(chunks[batch_indices(len(chunks), batch, method.step_count, self.cfg.seed)])
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
        if main and ckpt.is_file():  # a heal of an 8B model leaves tens of GB here: say so
            self.log(f"{desc}: checkpoint {ckpt} ({ckpt.stat().st_size / 2**30:.2f} GiB) kept for --resume; "
                     "delete the file to reclaim the space")
        return {"final": stats, "resumed_from_step": start_step, "wall_s": round(time.time() - started, 1),
                "checkpoint": str(ckpt)}

    # --- the manifest ---------------------------------------------------------------------------
    def manifest(self, sections: dict, quality: dict) -> Manifest:
        """The manifest every package carries; `sections` (method, size, engine, checks, format)
        come from the kind."""
        t, plan = self.target, self.plan
        return Manifest(
            format=sections.pop("format", "vllm"),
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            tool=Tool(version=TOOL_VERSION),
            source=Source(model=self.source.description, hf_dir=str(self.source.hf_dir),
                          architecture=self.architecture, family=self.adapter.family),
            target=Target(name=t.name, display_name=t.display_name, kind=t.kind,
                          compute_capability=t.compute_capability),
            method=sections["method"],
            quality=quality,
            size=self._size(sections["size"]),
            plan=Plan(text=plan.text(), reasons=plan.reasons, prediction=plan.prediction,
                      engine=plan.engine, engine_version=plan.engine_version),
            engine=Engine.from_dict(sections["engine"]),
            checks=sections["checks"],
            heal=self.heal_detail or None,
            quantization=self.quant_detail or None,
            wall_s=round(time.time() - self.started, 1),
        )

    def finish_checkpoint(self, directory: Path) -> None:
        """The written checkpoint as the source's family writes it (the adapter's rewrite: Phi-3's
        fused projections; nothing for most families)."""
        source = json.loads((Path(self.source.hf_dir) / "config.json").read_text())
        self.adapter.finish_checkpoint(directory, source)

    def _size(self, size: dict) -> dict:
        """The kind's size section, and with --quant the bytes the quantized checkpoint's
        weights take, against the dense model in bf16."""
        q = self.quant_detail
        if not q:
            return size
        # the package's other values: bf16 in a vLLM package, fp32 in an ONNX one (against the dense
        # model in the same precision)
        per_value = q.get("bytes_per_value", 2)
        lookup_bytes = per_value * size.get("lookup_params", 0)  # an untied input embedding: not streamed
        dense_bytes = per_value * size["params_dense"]
        return {**size, "weight_bytes_quantized": q["weight_bytes"],
                "ideal_ratio_quantized": (dense_bytes - lookup_bytes) / (q["weight_bytes"] - lookup_bytes)}


def batch_indices(n: int, batch: int, step: int, seed: int) -> torch.Tensor:
    """Batch `step` of a seeded reshuffle per pass over the data: deterministic and resumable."""
    idx = []
    for k in range(step * batch, (step + 1) * batch):
        epoch, pos = divmod(k, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        idx.append(int(perm[pos]))
    return torch.tensor(idx)


def dense_perplexity(model, windows: torch.Tensor, source: load.ModelSource) -> float:
    """The source model's perplexity on these exact windows, computed once per machine and
    cached by the model's content (a model replaced at the same path is measured anew)."""
    key = hashlib.sha256(load.fingerprint(source.hf_dir).encode() + windows.numpy().tobytes()).hexdigest()[:24]
    path = load.cache_dir() / "perplexity" / f"{key}.json"
    if path.is_file():
        return json.loads(path.read_text())["perplexity"]
    ppl = evaluate.perplexity(model, windows, "perplexity (dense)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"perplexity": ppl, "model": str(source.hf_dir), "windows": len(windows)}))
    os.replace(tmp, path)
    return ppl


# --- the temporary package directory -----------------------------------------------------------

def _tmp_prefix(out: Path, pid: int | str) -> str:
    return f".{out.name}.tmp-{pid}-"


def prepare_output(out: Path) -> Path:
    """Fail early (before any compute) when `out` cannot be created; return a temporary
    directory beside it, after sweeping the ones killed runs left there."""
    out = out.expanduser().resolve()
    if out.exists():
        raise UserError(f"{out} already exists; choose another -o or remove it")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        sweep_stale(parent)
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=_tmp_prefix(out, os.getpid())))
    except OSError as e:
        raise UserError(f"cannot write to {parent}: {e.strerror}") from None
    tmp.chmod(0o755)
    return tmp


def sweep_stale(parent: Path) -> list[Path]:
    """Remove the temporary package directories in `parent` whose process is gone (SIGKILL
    cannot be trapped). A directory of a live process, or of a pid that was reused, stays."""
    removed = []
    for d in parent.glob(".*.tmp-*-*"):
        pid = d.name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
        if not d.is_dir() or not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def staged(out: Path):
    """The temporary directory for `out`, removed unless the job renamed it into place.

    SIGTERM (what `docker stop`, Kubernetes and batch schedulers send) raises `Terminated`
    while the job runs, so the same cleanup runs as for Ctrl-C or a crash."""
    global _termination_requested
    previous, tmp = None, None
    if threading.current_thread() is threading.main_thread():
        _termination_requested = False
        previous = signal.signal(signal.SIGTERM, _terminated)
    created = []
    try:
        created = _missing_dirs(out.expanduser().resolve().parent)  # -o a/b/pkg makes a/ and a/b/: undone on failure
        tmp = prepare_output(out)  # the handler first: SIGTERM from here on raises Terminated
        yield tmp
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for d in created:  # deepest first; one that something else wrote into stays
            try:
                d.rmdir()
            except OSError:
                break
        raise  # (a SIGTERM inside prepare_output can leave its directory: the next start sweeps it)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
            _termination_requested = False


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


_termination_requested = False


def _terminated(signum, frame):
    # Python runs the handler at the next bytecode of the main thread, which can be inside a
    # finaliser or a callback that swallows exceptions; the flag lets the long loops re-raise it.
    global _termination_requested
    _termination_requested = True
    raise Terminated()


class StopAfterStep:
    """While training: the first SIGTERM or Ctrl-C only sets `signal` (and says so on stderr), so
    the step under way ends and `Job.train` checkpoints whole steps before it stops (--resume then
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


def stop_if_terminated() -> None:
    """Re-raise a SIGTERM whose `Terminated` something swallowed: `Job.train` at its end (its loop
    stops, checkpointed, on the same flag: `StopAfterStep.requested`), `Job.run` before the package
    goes into place."""
    if _termination_requested:
        raise Terminated()
