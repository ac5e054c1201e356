"""Heal's memory: each part measured on SmolLM2, per --heal-memory recipe, and scaled to an 8B
model by formula (docs/heal.md, "Memory").

    python bench/heal_memory.py                        # builds the student first (out/heal-memory-student)
    python bench/heal_memory.py out/heal-memory-student  # or measures a student built before:
    # optimize --method activation --retain 0.7 --no-heal --set data.eval_windows=1 -o out/heal-memory-student

For each recipe — fast (AdamW, every activation kept, the teacher in fp32) and lean (Adafactor,
activations recomputed per block, the teacher in bf16) — one heal step on one sequence of
--tokens tokens is profiled (torch.profiler's memory timeline, which sorts every allocation into
parameters, optimizer state, gradients, activations, temporaries) after a first step, so that
the optimizer's state exists. The weights, gradients, optimizer state and teacher are also
counted tensor by tensor. Scaled to LLaMA-3.1-8B pruned to the same retention: bytes per
parameter for the weights, gradients and teacher; the factored state by its rows and columns;
activations by tokens × layers × (hidden + intermediate) (lean: the blocks' inputs plus one
block's recomputation, the formula checked against the measurement on SmolLM2); the logits by
the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib
from core.manifest import Manifest

GB = 1e9
# LLaMA-3.1-8B: 32 layers, hidden 4096, intermediate 14336, 32 query / 8 KV heads of 128, an
# untied embedding and head of 128,256 × 4096.
LLAMA_8B = {"name": "LLaMA-3.1-8B", "params": 8.03e9, "vocab_params": 2 * 128256 * 4096, "layers": 32,
            "hidden": 4096, "intermediate": 14336, "vocab": 128256,
            # (rows, columns) of one block's matrices, dense: q, k, v, o, gate, up, down
            "matrices": [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096),
                         (4096, 14336)]}
RECIPES = {"fast": {"optimizer": "adamw", "checkpointing": False, "teacher": "float32"},
           "lean": {"optimizer": "adafactor", "checkpointing": True, "teacher": "bfloat16"}}
# torch.profiler's memory categories, in the order of its timeline's columns (after a leading 0)
CATEGORIES = ["parameter", "optimizer_state", "input", "temporary", "activation", "gradient", "autograd_detail",
              "unknown"]
STUDENT = "out/heal-memory-student"  # built by main() when missing: the student docs/heal.md's memory table used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("student", nargs="?", default=STUDENT,
                    help=f"a pruned package of the embedded model (optimize --no-heal); default {STUDENT}, built when missing")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of the profiled sequence (heal's default)")
    ap.add_argument("--scaled-tokens", type=int, default=2048, help="tokens a sequence on the 8B model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="run folder (default: a new bench/results/heal-memory/DATE-COMMIT)")
    args = ap.parse_args()
    if not Path(args.student).exists():
        if args.student != STUDENT:
            raise SystemExit(f"error: {args.student}: no such package")
        # the student every figure of docs/heal.md's memory table was measured on
        subprocess.run([str(Path(sys.executable).with_name("optimize")), "--method", "activation", "--retain", "0.7",
                        "--no-heal", "--set", "data.eval_windows=1", "-o", STUDENT], check=True)

    import torch

    from optimizer import load
    from optimizer.adapters import get_adapter
    from optimizer.methods.distill import Distillation, HealConfig
    torch.set_num_threads(args.threads)
    teacher, _ = load.load_model(load.resolve(None))
    gen = torch.Generator().manual_seed(0)
    lengths = (args.tokens // 2, args.tokens)  # two lengths: what grows with the sequence, what does not
    seqs = {n: torch.randint(0, teacher.config.vocab_size, (1, n), generator=gen) for n in lengths}
    measured = {}
    for name, recipe in RECIPES.items():
        student, _ = load.load_model(load.resolve(args.student))
        t = teacher.to(getattr(torch, recipe["teacher"]))
        d = Distillation(student, t, HealConfig(steps=3, optimizer=recipe["optimizer"], dtype="bfloat16",
                                                checkpointing=recipe["checkpointing"]),
                         blocks=get_adapter(student.config).blocks(student))
        d.step(seqs[lengths[0]])  # the optimizer's state now exists
        measured[name] = {"profiled": {str(n): profile_step(d, seqs[n]) for n in lengths}, "counted": d.state_bytes(),
                          "teacher_bytes": sum(p.numel() * p.element_size() for p in t.parameters()),
                          "student_frozen_bytes": sum(p.numel() * p.element_size() for p in student.parameters()
                                                      if not p.requires_grad)}
        d.close()
        act = {n: measured[name]["profiled"][str(n)]["activations"] for n in lengths}
        per_token = (act[lengths[1]] - act[lengths[0]]) / (lengths[1] - lengths[0])
        measured[name]["activations"] = {"bytes_per_token": per_token, "fixed_bytes": act[lengths[1]] - per_token * lengths[1]}
        print(name, json.dumps(measured[name]["activations"]), flush=True)
    c = student.config
    dims = {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "intermediate": c.intermediate_size,
            "vocab": c.vocab_size, "tokens": args.tokens, "retain": _retain(args.student)}
    result = {"student": args.student, "dims": dims, "measured": measured,
              "scaled": scale(measured, dims, LLAMA_8B, args.scaled_tokens), "scaled_to": LLAMA_8B["name"],
              "scaled_tokens": args.scaled_tokens, **benchlib.run_info()}
    out = benchlib.run_dir("heal-memory", args.out)
    benchlib.write_result(out / "heal-memory.json", result)
    benchlib.write_markdown(out / "heal-memory.md", markdown(result))
    benchlib.plot_table(markdown(result), out / "heal-memory.png", "a heal step's memory, SmolLM2-135M")
    print(markdown(result))


def profile_step(distil, ids) -> dict:
    """One step under torch.profiler: each memory category's peak, and the peak of their sum."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        distil.step(ids)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    rows = [row[1:] for row in sizes]
    peaks = {cat: max(r[i] for r in rows) for i, cat in enumerate(CATEGORIES)}
    activations = max(r[CATEGORIES.index("activation")] + r[CATEGORIES.index("autograd_detail")] for r in rows)
    return {"peak_bytes": peaks, "activations": activations, "peak_total_bytes": max(sum(r) for r in rows)}


