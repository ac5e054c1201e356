"""Where DDP's uniform export loses against its per-layer one (issue 3).

    .venv/bin/python bench/ddp_uniform_gap.py bench/results/ddp/ddp-params-r0.80.json --eval-windows 16

Takes the per-layer run recorded in a `bench/ddp.py` result file (its gates checkpoint; rerun
that command first on a fresh machine, training is deterministic), builds the per-layer masks the
package was cut from (`DDP.budget_masks`), and caps the MLP width of some layers at the uniform
layout's width, keeping each capped layer's best channels by gate value:

    per-layer       the package as exported (must reproduce its perplexity)
    first-capped    only layer 0 capped
    rest-capped     every layer but layer 0 capped
    all-capped      every layer capped (the uniform export's MLP; heads stay per layer)
    uniform-size    the per-layer export cut to the uniform row's achieved retention instead of
                    the budget (a uniform shape rarely meets the budget exactly, a per-layer one
                    does: this compares the two at the same size)

Perplexity of the masked model (equal to the physically pruned one: tests/test_ddp.py), same
WikiText-2 test windows as bench/ddp.py. Writes uniform-gap-r{retain}.json and .md into --out
(default: a new run folder bench/results/ddp-uniform-gap/<date>-<commit>/; the JSON names the
result file it analysed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import benchlib
from optimizer import evaluate, load
from optimizer.adapters import get_adapter
from optimizer.methods.ddp import DDP, DDPConfig, UnitCosts
from optimizer.masks import BlockMask, Masks
from optimizer.surgery import masked


def capped(masks: Masks, z_channels: torch.Tensor, width: int, layers) -> Masks:
    """`masks` with the MLP of `layers` cut to its `width` best channels by gate logit."""
    blocks = []
    for layer, b in enumerate(masks.blocks):
        if layer in layers and len(b.channels) > width:
            z = z_channels[layer]
            keep = sorted(sorted(b.channels, key=lambda i: -float(z[i]))[:width])
            scale = dict(zip(b.channels, b.channel_scale))
            b = BlockMask(b.heads, b.kv_heads, keep, b.head_scale, [scale[i] for i in keep])
        blocks.append(b)
    return Masks(blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a bench/ddp.py level file, e.g. bench/results/ddp/ddp-params-r0.80.json")
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--data", default=str(benchlib.DATA))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="run folder (default: a new bench/results/ddp-uniform-gap/<date>-<commit>)")
    args = ap.parse_args()
    provenance = benchlib.run_info()  # the command, and the commit as the run starts
    torch.set_num_threads(args.threads)

    result = Path(args.result)
    level = json.loads(result.read_text())
    runs = level["runs"]
    run = runs.get("ddp-per-layer", {})
    training = run.get("training")
    if training is None or not Path(training["checkpoint"]).is_file():
        sys.exit(f"error: the per-layer run's gates are not on this machine ({training and training['checkpoint']}); "
                 f"rerun its command first: {run.get('command', 'bench/ddp.py --layouts per-layer ...')}")
    if level["protocol"]["budget"] != "params":
        sys.exit("error: only params-budget runs (ddp-params-r*.json): the per-layer masks are rebuilt with parameter costs")
    uniform = next((runs[k] for k in ("ddp-uniform", "activation") if k in runs), None)
    if uniform is None:
        sys.exit(f"error: {result} has no uniform row (ddp-uniform or activation) to take the uniform width from")
    width = int(uniform["shape"]["intermediate_size"])
    out_dir = benchlib.run_dir("ddp-uniform-gap", args.out)
    stem = out_dir / f"uniform-gap-r{training['retain']:.2f}"
    benchlib.new_file(f"{stem}.json")

    model, tok = load.load_model(load.resolve(None))
    adapter = get_adapter(model.config)
    state = torch.load(training["checkpoint"], weights_only=False)
    ddp = DDP(model, adapter, DDPConfig(**state["config"]), UnitCosts.params(adapter, model.config))
    ddp.gates.load_state_dict(state["gates"])
    ddp.remove_hooks()
    per_layer = ddp.budget_masks()
    z = ddp.gates.channel.detach()
    n = len(per_layer.blocks)
    variants = {"per-layer": per_layer,
                "first-capped": capped(per_layer, z, width, {0}),
                "rest-capped": capped(per_layer, z, width, set(range(1, n))),
                "all-capped": capped(per_layer, z, width, set(range(n)))}
    ddp.cfg.retain = uniform["retain_achieved"]
    variants["uniform-size"] = ddp.budget_masks()
    windows = benchlib.wikitext_windows(tok, "test", args.eval_windows, data_dir=args.data)
    rows = {}
    dense = n * adapter.block_params(model.config, adapter.dense_shape(model.config))
    for name, masks in variants.items():
        with torch.inference_mode(), masked(model, adapter, masks):
            ppl = evaluate.perplexity(model, windows, name)
        rows[name] = {"ppl": ppl, "retain": sum(adapter.block_params(model.config, b.shape()) for b in masks.blocks) / dense,
                      "channels": [len(b.channels) for b in masks.blocks],
                      "heads": [len(b.heads) for b in masks.blocks]}
        print(f"{name}: {ppl:.2f}", flush=True)

    retain = training["retain"]
    out = {"result": str(result), "checkpoint": training["checkpoint"], "retain": retain, "uniform_width": width,
           "package_ppl": run["ppl"], "eval_windows": args.eval_windows, "variants": rows,
           **provenance}
    benchlib.write_result(f"{stem}.json", out)
    benchlib.write_markdown(f"{stem}.md", markdown(out))
    print(markdown(out))


def markdown(out: dict) -> str:
    lines = [f"# Per-layer DDP gates at retention {out['retain']}, MLP capped at the uniform width {out['uniform_width']}", "",
             f"PPL on {out['eval_windows']} × 2048 WikiText-2 test tokens; the per-layer package measured "
             f"{out['package_ppl']:.2f}. `{out['command']}`", ""]
    rows = []
    for variant, r in out["variants"].items():
        rest = r["channels"][1:]
        retain = f"{r['retain']:.3f}" if "retain" in r else "—"
        rows.append([variant, retain, r["channels"][0], f"{sum(rest) / len(rest):.1f}", f"{r['ppl']:.2f}"])
    lines.append(benchlib.markdown_table(
        ["variant", "retention", "layer 0 channels", "other layers' channels (mean)", "PPL"], rows, align="lrrrr"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
