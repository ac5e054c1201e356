"""Does SparseGPT's weight update help under RoI's learned mask? (issue 5 probe)

RoI learns which weights to keep with the weights frozen; SparseGPT chooses and also updates the
kept weights. This imposes a finished RoI run's mask (its checkpoint's φ, top-N per group) and
lets SparseGPT's block-by-block sweep reconstruct the kept weights around it, then compares the
perplexity with the mask on the original weights (what `--method roi` ships).

    .venv/bin/python bench/roi_reconstruct.py CHECKPOINT [--pattern 2:4] [--calib-windows 16]

CHECKPOINT: the `roi.checkpoint` path in a RoI package's manifest (or bench/results/sparse/sparse.json).
Measured (2026-11-30, RoI 2:4 from bench/sparse.py, 16 windows): 51.46 → 51.52, no gain.
Writes --json (a new file), by default roi-reconstruct-<pattern>.json in a new run folder
bench/results/roi-reconstruct/<date>-<commit>/.
"""

from __future__ import annotations

import argparse
import time

import torch

import benchlib
from optimizer import evaluate, load
from optimizer.adapters import get_adapter
from optimizer.methods.sparsegpt import SparseGPT
from optimizer.sequential import prune_blockwise
from optimizer.sparsity import parse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--pattern", default="2:4")
    ap.add_argument("--data", default=str(benchlib.DATA))
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the result here, a new file (default: roi-reconstruct-<pattern>.json in a "
                                   "new run folder bench/results/roi-reconstruct/<date>-<commit>)")
    args = ap.parse_args()
    run = benchlib.run_info()  # the commit as the run starts
    torch.set_num_threads(args.threads)
    sparsity = parse(args.pattern)
    if args.json:
        benchlib.new_file(args.json)  # now, not after the run
    model, tok = load.load_model(load.resolve(None))
    adapter = get_adapter(model.config)
    state = torch.load(args.checkpoint, weights_only=False, mmap=True)
    if state["sparsity"] != str(sparsity):
        raise SystemExit(f"{args.checkpoint} holds a {state['sparsity']} run, not {sparsity}")
    blocks = [adapter.linears(b) for b in adapter.blocks(model)]
    masks = {id(lin): sparsity.mask(phi[name].float()) for lins, phi in zip(blocks, state["phi"])
             for name, lin in lins.items()}
    del state
    linears = [lin for lins in blocks for lin in lins.values()]
    calib = benchlib.wikitext_windows(tok, "valid", args.calib_windows, data_dir=args.data)
    test = benchlib.wikitext_windows(tok, "test", args.eval_windows, data_dir=args.data)

    original = [lin.weight.detach().clone() for lin in linears]
    with torch.no_grad():
        for lin in linears:
            lin.weight.mul_(masks[id(lin)])
    masked = evaluate.perplexity(model, test, "RoI mask, original weights")
    with torch.no_grad():
        for lin, w in zip(linears, original):
            lin.weight.copy_(w)
    del original

    class Imposed(SparseGPT):
        def prune(self, sparsity):
            return super().prune(sparsity, keep_mask=masks[id(self.layer)])

    t0 = time.time()
    prune_blockwise(model, adapter, calib, Imposed, sparsity, desc="reconstructing under the RoI mask")
    result = {"checkpoint": args.checkpoint, "pattern": str(sparsity), "calib_windows": args.calib_windows,
              "eval_windows": args.eval_windows, "ppl_roi_mask": masked,
              "ppl_roi_mask_reconstructed": evaluate.perplexity(model, test, "reconstructed"),
              "reconstruct_s": round(time.time() - t0, 1), **run}
    json_path = args.json or benchlib.run_dir("roi-reconstruct") / f"roi-reconstruct-{str(sparsity).replace(':', 'of')}.json"
    benchlib.show_and_write_result(json_path, result)


if __name__ == "__main__":
    main()
