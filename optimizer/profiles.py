"""Hardware profiles: what each deployment target offers, and which engines can use it.

The facts live in ``profiles/<name>.yaml``, one file per target, not in this module:
datasheet numbers and "which vLLM versions had a 2:4 kernel on this GPU" change with
new hardware and new engine releases, and a data file is easier to review, cite
(``sources:``) and extend than code. This module only loads, validates and queries them,
and maps the GPU that NVML reports to a profile for ``--target auto``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from core.errors import UserError

PROFILES_DIR = Path(__file__).resolve().parents[1] / "profiles"

_KEYS = (
    "name", "display_name", "kind", "architecture", "compute_capability", "memory_gib",
    "memory_bandwidth_gbps", "peak_tflops", "sparse_tensor_cores", "nvml_names",
    "engines", "sources",
)
_PEAK_KEYS = ("bf16_dense", "bf16_sparse24", "fp32")  # int8_dense, fp8_dense: optional (null: none)
_ENGINE_KEYS = ("sparse24_kernel", "note")           # quant_kernels, quant_note: optional
# --quant's precisions: FP8 E4M3 weights and dynamic per-token activations; INT8 per-channel
# weights and dynamic per-token int8 activations; 4-bit grouped weights, 16-bit activations.
QUANT_PRECISIONS = ("fp8", "int8", "w4a16")
QUANT_NAMES = {"fp8": "FP8 W8A8", "int8": "INT8 W8A8", "w4a16": "W4A16", "none": "16-bit weights"}
_ENGINE_NAMES = {"vllm": "vLLM", "onnxruntime": "ONNX Runtime"}


@dataclass(frozen=True)
class EngineSupport:
    sparse24_kernel: tuple[str, ...]  # PEP 440 specifier sets; any one matching is enough
    note: str
    quant_kernels: dict[str, tuple[str, ...]] = field(default_factory=dict)  # precision -> specifier sets
    quant_note: str = ""


@dataclass(frozen=True)
class Profile:
    name: str
    display_name: str
    kind: str  # "gpu" | "cpu"
    architecture: str
    compute_capability: str | None
    memory_gib: float
    memory_bandwidth_gbps: float
    peak_bf16_dense_tflops: float
    peak_bf16_sparse24_tflops: float | None
    peak_fp32_tflops: float
    peak_int8_dense_tops: float | None
    peak_fp8_dense_tflops: float | None
    sparse_tensor_cores: bool
    nvml_names: tuple[str, ...]
    engines: dict[str, EngineSupport]
    # Time a decode step spends on each block outside its matmuls (attention kernels, norms, RoPE,
    # the residual adds, the framework between them), by batch size: a fixed cost per block kept,
    # which width pruning and quantization leave in place and only removing blocks takes away.
    # Measured where a profile says so (bench/vllm_profile.py); empty: not measured, taken as 0.
    block_overhead_ms: dict[int, float] = field(default_factory=dict)

    def block_overhead_s(self, batch: int) -> float:
        """block_overhead_ms at `batch`, linear between the measured batch sizes, held flat outside them."""
        points = sorted(self.block_overhead_ms.items())
        if not points:
            return 0.0
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            if b0 <= batch <= b1:
                return (t0 + (t1 - t0) * (batch - b0) / (b1 - b0)) / 1e3
        return (points[0][1] if batch < points[0][0] else points[-1][1]) / 1e3

    @property
    def short_name(self) -> str:
        return self.name.upper() if self.kind == "gpu" else "CPU"

    def has_sparse24_kernel(self, engine: str, version: str) -> bool:
        """True when `engine` at `version` has a 2:4 sparse kernel for this hardware."""
        support = self.engines.get(engine)
        parsed = _parse_version(version)
        if support is None or parsed is None or not self.sparse_tensor_cores:
            return False
        return any(SpecifierSet(s).contains(parsed, prereleases=True)
                   for s in support.sparse24_kernel)

    def has_quant_kernel(self, engine: str, version: str, precision: str) -> bool:
        """True when `engine` at `version` runs `precision` (QUANT_PRECISIONS) with a kernel of its
        own on this hardware (not a weight-only or emulated fallback)."""
        support = self.engines.get(engine)
        parsed = _parse_version(version)
        if support is None or parsed is None:
            return False
        return any(SpecifierSet(s).contains(parsed, prereleases=True)
                   for s in support.quant_kernels.get(precision, ()))

    def choose_quant(self, engine: str, version: str) -> tuple[str, str]:
        """`--quant auto`: FP8 W8A8 where the engine has an FP8 kernel here, else INT8 W8A8 where it
        has an INT8 one, else none (16-bit weights); W4A16 only on request (it speeds up
        memory-bound decode, not compute). Returns (precision, one sentence saying why)."""
        where = self.short_name + (f" (SM {self.compute_capability})" if self.compute_capability else "")
        label = f"{where} + {_ENGINE_NAMES.get(engine, engine)} {version}"
        support = self.engines.get(engine)
        note = f" ({support.quant_note})" if support and support.quant_note else ""
        for precision, peak in (("fp8", self.peak_fp8_dense_tflops), ("int8", self.peak_int8_dense_tops)):
            if self.has_quant_kernel(engine, version, precision):
                unit = "TFLOP/s" if precision == "fp8" else "TOPS"
                gain = f", {peak:g} {unit} against bf16's {self.peak_bf16_dense_tflops:g} TFLOP/s" if peak else ""
                return precision, f"{label}: {QUANT_NAMES[precision]} kernel{gain}{note}"
        return "none", f"{label}: no FP8 or INT8 W8A8 kernel, 16-bit weights{note}"

    def sparse24_reason(self, engine: str, version: str) -> str:
        """One sentence saying why there is, or is not, a 2:4 kernel."""
        where = self.short_name
        if self.compute_capability:
            where += f" (SM {self.compute_capability})"
        label = f"{where} + {_ENGINE_NAMES.get(engine, engine)} {version}"
        support = self.engines.get(engine)
        if support is None:
            known = ", ".join(sorted(self.engines))
            return f"{label}: no 2:4 kernel (no data for engine '{engine}'; known: {known})"
        if _parse_version(version) is None:
            return f"{label}: no 2:4 kernel assumed ('{version}' is not a valid version)"
        if self.has_sparse24_kernel(engine, version):
            return (f"{label}: 2:4 kernel available (versions "
                    f"{' or '.join(support.sparse24_kernel)}; {support.note})")
        return f"{label}: no 2:4 kernel ({support.note})"


def _parse_version(version: str) -> Version | None:
    """Parse a version, dropping local tags such as '+cpu' or '+cu124'."""
    try:
        return Version(str(version).strip().split("+", 1)[0])
    except InvalidVersion:
        return None


def _load_file(path: Path) -> Profile:
    def need(mapping, keys, where):
        if not isinstance(mapping, dict):
            raise UserError(f"profile file {path}: '{where}' must be a mapping")
        for key in keys:
            if key not in mapping:
                raise UserError(f"profile file {path}: missing key '{where}{key}'")

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise UserError(f"profile file {path} is not valid YAML: {exc}") from None
    need(data, _KEYS, "")
    need(data["peak_tflops"], _PEAK_KEYS, "peak_tflops.")
    if data["name"] != path.stem:
        raise UserError(f"profile file {path}: name '{data['name']}' must equal the file name")
    if data["kind"] not in ("gpu", "cpu"):
        raise UserError(f"profile file {path}: kind must be 'gpu' or 'cpu', not {data['kind']!r}")
    engines = {}
    for engine, entry in (data["engines"] or {}).items():
        need(entry, _ENGINE_KEYS, f"engines.{engine}.")
        for spec in entry["sparse24_kernel"]:
            try:
                SpecifierSet(spec)
            except InvalidSpecifier:
                raise UserError(f"profile file {path}: engines.{engine}.sparse24_kernel "
                                f"has an invalid version specifier {spec!r}") from None
        kernels = entry.get("quant_kernels") or {}
        unknown = set(kernels) - set(QUANT_PRECISIONS)
        if unknown:
            raise UserError(f"profile file {path}: engines.{engine}.quant_kernels has unknown precisions "
                            f"{sorted(unknown)}; known: {', '.join(QUANT_PRECISIONS)}")
        for spec in (s for specs in kernels.values() for s in specs):
            try:
                SpecifierSet(spec)
            except InvalidSpecifier:
                raise UserError(f"profile file {path}: engines.{engine}.quant_kernels "
                                f"has an invalid version specifier {spec!r}") from None
        engines[engine] = EngineSupport(tuple(entry["sparse24_kernel"]), str(entry["note"]),
                                        {k: tuple(v or ()) for k, v in kernels.items()},
                                        str(entry.get("quant_note") or ""))
    overhead = data.get("block_step_overhead_ms")
    overhead = {} if overhead is None else overhead

    def number(x, kind):
        return isinstance(x, kind) and not isinstance(x, bool) and math.isfinite(x)
    if not isinstance(overhead, dict) or not all(number(b, int) and b >= 1 and number(t, (int, float)) and t >= 0
                                                 for b, t in overhead.items()):
        raise UserError(f"profile file {path}: block_step_overhead_ms must map batch sizes (integers >= 1) "
                        f"to milliseconds (finite, >= 0), e.g. {{1: 0.16, 16: 0.37}}")
    peak = data["peak_tflops"]
    cc = data["compute_capability"]
    return Profile(
        name=data["name"],
        display_name=data["display_name"],
        kind=data["kind"],
        architecture=data["architecture"],
        compute_capability=None if cc is None else str(cc),
        memory_gib=float(data["memory_gib"]),
        memory_bandwidth_gbps=float(data["memory_bandwidth_gbps"]),
        peak_bf16_dense_tflops=float(peak["bf16_dense"]),
        peak_bf16_sparse24_tflops=None if peak["bf16_sparse24"] is None
        else float(peak["bf16_sparse24"]),
        peak_fp32_tflops=float(peak["fp32"]),
        peak_int8_dense_tops=None if peak.get("int8_dense") is None else float(peak["int8_dense"]),
        peak_fp8_dense_tflops=None if peak.get("fp8_dense") is None else float(peak["fp8_dense"]),
        sparse_tensor_cores=bool(data["sparse_tensor_cores"]),
        nvml_names=tuple(data["nvml_names"] or ()),
        engines=engines,
        block_overhead_ms={int(b): float(t) for b, t in overhead.items()},
    )


@lru_cache(maxsize=None)
def _all_profiles() -> tuple[Profile, ...]:
    files = sorted(PROFILES_DIR.glob("*.yaml"))
    if not files:
        raise UserError(f"no hardware profiles found in {PROFILES_DIR}")
    return tuple(_load_file(f) for f in files)


def list_profiles() -> list[Profile]:
    return sorted(_all_profiles(), key=lambda p: p.name)


def _known() -> str:
    return ", ".join(p.name for p in list_profiles())


def load_profile(name: str) -> Profile:
    """Profile by name, case-insensitively; also 'rtx-4090', '4090', 'h100-sxm', 'NVIDIA L4'."""
    by_name = {p.name: p for p in list_profiles()}
    words = [w for w in re.split(r"[\s_\-]+", str(name).lower().strip()) if w]
    core = [w for w in words if not re.fullmatch(
        r"nvidia|geforce|tesla|sxm\d?|pcie|nvl|hgx|dgx|\d+gi?b", w)]
    for cand in ("".join(words), "".join(core), "rtx" + "".join(core)):
        if cand in by_name:
            return by_name[cand]
    matched = match_profile(str(name))
    if matched is not None:
        return matched
    raise UserError(f"unknown target '{name}'; known targets: {_known()}")


def match_profile(gpu_name: str) -> Profile | None:
    """Profile whose nvml_names occur in `gpu_name` (case-insensitive, on word
    boundaries so that 'L4' does not match 'L40S'); the longest match wins."""
    best, best_len = None, 0
    for profile in list_profiles():
        for sub in profile.nvml_names:
            pattern = r"(?<![a-z0-9])" + re.escape(sub.lower()) + r"(?![a-z0-9])"
            if re.search(pattern, gpu_name.lower()) and len(sub) > best_len:
                best, best_len = profile, len(sub)
    return best


class NoDriverError(UserError):
    """NVML could not be loaded or initialised; `detail` says why."""

    def __init__(self, detail: str):
        super().__init__(f"no NVIDIA driver found (NVML could not be initialised): {detail}")
        self.detail = detail


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def detect_gpus() -> list[dict]:
    """The GPUs NVML sees: index, name, memory_gib, compute_capability, driver/CUDA versions."""
    try:
        import pynvml
    except ImportError:
        raise NoDriverError("the nvidia-ml-py package (pynvml) is not installed") from None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        raise NoDriverError(str(exc) or type(exc).__name__) from None
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        try:
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()
            cuda = f"{cuda // 1000}.{cuda % 1000 // 10}"
        except pynvml.NVMLError:  # an old driver without the call: the CUDA version stays unknown
            cuda = None
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append({
                "index": i,
                "name": _text(pynvml.nvmlDeviceGetName(handle)),
                "memory_gib": round(pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30, 1),
                "compute_capability": f"{major}.{minor}",
                "driver_version": driver,
                "cuda_driver_version": cuda,
            })
        return gpus
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:  # shutting down what failed to start: nothing to report
            pass


def auto_profile() -> tuple[Profile, str]:
    """The profile for `--target auto`, with a sentence explaining the choice."""
    try:
        gpus = detect_gpus()
    except NoDriverError as exc:
        return (load_profile("cpu"),
                f"No NVIDIA driver found (NVML could not be initialised: {exc.detail}); "
                "using the 'cpu' profile.")
    if not gpus:
        return load_profile("cpu"), "NVML reports no GPUs; using the 'cpu' profile."
    gpu = gpus[0]
    profile = match_profile(gpu["name"])
    if profile is None:
        raise UserError(f"GPU '{gpu['name']}' (SM {gpu['compute_capability']}) matches no "
                        f"hardware profile; pass --target with one of: {_known()}")
    explanation = (f"Detected {gpu['name']} (SM {gpu['compute_capability']}, "
                   f"{gpu['memory_gib']:g} GiB); using the '{profile.name}' profile.")
    if len(gpus) > 1:
        others = {g["name"] for g in gpus[1:]} - {gpu["name"]}
        explanation += f" {len(gpus)} GPUs found; profiled GPU 0"
        explanation += f" (others differ: {', '.join(sorted(others))})." if others else "."
    return profile, explanation


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def format_profiles_table(profiles, engine_version: str | None = None) -> str:
    """Plain-text table for the `profiles` command; `--quant auto` as chosen for vLLM at
    `engine_version` (default: the planner's)."""
    if engine_version is None:
        from optimizer.plan import DEFAULT_VLLM
        engine_version = DEFAULT_VLLM
    header = ("name", "GPU", "SM", "memory", "bandwidth", "bf16 dense", "bf16 2:4", "int8", "fp8",
              "2:4 in vLLM", f"--quant auto (vLLM {engine_version})")
    rows = []
    for p in profiles:
        vllm = p.engines.get("vllm")
        kernel = " or ".join(vllm.sparse24_kernel) if vllm and vllm.sparse24_kernel else "no"
        rows.append((
            p.name, p.display_name, p.compute_capability or "-", f"{p.memory_gib:g} GiB",
            f"{p.memory_bandwidth_gbps:g} GB/s", _num(p.peak_bf16_dense_tflops),
            _num(p.peak_bf16_sparse24_tflops), _num(p.peak_int8_dense_tops), _num(p.peak_fp8_dense_tflops),
            kernel, p.choose_quant("vllm", engine_version)[0],
        ))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("(peak TFLOP/s from datasheets; bandwidth in GB/s; 'cpu' describes this "
                 "machine class, not a datasheet)")
    return "\n".join(lines)


def format_detection() -> str:
    """What NVML sees, for the `detect` command."""
    try:
        gpus = detect_gpus()
    except NoDriverError as exc:
        return (f"No NVIDIA driver found: NVML could not be initialised ({exc.detail}).\n"
                "--target auto will use the 'cpu' profile.")
    if not gpus:
        return "NVML is available but reports no GPUs.\n--target auto will use the 'cpu' profile."
    lines = []
    for g in gpus:
        profile = match_profile(g["name"])
        lines.append(f"GPU {g['index']}: {g['name']}, {g['memory_gib']:g} GiB, "
                     f"SM {g['compute_capability']} -> profile "
                     f"{profile.name if profile else '(none)'}")
    first = gpus[0]
    lines.append(f"Driver {first['driver_version']}"
                 + (f", CUDA {first['cuda_driver_version']}" if first["cuda_driver_version"] else ""))
    profile = match_profile(first["name"])
    if profile is None:
        lines.append(f"--target auto will fail: no profile for '{first['name']}'; "
                     f"pass --target with one of: {_known()}")
    else:
        lines.append(f"--target auto will use the '{profile.name}' profile.")
    return "\n".join(lines)
