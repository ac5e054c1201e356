"""Time the quantized matmuls a target's packages would run against bf16, on a GPU (for sessions
lent one; not a test, and prepared without one: not run yet).

    python bench/gpu_quant_matmul.py        # writes bench/results/gpu-quant-matmul/<date>-<commit>/gpu-quant.json + .md

Issue 26's question for the planner: what does each precision really buy on this GPU, at decode
(1, 16 tokens) and prefill (512, 4096 tokens), for the dense and the pruned (retain 0.7) widths?
For each weight shape [out, in] (SmolLM2-135M dense and at the 0.7 package's widths, LLaMA-7B-like
4096 / 11008) it times, with CUDA events (median after warm-up), `F.linear` in bf16 against:
  fp8    E4M3 weights per output row, activations quantized per token on the fly, `torch._scaled_mm`
         with row-wise scales (Hopper / Ada / Blackwell), the quantization of the activations included
  int8   int8 weights per row, activations per token, `torch._int_mm` (int32 accumulate) and the
         rescale, activation quantization included (M padded to 32: the kernel wants M > 16)
  w4a16  4-bit weights in groups of 128, bf16 activations, `aten._weight_int4pack_mm` (tinygemm)
A kernel this torch or GPU lacks is recorded with its error, not fatal. Each result also carries
the kernel's relative error against the bf16 matmul of the dequantized weights, so a fast wrong
kernel is visible. The engine's own kernels (vLLM's CUTLASS FP8 / Marlin) differ; this measures
what the hardware gives through PyTorch.
"""

from __future__ import annotations

import argparse
import platform

import torch
import torch.nn.functional as F

import benchlib  # bench/, this script's directory (standard library only)

SHAPES = {"smollm2 q/o 576x576": (576, 576), "smollm2 gate/up 1536x576": (1536, 576),
          "smollm2 down 576x1536": (576, 1536), "smollm2 r0.7 gate/up 1024x576": (1024, 576),
          "smollm2 r0.7 down 576x1024": (576, 1024),
          "7b q/o 4096x4096": (4096, 4096), "7b gate/up 11008x4096": (11008, 4096),
          "7b down 4096x11008": (4096, 11008), "7b r0.7 gate/up 7680x4096": (7680, 4096)}
TOKENS = (1, 16, 512, 4096)
GROUP = 128


def timed(fn, warmup: int = 10, reps: int = 50) -> float:
    """Median milliseconds of fn() over `reps` CUDA-event timings after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-12)).item()


def per_row(t: torch.Tensor, qmax: float):
    """Symmetric absmax scale per row of t: (scale [rows, 1] float32)."""
    return (t.abs().amax(dim=1, keepdim=True).float() / qmax).clamp(min=1e-12)


def fp8_linear(w: torch.Tensor):
    fmax = torch.finfo(torch.float8_e4m3fn).max
    sw = per_row(w, fmax)
    wq = (w.float() / sw).to(torch.float8_e4m3fn)
    deq = (wq.float() * sw).to(torch.bfloat16)

    def run(x):
        sx = per_row(x, fmax)
        xq = (x.float() / sx).to(torch.float8_e4m3fn)
        return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16)
    return run, deq


def int8_linear(w: torch.Tensor):
    sw = per_row(w, 127)
    wq = (w.float() / sw).round().clamp(-127, 127).to(torch.int8)
    deq = (wq.float() * sw).to(torch.bfloat16)

    def run(x):
        m = x.shape[0]
        if m <= 16:  # _int_mm wants more than 16 rows
            x = F.pad(x, (0, 0, 0, 32 - m))
        sx = per_row(x, 127)
        xq = (x.float() / sx).round().clamp(-127, 127).to(torch.int8)
        acc = torch._int_mm(xq, wq.t())  # [K, N], column-major: the layout cuBLASLt's int8 GEMM takes
        return (acc.float() * sx * sw.t()).to(torch.bfloat16)[:m]
    return run, deq


def w4a16_linear(w: torch.Tensor):
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    q = ((g - lo) / scale).round().clamp(0, 15)
    deq = (q * scale + lo).view(n, k).to(torch.bfloat16)
    # tinygemm dequantizes (q - 8) · scale + zero, so its "zero" is the value of code 8 (checked on
    # the CPU twin of the op, _weight_int4pack_mm_for_cpu); the CUDA op takes two codes a byte
    zero = lo + 8 * scale
    q_pairs = q.view(n, k).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack((q_pairs[:, ::2] << 4 | q_pairs[:, 1::2]).contiguous(), 8)
    scales_zeros = torch.stack([scale.squeeze(2), zero.squeeze(2)], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)

    def run(x):
        return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, scales_zeros)
    return run, deq


KERNELS = {"fp8": fp8_linear, "int8": int8_linear, "w4a16": w4a16_linear}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--out", help="run folder (default: a new bench/results/gpu-quant-matmul/<date>-<commit>)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_quant_matmul.py needs a CUDA GPU (run it on a lent device)")
    out = benchlib.run_dir("gpu-quant-matmul", args.out)
    path = benchlib.new_file(out / "gpu-quant.json")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    results = {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
               "cuda": torch.version.cuda, "host": platform.node(), **benchlib.run_info(), "rows": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        built = {}
        for kern in args.kernels:
            try:
                built[kern] = KERNELS[kern](w)
            except Exception as e:  # noqa: BLE001 — a kernel this build lacks is a result
                built[kern] = f"{type(e).__name__}: {e}"[:300]
        for m in TOKENS:
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            row = {"shape": name, "out": n, "in": k, "tokens": m, "bf16_ms": timed(lambda: F.linear(x, w))}
            for kern, b in built.items():
                if isinstance(b, str):
                    row[kern] = {"error": b}
                    continue
                run, deq = b
                try:
                    ms = timed(lambda: run(x))
                    row[kern] = {"ms": ms, "speedup": row["bf16_ms"] / ms, "rel_err": rel_err(run(x), F.linear(x, deq))}
                except Exception as e:  # noqa: BLE001
                    row[kern] = {"error": f"{type(e).__name__}: {e}"[:300]}
            results["rows"].append(row)
            benchlib.write_result(path, results)
    lines = [f"# Quantized matmuls against bf16 on {results['gpu']} (SM {results['capability']}), torch {results['torch']}",
             "", "Speedup of each kernel over bf16 `F.linear` (median of 50 CUDA-event timings); — : kernel unavailable.", ""]
    cells = []
    for r in results["rows"]:
        cells.append([r["shape"], r["tokens"], f"{r['bf16_ms'] * 1e3:.1f} µs",
                      *(f"{r[k]['speedup']:.2f}x (err {r[k]['rel_err']:.1e})" if "ms" in r.get(k, {}) else "—"
                        for k in args.kernels)])
    lines.append(benchlib.markdown_table(["shape", "tokens", "bf16", *args.kernels], cells))
    benchlib.write_markdown(out / "gpu-quant.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
