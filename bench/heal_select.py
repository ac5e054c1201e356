"""Heal settings, chosen where the reported figures cannot see (issue 25's honest selection).

One unhealed student (a package written by `optimize --method activation --retain 0.7
--no-heal`), healed per variant for --steps steps of --batch × --seq tokens of the built-in
corpus's calibration half (Wikipedia; with --data mix also the first 90% of exllamav2's tiny /
technical / code / multilingual samples; with --data prose only the tiny and technical ones), once for each of --seeds, an order of those sequences:
the same setting scatters across orders by 0.03-0.04 (sd) on the mean held-out KL
(bench/results/heal-select/2026-12-06-796420d-heads), so a variant is the mean of three by
default (one, seed 0, until 2026-12-06). Each variant is scored on what the reported figures
never use:
- the KL to the dense model on held-out text: the calibration half's last 2048 tokens and 2048
  tokens of the last 10% of each of those four samples (never trained on), in windows of
  --heldout-seq tokens (1024 until 2026-12-06; 2048 is the reported perplexities' length, which a heal
  on short sequences never trains at);
- the zero-shot mean of ARC-Easy, PIQA and HellaSwag on --zeroshot documents each drawn with
  seed 4321 (the reported figures use seed 1234).
WikiText-2 and c4 (the reported perplexities) are not read here.

    optimize --target a100 --method activation --retain 0.7 --no-heal -o out/heal-select-student
    python bench/heal_select.py lr3e-4 --lr 3e-4 --student out/heal-select-student

Writes NAME.json into a run folder (benchlib.run_dir, default bench/results/heal-select/DATE-COMMIT)
and refuses to replace one; `--table` writes select.md from the folder's JSON files.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import benchlib

SELECTION_SEED = 4321


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="the variant's name (its JSON file's)")
    ap.add_argument("--student", default="out/heal-select-student", help="the unhealed package")
    ap.add_argument("--teacher", help="the dense model the student was pruned from (default: the embedded one)")
    ap.add_argument("--curve", type=int, default=0, metavar="N",
                    help="also the KL on the calibration half's held-out windows every N steps (0: only at the end)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lr-end", type=float, help="default: lr / 10")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--data", default="wiki", choices=["wiki", "mix", "prose"],
                    help="wiki: the Wikipedia half; mix: and the four samples' first 90% (the product's default text, "
                         "without its chat answers); "
                         "prose: and only the tiny and technical samples' (no code, no other languages)")
    ap.add_argument("--heldout-seq", type=int, default=2048, choices=[1024, 2048],
                    help="tokens a held-out window (2048 tokens of each text either way, not always the same ones)")
    ap.add_argument("--teacher-text", type=int, default=0, metavar="PROMPT_TOKENS",
                    help="train on the teacher's own samples: each sequence keeps its first PROMPT_TOKENS "
                         "tokens of --data and the dense model continues it (temperature 1, top-p 0.95); 0: off")
    ap.add_argument("--dtype", default="auto", help="the training passes' dtype: auto (the product's) | float32 | bfloat16")
    ap.add_argument("--zeroshot", type=int, default=150, help="documents per task (seed 4321); 0: none")
    ap.add_argument("--seeds", "--seed", type=int, nargs="+", default=[0, 1, 2], dest="seeds",
                    help="orders of the heal sequences, one heal each, scored by their mean (one seed, 0, until "
                         "2026-12-06): the same setting scatters by 0.03-0.04 (sd) on the mean held-out KL across seeds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="run folder (default: a new bench/results/heal-select/DATE-COMMIT)")
    ap.add_argument("--table", action="store_true", help="only write select.md from the folder's variants")
    a = ap.parse_args()
    out = benchlib.run_dir("heal-select", a.out)
    if a.table:
        benchlib.write_markdown(out / "select.md", markdown(out))
        print((out / "select.md").read_text())
        return
    path = benchlib.new_file(out / f"{a.name}.json")

    import torch

    from optimizer import data, load
    from optimizer.methods.distill import HealConfig, kd_eval
    from optimizer.sequential import calibration_dtype
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    teacher, tok = load.load_model(load.resolve(a.teacher))
    wiki = data.builtin_text("calib").text
    n_held = 2048 // a.heldout_seq
    held = {"wiki_heldout": data.token_windows(tok, wiki, a.heldout_seq)[-n_held:]}
    train = [data.token_windows(tok, wiki[: wiki.rfind("\n", 0, int(len(wiki) * 0.97))], a.seq)]
    for name in data.HEAL_SAMPLES:  # the product's default heal reads their first 90% (split_sample's)
        first, rest = data.split_sample(data.builtin_sample(name).read_text())
        held[name] = data.token_windows(tok, rest, a.heldout_seq)[:n_held]
        if a.data == "mix" or (a.data == "prose" and name in ("tiny.utf8", "technical.utf8")):
            train.append(data.token_windows(tok, first, a.seq))
    train = torch.cat(train)
    cfg = HealConfig(steps=a.steps, lr=a.lr, lr_end=a.lr / 10 if a.lr_end is None else a.lr_end,
                     dtype=str(calibration_dtype(a.dtype)).removeprefix("torch."))
    kls = lambda m: {k: round(kd_eval(m, teacher, v), 4) for k, v in held.items()}  # noqa: E731

    result = {"args": vars(a), "train_sequences": len(train), **benchlib.run_info(), "runs": []}
    for seed in a.seeds:
        student, _ = load.load_model(load.resolve(a.student))  # afresh for each seed
        if "before" not in result:
            result["before"] = kls(student)
        run = heal_once(student, teacher, tok, train, held, kls, cfg, a, seed)
        result["runs"].append(run)
        print(json.dumps({k: run[k] for k in ("seed", "after", "after_mean", "zeroshot") if k in run}, indent=1))
        del student
    # the variant's figures: the means over its seeds (and their standard deviations)
    runs = result["runs"]
    result["after"] = {k: round(sum(r["after"][k] for r in runs) / len(runs), 4) for k in held}
    result["after_mean"] = sum(r["after_mean"] for r in runs) / len(runs)
    if a.zeroshot:
        result["zeroshot"] = sum(r["zeroshot"] for r in runs) / len(runs)
    if len(runs) > 1:
        result["after_mean_sd"] = statistics.stdev(r["after_mean"] for r in runs)
        if a.zeroshot:
            result["zeroshot_sd"] = statistics.stdev(r["zeroshot"] for r in runs)
    benchlib.write_result(path, result)
    print(json.dumps({k: result[k] for k in ("after", "after_mean", "after_mean_sd", "zeroshot", "zeroshot_sd")
                      if k in result}, indent=1))


def heal_once(student, teacher, tok, train, held, kls, cfg, a, seed: int) -> dict:
    """One heal of `student` on `train` in the order `seed` draws, scored."""
    import torch

    from optimizer import zeroshot
    from optimizer.methods.distill import Distillation, kd_eval
    train = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))]
    torch.manual_seed(seed)
    gen_s = 0.0
    if a.teacher_text:  # only the windows the steps read
        started = time.time()
        train = teacher_continuations(teacher, train[: a.steps * a.batch], a.teacher_text, tok.eos_token_id)
        gen_s = time.time() - started
    distil = Distillation(student, teacher, cfg)
    started, losses, curve = time.time(), [], []
    for i in range(a.steps):
        losses.append(distil.step(train[(i * a.batch) % len(train):][: a.batch])["kd"])
        print(f"seed {seed}, step {i}: kd {losses[-1]:.3f}, {time.time() - started:.0f} s", flush=True)
        if a.curve and ((i + 1) % a.curve == 0 or i + 1 == a.steps):
            curve.append({"step": i + 1, "wiki_heldout": round(kd_eval(student, teacher, held["wiki_heldout"]), 4)})
            print(f"step {i + 1}: held-out KL {curve[-1]['wiki_heldout']}", flush=True)
    distil.close()
    run = {"seed": seed, "train_sequences": len(train), "generate_s": round(gen_s),
           "heal_s": round(time.time() - started), "train_kd": losses, "after": kls(student),
           **({"curve": curve} if curve else {})}
    run["after_mean"] = sum(run["after"].values()) / len(held)
    if a.zeroshot:
        run["zeroshot"] = zeroshot.evaluate(student, tok, ["arc_easy", "piqa", "hellaswag"], a.zeroshot,
                                            SELECTION_SEED)["mean"]
    return run


def teacher_continuations(teacher, windows, prompt_tokens: int, eos: int, batch: int = 24):
    """Each window's first prompt_tokens tokens, continued by the dense model's samples to the
    window's length (end-of-text suppressed until then). Seeded by the caller's torch seed."""
    import torch
    from tqdm import tqdm
    out = []
    for chunk in tqdm(windows.split(batch), desc="teacher's text", unit="batch"):
        prompt = chunk[:, :prompt_tokens]
        new = chunk.shape[1] - prompt_tokens
        out.append(teacher.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                    temperature=1.0, top_p=0.95, max_new_tokens=new, min_new_tokens=new,
                                    pad_token_id=eos))
    return torch.cat(out)


def markdown(folder: Path) -> str:
    rows = []
    for f in sorted(folder.glob("*.json")):
        r = json.loads(f.read_text())
        if "args" not in r:
            continue  # a probe's other files (chunk.json, ...)
        a = r["args"]
        data = a["data"] + (f" (teacher, prompt {a['teacher_text']})" if a.get("teacher_text") else "")
        seeds = [str(x["seed"]) for x in r["runs"]] if "runs" in r else [str(a.get("seed", 0))]
        sd = lambda key, fmt: f" ± {r[key]:{fmt}}" if key in r else ""  # noqa: E731
        rows.append([f.stem, Path(a["student"]).name, ", ".join(seeds), f"{a['lr']:g}", data,
                     f"{a['steps']} × {a['batch']} × {a['seq']}", f"{sum(r['before'].values()) / len(r['before']):.4f}",
                     f"{r['after_mean']:.4f}{sd('after_mean_sd', '.4f')}", *(f"{r['after'][k]:.4f}" for k in r["after"]),
                     f"{r['zeroshot']:.3f}{sd('zeroshot_sd', '.3f')}" if "zeroshot" in r else "—"])
    first = next(r for f in sorted(folder.glob("*.json")) if "args" in (r := json.loads(f.read_text())))
    header = ["variant", "student", "heal seeds", "lr", "data", "steps × batch × seq", "held-out KL before, mean",
              "after, mean (± sd over the seeds)", *first["after"], f"zero-shot mean (seed {SELECTION_SEED})"]
    return ("# Heal settings, selected on held-out KL and zero-shot seed 4321 (not the reported figures)\n\n"
            + benchlib.markdown_table(header, rows, align="l" * 6 + "r" * (len(header) - 6)) + "\n")


if __name__ == "__main__":
    main()
