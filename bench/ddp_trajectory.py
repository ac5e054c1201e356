"""DDP's export along its training (issue 3): is the last step where the gates are best?

    .venv/bin/python bench/ddp_trajectory.py --retain 0.8 --every 10

Runs the same training as `bench/ddp.py` (one level, one layout, the product's defaults unless
flags say otherwise) and, every `--every` steps, cuts the package's masks from the gates as they
stand (`decide` at the shape training is held to, or `budget_masks` per layer) and measures them:
perplexity on the first `--eval-windows` WikiText-2 test windows, and the loss on the calibration
window the pipeline holds out (the text a run could use to pick its step). Also the training step's
own KD loss. Writes trajectory-{layout}-r{retain}.json and .md under --out (default: a new run
folder bench/results/ddp-probes/trajectory/<date>-<commit>/).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import benchlib
from optimizer import evaluate
from optimizer.methods.ddp import DDP
from optimizer.pipeline import DataConfig, DDPSettings, HealSettings, OptimizeConfig, RefitSettings, optimize
from optimizer.surgery import masked


def main() -> None:
    defaults = OptimizeConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--retain", type=float, required=True)
    ap.add_argument("--layout", default="uniform", choices=["uniform", "per-layer"])
    ap.add_argument("--every", type=int, default=10, help="measure every this many steps")
    ap.add_argument("--eval-windows", type=int, default=4, help="test windows of 2048 per measurement")
    ap.add_argument("--steps", type=int, default=defaults.ddp.steps)
    ap.add_argument("--batch", type=int, default=defaults.ddp.batch)
    ap.add_argument("--lr", type=float, default=defaults.ddp.lr)
    ap.add_argument("--lr-end", type=float, default=defaults.ddp.lr_end)
    ap.add_argument("--seed", type=int, default=defaults.seed)
    ap.add_argument("--calib-windows", type=int, default=8)
    ap.add_argument("--data", default=str(benchlib.DATA))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="run folder (default: a new bench/results/ddp-probes/trajectory/<date>-<commit>)")
    args = ap.parse_args()
    run = benchlib.run_info()  # the commit as the run starts
    torch.set_num_threads(args.threads)
    data_dir = Path(args.data)
    out = benchlib.run_dir("ddp-probes/trajectory", args.out)
    stem = out / f"trajectory-{args.layout}-r{args.retain:.2f}"
    benchlib.new_file(f"{stem}.json")

    points, windows = [], {}
    train_step = DDP.step

    def step(ddp: DDP, input_ids: torch.Tensor) -> dict:
        lr = ddp.lr()  # the rate this step takes
        stats = train_step(ddp, input_ids)
        if ddp.step_count % args.every == 0 or ddp.step_count == ddp.cfg.steps or ddp.step_count == 1:
            points.append({"step": ddp.step_count, "kd": stats["kd"], "lr": lr, **measure(ddp, windows)})
            print(f"step {points[-1]['step']}: " + ", ".join(f"{k} {v:.4g}" for k, v in points[-1].items() if k != "step"),
                  flush=True)
        return stats

    DDP.step = step
    from transformers import AutoTokenizer  # noqa: E402
    from optimizer import load  # noqa: E402
    tok = AutoTokenizer.from_pretrained(load.resolve(None).hf_dir)
    windows["test"] = benchlib.wikitext_windows(tok, "test", args.eval_windows, data_dir=data_dir)
    windows["held_out"] = benchlib.wikitext_windows(tok, "valid", None, data_dir=data_dir)[-1:]
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        m = optimize(OptimizeConfig(
            target="a100", method="ddp", retain=args.retain, layout=args.layout, out=str(Path(tmp) / "pkg"),
            data=DataConfig(calib=str(benchlib.data_file("valid", data_dir)), eval=str(benchlib.data_file("test", data_dir)),
                            calib_windows=args.calib_windows, seq_len=2048, eval_windows=16),
            ddp=DDPSettings(steps=args.steps, batch=args.batch, lr=args.lr, lr_end=args.lr_end),
            seed=args.seed, threads=args.threads, heal=HealSettings(tokens=0), quant="none",
            refit=RefitSettings(on=False)))["manifest"]
    result = {"retain": args.retain, "layout": args.layout, "training": m.method["ddp"],
              "package_ppl_16_windows": m.perplexity["pruned"], "eval_windows": args.eval_windows,
              "points": points, "wall_s": round(time.time() - started, 1), **run}
    benchlib.write_result(f"{stem}.json", result)
    benchlib.write_markdown(f"{stem}.md", markdown(result))
    print(markdown(result))


def measure(ddp: DDP, windows: dict) -> dict:
    """The package's masks cut from the gates as they stand, on the test and held-out windows."""
    shape = ddp.layer_shape
    masks = ddp.decide(shape) if shape is not None else ddp.budget_masks()
    ddp.gates.enabled = False
    try:
        with torch.inference_mode(), masked(ddp.model, ddp.adapter, masks):
            ppl = evaluate.perplexity(ddp.model, windows["test"], "test")
            held = evaluate.perplexity(ddp.model, windows["held_out"], "held out")
    finally:
        ddp.gates.enabled = True
    return {"test_ppl": ppl, "held_out_ppl": held}


def markdown(r: dict) -> str:
    t = r["training"]
    lines = [f"# DDP's {r['layout']} export along training, retention {r['retain']}", "",
             f"{t['steps']} steps × {t['batch']} × {t['seq_len']} tokens, lr {t['lr']} → {t['lr_end']}, seed {t['seed']}. "
             f"Test PPL on {r['eval_windows']} × 2048 WikiText-2 test tokens; held-out PPL on the calibration window the "
             f"pipeline holds out; the package at the last step measured {r['package_ppl_16_windows']:.2f} on 16 test "
             f"windows. `{r['command']}`", "",
             benchlib.markdown_table(["step", "lr", "KD (training step)", "held-out PPL", "test PPL"],
                                     [[p["step"], f"{p['lr']:.4f}", f"{p['kd']:.3f}", f"{p['held_out_ppl']:.2f}",
                                       f"{p['test_ppl']:.2f}"] for p in r["points"]], align="rrrrr")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
