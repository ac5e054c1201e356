"""One table from the `evaluate --json` files of a directory (issue 3's zero-shot figures).

    .venv/bin/python bench/zeroshot_table.py bench/results/ddp/zeroshot-500

Each JSON is one model (the file name is the row; `dense.json`, if present, comes first). Columns:
each task's primary metric, the mean over all tasks (what `evaluate` prints), and the mean over
the tasks the dense model is clearly above chance on: more than two standard errors above
1/choices. At 135M parameters some tasks sit at chance even dense (BoolQ, WinoGrande here); their
scores move with noise only, and they would set the mean's differences by themselves.
Writes table.md beside the files (a view of them, rebuilt from them on each run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import benchlib


def informative(dense: dict) -> list[str]:
    return [name for name, t in dense["tasks"].items()
            if t["score"] - t["docs"] / t["choices"] > 2 * t["stderr"]]


def table(runs: dict[str, dict]) -> str:
    tasks = list(next(iter(runs.values()))["tasks"])
    signal = informative(runs["dense"]) if "dense" in runs else tasks
    head = ["model", *tasks, f"mean of {len(tasks)}", f"mean of {', '.join(signal)}"]
    rows = []
    for name, r in runs.items():
        scores = {t: r["tasks"][t]["score"] for t in tasks}
        sig = sum(scores[t] for t in signal) / len(signal)
        rows.append([name, *(f"{scores[t]:.3f}" for t in tasks), f"{r['mean']:.3f}", f"{sig:.3f}"])
    lines = [benchlib.markdown_table(head, rows, align="l" + "r" * (len(head) - 1))]
    docs = {r["tasks"][t]["docs"] for r in runs.values() for t in tasks}
    se = max(r["tasks"][t]["stderr"] for r in runs.values() for t in tasks)
    se_signal = max(sum(r["tasks"][t]["stderr"] ** 2 for t in signal) ** 0.5 / len(signal) for r in runs.values())
    lines += ["", f"Documents per task: {', '.join(map(str, sorted(docs)))} (a seeded subset, the same for every "
              f"model); standard error per task up to {se:.3f}, of the last column's mean up to {se_signal:.3f}. "
              f"Tasks above chance for dense (score − 1/choices > 2 SE): {', '.join(signal)}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory")
    args = ap.parse_args()
    files = sorted(Path(args.directory).glob("*.json"), key=lambda p: (p.stem != "dense", p.stem))
    if not files:
        raise SystemExit(f"error: no evaluate --json files in {args.directory}")
    runs = {p.stem: json.loads(p.read_text()) for p in files}
    text = table(runs)
    benchlib.write_markdown(Path(args.directory) / "table.md", text)
    print(text)


if __name__ == "__main__":
    main()
