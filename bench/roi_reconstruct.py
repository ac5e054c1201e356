"""Does SparseGPT's weight update help under RoI's learned mask? (issue 5 probe)

RoI learns which weights to keep with the weights frozen; SparseGPT chooses and also updates the
kept weights. This imposes a finished RoI run's mask (its checkpoint's φ, top-N per group) and
lets SparseGPT's block-by-block sweep reconstruct the kept weights around it, then compares the
perplexity with the mask on the original weights (what `--method roi` ships).

    .venv/bin/python bench/roi_reconstruct.py CHECKPOINT [--pattern 2:4] [--calib-windows 16]

CHECKPOINT: the `roi.checkpoint` path in a RoI package's manifest (or bench/results/sparse/sparse.json).
Measured (2026-11-30, RoI 2:4 from bench/sparse.py, 16 windows): 51.46 → 51.52, no gain.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from optimizer import data, evaluate, load  # noqa: E402
from optimizer.adapters import get_adapter  # noqa: E402
from optimizer.methods.sparsegpt import SparseGPT  # noqa: E402
from optimizer.sequential import prune_blockwise  # noqa: E402
from optimizer.sparsity import parse  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--pattern", default="2:4")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sparsity = parse(args.pattern)
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
    text = lambda name: data.read_text_file(Path(args.data) / name).text  # noqa: E731
    calib = data.token_windows(tok, text("wikitext2-valid.txt"), 2048, args.calib_windows)
    test = data.token_windows(tok, text("wikitext2-raw-test.txt"), 2048, args.eval_windows)

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
              "reconstruct_s": round(time.time() - t0, 1)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
