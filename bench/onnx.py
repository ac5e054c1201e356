"""Figures for ONNX packages: onnxruntime-CPU throughput pruned/dense, export and validation time.

    .venv/bin/python bench/onnx.py                        # full protocol (SmolLM2, r 0.7 and 0.5)
    .venv/bin/python bench/onnx.py --retain 1.0 --quant int8   # INT8 of the dense model against its fp32 graph
    .venv/bin/python bench/onnx.py --retain 1.0 --quant int8 int8+head   # and with the LM head INT8 too (quant_head)
    .venv/bin/python bench/onnx.py --retain 1.0 --quant int8 int8+head --ppl-windows 8   # and each graph's perplexity
    .venv/bin/python bench/onnx.py --model DIR --calib FILE --seq-len 64 --calib-windows 2 \\
        --eval-windows 1 --retain 0.6 --rounds 1 --requests 4 --output-tokens 8 --out /tmp/x   # smoke run

Protocol: SmolLM2-135M (embedded), pruned by the one-shot structured method (`activation`,
uniform layout) at each --retain with calibration on WikiText-2 validation (16 x 2048 tokens,
as bench/spine.py), exported with `--format onnx` (fp32, validated on export), plus the dense
model through the same path (`--retain 1.0`) as the baseline. Then `bench PACKAGE --baseline
DENSE_PACKAGE` at concurrency 1 and 4: the ONNX server (runtime/ort_server.py, continuous
batching) for each, alternating for --rounds rounds, best-of-N reported. --ppl-windows N: each
package's graph itself, run by onnxruntime, on N windows of 2048 tokens of WikiText-2 test and of
exllamav2's c4 sample (texts no package reads), each window one prefill. The ideal ratio is
dense / pruned ONNX weight bytes (what a memory-bound decode step streams; for INT8 the manifest's
`size.ideal_ratio_quantized`, which leaves out an untied embedding that is only looked up). Writes onnx.json
and onnx.md into a new run folder bench/results/onnx/<date>-<commit>/ (or --out, which must
not hold an onnx.json yet); packages go under out/onnx/ (ignored by git).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import benchlib  # from bench/, this script's directory: before the line below takes it off sys.path
from benchlib import ROOT

# `python bench/onnx.py` puts bench/ first on sys.path, where this file would shadow the onnx package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from core.manifest import Manifest, is_package  # noqa: E402
from optimizer.pipeline import (DataConfig, HealSettings, OnnxSettings, OptimizeConfig, RefitSettings,  # noqa: E402
                                optimize)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF dir or GGUF (default: the embedded SmolLM2-135M)")
    ap.add_argument("--data", default=str(benchlib.DATA))
    ap.add_argument("--calib", help="calibration text (default: WikiText-2 validation from --data)")
    ap.add_argument("--retain", type=float, nargs="+", default=[0.7, 0.5])
    ap.add_argument("--target", default="cpu")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--eval-windows", type=int, default=4, help="perplexity windows (quality is spine.py's job)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, help="requests per level (default: bench's)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (pipeline) and onnxruntime threads (server)")
    ap.add_argument("--quant", default=["none"], nargs="+", choices=["none", "int8", "int8+head"],
                    help="the pruned packages' precision, a level for each at each --retain (int8: onnxruntime's INT8, "
                         "--onnx-int8; int8+head: the LM head too, quant_head); the dense baseline stays fp32")
    ap.add_argument("--onnx-int8", default="dynamic", choices=["dynamic", "qdq"],
                    help="with --quant int8: activations quantized at run time, or static scales in QDQ form")
    ap.add_argument("--ppl-windows", type=int, default=0,
                    help="perplexity of each graph in onnxruntime on this many 2048-token windows of WikiText-2 test "
                         "and of c4; 0: none")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--skip-serve", action="store_true", help="packages, export and validation times only")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse packages already under --packages (e.g. from a --skip-serve run) instead of rebuilding")
    ap.add_argument("--packages", default=str(ROOT / "out" / "onnx"))
    ap.add_argument("--out", help="run folder (default: a new bench/results/onnx/<date>-<commit>)")
    args = ap.parse_args()
    if args.onnx_int8 != "dynamic" and "none" in args.quant:
        ap.error("--onnx-int8 qdq applies to --quant int8")
    levels = [(retain, quant) for retain in args.retain for quant in args.quant]

    if args.ppl_windows:
        benchlib.c4_file()  # before any package is built
    calib = Path(args.calib) if args.calib else benchlib.data_file("valid", args.data)
    out, packages = benchlib.run_dir("onnx", args.out), Path(args.packages)
    path = benchlib.new_file(out / "onnx.json")
    for retain, quant in levels if not args.skip_serve else []:
        benchlib.new_file(out / f"bench-{_level_name(retain, quant, args)}")
    torch.set_num_threads(args.threads)
    results = {"protocol": {"model": args.model or "SmolLM2-135M-Instruct (embedded)", "target": args.target,
                            "method": "activation (one-shot structured, uniform)",
                            "format": "onnx fp32" if args.quant == ["none"] else
                            f"onnx {' / '.join(args.quant)} (levels; INT8 "
                            f"{'QDQ static' if args.onnx_int8 == 'qdq' else 'dynamic'}), fp32 (dense)",
                            "calib": str(calib), "seq_len": args.seq_len, "calib_windows": args.calib_windows,
                            "threads": args.threads, "rounds": args.rounds, "concurrency": args.concurrency,
                            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                            **benchlib.run_info()},
               "dense": None, "levels": []}
    # All packages first (the dense one too), then all serving runs back to back.
    texts = None  # --ppl-windows: tokenized once, every package shares the model's tokenizer
    for k, (retain, quant) in enumerate([(1.0, "none")] + levels):
        # the baseline: the dense fp32 graph (a level may be --retain 1.0 --quant int8)
        pkg = packages / f"{_name(args)}-{_level_name(retain, quant, args)}"
        t0 = time.time()
        if args.reuse and is_package(pkg):
            m = Manifest.read(pkg)
        else:
            shutil.rmtree(pkg, ignore_errors=True)
            m = optimize(OptimizeConfig(model=args.model, target=args.target, method="activation", retain=retain,
                                        out=str(pkg), format="onnx", threads=args.threads,
                                        quant=quant.removesuffix("+head"), quant_head=quant.endswith("+head"),
                                        onnx=OnnxSettings(int8=args.onnx_int8 if quant != "none" else "dynamic"),
                                        data=DataConfig(calib=str(calib), calib_windows=args.calib_windows,
                                                        eval_windows=args.eval_windows, seq_len=args.seq_len),
                                        heal=HealSettings(tokens=0), refit=RefitSettings(on=False)))["manifest"]  # speed: heal and refit keep the shapes
        c = m.checks["onnx"]
        entry = {"retain": retain, "package": str(pkg),
                 "quant": quant if quant == "none" else f"{quant} {m.onnx.get('int8_activations', 'dynamic')}",
                 "bench": _level_name(retain, quant, args),
                 "perplexity": (m.perplexity or {}).get("pruned"),
                 "optimize_wall_s": m.wall_s if args.reuse else round(time.time() - t0, 1),
                 "retain_achieved": m.method["retain_achieved"], "shape": m.method["shape"],
                 "onnx_bytes": m.onnx["bytes"], "export_s": c["export_s"], "validate_s": c["validate_s"],
                 "validation": {"prefill_max_abs_diff": c["prefill"]["logits_max_abs_diff"],
                                "decode_max_abs_diff": c["decode"]["logits_max_abs_diff"],
                                "greedy_matched": c["greedy"]["matched"], "greedy_tokens": c["greedy"]["tokens"],
                                "greedy_parted_at_near_tie": c["greedy"].get("parted_at_near_tie"),
                                "tolerance_of_scale": c.get("tolerance_of_scale"),
                                "as_written": c.get("as_written")}}  # a QDQ graph's exact check (docs/onnx.md)
        if args.ppl_windows:
            texts = texts or _perplexity_texts(pkg, args)
            entry.update(_graph_perplexities(pkg, m, texts, args))
        if k == 0:
            results["dense"] = entry
        else:
            entry["ideal_ratio"] = (m.size.get("ideal_ratio_quantized") if quant != "none" else None) or \
                results["dense"]["onnx_bytes"] / entry["onnx_bytes"]
            results["levels"].append(entry)
        benchlib.update_result(path, results)
    for level in results["levels"] if not args.skip_serve else []:
        bench_dir = out / f"bench-{level['bench']}"
        cmd = [str(ROOT / ".venv" / "bin" / "bench"), level["package"], "--baseline", results["dense"]["package"], "--concurrency", args.concurrency,
                "--rounds", str(args.rounds), "--prompt-tokens", str(args.prompt_tokens),
                "--output-tokens", str(args.output_tokens), "--port", str(args.port), "--out", str(bench_dir),
                "--vllm-args", f"--threads {args.threads}"]
        if args.requests:
            cmd += ["--requests", str(args.requests)]
        subprocess.run(cmd, check=True)
        summary = json.loads((bench_dir / "bench.json").read_text())["summary"]
        level["serving"] = benchlib.serving_figures(summary, level["ideal_ratio"])
        benchlib.update_result(path, results)
    benchlib.write_markdown(out / "onnx.md", _markdown(results))
    benchlib.plot_table(_markdown(results), out / "onnx.png", "ONNX packages on onnxruntime")
    print(_markdown(results))


def _as_written(x: dict) -> str:
    return (f"; the QDQ graph as written, rounding as onnxruntime did at {x['near_ties_taken_from_onnxruntime']} "
            f"near-ties of {x['activations_compared']:,} quantized values: {x['prefill']['logits_max_abs_diff']:.2e} / "
            f"{x['decode']['logits_max_abs_diff']:.2e}, caches {x['prefill']['present_max_abs_diff']:.2e}")


def _perplexity_texts(pkg: Path, args) -> dict:
    """--ppl-windows windows of WikiText-2 test and of c4, by the package's tokenizer."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(pkg)
    return {"wikitext2": benchlib.wikitext_windows(tok, "test", args.ppl_windows, data_dir=Path(args.data)),
            "c4": benchlib.c4_windows(tok, args.ppl_windows)}


