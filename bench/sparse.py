"""The semi-structured family against llm-compressor, side by side (issue 5 figures).

    .venv/bin/python bench/sparse.py                       # everything below; --reuse keeps finished runs
    .venv/bin/python bench/sparse.py --runs sparsegpt:2:4 wanda:2:4 --no-peer
    bench/setup_peer.sh                                    # once: llm-compressor in .venv-peer (optional)

Protocol: SmolLM2-135M (embedded), calibration = the first --calib-windows windows of 2048
tokens of WikiText-2 validation (the same token ids for our pruners and the peer), perplexity
on the first --eval-windows windows of 2048 tokens of the WikiText-2 raw test split, fp32,
--threads torch threads for every run. Each of our runs is the product's own path
(`optimize(OptimizeConfig(method=..., sparsity=...))`, target h100 with vLLM 0.18 so 2:4
packages carry the sparse config); its wall time is the pruning alone (manifest wall_s).
The peer runs `oneshot` with SparseGPTModifier(mask_structure="2:4") in .venv-peer on the same
windows (bench/peer_llmcompressor.py), in its own process *at the same time* as our runs, so
both see the same machine load; its wall time is `oneshot` alone. A finished peer run is cached
per window count; `--fresh-peer` reruns it beside this invocation's runs, and only runs made
beside a running peer — still running when ours ended — get a wall-time ratio in the table
(`beside_peer`).

Writes sparse.json and sparse.md into a new run folder bench/results/sparse/<date>-<commit>/,
or into --out's: several processes (one per core, different --runs) given the same --out add
their rows to its sparse.json. A row already there is never replaced: --reuse keeps it (and
skips that run), otherwise the script stops before running anything.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import torch

import benchlib
from benchlib import ROOT
from optimizer import evaluate, load
from optimizer.job import dense_perplexity
from optimizer.pipeline import DataConfig, HealSettings, OptimizeConfig, RoISettings, SISettings, optimize
from peer_llmcompressor import PEER_RECIPE  # (bench/ is this script's directory)

DEFAULT_RUNS = ["magnitude:2:4", "wanda:2:4", "sparsegpt:2:4", "si+magnitude:2:4", "si+wanda:2:4",
                "si+sparsegpt:2:4", "roi:2:4",
                "magnitude:4:8", "wanda:4:8", "sparsegpt:4:8", "magnitude:2:8", "wanda:2:8", "sparsegpt:2:8"]
PEER_PYTHON = ROOT / ".venv-peer" / "bin" / "python"
PEER_RUN = "llm-compressor:2:4"
# Kept as the file has them when another process of the run wrote them first: its command line
# (each row records its own), and measurements any process makes alike.
KEEP = [*(f"protocol.{k}" for k in benchlib.RUN_KEYS), "dense_ppl", "si_fast_update"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(benchlib.DATA))
    ap.add_argument("--runs", nargs="*", default=DEFAULT_RUNS,
                    help="method:N:M entries; method:N:M@float32 (or @bfloat16) sets that run's --calib-dtype")
    ap.add_argument("--calib-windows", type=int, default=32)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    defaults = OptimizeConfig()  # the product's defaults, so a bench run measures what users get
    ap.add_argument("--roi-steps", type=int, default=defaults.roi.steps)
    ap.add_argument("--roi-seq-len", type=int, default=defaults.roi.seq_len, help="RoI: tokens per step (optimize --roi-seq-len)")
    ap.add_argument("--si-steps", type=int, default=defaults.si.steps)
    ap.add_argument("--seed", type=int, default=defaults.seed, help="optimize --seed (RoI: its noise and data order)")
    ap.add_argument("--calib-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="our calibration passes (optimize --set calib_dtype=...); the peer runs fp32 as it ships")
    ap.add_argument("--no-peer", action="store_true", help="skip llm-compressor")
    ap.add_argument("--fresh-peer", action="store_true",
                    help="rerun llm-compressor beside our runs even if a finished run of it is cached")
    ap.add_argument("--reuse", action="store_true", help="keep results of runs already in --out's JSON")
    ap.add_argument("--out", help="run folder (default: a new bench/results/sparse/<date>-<commit>; "
                                  "an earlier run's to add rows to it)")
    ap.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                    help="only merge the runs of these result files into --out's and rewrite the table")
    args = ap.parse_args()
    run_info = benchlib.run_info()
    if args.merge:
        if args.out is None:
            raise SystemExit("error: --merge adds runs to an earlier run's sparse.json: name its folder with --out")
        path = Path(args.out) / "sparse.json"
        if not path.is_file():
            raise SystemExit(f"error: {path}: no such file")
        for other in args.merge:
            other = json.loads(Path(other).read_text())
            results = benchlib.update_result(path, {"runs": other["runs"], **{k: other[k] for k in ("si_fast_update",)
                                                                             if other.get(k) is not None}}, KEEP)
        benchlib.write_markdown(Path(args.out) / "sparse.md", table(results))
        print(table(results))
        return

    data = Path(args.data)
    out = benchlib.run_dir("sparse", args.out)
    work = ROOT / "out" / "sparse"
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    path = out / "sparse.json"
    on_disk = benchlib.read_result(path, {"runs": {}})
    clash = [r for r in [*args.runs, *([] if args.no_peer else [PEER_RUN])] if r in on_disk["runs"]]
    if clash and not args.reuse:
        raise SystemExit(f"error: {path} has {', '.join(clash)} already; results are never replaced: run without "
                         "--out (a new run folder), or with --reuse to keep those rows and add the rest")
    results = on_disk if args.reuse else {"runs": {}}
    source = load.resolve(None)
    results["protocol"] = {"model": source.description, "calib_windows": args.calib_windows, "seq_len": 2048,
                           "eval_windows": args.eval_windows, "threads": args.threads, "roi_steps": args.roi_steps,
                           "roi_seq_len": args.roi_seq_len, "seed": args.seed,
                           "si_steps": args.si_steps, "calib_dtype": args.calib_dtype, **run_info}
    benchlib.check_update(path, results, KEEP)  # the same settings as the rows there, before any run
    model, tok = load.load_model(source)
    calib = benchlib.wikitext_windows(tok, "valid", args.calib_windows, data_dir=data)
    evalw = benchlib.wikitext_windows(tok, "test", args.eval_windows, data_dir=data)
    results["dense_ppl"] = dense_perplexity(model, evalw, source)
    if "si_fast_update" not in on_disk:  # else the file's is kept (KEEP)
        results["si_fast_update"] = si_fast_update(model, calib[:4])
    del model
    results = _save(results, path)

    # The peer runs *beside* our runs (its own process, same thread count), so both see the
    # same machine load; its perplexity is measured once both are done.
    peer = None
    if not args.no_peer and PEER_PYTHON.is_file():
        if PEER_RUN not in results["runs"]:
            peer = _start_peer(source, calib, work, args.threads, fresh=args.fresh_peer)
    elif not args.no_peer:
        print(f"peer skipped: {PEER_PYTHON} missing (run bench/setup_peer.sh)")
    for run in args.runs:
        spec, _, dtype = run.partition("@")  # "sparsegpt:2:4@float32": this run's passes' dtype
        method, pattern = spec.split(":", 1)
        done = benchlib.read_result(path)["runs"]  # as it is now: other processes add to it too
        if run in done:
            if args.reuse:
                continue
            raise SystemExit(f"error: another process made {run} in {path} meanwhile; results are never replaced")
        pkg = work / f"{method}-{pattern.replace(':', 'of')}{'-' + dtype if dtype else ''}"
        shutil.rmtree(pkg, ignore_errors=True)
        r = optimize(OptimizeConfig(target="h100", engine_version="0.18.0", method=method, sparsity=pattern,
                                    data=DataConfig(calib=str(benchlib.data_file("valid", data)),
                                                    eval=str(benchlib.data_file("test", data)),
                                                    calib_windows=args.calib_windows, eval_windows=args.eval_windows),
                                    threads=args.threads, si=SISettings(steps=args.si_steps),
                                    roi=RoISettings(steps=args.roi_steps, seq_len=args.roi_seq_len), seed=args.seed,
                                    heal=HealSettings(tokens=0), quant="none",  # the pruning methods, unhealed (bench/heal.py heals)
                                    out=str(pkg), calib_dtype=dtype or args.calib_dtype),
                     log=lambda *a: print(*a, flush=True))
        m = r["manifest"].method
        results["runs"][run] = {"method": method, "sparsity": pattern, "ppl": r["manifest"].perplexity["pruned"],
                                "wall_s": m["wall_s"], "zero_fraction": m["zero_fraction"],
                                "calib_dtype": m.get("calib_dtype", "float32"), "beside_peer": peer is not None and peer[1] is not None and peer[1].poll() is None,
                                **{k: m[k] for k in ("si", "roi") if k in m}, **run_info}
        results = _save(results, path)

    if peer is not None:
        results["runs"][PEER_RUN] = {**_finish_peer(*peer, evalw), **run_info}
        results = _save(results, path)
    benchlib.write_markdown(out / "sparse.md", table(results))
    benchlib.plot_table(table(results), out / "sparse.png", "semi-structured pruning against llm-compressor")
    print(table(results))


def si_fast_update(model, windows: torch.Tensor) -> dict:
    """SI's fast Wanda-metric update vs recomputation after a transform, on block 0 (paper: 22.65×).

    The transform is SI's statistics-based start for that block; recomputation absorbs it into
    a copy of the block and reruns it over `windows` for new input statistics."""
    from optimizer import absorb
    from optimizer.adapters import get_adapter
    from optimizer.methods.si import SparsityInduction, input_stats, time_wanda_update
    from optimizer.methods.wanda import Wanda
    from optimizer.sequential import block_inputs
    from optimizer.sparsity import parse
    import copy
    model = copy.deepcopy(model)
    adapter = get_adapter(model.config)
    inputs, kwargs = block_inputs(model, adapter, windows)
    block = adapter.blocks(model)[0]
    si = SparsityInduction(model, adapter, Wanda, parse("2:4"))
    t, _ = si.initial(input_stats(block, adapter, inputs, kwargs), absorb.layout(block, adapter))
    timing = time_wanda_update(block, adapter, inputs, kwargs, t)
    return {**timing, "block": 0, "tokens": windows.numel(), "paper_speedup": 22.65}


def _start_peer(source, calib, work: Path, threads: int, fresh: bool = False):
    """Start llm-compressor on `calib` in .venv-peer (unless a finished run is cached and not
    `fresh`); returns (package dir, process or None)."""
    windows = work / f"calib-windows-w{len(calib)}.pt"
    torch.save(calib, windows)
    pkg = work / f"peer-sparsegpt-2of4-w{len(calib)}"
    cached = json.loads((pkg / "peer.json").read_text()) if (pkg / "peer.json").is_file() else {}
    if cached.get("recipe") == PEER_RECIPE and not fresh:
        return pkg, None
    shutil.rmtree(pkg, ignore_errors=True)
    proc = subprocess.Popen([str(PEER_PYTHON), str(ROOT / "bench" / "peer_llmcompressor.py"), str(source.hf_dir),
                             str(windows), str(pkg), "--threads", str(threads)],
                            stdout=open(work / f"peer-w{len(calib)}.log", "w"), stderr=subprocess.STDOUT)
    return pkg, proc


def _finish_peer(pkg: Path, proc, evalw) -> dict:
    if proc is not None and proc.wait() != 0:
        raise RuntimeError(f"llm-compressor failed; see {pkg.parent}/peer-*.log")
    peer = json.loads((pkg / "peer.json").read_text())
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(pkg)
    if hasattr(cfg, "quantization_config"):  # its sparsity metadata; the weights are plain tensors
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_pretrained(pkg, config=cfg, dtype=torch.float32).eval()
    return {"method": peer["tool"], "sparsity": "2:4", "ppl": evaluate.perplexity(model, evalw, "peer perplexity"),
            "wall_s": peer["oneshot_wall_s"], "threads": peer["threads"], "recipe": peer.get("recipe"),
            "lm_head_zero_fraction": peer.get("lm_head_zero_fraction")}


def _save(results: dict, path: Path) -> dict:
    """Add this process's rows to the file and return what it holds now. Several bench
    processes (one per core, different --runs) may share one results file: rows another
    process added stay, and none is ever replaced (benchlib.update_result)."""
    return benchlib.update_result(path, results, KEEP)


def table(results: dict) -> str:
    dense = results["dense_ppl"]
    runs = results["runs"]
    peer = runs.get(PEER_RUN)
    p = results["protocol"]
    lines = [f"Dense perplexity {dense:.3f} ({p['eval_windows']} × 2048 tokens of WikiText-2 test); "
             f"calibration {p['calib_windows']} × 2048 tokens of WikiText-2 validation; {p['threads']} torch thread(s).",
             ""]
    rows = []
    for name, r in runs.items():
        excess = r["ppl"] - dense
        vs = f"{excess / (peer['ppl'] - dense):.2f}×" if peer and r["sparsity"] == "2:4" else "—"
        # a wall-time ratio only for runs made while the peer ran beside them (same load)
        wall = f"{peer['wall_s'] / r['wall_s']:.2f}×" if peer and r.get("beside_peer") and r is not peer else "—"
        passes = {"bfloat16": "bf16", "float32": "fp32", None: "none"}[r.get("calib_dtype", "float32")]
        rows.append([r["method"], r["sparsity"], passes, f"{r['ppl']:.3f}", f"{excess:.3f}", vs, f"{r['wall_s']:.0f}", wall])
    lines.append(benchlib.markdown_table(["method", "sparsity", "passes", "PPL", "excess PPL", "excess / peer's", "wall s",
                                          "peer's wall / ours (side by side)"], rows))
    fu = results.get("si_fast_update")
    if fu:
        lines += ["", f"SI fast Wanda-metric update vs recomputation (block 0, {fu['tokens']} tokens): "
                      f"{fu['recompute_s']:.3f} s → {fu['fast_s']:.4f} s, **{fu['speedup']:.1f}×** (paper: 22.65× on LLaMA-7B)."]
    roi = next((r["roi"] for r in runs.values() if "roi" in r), None)
    if roi:
        lines += [f"RoI trainable state (φ + Adam moments): {roi['trainable_state_bytes'] / 2**30:.2f} GiB = "
                  f"**{roi['state_to_model_ratio']:.2f}×** the fp32 model; {roi['steps']} steps × {roi['seq_len']} tokens."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
