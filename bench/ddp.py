"""DDP against the one-shot structured baseline at the same retention (issue 3 figures).

    .venv/bin/python bench/ddp.py                                   # 0.8 / 0.7 / 0.5, params budget
    .venv/bin/python bench/ddp.py --retain 0.7 --steps 120          # one level, shorter training
    .venv/bin/python bench/ddp.py --retain 0.7 --budget latency     # hardware-aware budget

Same data protocol as bench/spine.py: calibration (and DDP training text) from WikiText-2
validation, perplexity on the whole WikiText-2 raw test split in 2048-token windows. For each
retention: the baseline (--method activation) and DDP packages, their perplexities, DDP's
training tokens, wall time and peak memory. Writes bench/results/ddp/ddp.json and ddp.md;
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

from optimizer.pipeline import OptimizeConfig, optimize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--retain", type=float, nargs="+", default=[0.8, 0.7, 0.5])
    ap.add_argument("--budget", default="params", choices=["params", "latency"])
    ap.add_argument("--target", default="a100")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prior-spread", type=float, default=0.0, help="DDP gates start ordered by one-shot importance")
    ap.add_argument("--eval-windows", default="all")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ddp"))
    args = ap.parse_args()

    data = Path(args.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    results_path = out / f"ddp-{args.budget}.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"levels": {}}
    results["protocol"] = {"target": args.target, "budget": args.budget, "steps": args.steps,
                           "prior_spread": args.prior_spread,
                           "calib": str(data / "wikitext2-valid.txt"), "eval": str(data / "wikitext2-raw-test.txt"),
                           "eval_windows": args.eval_windows, "torch_threads": args.threads,
                           "command": " ".join(sys.argv)}
    methods = ["ddp"] if args.skip_baseline else ["activation", "ddp"]
    for retain in args.retain:
        level = results["levels"].setdefault(f"{retain:.2f}", {})
        for method in methods:
            pkg = ROOT / "out" / "ddp" / f"smollm2-{args.target}-{method}-{args.budget}-r{retain:.2f}"
            shutil.rmtree(pkg, ignore_errors=True)
            t0 = time.time()
            m = optimize(OptimizeConfig(
                target=args.target, method=method, retain=retain, budget=args.budget,
                calib=str(data / "wikitext2-valid.txt"), eval=str(data / "wikitext2-raw-test.txt"),
                out=str(pkg), calib_windows=16, ddp_steps=args.steps, seq_len=2048, threads=args.threads,
                ddp_prior_spread=args.prior_spread,
                eval_windows=None if args.eval_windows == "all" else int(args.eval_windows)))["manifest"]
            q = m["quality"]["perplexity"]
            level[method] = {"package": str(pkg), "wall_s": round(time.time() - t0, 1),
                             "shape": m["method"]["shape"], "retain_achieved": m["method"]["retain_achieved"],
                             "retain_budget_achieved": m["method"]["retain_budget_achieved"],
                             "ppl_dense": q["dense"], "ppl": q["pruned"], "excess_ppl": q["pruned"] - q["dense"],
                             "ideal_ratio": m["size"]["ideal_ratio"], "training": m["method"].get("ddp")}
            results_path.write_text(json.dumps(results, indent=2) + "\n")
    md = _markdown(results)
    (out / f"ddp-{args.budget}.md").write_text(md)
    print(md)


def _markdown(results: dict) -> str:
    p = results["protocol"]
    lines = [f"# DDP vs one-shot structured baseline ({p['budget']} budget, target {p['target']})", "",
             f"Perplexity on {Path(p['eval']).name} ({p['eval_windows']} windows of 2048); DDP trained "
             f"{p['steps']} steps on {Path(p['calib']).name}; torch threads {p['torch_threads']}.", "",
             "| retain | method | shape (heads/KV/MLP) | achieved | PPL | excess PPL | DDP excess / baseline | "
             "train tokens | train wall | peak RSS |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for retain, level in sorted(results["levels"].items(), reverse=True):
        base = level.get("activation")
        for method, r in level.items():
            s, t = r["shape"], r.get("training") or {}
            ratio = (f"{r['excess_ppl'] / base['excess_ppl']:.2f}" if method == "ddp" and base else "—")
            tokens = t.get("steps", 0) * t.get("batch", 0) * t.get("seq_len", 0)
            lines.append(f"| {retain} | {method} | {s['num_heads']}/{s['num_kv_heads']}/{s['intermediate_size']} | "
                         f"{r['retain_achieved']:.3f} | {r['ppl']:.2f} | {r['excess_ppl']:.2f} | {ratio} | "
                         f"{tokens or '—'} | {t.get('wall_s', '—')} s | {t.get('peak_rss_gib', '—')} GiB |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