def _graph_perplexities(pkg: Path, m: Manifest, texts: dict, args) -> dict:
    """The package's graph run by onnxruntime (one prefill a window) on each of `texts`."""
    import numpy as np

    from runtime.ort_server import OrtDecoder
    dec = OrtDecoder(pkg / m.onnx["files"][0], threads=args.threads)
    out = {}
    for name, windows in texts.items():
        nll, count = 0.0, 0
        for w in windows.numpy():
            ids = w[None]
            logits, _ = dec.run(ids, np.ones_like(ids), np.arange(ids.shape[1])[None], dec.empty_past(1))
            z = torch.from_numpy(logits[0, :-1]).float()
            nll += float(torch.nn.functional.cross_entropy(z, torch.from_numpy(w[1:]), reduction="sum"))
            count += len(w) - 1
        out[name] = float(np.exp(nll / count))
    print(f"{pkg.name}: onnxruntime perplexity WikiText-2 {out['wikitext2']:.3f}, c4 {out['c4']:.3f} "
          f"({args.ppl_windows} x 2048 tokens each)", flush=True)
    return {"graph_perplexity": {**out, "windows": args.ppl_windows, "seq_len": 2048}}


def _level_name(retain: float, quant: str, args) -> str:
    """A level's package and bench folder: r0.70, r1.00-int8, r1.00-int8+head-qdq."""
    return f"r{retain:.2f}" + ("" if quant == "none" else f"-{quant}" + ("-qdq" if args.onnx_int8 == "qdq" else ""))