def _retain(package: str) -> float:
    return Manifest.read(package).method["retain_achieved"]


def scale(measured: dict, d: dict, big: dict, tokens: int) -> dict:
    """Each part of each recipe on `big` pruned to the student's retention, in GB."""
    r = d["retain"]
    trainable = r * (big["params"] - big["vocab_params"])  # blocks and norms train; embedding and head frozen
    # activations that grow with the sequence: bytes a token, a layer and a unit of width (hidden +
    # intermediate, the pruned MLP; heads pruned alike); those that do not (one chunk's logits and
    # their gradient): by the vocabulary
    width, big_width = d["hidden"] + d["intermediate"], big["hidden"] + r * big["intermediate"]
    factored = 4 * big["layers"] * sum(rows + cols for rows, cols in big["matrices"])  # dense shapes: an upper bound
    out = {}
    for name, m in measured.items():
        a = m["activations"]
        per_token = a["bytes_per_token"] / (d["layers"] * width) * big["layers"] * big_width
        teacher_bytes = 2 if RECIPES[name]["teacher"] == "bfloat16" else 4
        parts = {"student_weights": (4 * trainable + 4 * big["vocab_params"]) / GB,
                 "gradients": 4 * trainable / GB,
                 "optimizer_state": (8 * trainable if RECIPES[name]["optimizer"] == "adamw" else factored) / GB,
                 "teacher": teacher_bytes * big["params"] / GB,
                 "activations": per_token * tokens / GB,
                 "logits": (a["fixed_bytes"] + m["profiled"][str(d["tokens"])]["peak_bytes"]["temporary"])
                 * big["vocab"] / d["vocab"] / GB}
        out[name] = {"parts_gb": parts, "total_gb": sum(parts.values())}
    return out


def markdown(r: dict) -> str:
    m, s, d = r["measured"], r["scaled"], r["dims"]
    at = str(d["tokens"])

    def row(label, get):
        return [label, *(f"{get(m[k]) / 1e6:.0f}" for k in RECIPES)]

    measured_table = benchlib.markdown_table(["part", *(f"{k} (MB)" for k in RECIPES)], [
        row("student weights, trainable (counted)", lambda x: x["counted"]["weights"]),
        row("student weights, frozen embedding and head (counted)", lambda x: x["student_frozen_bytes"]),
        row("gradients (profiled)", lambda x: x["profiled"][at]["peak_bytes"]["gradient"]),
        row("optimizer state (counted)", lambda x: x["counted"]["optimizer_state"]),
        row("teacher (counted)", lambda x: x["teacher_bytes"]),
        row(f"activations at {at} tokens (profiled)", lambda x: x["profiled"][at]["activations"]),
        row("  of which grow with the sequence", lambda x: x["activations"]["bytes_per_token"] * d["tokens"]),
        row("  of which do not (a chunk's logits)", lambda x: x["activations"]["fixed_bytes"]),
        row("temporaries (profiled)", lambda x: x["profiled"][at]["peak_bytes"]["temporary"]),
        row("**peak of the step, all categories (profiled)**", lambda x: x["profiled"][at]["peak_total_bytes"]),
    ], align="lrr")
    labels = {"student_weights": "student weights, fp32 (trainable and frozen)", "gradients": "gradients, fp32",
              "optimizer_state": "optimizer state", "teacher": "teacher",
              "activations": f"activations, {r['scaled_tokens']} tokens", "logits": "logits (the KL in chunks of 256)"}
    scaled_rows = [[labels[k], *(f"{s[n]['parts_gb'][k]:.2f}" for n in RECIPES)] for k in labels]
    scaled_rows.append(["**total**", *(f"{s[n]['total_gb']:.1f}" for n in RECIPES)])
    scaled_table = benchlib.markdown_table(["part", *(f"{k} (GB)" for k in RECIPES)], scaled_rows, align="lrr")
    recipes = "; ".join(f"{k}: {v['optimizer']}, activations {'recomputed per block' if v['checkpointing'] else 'kept'}, "
                        f"teacher {v['teacher']}" for k, v in RECIPES.items())
    return (f"# Heal memory\n\nRecipes ({recipes}). Measured: one heal step on one sequence, SmolLM2-135M at "
            f"retain {d['retain']:.3f} ({d['layers']} layers, hidden {d['hidden']}, intermediate {d['intermediate']}), "
            f"autocast bf16, torch.profiler's peak of each category; activations profiled at "
            f"{', '.join(m['fast']['profiled'])} tokens, split into what grows with the sequence and what does not."
            f"\n\n{measured_table}\n\nScaled: {r['scaled_to']} at the same retention, sequences of "
            f"{r['scaled_tokens']} tokens (activations by layers × (hidden + intermediate), logits and temporaries "
            f"by the vocabulary).\n\n{scaled_table}\n")


if __name__ == "__main__":
    main()
