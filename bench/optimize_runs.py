"""Run `optimize` on several settings of one model, side by side, and tabulate what each package's
manifest says: the heal (its learning-rate probe, held-out KL before and after), the perplexities,
the search's choice and the wall time.

    python bench/optimize_runs.py LABEL [--model M] [--out DIR] -- "--retain 0.9" "--retain 0.7 --quant none"

Each quoted string is one run's `optimize` options (after `--target a100`, which a run may
override). Writes into a new run folder bench/results/optimize-runs/<date>-<commit>-LABEL: each
run's manifest, report and log (`<k>-manifest.json`, ...), results.json, results.md and
results.png (held-out KL before and after healing a run). The packages are written to a
temporary folder and removed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib


def one_run(k: int, model: str | None, options: str, out: Path) -> dict:
    args = shlex.split(options)
    if "--target" not in args and "-t" not in args:
        args = ["--target", "a100", *args]
    with tempfile.TemporaryDirectory(prefix="optimize-runs-") as tmp:
        pkg = Path(tmp) / "pkg"
        cmd = [str(Path(sys.executable).parent / "optimize"), *([model] if model else []), *args, "-o", str(pkg)]
        print("$", shlex.join(cmd), flush=True)
        started = time.time()
        with open(out / f"{k}-output.txt", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        wall = round(time.time() - started, 1)
        if rc != 0:
            return {"options": options, "rc": rc, "wall_s": wall}
        manifest = json.loads((pkg / "manifest.json").read_text())
        shutil.copyfile(pkg / "manifest.json", out / f"{k}-manifest.json")  # as written
        (out / f"{k}-report.md").write_text((pkg / "report.md").read_text())
    heal = manifest.get("heal") or {}
    quality = manifest.get("quality", {}).get("perplexity", {})
    return {"options": options, "rc": 0, "wall_s": wall, "method": manifest.get("method", {}).get("name"),
            "perplexity": quality,
            "heal": {key: heal.get(key) for key in ("peak_rule", "probe", "attempts", "before", "after", "steps",
                                                    "kept_unhealed", "skipped_by_probe", "wall_s", "config")}}


def table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        h, q = r.get("heal") or {}, r.get("perplexity") or {}
        probe = ", ".join(f"{p['lr']:.1e}: {p['held_out_kd']:.4f}" for p in h.get("probe") or []) or "—"
        kl = (f"{h['before']['held_out_kd']:.4f} → {h['after']['held_out_kd']:.4f}" if h.get("before") else "—")
        lr = (h.get("config") or {}).get("lr")
        healed = ("skipped by the probe" if h.get("skipped_by_probe") else "undone" if h.get("kept_unhealed")
                  else f"{lr:.1e}" if lr else "—")
        ppl = (f"{q['dense']:.3f} / {q['pruned']:.3f}" if "dense" in q and "pruned" in q else "—")
        before = (h.get("before") or {}).get("perplexity")
        out.append([f"`{r['options']}`", probe, healed, kl, "—" if before is None else f"{before:.3f}", ppl,
                    h.get("wall_s", "—"), r["wall_s"]])
    return benchlib.markdown_table(["options", "probe (lr: held-out KL)", "healed at", "held-out KL before → after",
                                    "eval ppl before heal", "eval ppl dense / package", "heal s", "run s"], out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, before, after = [], [], []
    for r in rows:
        h = r.get("heal") or {}
        if h.get("before"):
            labels.append(r["options"])
            before.append(h["before"]["held_out_kd"])
            after.append(h["after"]["held_out_kd"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], before, 0.4, label="before healing")
    ax.bar([i + 0.2 for i in x], after, 0.4, label="package")
    ax.set_xticks(list(x), labels, rotation=15, fontsize=8)
    ax.set_ylabel("held-out KL to the dense model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def rebuild(folder: Path) -> None:
    """results.md and results.png again from the folder's results.json (after a table's format changed)."""
    rows = json.loads((folder / "results.json").read_text())["runs"]
    benchlib.write_markdown(folder / "results.md", table(rows))
    plot(rows, folder / "results.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("label")
    ap.add_argument("--model", default=None, help="MODEL for optimize (default: the embedded SmolLM2-135M)")
    ap.add_argument("--out", default=None, help="an existing run folder to add to (default: a new one)")
    ap.add_argument("runs", nargs="+", help="one quoted string of optimize options a run")
    a = ap.parse_args()
    out = benchlib.run_dir("optimize-runs", a.out or None)
    if a.out is None:
        out = out.rename(out.with_name(f"{out.name}-{a.label}"))
    rows = []
    for k, options in enumerate(a.runs, 1):
        rows.append(one_run(k, a.model, options, out))
        data = {**benchlib.run_info(), "model": a.model or "embedded SmolLM2-135M", "cpu": benchlib.cpu_name(),
                "runs": rows}
        (out / "results.json").write_text(json.dumps(data, indent=1))  # rewritten as runs finish (this run's own)
        benchlib.write_markdown(out / "results.md", table(rows))
    plot(rows, out / "results.png")
    print(out)


if __name__ == "__main__":
    main()