def _name(args) -> str:
    return "smollm2" if not args.model else Path(args.model).name.lower()


def _markdown(results: dict) -> str:
    p, d = results["protocol"], results["dense"]
    levels = p["concurrency"].split(",")
    f = lambda x, fmt="{:.2f}": fmt.format(x) if x is not None else "—"  # noqa: E731
    lines = [f"# ONNX figures: {p['model']}, onnxruntime CPU", "",
             f"Method {p['method']}, {p['format']}, calibration {Path(p['calib']).name} "
             f"({p['calib_windows']} x {p['seq_len']} tokens); runtime/ort_server.py with {p['threads']} threads, "
             f"prompts of {p['prompt_tokens']} random tokens, {p['output_tokens']} output tokens, best of "
             f"{p['rounds']} alternating rounds against the dense model exported the same way.", ""]
    graph_ppl = "graph_perplexity" in (d or {})
    ppl_header = ["WikiText-2 PPL (graph)", "c4 PPL (graph)"] if graph_ppl else []

    def ppl_cells(x):
        g = x.get("graph_perplexity")
        return [f"{g['wikitext2']:.2f}", f"{g['c4']:.2f}"] if g else ["—"] * len(ppl_header)

    header = ["retain (achieved)", "shape (heads/KV/MLP)", "precision", "PPL", *ppl_header, "ONNX MB", "ideal",
              *[h for c in levels for h in (f"tok/s dense/pruned c={c}", f"ratio c={c}", f"of ideal c={c}")],
              "export", "validation"]
    rows = []
    if d:
        s = d["shape"]
        rows.append(["dense", f"{s['num_heads']}/{s['num_kv_heads']}/{s['intermediate_size']}",
                     d.get("quant", "none"), f(d.get("perplexity")), *ppl_cells(d), f"{d['onnx_bytes'] / 1e6:.0f}", "1.00x", *["—"] * (3 * len(levels)),
                     f"{d['export_s']:.1f} s", f"{d['validate_s']:.1f} s"])
    for lv in results["levels"]:
        s, sv = lv["shape"], lv.get("serving", {})
        cells = []
        for c in levels:
            x = sv.get(c, {})
            cells += [f"{f(x.get('dense_tok_s'), '{:.0f}')}/{f(x.get('pruned_tok_s'), '{:.0f}')}",
                      f(x.get('ratio')), f(x.get('fraction_of_ideal'), '{:.0%}')]
        rows.append([f"{lv['retain']:.2f} ({lv['retain_achieved']:.3f})",
                     f"{s['num_heads']}/{s['num_kv_heads']}/{s['intermediate_size']}", lv.get("quant", "none"),
                     f(lv.get("perplexity")), *ppl_cells(lv), f"{lv['onnx_bytes'] / 1e6:.0f}",
                     f"{lv['ideal_ratio']:.2f}x", *cells, f"{lv['export_s']:.1f} s", f"{lv['validate_s']:.1f} s"])
    lines.append(benchlib.markdown_table(header, rows, align="lllr" + "r" * len(ppl_header) + "rr" + "rrr" * len(levels) + "rr"))
    lines += ["", "Validation on export (max |logit diff| vs PyTorch, prefill / decode; greedy tokens matched, or where "
                  "the two parted at a near-tie, which the check allows; an INT8 graph is held to its fake-quantized "
                  "PyTorch twin with a wider tolerance, docs/onnx.md):", ""]
    for lv in ([d] if d else []) + results["levels"]:
        v = lv["validation"]
        tie = v.get("greedy_parted_at_near_tie")
        lines.append(f"- {lv.get('bench') or 'r=%.2f' % lv['retain']}: {v['prefill_max_abs_diff']:.2e} / {v['decode_max_abs_diff']:.2e}; "
                     f"greedy {v['greedy_matched']}/{v['greedy_tokens']}"
                     + (f", parted at a near-tie at token {tie['step']} (logit margin {tie['logit_margin']:.3f})"
                        if tie else "")
                     + (_as_written(v["as_written"]) if v.get("as_written") else ""))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
