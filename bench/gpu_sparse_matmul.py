"""Time 2:4 semi-structured matmuls against dense on a GPU (for sessions lent one; not a test).

    python bench/gpu_sparse_matmul.py       # writes bench/results/gpu-sparse-matmul/<date>-<commit>/gpu-matmul.json

For each weight shape [out, in] (SmolLM2-135M's q/o, k/v, gate/up, down and LLaMA-7B-like
4096×4096, 11008×4096, 4096×11008) and token counts 1, 16, 512 and 4096 (decode and prefill),
compares `torch.sparse.to_sparse_semi_structured(W)` in `F.linear` with the dense bf16 matmul:
median of CUDA-event timings after warm-up. A ratio > 1 means the sparse kernel is faster.
PyTorch picks CUTLASS or cuSPARSELt; both are recorded. Public reports range from 0.4× to
1.3×, which is why the planner never assumes a speedup it has not measured.
"""

from __future__ import annotations

import argparse
import platform

import torch
import torch.nn.functional as F

import benchlib  # bench/, this script's directory (standard library only)

SHAPES = {"smollm2 q/o 576x576": (576, 576), "smollm2 k/v 192x576": (192, 576),
          "smollm2 gate/up 1536x576": (1536, 576), "smollm2 down 576x1536": (576, 1536),
          "7b q/o 4096x4096": (4096, 4096), "7b gate/up 11008x4096": (11008, 4096),
          "7b down 4096x11008": (4096, 11008)}
TOKENS = (1, 16, 512, 4096)


def two_four(w: torch.Tensor) -> torch.Tensor:
    g = w.reshape(w.shape[0], -1, 4)
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(2, g.abs().topk(2, dim=2).indices, True)
    return (g * keep).reshape_as(w)


def timed(fn, iters: int = 50) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="result file, a new one (default: gpu-matmul.json in a new run folder "
                                  "bench/results/gpu-sparse-matmul/<date>-<commit>)")
    args = ap.parse_args()
    run = benchlib.run_info()
    if args.out:
        benchlib.new_file(args.out)  # now, not after the run
    from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured
    dev = torch.device("cuda")
    rows = []
    for backend in ("cutlass", "cusparselt"):
        SparseSemiStructuredTensor._FORCE_CUTLASS = backend == "cutlass"
        for name, (out_f, in_f) in SHAPES.items():
            w = two_four(torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16))
            try:
                ws = to_sparse_semi_structured(w)
            except Exception as e:  # a backend missing from this build, or a shape it refuses
                rows.append({"backend": backend, "shape": name, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            for t in TOKENS:
                x = torch.randn(t, in_f, device=dev, dtype=torch.bfloat16)
                try:
                    dense_ms = timed(lambda: F.linear(x, w))
                    sparse_ms = timed(lambda: F.linear(x, ws))
                    err = (F.linear(x, ws) - F.linear(x, w)).abs().max().item()
                    rows.append({"backend": backend, "shape": name, "tokens": t, "dense_ms": dense_ms,
                                 "sparse_ms": sparse_ms, "speedup": dense_ms / sparse_ms, "max_abs_diff": err})
                except Exception as e:
                    rows.append({"backend": backend, "shape": name, "tokens": t, "error": f"{type(e).__name__}: {e}"[:200]})
                print(rows[-1], flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), **run}
    out = args.out or benchlib.run_dir("gpu-sparse-matmul") / "gpu-matmul.json"
    benchlib.write_result(out, {"meta": meta, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
