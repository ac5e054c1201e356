"""DDP against the one-shot structured baseline at the same retention (issue 3 figures).

    .venv/bin/python bench/ddp.py                                   # 0.8 / 0.7 / 0.5, params budget
    .venv/bin/python bench/ddp.py --retain 0.7 --steps 120          # one level, longer training
    .venv/bin/python bench/ddp.py --retain 0.7 --budget latency     # hardware-aware budget
    .venv/bin/python bench/ddp.py --retain 0.7 --beta 10 --out bench/results/ddp-probes/beta10   # settings
    .venv/bin/python bench/ddp.py --refit --resume --out bench/results/ddp-refit  # the same gates, refitted

Levels run as separate processes (one per core) write separate files
(ddp-{budget}-r{retain}.json); the table gathers every level present.

Same data protocol as bench/spine.py: calibration (and DDP training text) from WikiText-2
validation, perplexity on WikiText-2 raw test in 2048-token windows (--eval-windows). For each
retention: the baseline (--method activation), DDP exported per layer (its natural result), and
DDP trained for the uniform layout (every layer held to the baseline's shape);
their perplexities, DDP's training tokens, wall time and peak memory. Writes
bench/results/ddp/ddp-{budget}-r*.json and ddp-{budget}.md;
serve them with `bench PACKAGE --baseline embedded` for the speed ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from optimizer.pipeline import DataConfig, DDPSettings, OptimizeConfig, RefitSettings, optimize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = OptimizeConfig()  # the product's defaults, so a bench run measures what users get
    ddp_defaults = defaults.ddp
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
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
                    help="continue (or reuse, if finished) a training of the same settings from its checkpoint")
    ap.add_argument("--refit", action="store_true",
                    help="every row (baseline too) with the least-squares refit of the kept o_proj / down_proj columns")
    ap.add_argument("--layouts", nargs="+", default=["per-layer", "uniform"], choices=["per-layer", "uniform"])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ddp"))
    args = ap.parse_args()

    data = Path(args.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    protocol = {"target": args.target, "budget": args.budget, "steps": args.steps, "batch": args.batch,
                "seq_len": args.seq_len, "lr": args.lr, "lr_end": args.lr_end,
                "beta": args.beta, "calib": str(data / "wikitext2-valid.txt"), "calib_windows": args.calib_windows,
                "calib_dtype": args.calib_dtype, "refit": args.refit,
                "eval": str(data / "wikitext2-raw-test.txt"), "eval_windows": args.eval_windows,
                "torch_threads": args.threads, "seed": args.seed, "command": " ".join(sys.argv)}
    runs = [("activation", "uniform")] if not args.skip_baseline else []
    runs += [("ddp", layout) for layout in args.layouts]
    for retain in args.retain:
        path = out / f"ddp-{args.budget}-r{retain:.2f}.json"
        for method, layout in runs:
            name = method if method == "activation" else f"ddp-{layout}"
            pkg = ROOT / "out" / out.name / f"smollm2-{args.target}-{name}-{args.budget}-r{retain:.2f}"
            shutil.rmtree(pkg, ignore_errors=True)
            t0 = time.time()
            m = optimize(OptimizeConfig(
                target=args.target, method=method, retain=retain, budget=args.budget, layout=layout, out=str(pkg),
                data=DataConfig(calib=str(data / "wikitext2-valid.txt"), eval=str(data / "wikitext2-raw-test.txt"),
                                seq_len=2048, calib_windows=args.calib_windows,
                                eval_windows=None if args.eval_windows == "all" else int(args.eval_windows)),
                ddp=DDPSettings(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, lr_end=args.lr_end,
                                beta=args.beta),
                threads=args.threads, seed=args.seed, calib_dtype=args.calib_dtype,
                refit=RefitSettings() if args.refit else None, resume=args.resume))["manifest"]
            q = m["quality"]["perplexity"]
            # Runs of one level may come from separate processes (--layouts): read the file
            # again just before writing this run's row into it, so none is lost; newest wins.
            level = json.loads(path.read_text()) if path.is_file() else {"runs": {}}
            level["protocol"] = protocol
            training = m["method"].get("ddp")
            old = level["runs"].get(name, {}).get("training") or {}
            if (training and training["resumed_from_step"] == training["steps"] and old.get("resumed_from_step") == 0
                    and old.get("checkpoint") == training["checkpoint"]):
                # Re-exported (--resume) from the gates an earlier run of this row trained: the
                # training's own wall time and memory are that run's.
                training = {**training, "wall_s": old["wall_s"], "peak_rss_gib": old["peak_rss_gib"],
                            "resumed_from_step": 0, "reexported": True}
            level["runs"][name] = {"package": str(pkg), "wall_s": round(time.time() - t0, 1),
                                   "shape": m["method"]["shape"], "retain_achieved": m["method"]["retain_achieved"],
                                   "retain_budget_achieved": m["method"]["retain_budget_achieved"],
                                   "ppl_dense": q["dense"], "ppl": q["pruned"], "excess_ppl": q["pruned"] - q["dense"],
                                   "ideal_ratio": m["size"]["ideal_ratio"], "training": training,
                                   "refit": m["method"].get("refit"),
                                   "command": protocol["command"]}
            path.write_text(json.dumps(level, indent=2) + "\n")
    results = {"protocol": protocol, "levels": {}}
    for f in sorted(out.glob(f"ddp-{args.budget}-r*.json")):
        results["levels"][f.stem.rsplit("-r", 1)[1]] = json.loads(f.read_text())["runs"]
    md = _markdown(results)
    (out / f"ddp-{args.budget}.md").write_text(md)
    print(md)


def _markdown(results: dict) -> str:
    p = results["protocol"]
    refit = " — every row refitted (--refit)" if p.get("refit") else ""
    lines = [f"# DDP vs one-shot structured baseline ({p['budget']} budget, target {p['target']}){refit}", "",
             f"Perplexity on {Path(p['eval']).name} ({p['eval_windows']} windows of 2048); DDP trained "
             f"on {Path(p['calib']).name} (β, steps × sequences × tokens per step per row), starting from "
             f"the {p.get('ddp_start', 'baseline')} selection; torch threads {p['torch_threads']}. Each DDP row is its own "
             "training unless its train wall says \"same gates\" (a finished checkpoint re-exported with --resume).", "",
             "| retain | method | β, steps × batch × seq (KD passes if not bf16) | shape (heads/KV/MLP) | achieved | PPL | excess PPL | DDP excess / baseline | "
             "train tokens | train wall | peak RSS |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
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
            lines.append(f"| {retain} | {method} | {beta} | {s['num_heads']:g}/{s['num_kv_heads']:g}/{s['intermediate_size']:g} | "
                         f"{r['retain_achieved']:.3f} | {r['ppl']:.2f} | {r['excess_ppl']:.2f} | {ratio} | "
                         f"{tokens or '—'} | {wall} | {str(t['peak_rss_gib']) + ' GiB' if t else '—'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
