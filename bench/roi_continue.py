"""Does RoI gain from more steps at the end of its schedule? (issue 5 probe)

RoI anneals τ down and the logit scale λ up over `--roi-steps`; in the 240-step run most of the
KD loss fell in the last quarter, where sampling is nearly deterministic. This resumes a finished
run's checkpoint (φ, Adam, noise generator, data order) and trains `--steps` more steps at the
final τ and λ, measuring the perplexity of the hard mask before and every `--eval-every` steps.

    .venv/bin/python bench/roi_continue.py CHECKPOINT --steps 100 --eval-every 50 --threads 2 \
        --json bench/results/sparse-roi-long/roi-continue-2of4.json

CHECKPOINT: the `roi.checkpoint` path in a RoI package's manifest (or a bench/sparse.py JSON). The
calibration and evaluation windows are bench/sparse.py's (32 and 16 × 2048 tokens). Writes
--json (a new file), by default roi-continue-<pattern>.json in a new run folder
bench/results/roi-continue/<date>-<commit>/.

The loop is the product's training step (`RoI.step` on `optimizer.job.batch_indices`' seeded
order, one chunk a step, as `Trainer.train` runs it) without `Trainer.train` itself: that needs a whole
optimize job, steps to an absolute count and checkpoints every 2 minutes, where this measures the
hard mask every --eval-every steps and saves only with --save.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

import benchlib
from optimizer import evaluate, load
from optimizer.adapters import get_adapter
from optimizer.methods.roi import RoI, RoIConfig
from optimizer.training import batch_indices
from optimizer.sparsity import parse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--data", default=str(benchlib.DATA))
    ap.add_argument("--calib-windows", type=int, default=32)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=512, choices=[256, 512, 1024, 2048],
                    help="tokens per step: the run's roi.seq_len setting (the checkpoint does not record it)")
    ap.add_argument("--json", help="write the result here, a new file (default: roi-continue-<pattern>.json in a "
                                   "new run folder bench/results/roi-continue/<date>-<commit>)")
    ap.add_argument("--save", help="checkpoint the continued run here (it can be continued again)")
    args = ap.parse_args()
    run = benchlib.run_info()  # the commit as the run starts
    if not Path(args.checkpoint).is_file():
        raise SystemExit(f"error: {args.checkpoint}: no such checkpoint (a RoI run's `roi.checkpoint`)")
    if args.steps < 1 or args.eval_every < 1:
        raise SystemExit("error: --steps and --eval-every must be at least 1")
    torch.set_num_threads(args.threads)
    state = torch.load(args.checkpoint, weights_only=False, mmap=True)
    cfg, sparsity = RoIConfig(**state["config"]), parse(state["sparsity"])
    del state
    if args.json:
        benchlib.new_file(args.json)  # now, not after the run
    model, tok = load.load_model(load.resolve(None))
    chunks = benchlib.wikitext_windows(tok, "valid", args.calib_windows, data_dir=args.data).reshape(-1, args.seq_len)
    test = benchlib.wikitext_windows(tok, "test", args.eval_windows, data_dir=args.data)
    roi = RoI(model, get_adapter(model.config), sparsity, cfg)
    if not roi.load(args.checkpoint):
        raise SystemExit(f"{args.checkpoint}: could not resume")
    if roi.step_count < cfg.steps:
        raise SystemExit(f"{args.checkpoint}: the run stopped at step {roi.step_count} of {cfg.steps}; finish it first")

    def ppl(desc):
        roi.mode = "hard"
        with torch.no_grad():
            return evaluate.perplexity(model, test, desc)

    trace = [{"extra_steps": 0, "ppl": ppl("hard mask, end of schedule")}]
    print(trace[-1], flush=True)
    t0, losses = time.time(), []
    for k in tqdm(range(1, args.steps + 1), desc=f"RoI {sparsity}: steps at τ={roi.tau():.2f}, λ={roi.scale():.1f}"):
        losses.append(roi.step(chunks[batch_indices(len(chunks), 1, roi.step_count, cfg.seed)])["loss"])
        if k % args.eval_every == 0 or k == args.steps:
            trace.append({"extra_steps": k, "ppl": ppl(f"hard mask, +{k} steps"),
                          "kd_last10": sum(losses[-10:]) / len(losses[-10:]), "train_s": round(time.time() - t0, 1)})
            print(trace[-1], flush=True)
    if args.save:
        roi.save(args.save)
    result = {"checkpoint": args.checkpoint, "saved": args.save, "steps_done": roi.step_count,
              "pattern": str(sparsity), "schedule_steps": cfg.steps, "tau": roi.tau(), "scale": roi.scale(),
              "calib_windows": args.calib_windows, "eval_windows": args.eval_windows, "threads": args.threads,
              "trace": trace, **run}
    json_path = args.json or benchlib.run_dir("roi-continue") / f"roi-continue-{str(sparsity).replace(':', 'of')}.json"
    benchlib.show_and_write_result(json_path, result)


if __name__ == "__main__":
    main()
