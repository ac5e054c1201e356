"""Click commands: serve PACKAGE, bench PACKAGE --baseline MODEL."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

import click

from core.engines import installed_vllm_version
from core.errors import UserError, one_line_errors
from core.manifest import Engine, Manifest, is_package
from serve import launch, loadgen, report

# `bench` of a model directory another tool wrote (e.g. llm-compressor's W8A8): served as our vLLM
# packages are (exporters/vllm.recommended_args at the packages' max-model-len), so that it and its
# baseline run under the same engine arguments.
MODEL_DIR_ARGS = ["--dtype", "bfloat16", "--max-model-len", "2048"]


def _manifest_or_model(package: str) -> tuple[Manifest, bool]:
    """The package's manifest, and whether it stands in for a model directory without one (what
    bench needs of it: a served name and the packages' engine arguments; no size, no plan)."""
    if not is_package(package) and (Path(package) / "config.json").is_file():
        return Manifest(engine=Engine(served_model_name=Path(package).resolve().name, args=MODEL_DIR_ARGS)), True
    return Manifest.read(package), False


@click.command(context_settings={"help_option_names": ["-h", "--help"], "ignore_unknown_options": True})
@click.argument("package", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True)
@click.option("--tensor-parallel-size", "-tp", type=int, help="Shard over this many GPUs (vLLM tensor parallelism).")
@click.option("--print-command", is_flag=True, help="Print the server command instead of running it.")
@click.option("--api-key", envvar="VLLM_API_KEY", show_envvar=True,
              help="Require `Authorization: Bearer KEY` on every route but /health (vLLM's --api-key; the ONNX "
                   "server's too). Default: $VLLM_API_KEY. Given to the server in its environment as "
                   "VLLM_API_KEY, which both read, so that it stays out of the process list.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
@one_line_errors
def serve(package, host, port, tensor_parallel_size, print_command, api_key, vllm_args):
    """Start vLLM's OpenAI-compatible server for PACKAGE with its recommended arguments.

    Arguments after the options go to vLLM unchanged (e.g. `serve PKG --enforce-eager`).
    An ONNX package (optimize --format onnx) is served by onnxruntime behind the same
    endpoint (runtime/ort_server.py); arguments then go to that server (e.g. `--threads 2`).
    """
    manifest = Manifest.read(package)
    extra = list(vllm_args)
    if tensor_parallel_size:
        if manifest.format == "onnx":
            raise UserError("-tp is vLLM tensor parallelism; an ONNX package is served by onnxruntime")
        extra += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if any(a == "--api-key" or a.startswith("--api-key=") for a in extra):
        raise UserError("give the key as serve's own --api-key (or $VLLM_API_KEY): it then reaches the server "
                        "in its environment, not on its command line")
    cmd = launch.package_command(package, manifest, host, port, extra)
    if print_command:
        click.echo(shlex.join(cmd))
        if api_key:
            click.echo("note: the server reads its API key from VLLM_API_KEY in its environment (not shown)", err=True)
        return
    click.echo(f"serving {manifest.engine.served_model_name} on http://{host}:{port}/v1 "
               f"({shlex.join(cmd[1:4])} ...){', API key required' if api_key else ''}", err=True)
    env = launch.server_env(manifest, api_key)
    os.execvpe(cmd[0], cmd, env)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("package", type=click.Path())
@click.option("--baseline", help="Dense model to compare with: HF dir, GGUF, hub id, or 'embedded' "
                                 "(default: the package's source model), or a package directory, served "
                                 "by its own format (an ONNX package needs an ONNX baseline package).")
@click.option("--concurrency", default="1,4,16", show_default=True, help="Comma-separated load levels.")
@click.option("--requests", "requests_per_level", type=int, help="Requests per level (default: max(8, 2 x concurrency)).")
@click.option("--prompt-tokens", default=128, show_default=True)
@click.option("--output-tokens", default=64, show_default=True)
@click.option("--rounds", default=2, show_default=True, help="Alternating dense/pruned rounds; best-of-N is reported.")
@click.option("--repeat", default=1, show_default=True,
              help="Measurements of each level in each round (one server start); all count towards best-of-N.")
@click.option("--port", default=8123, show_default=True, help="The baseline's port (and the package's; with "
                                                                 "--interleave the package's is the next one).")
@click.option("--interleave", is_flag=True,
              help="Run both servers at once and measure them in turn, measurement by measurement, so the machine's "
                   "drift falls on both alike (memory for both needed; on a GPU give each its share, e.g. "
                   "--vllm-args '--gpu-memory-utilization 0.45'). Default: one server at a time, a start a round.")
@click.option("--out", type=click.Path(), help="Directory for bench.json / bench.md / bench.png "
                                              "(default: bench-results/<package name>).")
@click.option("--vllm-args", default="", help="Extra vLLM arguments for both servers, e.g. '--enforce-eager' "
                                              "(ONNX packages: ort_server arguments, e.g. '--threads 2').")
@click.option("--api-key", envvar="VLLM_API_KEY", show_envvar=True,
              help="Start both servers with this API key (in their environment, as `serve --api-key`) and send "
                   "it with every request.")
@one_line_errors
def bench(package, baseline, concurrency, requests_per_level, prompt_tokens, output_tokens, rounds, repeat, port,
          interleave, out, vllm_args, api_key):
    """Measure PACKAGE and its dense baseline side by side under the same load.

    Every request must succeed: bench.json (summary.requests) and bench.md state the requests
    sent / succeeded / failed per model and level. When any request was lost, at a level or in
    a warm-up, the report is still written, a line starting with FAILED names where, and the
    exit status is 1 (0: none lost; 2: bad arguments).
    """
    manifest, model_dir = _manifest_or_model(package)
    if model_dir and baseline is None:
        raise UserError(f"{package}: a model directory, not a package made by optimize: name its --baseline")
    try:
        levels = sorted({int(c) for c in concurrency.split(",")})
    except ValueError:
        raise UserError(f"--concurrency must be comma-separated integers, got {concurrency!r}") from None
    if not levels or min(levels) < 1 or rounds < 1 or repeat < 1:
        raise UserError("--concurrency levels, --rounds and --repeat must be >= 1")
    base_dir, base_manifest = _baseline(baseline, manifest)
    name = manifest.engine.served_model_name
    out_dir = Path(out or Path("bench-results") / name)
    extra = shlex.split(vllm_args)
    if any(a == "--port" or a.startswith("--port=") for a in extra):
        raise UserError("--vllm-args must not set --port: give bench --port (with --interleave the package "
                        "takes the next one)")
    if any(a == "--api-key" or a.startswith("--api-key=") for a in extra):
        raise UserError("--vllm-args must not set --api-key: give bench --api-key (it reaches both servers and "
                        "the load generator)")
    vocab = json.loads((Path(package) / "config.json").read_text())["vocab_size"]
    host = "127.0.0.1"
    if base_manifest is None:  # a model directory: vLLM with the package's arguments
        dense_cmd = launch.server_command(str(base_dir), "dense", manifest.engine.args) + \
            ["--host", host, "--port", str(port), *extra]
    else:
        dense_cmd = launch.package_command(base_dir, base_manifest, host, port, extra, served_name="dense")
    pruned_cmd = launch.package_command(package, manifest, host, port, extra)  # built once: it may print a note
    # each server's command (at --port; with --interleave the package's moves to the next one) and its served name
    servers = {"dense": (dense_cmd, "dense"), "pruned": (pruned_cmd, name)}
    env = launch.server_env(manifest, api_key)
    measure = _measure_interleaved if interleave else _measure_alternating
    runs, warmup = measure(servers, env, host, port, out_dir, levels, rounds, repeat,
                           _Load(requests_per_level, prompt_tokens, output_tokens, vocab, api_key))
    results = {
        "meta": {"package": str(Path(package).resolve()), "baseline": str(base_dir),
                 "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 "host": platform.node(), "cpus": os.cpu_count(), "engine": _engine_version(manifest),
                 "engine_args": manifest.engine.args + extra, "rounds": rounds, "repeat": repeat,
                 "interleave": interleave, "api_key": bool(api_key),  # whether one was required, never the key
                 "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
                 "command": " ".join(sys.argv)},
        "runs": runs,
        "warmup": warmup,
        "ideal_ratio": ideal_ratio(manifest, base_manifest, base_dir),
        "predicted": predicted_speedups(manifest, base_manifest, base_dir),
    }
    summary = report.write_report(results, out_dir)
    click.echo(report.markdown_table(summary))  # ends with the Requests: / FAILED: line
    click.echo(f"written: {out_dir}/bench.json, bench.md, bench.png", err=True)
    if not summary["requests"]["all_succeeded"]:
        click.echo(report.requests_line(summary), err=True)
        sys.exit(1)


def _measure_alternating(servers, env, host, port, out_dir, levels, rounds, repeat, load):
    """One server at a time: each round starts the baseline and the package in turn (the order
    alternates round by round, against slow drift) and measures every level `repeat` times."""
    runs = {label: {str(c): [] for c in levels} for label in servers}
    warmup = {label: [] for label in servers}  # not measured, but its requests must not be lost either
    base_url = f"http://{host}:{port}"
    for r in range(rounds):
        order = ["dense", "pruned"] if r % 2 == 0 else ["pruned", "dense"]  # cancel slow drift
        for label in order:
            cmd, served = servers[label]
            click.echo(f"round {r + 1}/{rounds}: starting {label} server", err=True)
            with launch.running(cmd, env, base_url, out_dir / f"server-{label}-{r + 1}.log", api_key=load.api_key):
                warmup[label].append(_warm_up(base_url, served, label, levels, r, load))
                for c in levels:
                    for k in range(repeat):  # a new seed each time: no prefix-cache hit on an earlier prompt
                        runs[label][str(c)].append(_measure_once(base_url, served, label, c, r + 100_000 * k,
                                                                 load))
    return runs, warmup


def _measure_interleaved(servers, env, host, port, out_dir, levels, rounds, repeat, load):
    """Both servers up at once (the package's at port + 1), measured in turn at every level: each
    measurement of one lies next to one of the other in time, so a drift of the machine cannot fall
    on one side. Each round starts both anew, in alternating order, so that the rounds sample
    several server starts and neither side always starts second. Needs memory for both."""
    runs = {label: {str(c): [] for c in levels} for label in servers}
    warmup = {label: [] for label in servers}
    ports = {"dense": port, "pruned": port + 1}
    urls = {label: f"http://{host}:{p}" for label, p in ports.items()}
    for r in range(rounds):
        starts = ["dense", "pruned"] if r % 2 == 0 else ["pruned", "dense"]
        with contextlib.ExitStack() as stack:
            for label in starts:
                cmd, _ = servers[label]
                click.echo(f"round {r + 1}/{rounds}: starting {label} server at port {ports[label]}", err=True)
                stack.enter_context(launch.running(_with_port(cmd, ports[label]), env, urls[label],
                                                   out_dir / f"server-{label}-{r + 1}.log", api_key=load.api_key))
            for label in starts:
                warmup[label].append(_warm_up(urls[label], servers[label][1], label, levels, r, load))
            for c in levels:
                for k in range(repeat):
                    order = starts if k % 2 == 0 else starts[::-1]
                    for label in order:  # the same prompts to both (the same seed); each server sees them once
                        runs[label][str(c)].append(_measure_once(urls[label], servers[label][1], label, c,
                                                                 r + 100_000 * k, load))
    return runs, warmup


class _Load(NamedTuple):
    """What every measurement sends: requests per level (None: max(8, 2 x concurrency)), token counts,
    vocabulary, and the API key the servers require (None: none)."""
    requests_per_level: int | None
    prompt_tokens: int
    output_tokens: int
    vocab: int
    api_key: str | None = None


def _warm_up(base_url, served, label, levels, r, load: _Load) -> dict:
    """First requests pay for graph capture / allocator growth: run, not measured."""
    res = loadgen.run_load(base_url, served, loadgen.LoadSpec(max(levels), max(levels), load.prompt_tokens,
                                                              load.output_tokens), load.vocab, seed=10_000 + r,
                           api_key=load.api_key)
    if res["failed"]:
        click.echo(f"  {label} warm-up: {_requests_text(res)}", err=True)
    return res


def _measure_once(base_url, served, label, c, seed, load: _Load) -> dict:
    """One measurement of one server at concurrency c, echoed as it ends."""
    n = load.requests_per_level or max(8, 2 * c)
    res = loadgen.run_load(base_url, served, loadgen.LoadSpec(c, n, load.prompt_tokens, load.output_tokens),
                           load.vocab, seed=seed, api_key=load.api_key)
    click.echo(f"  {label} c={c}: {res['output_tokens_per_s']:.1f} tok/s, {_requests_text(res)}", err=True)
    return res


def _with_port(cmd: list[str], port: int) -> list[str]:
    """The server command with its --port replaced."""
    cmd = list(cmd)
    cmd[cmd.index("--port") + 1] = str(port)
    return cmd


def _requests_text(res: dict) -> str:
    """'8/8 succeeded' or '1 of 8 FAILED (first error)' for one run_load result."""
    n = res["completed"] + res["failed"]
    if not res["failed"]:
        return f"{res['completed']}/{n} succeeded"
    first = f" ({res['errors'][0]})" if res.get("errors") else ""
    return f"{res['failed']} of {n} FAILED{first}"


def ideal_ratio(manifest: Manifest, base_manifest: Manifest | None, base_dir: Path | None = None) -> float | None:
    """The package's ideal speed-up over what it is compared with (its weight bytes against the
    dense model's in bf16, quantized bytes where it is quantized): both ratios are against the
    dense model, so against another package it is their quotient. Against a model directory that
    is not ours and holds a quantization_config (another tool's checkpoint) it is unknown: None."""
    if manifest.ideal_ratio is None:  # a model directory another tool wrote: its bytes are not ours to know
        return None
    if base_manifest is not None:
        return manifest.ideal_ratio / base_manifest.ideal_ratio
    if base_dir is not None and (base_dir / "config.json").is_file():
        if "quantization_config" in json.loads((base_dir / "config.json").read_text()):
            return None
    return manifest.ideal_ratio


def predicted_speedups(manifest: Manifest, base_manifest: Manifest | None, base_dir: Path) -> dict | None:
    """The plan's roofline decode speedups on the package's target (batch 1 and 16, against the dense
    source model in bf16), for the report to set beside the measured ones: only where the baseline
    is that source model, which the prediction is about."""
    pred = manifest.plan.prediction if manifest.plan else None
    src = manifest.source.hf_dir if manifest.source else None
    if not pred or base_manifest is not None or not src or Path(src).resolve() != Path(base_dir).resolve():
        return None
    import torch
    return {"target": manifest.target.name, "kind": manifest.target.kind,
            "host": "gpu" if torch.cuda.is_available() else "cpu",
            "prompt_tokens": pred.get("prompt_tokens"), "context_tokens": pred.get("context_tokens"),
            "decode": {"1": pred["decode_speedup_b1"], "16": pred["decode_speedup_b16"]}}


def _baseline(baseline: str | None, manifest: Manifest) -> tuple[Path, Manifest | None]:
    """The baseline's directory, and its manifest when it is a package (served by its own format)."""
    fmt = manifest.format
    if baseline is not None and is_package(baseline):
        base_manifest = Manifest.read(baseline)
        if base_manifest.format != fmt:
            raise UserError(f"the baseline package is {base_manifest.format} and the package is {fmt}: "
                            "compare packages of the same format")
        return Path(baseline).resolve(), base_manifest
    if fmt == "onnx":
        raise UserError("an ONNX package is measured against an ONNX baseline: make one with "
                        "`optimize MODEL --retain 1.0 --format onnx` and pass its directory as --baseline")
    return _baseline_dir(baseline, manifest), None


def _baseline_dir(baseline: str | None, manifest: Manifest) -> Path:
    from optimizer import load  # a dense model by name (hub id, GGUF, 'embedded'): the product's public loader
    if baseline is None:
        if manifest.source is None or not manifest.source.hf_dir:
            raise UserError("the package names no source model; pass --baseline MODEL")
        path = Path(manifest.source.hf_dir)
        if (path / "config.json").is_file():
            return path
        raise UserError(f"the package's source {path} is not on this machine; pass --baseline MODEL")
    return load.resolve(None if baseline in ("embedded", "default") else baseline).hf_dir


def _engine_version(manifest: Manifest) -> str:
    if manifest.format == "onnx":
        import onnxruntime
        return f"onnxruntime {onnxruntime.__version__}"
    return f"vllm {installed_vllm_version() or 'unknown'}"
