"""Heal: what distillation after pruning buys, per method and budget (issue 25's evidence).

For every --methods entry at every --retain level (structured) or its pattern (2:4 methods),
and every --heal-tokens budget (0 = the unhealed package), one `optimize` run on the embedded
SmolLM2-135M; then, per package: perplexity on WikiText-2 test (16 × 2048, as the README's
tables) and on exllamav2's c4 sample (neither trained on nor Wikipedia), each with its ratio to
the dense model, and the zero-shot mean of ARC-Easy, PIQA and HellaSwag (`--zeroshot-limit`
seeded documents each, `--zeroshot-seed`). The stages' wall times come from the manifests.

    python bench/heal.py --methods activation --retain 0.7 --heal-tokens 0 36864 98304

Rows measure the product's default job at the commit they ran (refit, heal settings): a rerun at a
later commit measures that commit's default, a new invocation in heal.json's `protocol.invocations`.

Honest selection (issue 25): choose heal settings with --heal-data on text that is not WikiText
and --zeroshot-seed other than the reported one; report the targets once from the default
command. Writes heal.json, heal.md and heal.png into a new run folder (benchlib.run_dir).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import benchlib
from core.manifest import Manifest

TASKS = ["arc_easy", "piqa", "hellaswag"]
STRUCTURED = {"activation", "ddp", "depth"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["activation"],
                    help="activation | ddp | ddp:per-layer | depth | sparsegpt | roi (2:4)")
    ap.add_argument("--retain", type=float, nargs="+", default=[0.7])
    ap.add_argument("--heal-tokens", type=int, nargs="+", default=[0, 36864],
                    help="heal budgets (0: unhealed; default: the product's)")
    ap.add_argument("--heal-data", nargs="*", default=None, help="heal text (default: the product's)")
    ap.add_argument("--heal-chat", type=int, default=None,
                    help="chat answers the dense model writes, mixed in (default: the product's, 40 for an Instruct model)")
    ap.add_argument("--heal-lr", type=float, default=None, help="heal's peak learning rate (default: the product's)")
    ap.add_argument("--heal-seq", type=int, default=None, help="heal's tokens a sequence (default: the product's, 512)")
    ap.add_argument("--heal-memory", default="fast", choices=["fast", "lean"],
                    help="the heal's memory recipe (rows of another recipe are named ...-lean)")
    ap.add_argument("--calib", help="calibration text (default: the built-in corpus)")
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--zeroshot-limit", type=int, default=500, help="documents per task; 0: no zero-shot")
    ap.add_argument("--zeroshot-seed", type=int, default=1234)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="`optimize --seed` values (the heal's sequence order and chat answers; DDP's and RoI's "
                         "training too): each other than 0 is its own row, named ...-sN, for healed rows only: "
                         "how far the same settings scatter")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", default=str(benchlib.DATA))
    ap.add_argument("--out", help="run folder (default: a new bench/results/heal/DATE-COMMIT)")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the finished (or continue the interrupted) DDP / RoI training and heal of the same "
                         "settings from their checkpoints, keyed by content (the seconds then count only what ran)")
    ap.add_argument("--dense-from", help="a heal run folder measured on the same texts, windows and zero-shot documents: "
                                         "its dense row is copied (marked measured_in) instead of measured again")
    ap.add_argument("--table", action="store_true", help="only rewrite --out's heal.md and heal.png from its heal.json")
    args = ap.parse_args()
    if args.table:
        if not args.out:
            raise SystemExit("error: --table needs --out, the run folder")
        result = benchlib.read_result(Path(args.out) / "heal.json")
        if result is None:
            raise SystemExit(f"error: {args.out}: no heal.json to make a table from")
        benchlib.write_markdown(Path(args.out) / "heal.md", markdown(result))
        plot(result, Path(args.out) / "heal.png")
        print(markdown(result))
        return

    import torch

    from optimizer import evaluate, load
    from optimizer.pipeline import DataConfig, DDPSettings, HealSettings, OptimizeConfig, optimize
    torch.set_num_threads(args.threads)
    out = benchlib.run_dir("heal", args.out)
    path = out / "heal.json"
    test_file = benchlib.data_file("test", Path(args.data))
    c4_file = benchlib.c4_file()
    # what every row of the folder shares (a later invocation with --out must match it), and
    # each invocation's own methods, levels, budgets and commit
    protocol = {"heal_data": args.heal_data, "heal_chat": args.heal_chat, "heal_lr": args.heal_lr,
                "heal_seq": args.heal_seq,
                "calib": args.calib, "calib_windows": args.calib_windows,
                "eval": str(test_file), "eval_windows": args.eval_windows, "c4": str(c4_file),
                "zeroshot": {"tasks": TASKS, "limit": args.zeroshot_limit, "seed": args.zeroshot_seed},
                "threads": args.threads}
    invocation = {"methods": args.methods, "retain": args.retain, "heal_tokens": args.heal_tokens,
                  "heal_memory": args.heal_memory, "seeds": args.seeds, "resume": args.resume, **benchlib.run_info()}
    # keyed by command and commit: the same command rerun at another commit is another invocation
    key = f"{invocation['command']} @ {(invocation.get('commit') or 'unknown')[:7]}"
    benchlib.update_result(path, {"protocol": {**protocol, "invocations": {key: invocation}},
                                  "runs": {}})

    source = load.resolve(None)
    dense, tok = load.load_model(source)
    c4 = benchlib.c4_windows(tok, args.eval_windows)
    test = benchlib.wikitext_windows(tok, "test", args.eval_windows, data_dir=Path(args.data))
    if "dense" not in benchlib.read_result(path, {}) and args.dense_from:
        benchlib.update_result(path, {"dense": _dense_from(Path(args.dense_from), protocol)})
    if "dense" not in benchlib.read_result(path, {}):
        row = {"wikitext2": evaluate.perplexity(dense, test, "dense: WikiText-2"),
               "c4": evaluate.perplexity(dense, c4, "dense: c4")}
        if args.zeroshot_limit:
            row["zeroshot"] = _zeroshot(dense, tok, args)
        benchlib.update_result(path, {"dense": row})
    del dense

    for spec in args.methods:
        method, _, layout = spec.partition(":")
        levels = args.retain if method in STRUCTURED else [None]
        for retain in levels:
            # unhealed rows at the first seed only (a one-shot one is the same at every seed)
            for tokens, seed in ((t, s) for t in args.heal_tokens for s in (args.seeds if t else args.seeds[:1])):
                name = f"{spec}-r{retain:.2f}-h{tokens}" if retain else f"{spec}-2of4-h{tokens}"
                if args.heal_memory != "fast" and tokens:
                    name += f"-{args.heal_memory}"
                if seed:
                    name += f"-s{seed}"
                if name in benchlib.read_result(path)["runs"]:
                    continue
                pkg = benchlib.ROOT / "out" / "heal" / out.name / name
                shutil.rmtree(pkg, ignore_errors=True)
                t0 = time.time()
                cfg = OptimizeConfig(
                    target="a100" if method in STRUCTURED else "h100", method=method,
                    engine_version=None if method in STRUCTURED else "0.18.0", sparsity="2:4",
                    retain=retain or 0.7, layout=layout or "uniform", out=str(pkg), threads=args.threads,
                    resume=args.resume, seed=seed,
                    data=DataConfig(calib=args.calib, eval=str(test_file), calib_windows=args.calib_windows,
                                    eval_windows=args.eval_windows),
                    ddp=DDPSettings(), quant="none",  # the 16-bit healed package (bench/quant.py quantizes)
                    heal=HealSettings(tokens=tokens, data=args.heal_data, chat=args.heal_chat, memory=args.heal_memory,
                                                      **({"lr": args.heal_lr} if args.heal_lr else {}),
                                                      **({"seq_len": args.heal_seq} if args.heal_seq else {})))
                m = optimize(cfg, log=lambda *a: print(*a, flush=True))["manifest"]
                model, _ = load.load_model(load.resolve(str(pkg)))
                row = {"method": spec, "retain": retain, "heal_tokens": tokens, "heal_memory": args.heal_memory,
                       "seed": seed, "package": str(pkg),
                       "wikitext2": m.perplexity["pruned"],
                       "c4": evaluate.perplexity(model, c4, f"{name}: c4"),
                       "optimize_wall_s": round(time.time() - t0, 1),
                       "method_wall_s": _method_wall(m), "heal": _heal_summary(m)}
                if args.zeroshot_limit:
                    row["zeroshot"] = _zeroshot(model, tok, args)
                benchlib.update_result(path, {"runs": {name: row}})
                del model
    result = benchlib.read_result(path)
    benchlib.write_markdown(out / "heal.md", markdown(result))
    plot(result, out / "heal.png")
    print(markdown(result))


def _dense_from(folder: Path, protocol: dict) -> dict:
    """The dense row of another run folder whose texts, windows and zero-shot documents are this one's
    (a run without zero-shot takes the row without its zero-shot scores)."""
    other = benchlib.read_result(folder / "heal.json")
    if other is None or "dense" not in other:
        raise SystemExit(f"error: --dense-from {folder}: no heal.json with a dense row there")
    theirs, dense = other["protocol"], dict(other["dense"])
    no_zeroshot = not protocol["zeroshot"]["limit"]
    for key in ("eval_windows", "zeroshot", "eval", "c4"):
        mine, their = protocol[key], theirs.get(key)
        if key in ("eval", "c4"):
            mine, their = Path(mine).name, Path(their or "").name
        if key == "zeroshot" and no_zeroshot:
            dense.pop("zeroshot", None)
            continue
        if mine != their:
            raise SystemExit(f"error: --dense-from {folder}: its {key} is {their}, this run's {mine}")
    return {**dense, "measured_in": str(folder)}


def _zeroshot(model, tok, args) -> dict:
    from optimizer import zeroshot
    r = zeroshot.evaluate(model, tok, TASKS, args.zeroshot_limit, args.zeroshot_seed)
    return {"mean": r["mean"], "tasks": {t: r["tasks"][t]["score"] for t in TASKS}}


def _method_wall(m: Manifest) -> float | None:
    meth = m.method
    if "ddp" in meth:  # the gates' training alone
        return meth["ddp"]["wall_s"]
    return meth.get("wall_s")  # the method's whole stage (RoI: its prior and training)


def _heal_summary(m: Manifest) -> dict | None:
    h = m.heal
    if not h:
        return None
    return {k: h[k] for k in ("tokens", "steps", "wall_s", "peak_rss_gib", "before", "after", "data")}


def markdown(r: dict) -> str:
    d, p = r["dense"], r["protocol"]
    rows = [["dense", "—", "—", f"{d['wikitext2']:.2f}", "1.00", f"{d['c4']:.2f}", "1.00",
             f"{d['zeroshot']['mean']:.3f}" if "zeroshot" in d else "—", "—", "—", "—"]]
    for name, x in r["runs"].items():
        h = x.get("heal") or {}
        method = x["method"] + (f" ({x['heal_memory']} heal)" if x.get("heal_memory", "fast") != "fast" else "") \
            + (f" (seed {x['seed']})" if x.get("seed") else "")
        rows.append([method, "2:4" if x["retain"] is None else f"{x['retain']:.2f}", f"{x['heal_tokens']:,}",
                     f"{x['wikitext2']:.2f}", f"{x['wikitext2'] / d['wikitext2']:.2f}",
                     f"{x['c4']:.2f}", f"{x['c4'] / d['c4']:.2f}",
                     f"{x['zeroshot']['mean']:.3f}" if "zeroshot" in x else "—",
                     None if x["method_wall_s"] is None else f"{x['method_wall_s']:.0f}",
                     f"{h['wall_s']:.0f}" if h else None, f"{x['optimize_wall_s']:.0f}"])
    header = ["method", "retain", "heal tokens", "WikiText-2 PPL", "× dense", "c4 PPL", "× dense",
              "zero-shot mean", "method s (DDP / RoI training, 2:4 pruning)", "heal s", "optimize s"]
    return (f"# Heal on SmolLM2-135M\n\nPerplexity on {p['eval_windows']} × 2048 tokens of WikiText-2 test and of "
            f"exllamav2's c4 sample; "
            + (f"zero-shot mean of {', '.join(TASKS)} ({p['zeroshot']['limit']} documents each, "
               f"seed {p['zeroshot']['seed']}); " if p["zeroshot"]["limit"] else "no zero-shot; ")
            + f"{p['threads']} threads.\n\n"
            + benchlib.markdown_table(header, rows, align="lllrrrrrrrr") + "\n\nHeal data: "
            + "; ".join(sorted({x["heal"]["data"] for x in r["runs"].values() if x.get("heal")})) + "\n")


def plot(r: dict, path: Path) -> None:
    """The recovery curve: each metric's ratio to dense against heal tokens, one line per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    d = r["dense"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    series = {}
    for x in r["runs"].values():
        key = f"{x['method']} {'2:4' if x['retain'] is None else x['retain']}"
        if x.get("heal_memory", "fast") != "fast":
            key += f" {x['heal_memory']}"
        if x.get("seed"):
            key += f" seed {x['seed']}"
        series.setdefault(key, []).append(x)
    for key, xs in series.items():
        xs = sorted(xs, key=lambda x: x["heal_tokens"])
        t = [x["heal_tokens"] for x in xs]
        axes[0].plot(t, [x["wikitext2"] / d["wikitext2"] for x in xs], "o-", label=key)
        axes[1].plot(t, [x["c4"] / d["c4"] for x in xs], "o-", label=key)
        if all("zeroshot" in x for x in xs) and "zeroshot" in d:
            axes[2].plot(t, [x["zeroshot"]["mean"] for x in xs], "o-", label=key)
    if "zeroshot" in d:
        axes[2].axhline(d["zeroshot"]["mean"], color="k", ls="--", lw=1, label="dense")
    for ax, title in zip(axes, ("WikiText-2 PPL / dense", "c4 PPL / dense", "zero-shot mean")):
        ax.set_title(title)
        ax.set_xlabel("heal tokens")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
