"""Which weight recipe `--quant` uses: round to nearest, SmoothQuant-style migration, GPTQ, on the
dense embedded SmolLM2-135M (issue 26's recipe choice; bench/quant.py measures the packages).

    .venv/bin/python bench/quant_recipe.py                   # int8 and w4a16, 16 test windows
    .venv/bin/python bench/quant_recipe.py --eval-windows 4  # a quicker look
    .venv/bin/python bench/quant_recipe.py --recipes "w4a16 gptq" --calib-windows 16   # more calibration

Each recipe starts from the dense model and uses optimizer.quantize's own functions on the same
calibration windows the stage uses (the first SMOOTH_WINDOWS windows of 2048 tokens of the built-in
corpus, or --calib-windows); perplexity on the first --eval-windows windows of 2048 tokens of WikiText-2 test, and the
wall time of the recipe alone. Writes recipe.json and recipe.md into a new run folder.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import benchlib

RECIPES = {  # name: (precision, smooth, gptq)
    "int8 rtn": ("int8", False, False),
    "int8 smooth": ("int8", True, False),
    "int8 smooth+gptq": ("int8", True, True),
    "w4a16 rtn": ("w4a16", False, False),
    "w4a16 gptq": ("w4a16", False, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--calib-windows", type=int, help="calibration windows (default: the stage's SMOOTH_WINDOWS)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", default=str(benchlib.DATA))
    ap.add_argument("--out", help="run folder (default: a new bench/results/quant-recipe/DATE-COMMIT)")
    args = ap.parse_args()

    import torch

    from optimizer import data, evaluate, load
    from optimizer.adapters import get_adapter
    from optimizer.quantize import SMOOTH_ALPHA, SMOOTH_WINDOWS, apply, gptq, smooth, w4_group
    torch.set_num_threads(args.threads)
    out = benchlib.run_dir("quant-recipe", args.out)
    dense, tok = load.load_model(load.resolve(None))
    adapter = get_adapter(dense.config)
    test = benchlib.wikitext_windows(tok, "test", args.eval_windows, data_dir=Path(args.data))
    n_calib = args.calib_windows or SMOOTH_WINDOWS
    calib = data.token_windows(tok, data.builtin_text("calib").text, 2048)[:n_calib]
    result = {"protocol": {"model": "SmolLM2-135M-Instruct (embedded)", "eval_windows": args.eval_windows,
                           "calib_windows": len(calib), "smooth_alpha": SMOOTH_ALPHA, "threads": args.threads,
                           **benchlib.run_info()},
              "dense": evaluate.perplexity(dense, test, "dense"), "recipes": {}}
    for name in args.recipes:
        precision, smoothed, corrected = RECIPES[name]
        model = copy.deepcopy(dense)
        started = time.time()
        if smoothed:
            smooth(model, adapter, calib)
        apply(model, precision, w4_group(model, adapter) if precision == "w4a16" else None)
        errors = gptq(model, adapter, calib) if corrected else None
        wall = time.time() - started
        ppl = evaluate.perplexity(model, test, name)
        result["recipes"][name] = {"ppl": ppl, "x_dense": ppl / result["dense"], "wall_s": round(wall, 1),
                                   "gptq": errors}
        print(name, result["recipes"][name], flush=True)
        del model
    benchlib.write_result(out / "recipe.json", result)
    rows = [["dense (bf16 weights)", f"{result['dense']:.2f}", "1.000", "—"]]
    rows += [[n, f"{r['ppl']:.2f}", f"{r['x_dense']:.3f}", f"{r['wall_s']:.0f}"] for n, r in result["recipes"].items()]
    table = benchlib.markdown_table(["recipe", "WikiText-2 PPL", "× dense", "recipe s"], rows, align="lrrr")
    benchlib.write_markdown(out / "recipe.md", f"# Weight recipes on the dense SmolLM2-135M\n\nPerplexity on "
                            f"{args.eval_windows} × 2048 tokens of WikiText-2 test; calibration {len(calib)} × 2048 "
                            f"tokens of the built-in corpus; {args.threads} threads.\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
