"""Heal's memory: each part measured on SmolLM2 (a healed package's manifest) and scaled to a
larger model by formula (docs/heal.md).

    python bench/heal_memory.py bench/results/heal/probes/2026-12-02-oneshot-r0.70-h98304/manifest.json

The measured part is what `optimizer/heal.py` holds beside the models (fp32 weights, gradients,
AdamW's two moments of the trainable parameters); the scaled rows apply bytes per parameter to
the larger model pruned to the same retention: today's fp32 recipe, and the one designed to fit
one 80 GB GPU (bf16 weights without a master copy, bf16 gradients, 8-bit Adam, a bf16 teacher,
activations checkpointed per block, the KL over the vocabulary in chunks of the sequence).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import benchlib

GB = 1e9
# LLaMA-3.1-8B: 32 layers, hidden 4096, vocabulary 128,256, untied embedding and head.
LLAMA_8B = {"name": "LLaMA-3.1-8B", "params": 8.03e9, "vocab_params": 2 * 128256 * 4096, "layers": 32,
            "hidden": 4096, "vocab": 128256}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("manifest", help="a healed package's manifest.json (its heal.memory_bytes)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens a sequence, for activations")
    ap.add_argument("--kl-chunk", type=int, default=256)
    ap.add_argument("--out", help="run folder (default: a new bench/results/heal-memory/DATE-COMMIT)")
    args = ap.parse_args()
    m = json.loads(Path(args.manifest).read_text())
    mem = m["heal"]["memory_bytes"]
    retain = m["method"]["retain_achieved"]
    big = LLAMA_8B
    blocks = big["params"] - big["vocab_params"]
    trainable = retain * blocks                      # blocks (and norms) train; embedding and head frozen
    total = trainable + big["vocab_params"]
    rows = {
        "measured": {"model": m["source"]["model"], "retain": retain, "trainable_params": mem["trainable_params"],
                     "weights_bytes": mem["weights"], "grads_bytes": mem["grads"], "adam_bytes": mem["adam"],
                     "peak_rss_gib": m["heal"]["peak_rss_gib"]},
        "scaled_to": big["name"],
        "trainable_params": trainable, "student_params": total,
        "fp32_recipe_gb": {"weights": 4 * total / GB, "grads": 4 * trainable / GB, "adam": 8 * trainable / GB,
                           "teacher_bf16": 2 * big["params"] / GB},
        "fitting_recipe_gb": {"weights_bf16": 2 * total / GB, "grads_bf16": 2 * trainable / GB,
                              "adam_8bit": 2 * trainable / GB, "teacher_bf16": 2 * big["params"] / GB,
                              "activations_checkpointed": 2 * args.tokens * big["hidden"] * big["layers"] / GB,
                              "logits_chunked": 2 * 4 * args.kl_chunk * big["vocab"] / GB},
        "manifest": str(args.manifest), **benchlib.run_info(),
    }
    for recipe in ("fp32_recipe_gb", "fitting_recipe_gb"):
        rows[recipe]["total"] = sum(rows[recipe].values())
    out = benchlib.run_dir("heal-memory", args.out)
    benchlib.write_result(out / "heal-memory.json", rows)
    benchlib.write_markdown(out / "heal-memory.md", markdown(rows))
    print(markdown(rows))


def markdown(r: dict) -> str:
    me, a, b = r["measured"], r["fp32_recipe_gb"], r["fitting_recipe_gb"]
    table = benchlib.markdown_table(
        ["part", "measured on SmolLM2 (MB)", f"{r['scaled_to']} at the same retention (GB)"],
        [["weights, fp32 (trainable / all)", f"{me['weights_bytes'] / 1e6:.0f}", f"{a['weights']:.1f}"],
         ["gradients, fp32", f"{me['grads_bytes'] / 1e6:.0f}", f"{a['grads']:.1f}"],
         ["AdamW moments, fp32", f"{me['adam_bytes'] / 1e6:.0f}", f"{a['adam']:.1f}"],
         ["teacher, bf16", None, f"{a['teacher_bf16']:.1f}"],
         ["**today's recipe**", None, f"{a['total']:.1f}"],
         ["weights, bf16", None, f"{b['weights_bf16']:.1f}"],
         ["gradients, bf16", None, f"{b['grads_bf16']:.1f}"],
         ["Adam, 8-bit", None, f"{b['adam_8bit']:.1f}"],
         ["teacher, bf16", None, f"{b['teacher_bf16']:.1f}"],
         ["activations, checkpointed per block", None, f"{b['activations_checkpointed']:.2f}"],
         ["logits, KL in chunks", None, f"{b['logits_chunked']:.2f}"],
         ["**the recipe that fits**", None, f"{b['total']:.1f}"]], align="lrr")
    return (f"# Heal memory\n\nMeasured: {me['model']} at retain {me['retain']:.3f}, {me['trainable_params']:,} "
            f"trainable parameters. Scaled: {r['scaled_to']}, {r['trainable_params'] / 1e9:.2f}B trainable of "
            f"{r['student_params'] / 1e9:.2f}B.\n\n{table}\n")


if __name__ == "__main__":
    main()
