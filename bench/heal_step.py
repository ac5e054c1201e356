"""Seconds a heal step: the product's `Distillation.step` on the real model, alone.

One unhealed student (`optimize ... --no-heal -o DIR`), the dense teacher, the default's step (1
sequence of --seq tokens of the built-in corpus, the product's dtype), --warmup steps untimed,
then --steps timed. The trained weights' digest afterwards tells whether two code versions take
the same steps bit for bit. To compare versions, run this file against each version's `optimizer`
package, one after the other, into one folder (`--name` tells them apart):

    PYTHONPATH=/path/to/old/checkout:bench python bench/heal_step.py old --student out/sel-student --out F
    PYTHONPATH=.:bench python bench/heal_step.py new --student out/sel-student --out F
    python bench/heal_step.py --table --out F

Writes NAME.json into a run folder (benchlib.run_dir, default bench/results/heal-step/DATE-COMMIT);
the `optimizer` package's own commit is recorded beside the script's, and `heal.digest` of the trained
weights before and after the steps (until 2026-12-06 the after-digest hashed their bytes alone, without their names:
compare digests within one version of this script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import benchlib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", help="this version's name (its JSON file's)")
    ap.add_argument("--student", default="out/sel-student", help="the unhealed package")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="auto", help="auto (the product's) | float32 | bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="run folder (default: a new bench/results/heal-step/DATE-COMMIT)")
    ap.add_argument("--table", action="store_true", help="only write steps.md from the folder's JSON files")
    a = ap.parse_args()
    if a.table and not a.out:
        ap.error("--table needs the --out folder to tabulate")
    if not a.table and not a.name:
        ap.error("a name is needed (or --table)")
    out = benchlib.run_dir("heal-step", a.out)
    if a.table:
        benchlib.write_markdown(out / "steps.md", markdown(out))
        print((out / "steps.md").read_text())
        return
    path = benchlib.new_file(out / f"{a.name}.json")

    import torch

    import optimizer
    from optimizer import data, load
    from optimizer.methods.distill import Distillation, HealConfig, digest
    from optimizer.sequential import calibration_dtype, fast_bf16
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    teacher, tok = load.load_model(load.resolve(None))
    student, _ = load.load_model(load.resolve(a.student))
    train = data.token_windows(tok, data.builtin_text("calib").text, a.seq)[: a.warmup + a.steps]
    if len(train) < a.warmup + a.steps or a.steps < 1:
        raise SystemExit(f"error: the built-in text has {len(train)} sequences of {a.seq} tokens; "
                         f"--warmup {a.warmup} + --steps {a.steps} (at least 1) needs that many")
    dtype = str(calibration_dtype(a.dtype)).removeprefix("torch.")
    distil = Distillation(student, teacher, HealConfig(steps=a.warmup + a.steps, dtype=dtype))
    seconds, kd = [], []
    for i, seq in enumerate(train.split(1)):
        started = time.perf_counter()
        kd.append(distil.step(seq)["kd"])
        if i >= a.warmup:
            seconds.append(time.perf_counter() - started)
        print(f"step {i}: kd {kd[-1]:.5f}, {time.perf_counter() - started:.3f} s", flush=True)
    package = Path(optimizer.__file__).resolve().parent.parent
    commit = benchlib._git("-C", str(package), "rev-parse", "--short", "HEAD")
    dirty = bool(benchlib._git("-C", str(package), "status", "--porcelain", "--", "optimizer"))
    result = {"args": vars(a), "dtype": dtype, "torch": torch.__version__,
              "student_digest": distil.start_digest,  # the trained weights before the first step
              "optimizer_package": {"path": str(package), "commit": commit, "dirty": dirty},
              "cpu": benchlib.cpu_name(), "fast_bf16": fast_bf16(),
              "step_s": seconds, "step_s_median": statistics.median(seconds),
              "tokens_per_s": round(a.seq / statistics.median(seconds), 1), "kd": kd,
              "weights_digest": digest(distil.params), **benchlib.run_info()}
    benchlib.write_result(path, result)
    print(json.dumps({k: result[k] for k in ("step_s_median", "tokens_per_s", "weights_digest")}, indent=1))


def markdown(folder: Path) -> str:
    rows = []
    for p in sorted(folder.glob("*.json")):
        r = json.loads(p.read_text())
        if "step_s_median" not in r:
            continue
        pkg = r["optimizer_package"]
        rows.append([p.stem, f"{pkg['commit']}{' (dirty)' if pkg['dirty'] else ''}", r["cpu"], r["dtype"],
                     f"{r['step_s_median']:.3f}", r["tokens_per_s"], r["weights_digest"]])
    return benchlib.markdown_table(["version", "optimizer commit", "CPU", "dtype", "s a step (median)", "tokens/s",
                                    "weights digest after the steps"], rows)


if __name__ == "__main__":
    main()
