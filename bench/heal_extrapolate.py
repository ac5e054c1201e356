"""How many heal tokens would issue 25's 0.7 targets need, if the recovery curve went on as measured?

Reads finished `bench/heal.py` runs (nothing is trained or evaluated here) and puts each series of the
default 0.7 job at several heal budgets on one axis, log2(heal tokens):

- for WikiText-2 and c4, the perplexity ratio to dense bought by each doubling between measured budgets,
  and a least-squares line through the healed points: if every doubling kept buying what the line says,
  the tokens at which the line reaches 1.4× and 1.2× dense (the older heal text's run to ten times the
  default dropped half as much a doubling as the default text's to four times: the line is likely the
  optimistic reading);
- for the zero-shot mean, the line's slope a doubling with two standard errors (the points' scatter
  about the line; each point's own sampling error carried through the fit, as if the points were
  independent, though they score the same documents), the tokens at which it reaches 0.46 and 0.50, and
  each point's standard error (500 documents a task, three tasks).

    python bench/heal_extrapolate.py            # the series below, into a new bench/results/heal/DATE-COMMIT-extrapolation

Writes extrapolation.json and extrapolation.md into the run folder.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import benchlib

HEAL = benchlib.RESULTS / "heal"
# series: (name, [(run folder, run key)...]) — one student, one heal text, seed 0, heal tokens rising
SERIES = [
    ("the default heal text since 5e5f2ce (Wikipedia, exllamav2 samples, chat answers)", [
        ("2026-12-06-9586a99-curve", "activation-r0.70-h0"),
        ("2026-12-06-9586a99-curve", "activation-r0.70-h36864"),
        ("2026-12-06-9586a99-curve", "activation-r0.70-h73728"),
        ("2026-12-06-9586a99-curve", "activation-r0.70-h147456"),
    ]),
    ("the heal text before 5e5f2ce (Wikipedia and chat answers)", [
        ("2026-12-03-0a7061b", "activation-r0.70-h0"),
        ("2026-12-03-0a7061b", "activation-r0.70-h36864"),
        ("2026-12-04-846dfb1", "activation-r0.70-h368640"),
    ]),
]
DEFAULT_TOKENS = 36_864  # optimizer/config.py's default budget: the job in 15 minutes on the Xeon without native bf16
TARGETS = (1.4, 1.2)     # WikiText-2 × dense: the default budget's target, the 1-hour budget's
ZEROSHOT_TARGETS = (0.46, 0.50)  # the zero-shot mean: the same two budgets' targets
DOCS_PER_TASK = 500


def line(xs: list[float], ys: list[float]) -> tuple[float, float, float | None]:
    """Least squares y = a + b x: (a, b, standard error of b; None with two points)."""
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    if n < 3:
        return a, b, None
    resid = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return a, b, math.sqrt(resid / (n - 2) / sxx)


def zeroshot_se(tasks: dict[str, float]) -> float:
    """Standard error of the mean of the task accuracies, each on DOCS_PER_TASK documents."""
    return math.sqrt(sum(p * (1 - p) / DOCS_PER_TASK for p in tasks.values())) / len(tasks)


def analyse(name: str, points: list[tuple[str, str]]) -> dict:
    rows, dense, files = [], None, {}
    for folder, key in points:
        if folder not in files:  # several points of a series come from one run's file
            files[folder] = json.loads((HEAL / folder / "heal.json").read_text())
        data = files[folder]
        run, dense = data["runs"][key], dense or data["dense"]  # one dense model: the first file's figures
        rows.append({"source": f"heal/{folder}", "run": key, "heal_tokens": run["heal_tokens"],
                     "wikitext2_x": run["wikitext2"] / dense["wikitext2"], "c4_x": run["c4"] / dense["c4"],
                     "zeroshot": run["zeroshot"]["mean"], "zeroshot_se": zeroshot_se(run["zeroshot"]["tasks"])})
    healed = [r for r in rows if r["heal_tokens"] > 0]
    xs = [math.log2(r["heal_tokens"]) for r in healed]
    out = {"series": name, "points": rows, "dense": {"wikitext2": dense["wikitext2"], "c4": dense["c4"]}}
    for metric in ("wikitext2_x", "c4_x"):
        drops = [{"from": a["heal_tokens"], "to": b["heal_tokens"],
                  "drop_per_doubling": (a[metric] - b[metric]) / math.log2(b["heal_tokens"] / a["heal_tokens"])}
                 for a, b in zip(healed, healed[1:])]
        a, b, _ = line(xs, [r[metric] for r in healed])
        out[metric] = {"drops": drops, "line_drop_per_doubling": -b}
        if metric == "wikitext2_x":
            # a + b log2(t) = target; b < 0 (the ratio falls)
            out[metric]["tokens_to_reach"] = {str(t): (2 ** ((t - a) / b) if b < 0 else None) for t in TARGETS}
    a, b, se = line(xs, [r["zeroshot"] for r in healed])
    sxx = sum((x - sum(xs) / len(xs)) ** 2 for x in xs)
    sampling = sum(r["zeroshot_se"] for r in healed) / len(healed) / math.sqrt(sxx)
    out["zeroshot"] = {"line_gain_per_doubling": b, "line_gain_se": se, "line_gain_se_sampling": sampling,
                       "tokens_to_reach": {str(t): (2 ** ((t - a) / b) if b > 0 else None) for t in ZEROSHOT_TARGETS}}
    return out


def markdown(result: dict) -> str:
    parts = [f"# Issue 25's 0.7 targets against the measured recovery curve\n\nMade by `{result['protocol']['command']}` "
             f"at {result['protocol']['commit'][:7]}{' (dirty)' if result['protocol']['dirty'] else ''} from finished "
             "runs (seed 0 each; nothing trained here). Ratios are perplexity over dense "
             f"({result['series'][0]['dense']['wikitext2']:.2f} WikiText-2, {result['series'][0]['dense']['c4']:.2f} c4).\n"]
    for s in result["series"]:
        parts.append(f"## {s['series']}\n")
        parts.append(benchlib.markdown_table(
            ["heal tokens", "WikiText-2 × dense", "c4 × dense", "zero-shot mean ± SE", "source"],
            [[f"{r['heal_tokens']:,}", f"{r['wikitext2_x']:.3f}", f"{r['c4_x']:.3f}",
              f"{r['zeroshot']:.3f} ± {r['zeroshot_se']:.3f}", f"[{r['source']}](../{r['source'].split('/', 1)[1]}/heal.md)"]
             for r in s["points"]], "rrrrl") + "\n")
        parts.append(benchlib.markdown_table(
            ["metric", "drop a doubling, between measured budgets", "line through the healed points: drop a doubling"],
            [[m, ", ".join(f"{d['from']:,}→{d['to']:,}: {d['drop_per_doubling']:.3f}" for d in s[m]["drops"]),
              f"{s[m]['line_drop_per_doubling']:.3f}"] for m in ("wikitext2_x", "c4_x")], "llr") + "\n")
        reach = s["wikitext2_x"]["tokens_to_reach"]
        zs = s["zeroshot"]
        parts.append("If every doubling bought the line's drop: WikiText-2 " + ", ".join(
            f"{t}× at {reach[t]:,.0f} tokens ({reach[t] / DEFAULT_TOKENS:.0f}× the default's {DEFAULT_TOKENS:,})"
            if reach[t] else f"{t}×: never" for t in reach) + ". Zero-shot: "
            f"{zs['line_gain_per_doubling']:+.4f} a doubling"
            + (f" ± {zs['line_gain_se']:.4f} (scatter about the line)" if zs["line_gain_se"] is not None else "")
            + f", ± {zs['line_gain_se_sampling']:.4f} (the points' sampling error)"
            + "; at that rate " + ", ".join(f"{t} at {n:.1e} tokens" if n else f"{t}: never"
                                            for t, n in zs["tokens_to_reach"].items()) + ".\n")
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="run folder (default: a new bench/results/heal/DATE-COMMIT-extrapolation)")
    args = ap.parse_args()
    series = [analyse(name, points) for name, points in SERIES]  # read everything before making a folder
    default = HEAL / f"{benchlib.run_name()}-extrapolation"
    if not args.out and default.exists():
        raise SystemExit(f"error: {default} exists; results are never overwritten: pass --out NEW_FOLDER")
    folder = benchlib.run_dir("heal", args.out or default)
    result = {"protocol": {**benchlib.run_info(), "default_tokens": DEFAULT_TOKENS, "targets_wikitext2_x": TARGETS,
                           "docs_per_task": DOCS_PER_TASK}, "series": series}
    benchlib.show_and_write_result(folder / "extrapolation.json", result)
    benchlib.write_markdown(folder / "extrapolation.md", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
