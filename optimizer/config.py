"""What a user sets: `OptimizeConfig`, the CLI's options one to one, with per-method settings.

Every field is either a CLI option of `optimize` or part of the public API below; settings the
benchmarks found no better than the defaults are not offered. Why a default is what it is, and
the runs behind it, are in `bench/results/`, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optimizer import data, distributed
from optimizer import plan as planner
from optimizer import sparsity as sparsity_mod
from optimizer.errors import UserError

FORMATS = ("vllm", "onnx")
HEAL_MEMORY = ("fast", "lean")
QUANT = ("none", "auto", "int8", "fp8", "w4a16")
ONNX_INT8 = ("dynamic", "qdq")  # how an INT8 ONNX package quantizes its activations (optimizer/quantize.py)
LAYOUTS = ("uniform", "per-layer")
BUDGETS = ("params", "latency")


@dataclass
class DataConfig:
    """Calibration and evaluation text (None: the built-in corpus, or text the model writes)."""
    calib: str | None = None          # text file the methods observe / train on
    eval: str | None = None           # text file for perplexity; never trained on
    seq_len: int = 2048               # tokens per window
    calib_windows: int = 16           # windows the one-shot statistics (and --refit) read
    eval_windows: int | None = 8      # None: every window of the evaluation text


@dataclass
class DDPSettings:
    """`--method ddp`: learned gates on heads and channels (optimizer/methods/ddp.py)."""
    steps: int = 80
    batch: int | None = None          # sequences a step; None: 4 in the uniform layout, 1 per layer
    seq_len: int = 1024               # tokens a sequence (the whole window where it does not divide)
    lr: float = 0.05
    lr_end: float | None = None       # cosine to this; None: lr / 10 in the uniform layout, constant per layer
    beta: float = 25.0                # augmented-Lagrangian penalty

    def by_layout(self, layout: str) -> tuple[int, float | None]:
        """(sequences a step, the learning rate's end) where these settings leave them to the layout."""
        uniform = layout == "uniform"
        batch = self.batch if self.batch is not None else 4 if uniform else 1
        lr_end = self.lr_end if self.lr_end is not None else self.lr / 10 if uniform else None
        return batch, lr_end


@dataclass
class RoISettings:
    """`--method roi`: learned N:M masks (optimizer/methods/roi.py)."""
    steps: int = 120
    seq_len: int = 2048               # tokens a step (the whole window where it does not divide)
    prior: str = "wanda"              # one-shot start: wanda | sparsegpt


@dataclass
class SISettings:
    """`--method si+PRUNER`: sparsity-inducing transforms before the pruner (optimizer/methods/si.py)."""
    steps: int = 20                   # optimisation steps per block


@dataclass
class RefitSettings:
    """`--refit` (on by default for structured methods): least-squares refit of the kept o_proj /
    down_proj columns (optimizer/refit.py) from the calibration pass's statistics."""
    damp: float = 0.1                 # ridge toward the masked weights, × the Gram matrix's mean diagonal
    asked: bool = False               # named on the command line: refused where it does not apply
                                      # (semi-structured, MoE), where the default refit is quietly skipped


@dataclass
class HealSettings:
    """Distillation of the pruned model from the dense one after surgery (optimizer/heal.py)."""
    tokens: int = 36_864              # training tokens; 0: no healing (the default fits the job in 15 minutes
                                      # on 2 CPU cores: README, "Healing")
    time_s: float | None = None       # a cap on the training's wall time
    data: list[str] | None = None     # text / JSONL files; None: the calibration text
    lr: float | None = None           # peak learning rate; None: the optimizer's (heal.OPTIMIZER_LR: AdamW
                                      # 3e-4, bench/results/heal-select/), a cosine to a thirtieth of it
    memory: str = "fast"              # fast: AdamW, activations kept | lean: Adafactor, activations
                                      # recomputed per block (docs/heal.md, "Memory")
    seq_len: int = 512                # tokens a sequence (the whole window where it does not divide);
                                      # 128 healed more in the selection probe, not in the product
                                      # (bench/results/heal/2026-12-06-bd26f05-seq128)
    batch: int = 1                    # sequences a step: more, smaller steps heal more per token
                                      # (bench/results/heal-select/2026-12-03-probe)
    chat: int | None = None           # chat answers the dense model writes to mix in; None: 40 where the
                                      # model has a chat template (an Instruct model), else none
    device: str = "auto"              # where the heal trains: auto (CUDA where torch sees it, else the
                                      # CPU) | cpu | cuda | cuda:N; the package is written from the CPU


def check_heal_device(h: HealSettings) -> None:
    """--heal-device names a device torch sees here (checked before anything loads)."""
    import re
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", h.device):
        raise UserError(f"unknown --heal-device '{h.device}'; choose from: auto, cpu, cuda, cuda:N")
    processes = distributed.launched()
    if processes > 1 and not h.tokens:
        raise UserError(f"{processes} processes share the heal's steps, and healing is off: run one process "
                        "(without torchrun), or heal")
    if processes > 1 and ":" in h.device:
        raise UserError(f"--heal-device {h.device} names one GPU for all {processes} processes; use cuda (or auto): "
                        "each process trains on its own, LOCAL_RANK's")
    if processes > 1 and h.device in ("auto", "cuda"):
        import torch
        seen, rank = torch.cuda.device_count(), distributed.local_rank()
        if (h.device == "cuda" or seen) and rank >= seen:
            raise UserError(f"process LOCAL_RANK {rank} has no GPU of its own: torch sees {seen} here; start at most "
                            f"{seen} processes a node (--nproc-per-node), or heal on the CPU (--heal-device cpu)")
    if h.tokens and h.device.startswith("cuda"):
        import torch
        seen = torch.cuda.device_count()  # 0 without CUDA
        if int(h.device.partition(":")[2] or 0) >= seen:
            raise UserError(f"--heal-device {h.device}: torch sees {seen} CUDA device(s) here; "
                            "use --heal-device cpu (or auto)")


def heal_seq_len(h: HealSettings, window: int) -> int:
    """Tokens a heal sequence: --heal-data is cut at h.seq_len; the calibration windows (`window`
    tokens) are split into h.seq_len pieces where that divides them, else used whole."""
    return h.seq_len if h.data or window % h.seq_len == 0 else window


@dataclass
class OptimizeConfig:
    model: str | None = None          # HF dir, hub id, GGUF file; None = the embedded default
    target: str = "auto"              # a profile name, or auto (detect)
    method: str = "auto"              # auto | structured | activation | ddp | depth | semi-structured | a pruner
    retain: float = 0.7               # structured: fraction of the blocks' parameters (or latency) kept
    sparsity: str = "2:4"             # semi-structured: N:M, or an unstructured fraction
    budget: str = "params"            # what --retain counts: params | latency (on the target)
    layout: str = "uniform"           # uniform (plain config) | per-layer (DDP: DeciLM or plugin package)
    format: str = "vllm"              # vllm | onnx
    onnx_dtype: str = "float32"       # float32 | float16 (ONNX packages)
    onnx_int8: str = "dynamic"        # dynamic (MatMulInteger) | qdq (static scales): ONNX packages with --quant int8
    out: str | None = None            # package directory; None: out/MODEL-TARGET-METHOD-LEVEL
    engine_version: str | None = None # vLLM version the package is for; None: installed, else the default
    data: DataConfig = field(default_factory=DataConfig)
    calib_dtype: str = "auto"         # one-shot calibration and training passes: auto | float32 | bfloat16
    seed: int = 0
    threads: int | None = None        # torch CPU threads; None: torch's choice
    resume: bool = False              # continue a trained method from its checkpoint
    refit: RefitSettings | None = field(default_factory=RefitSettings)  # None: no refit; structured only
    ddp: DDPSettings = field(default_factory=DDPSettings)
    roi: RoISettings = field(default_factory=RoISettings)
    si: SISettings = field(default_factory=SISettings)
    heal: HealSettings = field(default_factory=HealSettings)
    quant: str = "auto"               # auto (the target's choice; 16-bit where a package kind is not quantized
                                      # yet) | none | int8 | fp8 | w4a16 (optimizer/quantize.py)
    zeroshot: int = 0                 # documents per zero-shot task (ARC-Easy, PIQA, HellaSwag) scored
                                      # dense / before / after healing; 0: none
    keep_checkpoints: bool = False    # keep the training checkpoints once the package is written (else removed)


def validate(cfg: OptimizeConfig) -> None:
    """Every check that bad input can fail, before anything expensive runs: a UserError (one line)."""
    if cfg.format not in FORMATS:
        raise UserError(f"unknown --format '{cfg.format}'; choose from: {', '.join(FORMATS)}")
    if not 0 < cfg.retain <= 1:
        raise UserError(f"--retain must be in (0, 1], got {cfg.retain}")
    if cfg.budget not in BUDGETS:
        raise UserError(f"--budget must be 'params' or 'latency', got '{cfg.budget}'")
    if cfg.layout not in LAYOUTS:
        raise UserError(f"unknown --layout '{cfg.layout}'; choose from: {', '.join(LAYOUTS)}")
    if cfg.layout == "per-layer" and cfg.method != "ddp":
        raise UserError("--layout per-layer needs --method ddp (the one-shot activation method is uniform-only)")
    if cfg.layout == "per-layer" and cfg.format != "vllm":
        raise UserError(f"--layout per-layer writes vLLM packages only, not --format {cfg.format}")
    d = cfg.ddp
    if min(d.steps, 1 if d.batch is None else d.batch, d.seq_len) < 1:
        raise UserError("--steps, the DDP batch and its sequence length must be >= 1")
    if not (d.lr > 0 and (d.lr_end is None or d.lr_end >= 0) and d.beta > 0):
        raise UserError("the DDP learning rate and β must be > 0, the learning rate's end >= 0")
    if cfg.refit is not None and cfg.refit.damp <= 0:
        raise UserError(f"the refit's ridge (damp) must be > 0, got {cfg.refit.damp}")
    dc = cfg.data
    if dc.seq_len < 16 or dc.calib_windows < 1 or (dc.eval_windows is not None and dc.eval_windows < 1):
        raise UserError("--seq-len must be >= 16 and window counts >= 1")
    if cfg.si.steps < 0 or cfg.roi.steps < 0:
        raise UserError("--si-steps and --roi-steps must be >= 0")
    if planner.is_sparse(cfg.method) or cfg.method == "semi-structured":
        if cfg.refit is not None and cfg.refit.asked:
            raise UserError("--refit applies to structured methods (removed heads and channels), not semi-structured ones")
        if cfg.roi.prior not in ("sparsegpt", "wanda"):
            raise UserError(f"--roi-prior must be 'sparsegpt' or 'wanda', got '{cfg.roi.prior}'")
        if cfg.roi.seq_len < 16:
            raise UserError(f"--roi-seq-len must be >= 16, got {cfg.roi.seq_len}")
        if cfg.method == "roi" and not sparsity_mod.parse(cfg.sparsity).is_nm:  # parse raises on a malformed pattern
            raise UserError(f"--method roi learns N:M masks; --sparsity {cfg.sparsity} is unstructured")
        if cfg.layout != "uniform":
            raise UserError("--layout applies to structured methods; semi-structured pruning keeps every shape")
    if cfg.quant not in QUANT:
        raise UserError(f"unknown --quant '{cfg.quant}'; choose from: {', '.join(QUANT)}")
    if cfg.onnx_int8 not in ONNX_INT8:
        raise UserError(f"unknown --onnx-int8 '{cfg.onnx_int8}'; choose from: {', '.join(ONNX_INT8)}")
    if cfg.onnx_int8 != "dynamic" and (cfg.format != "onnx" or cfg.quant not in ("int8", "auto")):
        raise UserError(f"--onnx-int8 {cfg.onnx_int8} applies to ONNX packages quantized to INT8: "
                        f"add --format onnx --quant int8")
    if cfg.quant not in ("none", "auto"):  # auto falls back to 16-bit for these (plan.choose_quant)
        if cfg.format == "onnx" and cfg.quant != "int8":
            raise UserError(f"ONNX packages are quantized by onnxruntime to INT8 only: use --quant int8 or none, "
                            f"not {cfg.quant}")
        if cfg.format == "onnx" and cfg.onnx_dtype != "float32":
            raise UserError("an INT8 ONNX package is quantized from the float32 graph: drop --onnx-dtype float16")
        if planner.is_sparse(cfg.method) or cfg.method == "semi-structured":
            raise UserError("--quant applies to structured packages; semi-structured ones are not quantized yet")
    h = cfg.heal
    if h.memory not in HEAL_MEMORY:
        raise UserError(f"unknown --heal-memory '{h.memory}'; choose from: {', '.join(HEAL_MEMORY)}")
    check_heal_device(h)
    for bad, what in ((h.tokens < 0, f"--heal-tokens must be >= 0, got {h.tokens}"),
                      (h.chat is not None and h.chat < 0, f"--heal-chat must be >= 0, got {h.chat}"),
                      (h.time_s is not None and h.time_s <= 0, f"--heal-time must be > 0 seconds, got {h.time_s:g}"
                       if h.time_s is not None else ""),
                      (h.lr is not None and h.lr <= 0, f"--heal-lr must be > 0, got {h.lr:g}" if h.lr is not None else ""),
                      (h.seq_len < 16, f"the heal sequence length must be >= 16 tokens, got {h.seq_len}"),
                      (h.batch < 1, f"--heal-batch must be >= 1, got {h.batch}")):
        if bad:
            raise UserError(what)
    seq, batch = heal_seq_len(h, dc.seq_len), distributed.heal_batch(h.batch)
    if 0 < h.tokens < batch * seq:
        raise UserError(f"--heal-tokens {h.tokens} is less than one step of {batch} × {seq} tokens")
    if cfg.zeroshot < 0:
        raise UserError(f"--zeroshot must be >= 0 documents per task, got {cfg.zeroshot}")
    for path, what in ((dc.calib, "calibration file"), (dc.eval, "evaluation file"),
                       *((p, "heal data file") for p in h.data or ())):
        if path is not None:
            data.read_text_file(path, what)  # raises on missing / empty / binary
    if h.data:
        from optimizer.heal_data import heal_records
        for path in h.data:
            heal_records(path)  # JSON records parsed now: a malformed file fails before the model loads
