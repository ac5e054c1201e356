"""Figures for the spine: perplexity and vLLM throughput of the one-shot structured method.

    .venv/bin/python bench/spine.py                       # full protocol (about an hour here)
    .venv/bin/python bench/spine.py --retain 0.7 --rounds 1 --eval-windows 8   # quick look

Protocol: SmolLM2-135M (embedded), target a100, calibration on WikiText-2 validation
(16 x 2048 tokens), perplexity on the whole WikiText-2 raw test split in 2048-token
windows; then `bench PACKAGE --baseline embedded` at concurrency 1 and 16, dense and pruned
servers alternating for --rounds rounds, best-of-N reported. Writes
bench/results/spine.json and spine.md (per-package bench.json/md/png beside them).

The per-step engine overhead at concurrency 1 is estimated from the two measured decode
step times and the two weight sizes: t = overhead + bytes / bandwidth, two equations, two
unknowns.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from optimizer.pipeline import DataConfig, OptimizeConfig, optimize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--retain", type=float, nargs="+", default=[0.7, 0.5])
    ap.add_argument("--target", default="a100")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--eval-windows", default="all")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for calibration and perplexity")
    ap.add_argument("--skip-serve", action="store_true", help="perplexity only")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "spine"))
    args = ap.parse_args()

    data = Path(args.data)
    calib, test = data / "wikitext2-valid.txt", data / "wikitext2-raw-test.txt"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    results = {"protocol": {"model": "SmolLM2-135M-Instruct (embedded)", "target": args.target,
                            "calib": str(calib), "eval": str(test), "seq_len": 2048, "calib_windows": 16,
                            "eval_windows": args.eval_windows, "torch_threads": args.threads,
                            "rounds": args.rounds, "concurrency": args.concurrency,
                            "command": " ".join(sys.argv)},
               "levels": []}
    # All packages first, then all serving runs: the vLLM figures are taken back to back.
    for retain in args.retain:
        pkg = ROOT / "out" / "spine" / f"smollm2-{args.target}-r{retain:.2f}"  # weights stay out of git
        shutil.rmtree(pkg, ignore_errors=True)
        t0 = time.time()
        res = optimize(OptimizeConfig(target=args.target, method="activation", retain=retain, out=str(pkg),
                                      data=DataConfig(calib=str(calib), eval=str(test), calib_windows=16, seq_len=2048,
                                                      eval_windows=None if args.eval_windows == "all"
                                                      else int(args.eval_windows)),
                                      threads=args.threads))
        m = res["manifest"]
        results["levels"].append({
            "retain": retain, "package": str(pkg), "optimize_wall_s": round(time.time() - t0, 1),
            "retain_achieved": m["method"]["retain_achieved"], "shape": m["method"]["shape"],
            "perplexity": m["quality"]["perplexity"], "ideal_ratio": m["size"]["ideal_ratio"],
            "bf16_bytes": {"dense": m["size"]["bf16_bytes_dense"], "pruned": m["size"]["bf16_bytes_pruned"]}})
        (out / "spine.json").write_text(json.dumps(results, indent=2) + "\n")
    for level in results["levels"] if not args.skip_serve else []:
        bench_dir = out / f"bench-r{level['retain']:.2f}"
        subprocess.run([str(ROOT / ".venv" / "bin" / "bench"), level["package"], "--baseline", "embedded",
                        "--concurrency", args.concurrency, "--rounds", str(args.rounds), "--out", str(bench_dir)],
                       check=True)
        summary = json.loads((bench_dir / "bench.json").read_text())["summary"]
        level["serving"] = _serving_figures(summary, level)
        (out / "spine.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "spine.md").write_text(_markdown(results))
    print(_markdown(results))


def _serving_figures(summary: dict, level: dict) -> dict:
    best, ratios = summary["best"], summary["ratios"]
    fig = {}
    for c in summary["concurrencies"]:
        r = ratios["pruned"][c]
        fig[c] = {"dense_tok_s": best["dense"][c]["output_tokens_per_s"],
                  "pruned_tok_s": best["pruned"][c]["output_tokens_per_s"],
                  "ratio": r["tokens_per_s"], "fraction_of_ideal": r.get("fraction_of_ideal"),
                  "tpot_p50_ms": {"dense": best["dense"][c]["tpot_ms"]["p50"],
                                  "pruned": best["pruned"][c]["tpot_ms"]["p50"]}}
    if "1" in fig:
        t_d, t_p = fig["1"]["tpot_p50_ms"]["dense"], fig["1"]["tpot_p50_ms"]["pruned"]
        b_d, b_p = level["bf16_bytes"]["dense"], level["bf16_bytes"]["pruned"]
        if t_d and t_p and t_d > t_p:
            ms_per_byte = (t_d - t_p) / (b_d - b_p)
            overhead = t_d - b_d * ms_per_byte
            fig["decode_step_model"] = {"overhead_ms": overhead, "weights_ms_dense": b_d * ms_per_byte,
                                        "overhead_share_dense": overhead / t_d,
                                        "effective_GBps": 1e-6 / ms_per_byte}
    return fig


def _markdown(results: dict) -> str:
    p = results["protocol"]
    lines = [f"# Spine figures: {p['model']}, target {p['target']}", "",
             f"Calibration {Path(p['calib']).name} (16 x 2048 tokens); perplexity on {Path(p['eval']).name} "
             f"({p['eval_windows']} windows of 2048); vLLM best of {p['rounds']} alternating rounds; "
             f"torch threads {p['torch_threads']}.", "",
             "| retain (achieved) | shape (heads/KV/MLP) | PPL dense | PPL pruned | ideal | "
             "tok/s ratio c=1 | tok/s ratio c=16 | of ideal c=16 | optimize wall |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in results["levels"]:
        s, q = lv["shape"], lv["perplexity"]
        sv = lv.get("serving", {})
        c1, c16 = sv.get("1", {}), sv.get("16", {})
        f = lambda x, fmt="{:.2f}": fmt.format(x) if x is not None else "—"  # noqa: E731
        lines.append(f"| {lv['retain']:.2f} ({lv['retain_achieved']:.3f}) | {s['num_heads']}/{s['num_kv_heads']}/"
                     f"{s['intermediate_size']} | {q['dense']:.2f} | {q['pruned']:.2f} | {lv['ideal_ratio']:.2f}x | "
                     f"{f(c1.get('ratio'))} | {f(c16.get('ratio'))} | {f(c16.get('fraction_of_ideal'), '{:.0%}')} | "
                     f"{lv['optimize_wall_s']:.0f} s |")
    for lv in results["levels"]:
        m = lv.get("serving", {}).get("decode_step_model")
        if m:
            lines.append(f"\nr={lv['retain']:.2f}: decode step at c=1 ≈ {m['overhead_ms']:.1f} ms engine overhead + "
                         f"{m['weights_ms_dense']:.1f} ms weight streaming (dense); overhead is "
                         f"{m['overhead_share_dense']:.0%} of the dense step.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
