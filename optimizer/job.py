"""The one job skeleton: load → calibrate → method → surgery → (heal → quantize) → evaluate → export.

`Job` holds what every kind of run shares — the model and tokenizer, the calibration and
evaluation windows, the dense model's perplexity, the training loop (`training.Trainer`) and the
temporary package directory — and `Job.run(kind)` calls the stages of one *kind* of run in order,
collecting what each returns into the manifest. The structured kind (`optimizer/structured.py`),
the depth kind (`optimizer/depth.py`), the semi-structured kind (`optimizer/semistructured.py`)
and the expert kind (`optimizer/experts.py`) are peers on it.

The kind contract. A kind is an object with four methods (and `edits_in_place`: whether its
method writes into job.model); each gets the job and what the previous stage returned:

    method(job)                 → Decision   observe the calibration windows (statistics, or a
                                             training run through `job.trainer`) and decide: typed
                                             masks (`optimizer.masks`) and the manifest's account
                                             of the method. May hook the model; must unhook it.
                                             Semi-structured methods zero weights in place.
    surgery(job, decision)      → model      the deployable model: units physically removed
                                             (structured) or the zeros checked against the
                                             pattern (semi-structured). Never changes job.model's
                                             weights where the kind keeps them as the teacher.
    describe(job, decision, m)  → dict       manifest sections only the kind knows: method,
                                             size, engine, checks, prediction (and "format").
    export(job, m, manifest, q) → None       write the package into job.tmp and rename it to
                                             job.out (an exporter's write_package does both);
                                             q: the quantize stage's report, or None.
                                             `manifest` is a core.manifest.Manifest; the kind
                                             passes it and the report up to its plan
                                             (optimizer/report.py), and the exporter adds its
                                             own sections to both before writing each once.

The stages between surgery and evaluation are functions of the model and typed settings that
return the model (same shapes) and a report; they write into nothing else:
  heal.heal(student, teacher, text, HealSettings, ...)  → (model, HealReport)   with --heal-tokens:
        distillation from the dense model (a copy where the kind edits job.model in place);
        weights change, shapes and zeros never do; trains through `job.trainer`
  quantize.quantize(model, adapter, windows, QuantConfig) → (model, QuantReport)   with --quant:
        the block Linears to the plan's precision, fake-quantized from then on (evaluation
        measures the quantized model); the exporter compresses the weights
A training stage's checkpoint is keyed by `job.checkpoint(...)`, which hashes the model's and the
calibration text's *content* with the stage's settings; once the package is in place the job
removes them (`keep_checkpoints` keeps them).

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

from core.errors import UserError
from core.manifest import Engine, Manifest, Plan, Source, Target, Tool
from optimizer import data, distributed, evaluate, heal_data, load, quantize, registry, training
from optimizer import search as search_mod
from optimizer import heal as heal_stage
from optimizer.config import OptimizeConfig

TOOL_VERSION = "0.1.0"
MAX_MODEL_LEN = 2048          # the packages' --max-model-len
ZEROSHOT_TASKS = ("arc_easy", "piqa", "hellaswag")  # --zeroshot: where SmolLM2-135M is above chance


@dataclass
class Calibration:
    text: data.Text
    train: torch.Tensor       # [windows, seq_len]: what methods observe and train on
    held_out: torch.Tensor    # [1, seq_len]: the last window, for shape choice and checks
    search: torch.Tensor | None = None  # the search's held-out windows (optimizer/search.py), never trained on


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
    dense_zeroshot: dict | None = None       # --zeroshot
    architecture: str = "?"                  # the source's, before adapter.working_model
    trainer: training.Trainer | None = None  # the training loop DDP, RoI and the heal share (their checkpoints)

    def __post_init__(self):
        if self.trainer is None:
            self.trainer = training.Trainer(resume=self.cfg.resume, seed=self.cfg.seed, log=self.log)

    # --- the skeleton ------------------------------------------------------------------------
    def run(self, kind=None, candidates: list | None = None, budget=None) -> dict:
        """{"plan", "manifest" (the package's, as written), "out"}. With `candidates` (and their
        `budget`), the search (optimizer/search.py) scores them and the job builds the one it
        chooses; otherwise `kind` builds the plan's."""
        main = distributed.is_main()   # several processes: only rank 0 evaluates and writes
        self.load()
        self.calibrate(search=bool(candidates))
        if main:
            self.evaluate_dense()      # before any method: semi-structured ones edit in place
        # the heal data checked before minutes go to a search or a method, where a heal may run: never
        # where nothing is removed (the dense model, quantized or not)
        removes = bool(candidates) or bool(self.plan.sparsity) or self.cfg.retain < 1
        heal_files = self.heal_files() if self.cfg.heal.tokens > 0 and removes and main else None
        frontier = None
        if candidates:
            frontier = self.search(candidates, budget)
            kind = registry.kind_class(self.plan.kind)()
        heal = self.cfg.heal.tokens > 0 and (bool(self.plan.sparsity) or self.cfg.retain < 1)
        teacher = heal_text = None
        if heal:
            # the teacher is the dense model: a copy where the method edits job.model in place
            teacher = copy.deepcopy(self.model) if kind.edits_in_place else self.model
            heal_text = self.heal_text(teacher, heal_files)  # too little fails here, not after minutes of zero-shot
        elif self.cfg.heal.tokens:
            self.log("heal: skipped, nothing was removed")
        if self.cfg.zeroshot and main:
            self.dense_zeroshot = self.zeroshot(self.model)
        while True:
            decision = kind.method(self)
            model = kind.surgery(self, decision)
            healed = None
            if heal:
                model, healed = self.heal(model, teacher, heal_text)
            if not main:
                return {"plan": self.plan, "manifest": None, "out": None}
            quantized, unquantized_ppl = None, None
            if self.plan.quant != "none":
                if self.evaluation is not None:  # what quantizing costs, apart from what pruning and healing did
                    unquantized_ppl = (self.dense_ppl if self.cfg.retain >= 1 and not self.plan.sparsity  # the dense model
                                       else evaluate.perplexity(model, self.evaluation.windows, "perplexity (unquantized)"))
                model, quantized = quantize.quantize(model, self.adapter, self.calib.train[:self.cfg.data.calib_windows],
                                                     self.quant_config(), self.log)
            if frontier is None or frontier.recheck(model):
                break
            # the healed candidate missed the budget: the best one with nothing removed instead
            instead = frontier.fall_back()
            self.cfg, self.plan, heal = instead.cfg, instead.plan, False
            kind = registry.kind_class(self.plan.kind)()
        quality = self.quality(model, unquantized_ppl)
        manifest = self.manifest(kind.describe(self, decision, model), quality, healed,
                                 quantized.section if quantized else None,
                                 frontier.section() if frontier else None)
        if frontier is not None:
            frontier.plot(self.tmp / "frontier.png")
        training.stop_if_terminated()  # a SIGTERM something swallowed: no package goes into place
        kind.export(self, model, manifest, quantized)
        self.log(f"package: {self.out.resolve()}  (serve it: serve {self.out})")
        self.remove_checkpoints()
        return {"plan": self.plan, "manifest": manifest, "out": self.out,
                **({"frontier": manifest.frontier} if frontier else {})}

    def search(self, candidates: list, budget) -> "search_mod.Frontier":
        """Score the candidates on the held-out text, choose one, and take its settings and plan:
        from here on the job builds that candidate."""
        frontier = search_mod.Frontier(candidates, budget, heal=self.cfg.heal.tokens > 0, log=self.log)
        frontier.score(self)
        chosen = frontier.choose()
        self.cfg, self.plan = chosen.cfg, chosen.plan
        return frontier

    # --- load, calibrate, evaluate ------------------------------------------------------------
    def load(self) -> None:
        """Threads and seed set, then the model and tokenizer."""
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        torch.manual_seed(self.cfg.seed)
        self.model, self.tok = load.load_model(self.source)
        self.architecture = (self.model.config.architectures or ["?"])[0]
        self.model = self.adapter.working_model(self.model)  # Phi-3: its fused projections split

    def calibrate(self, search: bool = False) -> Calibration:
        """The calibration text and its windows; the last window is held out (shape choice, refit,
        heal checks), and for a search the SEARCH_WINDOWS before it too (its held-out text)."""
        d = self.cfg.data
        text = data.read_text_file(d.calib, "calibration file") if d.calib else data.builtin_text("calib")
        if text is None:
            text = data.self_generated_text(self.model, self.tok, (d.calib_windows + 1) * d.seq_len, self.cfg.seed)
        windows = data.token_windows(self.tok, text.text, d.seq_len)
        train, held_out = (windows[:-1], windows[-1:]) if len(windows) > 1 else (windows, windows)
        set_aside = None
        if search:
            n = search_mod.SEARCH_WINDOWS
            if len(train) < d.calib_windows + n:
                raise UserError(f"the calibration text has {len(windows)} windows of {d.seq_len} tokens; the search "
                                f"needs {d.calib_windows + n + 1} (data.calib_windows, {n} held out for the search "
                                f"and one for the checks): a longer --calib, or pin a candidate with --retain")
            train, set_aside = train[:-n], train[-n:]
        self.log(f"calibration: {text.description}, {train.numel()} tokens available")
        self.calib = Calibration(text, train, held_out, set_aside)
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

    def heal_files(self) -> str | None:
        """The --heal-data files read (checked, and the evaluation text refused in them, or in the
        default heal data): before any minutes are spent on a method or a search. Rank 0 only."""
        s = self.cfg.heal
        files_text = heal_data.heal_files_text(s.data, self.tok) if s.data else None  # read once: checked, then tokenized
        if self.evaluation is not None:
            if s.data:
                text, what = files_text, "--heal-data"
            else:
                text = "\n".join([self.calib.text.text, *heal_data.default_heal_samples(self.calib.text).values()])
                what = "the default heal data (the calibration text and built-in samples)"
            share = heal_data.eval_overlap(text, self.evaluation.text)
            if share > 0.05:
                raise UserError(f"{what} contains {share:.0%} of the evaluation text's lines; healing on it would "
                                f"make the reported perplexity a memory test: use other heal data or another --eval")
            if share > 0:
                self.log(f"warning: {what} contains {share:.1%} of the evaluation text's lines")
        return files_text

    def heal_text(self, teacher, files_text: str | None) -> heal_data.HealText | None:
        """The heal text, tokenized before pruning (too little is a one-line error now, not after).
        None on the ranks other than 0, which receive rank 0's (heal._heal)."""
        if not distributed.is_main():
            return None
        s = self.cfg.heal
        n_chat = heal_data.chat_answers(s, self.tok)
        chat = heal_data.teacher_chat(teacher, self.tok, n_chat, self.cfg.seed) if n_chat else None
        return heal_data.heal_text(s, self.tok, self.calib, chat, files_text)

    def heal(self, model, teacher, text: heal_data.HealText | None) -> tuple[torch.nn.Module, dict]:
        """The heal stage, with what the job measures around it: the perplexity (and with
        --zeroshot the zero-shot scores) before healing. Returns the model and the manifest's "heal"
        section."""
        before = {}
        if self.evaluation is not None:
            before["perplexity"] = evaluate.perplexity(model, self.evaluation.windows, "perplexity (before healing)")
        if self.cfg.zeroshot and distributed.is_main():
            before["zeroshot"] = self.zeroshot(model)
        model, report = heal_stage.heal(
            model, teacher, text, self.cfg.heal, held_out=self.calib.held_out, trainer=self.trainer,
            checkpoint=self.checkpoint, adapter=self.adapter, tok=self.tok, hold_zeros=bool(self.plan.sparsity),
            seed=self.cfg.seed, calib_dtype=self.cfg.calib_dtype, log=self.log)
        report.before = {**before, **report.before}
        return model, report.as_dict()

    def quant_config(self) -> quantize.QuantConfig:
        """The quantize stage's settings: the plan's precision, for this package's engine."""
        return quantize.QuantConfig(precision=self.plan.quant, head=self.plan.quant_head, reason=self.plan.quant_reason,
                                    target_kind=self.target.kind, calib_dtype=self.cfg.calib_dtype,
                                    onnx_int8=self.cfg.onnx.int8 if self.cfg.format == "onnx" else None)

    def remove_checkpoints(self) -> None:
        """The package is in place: the training checkpoints behind it have nothing left to resume
        (an 8B heal's are tens of GB), unless the user keeps them."""
        if not distributed.is_main():
            return
        if self.cfg.keep_checkpoints:
            for ckpt in self.trainer.written:
                if ckpt.is_file():
                    self.log(f"checkpoint kept: {ckpt} ({ckpt.stat().st_size / 2**30:.2f} GiB)")
            return
        freed = self.trainer.remove_checkpoints()
        if freed:
            self.log(f"training checkpoints removed ({freed / 2**30:.2f} GiB): the package is complete "
                     "(keep_checkpoints=true keeps them)")

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

    # --- the manifest ---------------------------------------------------------------------------
    def manifest(self, sections: dict, quality: dict, heal: dict | None = None, quant: dict | None = None,
                 frontier: dict | None = None) -> Manifest:
        """The manifest every package carries; `sections` (method, size, engine, checks, format,
        and the achieved shape's prediction) come from the kind, `heal` and `quant` from those stages."""
        t, plan = self.target, self.plan
        prediction = sections.pop("prediction", plan.prediction)  # of the achieved shape, where the kind has it
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
            size=self._size(sections["size"], quant),
            plan=Plan(text=plan.text(prediction), reasons=plan.reasons, prediction=prediction,
                      engine=plan.engine, engine_version=plan.engine_version),
            engine=Engine.from_dict(sections["engine"]),
            checks=sections["checks"],
            heal=heal or None,
            quantization=quant or None,
            frontier=frontier,
            wall_s=round(time.time() - self.started, 1),
        )

    def finish_checkpoint(self, directory: Path) -> None:
        """The written checkpoint as the source's family writes it (the adapter's rewrite: Phi-3's
        fused projections; nothing for most families)."""
        source = json.loads((Path(self.source.hf_dir) / "config.json").read_text())
        self.adapter.finish_checkpoint(directory, source)

    @staticmethod
    def _size(size: dict, q: dict | None) -> dict:
        """The kind's size section, and with --quant the bytes the quantized checkpoint's
        weights take, against the dense model in bf16."""
        if not q:
            return size
        # the package's other values: bf16 in a vLLM package, fp32 in an ONNX one (against the dense
        # model in the same precision)
        per_value = q.get("bytes_per_value", 2)
        lookup_bytes = per_value * size.get("lookup_params", 0)  # an untied input embedding: not streamed
        lookup_bytes_pruned = per_value * size.get("lookup_params_pruned", size.get("lookup_params", 0))
        dense_bytes = per_value * size["params_dense"]
        return {**size, "weight_bytes_quantized": q["weight_bytes"],
                "ideal_ratio_quantized": (dense_bytes - lookup_bytes) / (q["weight_bytes"] - lookup_bytes_pruned)}


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
    previous, tmp = None, None
    if threading.current_thread() is threading.main_thread():
        training.clear_termination()
        previous = signal.signal(signal.SIGTERM, training.terminated)
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
            training.clear_termination()


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing
