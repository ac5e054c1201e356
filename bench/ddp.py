"""DDP against the one-shot structured baseline at the same retention (issue 3 figures).

    .venv/bin/python bench/ddp.py                                   # 0.8 / 0.7 / 0.5, params budget
    .venv/bin/python bench/ddp.py --retain 0.7 --steps 120          # one level, longer training
    .venv/bin/python bench/ddp.py --retain 0.7 --budget latency     # hardware-aware budget
    .venv/bin/python bench/ddp.py --retain 0.7 --beta 10 --out bench/results/ddp-probes/beta10b  # settings, a folder of their own
    .venv/bin/python bench/ddp.py --refit --resume --out bench/results/ddp-refit/run2  # the same gates, refitted
    .venv/bin/python bench/ddp.py --retain 0.7 --layouts per-layer --quant int8 --resume --out ...  # the same gates, INT8

Each run writes into a new folder bench/results/ddp/<date>-<commit>/ unless --out names one
(packages: out/ddp/, or out/<--out's name>/).
Levels run as separate processes (one per core) given the same --out write separate files
(ddp-{budget}-r{retain}.json), and processes of one level (--layouts) add their rows to its
file; the table gathers every level present. A row already in the file is never replaced: the
run stops before training, or, with --resume, keeps that row as it is and skips it.

Same data protocol as bench/spine.py: calibration (and DDP training text) from WikiText-2
validation, perplexity on WikiText-2 raw test in 2048-token windows (--eval-windows). For each
retention: the baseline (--method activation), DDP exported per layer (its natural result), and
DDP trained for the uniform layout (every layer held to the baseline's shape);
their perplexities, DDP's training tokens, wall time and peak memory. Writes
ddp-{budget}-r*.json and ddp-{budget}.md into the run folder;
serve them with `bench PACKAGE --baseline embedded` for the speed ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

import benchlib
from benchlib import ROOT
from optimizer.pipeline import DataConfig, DDPSettings, HealSettings, OptimizeConfig, RefitSettings, optimize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = OptimizeConfig()  # the product's defaults, so a bench run measures what users get
    ddp_defaults = defaults.ddp
    ap.add_argument("--data", default=str(benchlib.DATA))
    ap.add_argument("--retain", type=float, nargs="+", default=[0.8, 0.7, 0.5])
    ap.add_argument("--budget", default="params", choices=["params", "latency"])
    ap.add_argument("--target", default="a100")
    ap.add_argument("--steps", type=int, default=ddp_defaults.steps, help="DDP gate-training steps")
    ap.add_argument("--batch", type=int, default=ddp_defaults.batch, help="DDP sequences (of --seq-len tokens) per step (default: by layout, DDPSettings.by_layout)")
    ap.add_argument("--seq-len", type=int, default=ddp_defaults.seq_len, help="DDP training sequence length, divides 2048")
    ap.add_argument("--lr", type=float, default=ddp_defaults.lr, help="DDP gate learning rate (Adam)")
    ap.add_argument("--lr-end", type=float, default=ddp_defaults.lr_end, help="the learning rate falls along a cosine to this (default: by layout, DDPSettings.by_layout; --lr for a constant one)")
    ap.add_argument("--beta", type=float, default=ddp_defaults.beta, help="DDP augmented-Lagrangian penalty")
    ap.add_argument("--eval-windows", default="all")
    ap.add_argument("--calib-windows", type=int, default=8, help="windows of 2048 for the one-shot importance, so DDP's start; DDP trains on the whole file but its last window")
    ap.add_argument("--calib-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="calibration and DDP KD passes (auto: bf16 where the CPU has it natively)")
    ap.add_argument("--seed", type=int, default=defaults.seed, help="DDP's batch order")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--resume", action="store_true",
                    help="continue (or reuse, if finished) a training of the same settings from its checkpoint; "
                         "rows already in --out's files are kept as they are")
    ap.add_argument("--refit", action="store_true",
                    help="every row (baseline too) with the least-squares refit of the kept o_proj / down_proj columns")
    ap.add_argument("--layouts", nargs="+", default=["per-layer", "uniform"], choices=["per-layer", "uniform"])
    ap.add_argument("--quant", default="none", choices=["none", "int8", "fp8", "w4a16"],
                    help="every row's precision (default none: the pruning methods alone); the perplexity is the quantized model's")
    ap.add_argument("--out", help="run folder (default: a new bench/results/ddp/<date>-<commit>)")
    args = ap.parse_args()

    calib, test = benchlib.data_file("valid", args.data), benchlib.data_file("test", args.data)
    out = benchlib.run_dir("ddp", args.out)
    packages = ROOT / "out" / ("ddp" if args.out is None else out.name)  # weights stay out of git
    torch.set_num_threads(args.threads)
    run = benchlib.run_info()
    protocol = {"target": args.target, "budget": args.budget, "steps": args.steps, "batch": args.batch,
                "seq_len": args.seq_len, "lr": args.lr, "lr_end": args.lr_end,
                "beta": args.beta, "calib": str(calib), "calib_windows": args.calib_windows,
                "calib_dtype": args.calib_dtype, "refit": args.refit, "quant": args.quant,
                "eval": str(test), "eval_windows": args.eval_windows,
                "torch_threads": args.threads, "seed": args.seed, **run}
    runs = [("activation", "uniform")] if not args.skip_baseline else []
    runs += [("ddp", layout) for layout in args.layouts]
    # Rows already in the run's files: kept with --resume, else refused before any training.
    todo = []
    for retain in args.retain:
        path = out / f"ddp-{args.budget}-r{retain:.2f}.json"
        benchlib.check_update(path, {"protocol": protocol}, keep_existing=[f"protocol.{k}" for k in benchlib.RUN_KEYS])
        done = (benchlib.read_result(path) or {}).get("runs", {})
        for method, layout in runs:
            name = method if method == "activation" else f"ddp-{layout}"
            if name not in done:
                todo.append((retain, path, method, layout, name))
            elif args.resume:
                print(f"{path}: {name} is there already; kept (--resume)")
            else:
                raise SystemExit(f"error: {path} has the row {name} already; results are never replaced: run without "
                                 "--out (a new run folder), or with --resume to keep the rows there and add the rest")
    for retain, path, method, layout, name in todo:
        pkg = packages / f"smollm2-{args.target}-{name}-{args.budget}-r{retain:.2f}"
        shutil.rmtree(pkg, ignore_errors=True)
        t0 = time.time()
        m = optimize(OptimizeConfig(
            target=args.target, method=method, retain=retain, retain_by=args.budget, layout=layout, out=str(pkg),
            data=DataConfig(calib=str(calib), eval=str(test),
                            seq_len=2048, calib_windows=args.calib_windows,
                            eval_windows=None if args.eval_windows == "all" else int(args.eval_windows)),
            ddp=DDPSettings(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, lr_end=args.lr_end,
                            beta=args.beta),
            threads=args.threads, seed=args.seed, calib_dtype=args.calib_dtype,
            refit=RefitSettings(on=None if args.refit else False), resume=args.resume,
            heal=HealSettings(tokens=0), quant=args.quant))["manifest"]  # the pruning methods, unhealed (bench/heal.py heals)
        q = m.perplexity
        row = {"package": str(pkg), "wall_s": round(time.time() - t0, 1),
               "shape": m.method["shape"], "retain_achieved": m.method["retain_achieved"],
               "retain_budget_achieved": m.method["retain_budget_achieved"],
               "ppl_dense": q["dense"], "ppl": q["pruned"], "excess_ppl": q["pruned"] - q["dense"],
               "ideal_ratio": m.size["ideal_ratio"], "training": m.method.get("ddp"),
               "refit": m.method.get("refit"), "quantization": m.quantization, **run}
        # Runs of one level may come from separate processes (--layouts): this adds the row
        # to the file as it is now (another process's rows stay); the protocol is the
        # run's, the command and commit of each row its own.
        benchlib.update_result(path, {"protocol": protocol, "runs": {name: row}},
                               keep_existing=[f"protocol.{k}" for k in benchlib.RUN_KEYS])
    results = {"protocol": protocol, "levels": {}}
    for f in sorted(out.glob(f"ddp-{args.budget}-r*.json")):
        results["levels"][f.stem.rsplit("-r", 1)[1]] = json.loads(f.read_text())["runs"]
    md = _markdown(results)
    benchlib.write_markdown(out / f"ddp-{args.budget}.md", md)
    benchlib.plot_table(md, out / f"ddp-{args.budget}.png", "DDP against the one-shot method")
    print(md)


def _markdown(results: dict) -> str:
    p = results["protocol"]
    refit = " — every row refitted (--refit)" if p.get("refit") else ""
    quant = f" — every row quantized to {p['quant']} (its PPL the quantized model's)" if p.get("quant", "none") != "none" else ""
    lines = [f"# DDP vs one-shot structured baseline ({p['budget']} budget, target {p['target']}){refit}{quant}", "",
             f"Perplexity on {Path(p['eval']).name} ({p['eval_windows']} windows of 2048); DDP trained "
             f"on {Path(p['calib']).name} (β, steps × sequences × tokens per step per row), starting from "
             f"the {p.get('ddp_start', 'baseline')} selection; torch threads {p['torch_threads']}. Each DDP row is its own "
             "training unless its train wall says \"same gates\" (a finished checkpoint re-exported with --resume).", ""]
    rows = []
    for retain, level in sorted(results["levels"].items(), reverse=True):
        base = level.get("activation")
        for method, r in level.items():
            s, t = r["shape"], r.get("training") or {}
            ratio = (f"{r['excess_ppl'] / base['excess_ppl']:.2f}" if method.startswith("ddp") and base else "—")
            tokens = t.get("steps", 0) * t.get("batch", 0) * t.get("seq_len", 0)
            wall = ("same gates" if t and t.get("resumed_from_step") == t.get("steps")
                    else f"{t['wall_s']} s" + (" (re-exported)" if t.get("reexported") else "") if t else "—")
            beta = (f"{t['beta']:g}, {t['steps']} × {t['batch']} × {t['seq_len']}" + (f", {t['dtype']}" if t.get("dtype", "bfloat16") != "bfloat16" else "")
                    if t else "—")
            if r.get("refit") and not r["refit"]["applied"]:
                method += " (refit refused: held-out loss rose)"
            rows.append([retain, method, beta, f"{s['num_heads']:g}/{s['num_kv_heads']:g}/{s['intermediate_size']:g}",
                         f"{r['retain_achieved']:.3f}", f"{r['ppl']:.2f}", f"{r['excess_ppl']:.2f}", ratio,
                         tokens or "—", wall, str(t['peak_rss_gib']) + " GiB" if t else "—"])
    lines.append(benchlib.markdown_table(
        ["retain", "method", "β, steps × batch × seq (KD passes if not bf16)", "shape (heads/KV/MLP)", "achieved", "PPL",
         "excess PPL", "DDP excess / baseline", "train tokens", "train wall", "peak RSS"], rows, align="llrlrrrrrrr"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
