"""The optimize job, end to end: profile → plan → method → surgery → export.

`optimize(OptimizeConfig(...))` is the one-verb API the CLI wraps. Every check that can fail
on bad input runs before the first expensive step, and the package is written to a
temporary directory that is renamed into place only when complete.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from exporters import per_layer as per_layer_export
from exporters import vllm as vllm_export
from optimizer import budget, data, evaluate, load, plan as planner, profiles, report, sparsity
from optimizer.adapters import get_adapter
from optimizer.errors import UserError
from optimizer.methods.activation import ActivationImportance
from optimizer.methods.ddp import DDP, DDPConfig, UnitCosts, peak_rss_gib
from optimizer.sequential import calibration_dtype
from optimizer.surgery import layer_shapes, masked, prune, prune_per_layer

TOOL_VERSION = "0.1.0"


def _exporter(fmt: str):
    """The module that writes a package of this format: write_package(tmp, out, model, tok, manifest, report)."""
    if fmt == "onnx":
        from exporters import onnx as onnx_export
        return onnx_export
    return vllm_export


EXPORTERS = ("vllm", "onnx")
LAYOUTS = ("uniform", "per-layer")


@dataclass
class OptimizeConfig:
    model: str | None = None          # HF dir, hub id, GGUF file; None = embedded default
    target: str = "auto"
    method: str = "auto"
    retain: float = 0.7               # fraction of the blocks' parameters kept
    calib: str | None = None          # text file; None = built-in corpus / self-generated
    eval: str | None = None           # text file; None = held-out half of the built-in corpus
    out: str | None = None
    dry_run: bool = False
    format: str = "vllm"              # vllm | onnx
    onnx_dtype: str = "float32"       # float32 | float16 (ONNX packages)
    engine_version: str | None = None
    calib_windows: int = 16           # windows the one-shot statistics and --refit read; DDP trains on all but the held-out one
    eval_windows: int | None = 16     # None = every window of the eval text
    seq_len: int = 2048
    max_model_len: int = 2048
    seed: int = 0
    threads: int | None = None
    budget: str = "params"            # what --retain counts: params | latency (on the target)
    layout: str = "uniform"           # uniform (plain config) | per-layer (DDP: DeciLM or plugin package)
    ddp_steps: int = 80                # measured: bench/ddp.py (160 helped at 0.8 and hurt at 0.7, both layouts)
    # DDP's training settings (bench/results/ddp-probes/README.md has the runs): longer training
    # sequences and a looser budget won at every level (SmolLM2-135M per layer, before the budget
    # fill: 29.80 / 36.77 / 63.19 at 0.8 / 0.7 / 0.5, against 32.51 / 41.74 / 79.06 at 2 × 256
    # tokens and β = 50).
    # None: by layout (_ddp_by_layout). Held to one shape (the uniform layout's layer budget),
    # 4 sequences a step: SmolLM2 29.05 / 35.24 / 74.82 at 0.8 / 0.7 / 0.5, within ½ the baseline's
    # excess at every level, where 2 gave 29.94 / 36.41 / 74.05 and 1 gave 30.60 / 39.61 / 80.81
    # (README); a step costs its sequences, so training takes 4 times as long as at 1 (about 15
    # minutes on 2 cores). Per layer 1, the runs its figures are from.
    ddp_batch: int | None = None       # DDP sequences per step
    ddp_seq_len: int = 1024            # DDP training sequence length (the whole window where it does not divide seq_len)
    ddp_start: str = "baseline"       # DDP: gates start at the one-shot baseline's selection | dense (the paper's)
    ddp_lr: float = 0.05
    # None: by layout. Held to one shape (the uniform layout's layer budget), the learning rate
    # falls along a cosine to lr / 10: SmolLM2 30.60 / 39.61 / 80.81 at 0.8 / 0.7 / 0.5, against
    # 32.17 / 39.95 / 105.59 at a constant one (both at 1 sequence a step). Per layer it stays constant: where the final cut
    # to the budget depends on where the multiplier's swing ends, a cosine to 0 cost 0.7 and 0.5
    # (38.38 / 117.04 against 35.15 / 57.91). Set it to ddp_lr for a constant rate.
    ddp_lr_end: float | None = None
    ddp_beta: float = 25.0             # augmented-Lagrangian penalty (DDPConfig.beta)
    ddp_beta_start: float | None = None
    ddp_project_uniform: bool = False  # uniform layout: train the gates projected onto the baseline's shape
    # Uniform layout: hold every layer to the baseline's shape (DDPConfig.layer_shape). Exporting
    # gates trained under one model-wide budget cut every layer back to one shape, which cost more
    # the further training had moved units between layers (SmolLM2, at a constant learning rate:
    # 32.17 / 39.95 / 105.59 with it, 33.83 / 44.54 / 102.33 without).
    ddp_layer_budget: bool = True
    resume: bool = False
    checkpoint_every: int = 25
    sparsity: str = "2:4"             # semi-structured methods: N:M, or an unstructured fraction
    si_steps: int = 20                # SI: optimisation steps per block
    roi_prior: str = "wanda"          # RoI's one-shot start: wanda (one dense pass) | sparsegpt (mask + weight update)
    roi_steps: int = 120              # RoI: mask-training steps of roi_seq_len tokens
    roi_seq_len: int = 2048           # RoI: tokens per step, a chunk of a calibration window (the whole window
                                      # where this does not divide --seq-len). SmolLM2 2:4: 120 × 2048 gave 40.71
                                      # where 240 × 512 gave 46.14 in about the same time (22–35 s against 13–14 s
                                      # a step: the per-weight mask work is the same for any number of tokens)
    calib_dtype: str = "auto"         # one-shot calibration passes: auto (bf16 where native) | float32 | bfloat16
    refit: bool = False               # structured: least-squares refit of the kept o_proj / down_proj columns
    refit_damp: float = 0.1           # its ridge toward the masked weights, × mean diag of the Gram matrix
    log: callable = field(default=print, repr=False)


def validate(cfg: OptimizeConfig) -> None:
    if cfg.format not in EXPORTERS:
        raise UserError(f"unknown --format '{cfg.format}'; choose from: {', '.join(EXPORTERS)}")
    if not 0 < cfg.retain <= 1:
        raise UserError(f"--retain must be in (0, 1], got {cfg.retain}")
    if cfg.budget not in ("params", "latency"):
        raise UserError(f"--budget must be 'params' or 'latency', got '{cfg.budget}'")
    if cfg.layout not in LAYOUTS:
        raise UserError(f"unknown --layout '{cfg.layout}'; choose from: {', '.join(LAYOUTS)}")
    if cfg.layout == "per-layer" and cfg.method != "ddp":
        raise UserError("--layout per-layer needs --method ddp (the one-shot activation method is uniform-only)")
    if cfg.layout == "per-layer" and cfg.format != "vllm":
        raise UserError(f"--layout per-layer writes vLLM packages only, not --format {cfg.format}")
    if cfg.ddp_start not in ("baseline", "dense"):
        raise UserError(f"--ddp-start must be baseline or dense, got {cfg.ddp_start!r}")
    if min(cfg.ddp_steps, 1 if cfg.ddp_batch is None else cfg.ddp_batch, cfg.ddp_seq_len) < 1:
        raise UserError("--steps, the DDP batch and its sequence length must be >= 1")
    if not (cfg.ddp_lr > 0 and (cfg.ddp_lr_end is None or cfg.ddp_lr_end >= 0) and cfg.ddp_beta > 0 and (cfg.ddp_beta_start is None or cfg.ddp_beta_start > 0)):
        raise UserError("the DDP learning rate and β (and β's start) must be > 0, the learning rate's end >= 0")
    if cfg.refit_damp <= 0:
        raise UserError(f"the refit's ridge (refit_damp) must be > 0, got {cfg.refit_damp}")
    if cfg.seq_len < 16 or cfg.calib_windows < 1 or (cfg.eval_windows is not None and cfg.eval_windows < 1):
        raise UserError("--seq-len must be >= 16 and window counts >= 1")
    if planner.is_sparse(cfg.method) or cfg.method == "semi-structured":
        if cfg.roi_prior not in ("sparsegpt", "wanda"):
            raise UserError(f"--roi-prior must be 'sparsegpt' or 'wanda', got '{cfg.roi_prior}'")
        if cfg.roi_seq_len < 16:
            raise UserError(f"--roi-seq-len must be >= 16, got {cfg.roi_seq_len}")
        if cfg.method == "roi" and not sparsity.parse(cfg.sparsity).is_nm:  # parse raises on a malformed pattern
            raise UserError(f"--method roi learns N:M masks; --sparsity {cfg.sparsity} is unstructured")
        if cfg.layout != "uniform":
            raise UserError("--layout applies to structured methods; semi-structured pruning keeps every shape")
        if cfg.refit:
            raise UserError("--refit applies to structured methods (removed heads and channels), not semi-structured ones")
    for path, what in ((cfg.calib, "calibration file"), (cfg.eval, "evaluation file")):
        if path is not None:
            data.read_text_file(path, what)  # raises on missing / empty / binary


def optimize(cfg: OptimizeConfig) -> dict:
    log = cfg.log
    validate(cfg)
    target, why_target = _target(cfg.target)
    plan = planner.choose(target, cfg.method, engine_version=cfg.engine_version, sparsity=cfg.sparsity)
    if plan.sparsity and cfg.format != "vllm":
        raise UserError(f"semi-structured packages are vLLM packages (onnxruntime has no 2:4 kernel); "
                        f"drop --format {cfg.format} or use --method structured")
    source = load.resolve(cfg.model)
    from transformers import AutoConfig
    try:
        hf_config = AutoConfig.from_pretrained(source.hf_dir)
    except Exception as e:
        raise UserError(f"{source.description}: unreadable config ({type(e).__name__})") from None
    adapter = get_adapter(hf_config)
    if plan.sparsity:
        for name, width in adapter.input_widths(hf_config).items():
            sparsity.parse(plan.sparsity).check_shape(width, name)
        plan.prediction = planner.roofline_sparse(target, adapter, hf_config, plan.sparse_kernel)
    else:
        nominal = budget.uniform_candidates(adapter, hf_config, cfg.retain)
        if not nominal:
            raise UserError(f"--retain {cfg.retain} leaves too little of each block for a uniform layout")
        plan.prediction = planner.roofline(target, adapter, hf_config, nominal[0])
    if why_target:
        log(why_target)
    log(plan.text())
    if cfg.dry_run:
        return {"plan": plan, "dry_run": True}

    level = f"s{plan.sparsity.replace(':', 'of')}" if plan.sparsity else f"r{cfg.retain:.2f}"
    out = Path(cfg.out or f"out/{source.name}-{target.name}-{plan.method}-{level}")
    try:
        tmp = vllm_export.prepare_output(out)
    except (FileExistsError, PermissionError) as e:
        raise UserError(str(e)) from None
    try:
        if plan.sparsity:
            from optimizer import semistructured
            return semistructured.run(cfg, target, plan, source, adapter, out, tmp)
        return _run(cfg, target, plan, source, adapter, out, tmp)
    except BaseException:
        vllm_export.remove_partial(tmp)
        raise


def _target(name: str):
    if name == "auto":
        return profiles.auto_profile()
    return profiles.load_profile(name), None


def _run(cfg, target, plan, source, adapter, out: Path, tmp: Path) -> dict:
    log = cfg.log
    started = time.time()
    model, tok = _load(cfg, source)
    config = model.config

    calib_text, train, held_out = _calibration(cfg, model, tok)

    costs = (adapter.unit_params(config) if cfg.budget == "params"
             else planner.unit_latency_costs(target, adapter, config))
    if plan.method == "activation":
        method, detail = _observe_activation(cfg, model, adapter, train)
    else:
        method, detail = _observe_ddp(cfg, model, adapter, train, held_out, costs, source, calib_text)
    detail["calibration"] = {"source": calib_text.description, "tokens": detail.pop("tokens")}

    per_layer = None
    if cfg.layout == "per-layer":
        # DDP's natural result: the units with z > 0, binarised to meet the budget exactly
        # every block keeps its own shape.
        masks = method.budget_masks()
        tried, chosen, shape = [], _per_layer_retention(adapter, config, masks, costs), _mean_shape(masks)
        masks = _refit(cfg, model, adapter, masks, train, held_out, detail)
        pruned = prune_per_layer(model, adapter, masks)
        fmt, why = per_layer_export.choose(pruned)
        pruned = per_layer_export.convert(pruned, fmt)
        per_layer = {"format": fmt, "format_reason": why, "layer_shapes": layer_shapes(masks)}
        log(f"per-layer shapes (mean {shape.num_heads:.2f} heads / {shape.num_kv_heads:.2f} KV heads / "
            f"{shape.intermediate_size:.1f} channels per block), retention {chosen['retain']:.3f} of block "
            f"parameters; package format: {why}")
    else:
        # DDP trained for the uniform layout was held to one shape throughout: that shape.
        held = getattr(method, "shape", None) or getattr(method, "layer_shape", None)
        fixed = [held] if held is not None else None
        shape, masks, chosen, tried = _choose_uniform(cfg, model, adapter, method, held_out, costs, fixed)
        log(f"shape: {shape.num_heads} heads / {shape.num_kv_heads} KV heads / {shape.intermediate_size} channels "
            f"per block (dense {adapter.dense_shape(config).__dict__}), "
            f"retention {chosen['retain']:.3f} of block parameters"
            + (f", {chosen['retain_budget']:.3f} of predicted latency" if cfg.budget == "latency" else ""))
        masks = _refit(cfg, model, adapter, masks, train, held_out, detail)
        pruned = prune(model, adapter, masks)
    with torch.inference_mode(), masked(model, adapter, masks):
        ref = model(held_out[:, :256]).logits
    with torch.inference_mode():
        max_diff = (pruned(held_out[:, :256]).logits - ref).abs().max().item()
    if max_diff > 1e-3 * max(1.0, ref.abs().max().item()):
        raise RuntimeError(f"internal check failed: pruned model differs from the masked model by {max_diff}")

    evaluation = _evaluation(cfg, tok)
    quality = (_quality(cfg, evaluation, _dense_perplexity(model, evaluation[1], source), pruned)
               if evaluation else {})

    plan.prediction = planner.roofline(target, adapter, config, shape)
    dense_params = sum(p.numel() for p in model.parameters())
    pruned_params = sum(p.numel() for p in pruned.parameters())
    manifest = {
        "schema": vllm_export.SCHEMA,
        "format": cfg.format,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "tool": {"name": "llm-deploy-optimizer", "version": TOOL_VERSION},
        "source": {"model": source.description, "hf_dir": str(source.hf_dir),
                   "architecture": (config.architectures or ["?"])[0], "family": adapter.family},
        "target": {"name": target.name, "display_name": target.display_name, "kind": target.kind,
                   "compute_capability": target.compute_capability},
        "method": {"name": plan.method, "plan": plan.method, "layout": cfg.layout, "budget": cfg.budget,
                   "retain_requested": cfg.retain, "retain_achieved": chosen["retain"],
                   "retain_budget_achieved": chosen["retain_budget"],
                   "dense_shape": adapter.dense_shape(config).__dict__, "shape": shape.__dict__,
                   "candidates": tried, "seed": cfg.seed, **detail},
        "quality": {"perplexity": quality} if quality else {},
        "size": {"params_dense": dense_params, "params_pruned": pruned_params,
                 "block_params_dense": config.num_hidden_layers * adapter.block_params(config, adapter.dense_shape(config)),
                 "block_params_pruned": config.num_hidden_layers * adapter.block_params(config, shape),
                 "bf16_bytes_dense": 2 * dense_params, "bf16_bytes_pruned": 2 * pruned_params,
                 "ideal_ratio": dense_params / pruned_params},
        "plan": {"text": plan.text(), "reasons": plan.reasons, "prediction": plan.prediction,
                 "engine": plan.engine, "engine_version": plan.engine_version},
        "engine": (per_layer_export.engine_section(per_layer["format"], target.kind, cfg.max_model_len, out.name)
                   if per_layer else _exporter(cfg.format).engine_section(target.kind, cfg.max_model_len, out.name)),
        "checks": {"masked_vs_pruned_max_abs_logit_diff": max_diff},
        "wall_s": round(time.time() - started, 1),
    }
    if per_layer:
        manifest["method"].update(per_layer, shape={k: round(v, 2) for k, v in shape.__dict__.items()})
        manifest["size"]["block_params_pruned"] = sum(p.numel() for p in adapter.blocks(pruned).parameters())
        per_layer_export.write_package(tmp, out, pruned, tok, manifest,
                                       report.render(manifest) + per_layer_export.report_section(manifest),
                                       per_layer["format"])
    else:
        _exporter(cfg.format).write_package(tmp, out, pruned, tok, manifest, report.render(manifest),
                                        **({"dtype": cfg.onnx_dtype} if cfg.format == "onnx" else {}))
    log(f"package: {out.resolve()}  (serve it: serve {out})")
    return {"plan": plan, "manifest": manifest, "out": out}


def _calibration(cfg, model, tok):
    """The calibration text and its windows; the last window is held out (shape choice)."""
    calib_text = data.read_text_file(cfg.calib, "calibration file") if cfg.calib else data.builtin_text("calib")
    if calib_text is None:
        calib_text = data.self_generated_text(model, tok, (cfg.calib_windows + 1) * cfg.seq_len, cfg.seed)
    windows = data.token_windows(tok, calib_text.text, cfg.seq_len)
    train, held_out = (windows[:-1], windows[-1:]) if len(windows) > 1 else (windows, windows)
    cfg.log(f"calibration: {calib_text.description}, {train.numel()} tokens available")
    return calib_text, train, held_out


def _evaluation(cfg, tok) -> tuple[str, torch.Tensor] | None:
    """The evaluation text's description and windows, read and tokenized once per run;
    None when there is no --eval file and no built-in corpus."""
    eval_text = data.read_text_file(cfg.eval, "evaluation file") if cfg.eval else data.builtin_text("eval")
    if eval_text is None:
        cfg.log("perplexity: skipped (no --eval file and no built-in corpus)")
        return None
    return eval_text.description, data.token_windows(tok, eval_text.text, cfg.seq_len, cfg.eval_windows)


def _quality(cfg, evaluation, dense_ppl: float, pruned) -> dict:
    """The manifest's perplexity entry: dense (measured by the caller) against pruned."""
    description, windows = evaluation
    quality = {"eval": description, "windows": len(windows), "seq_len": cfg.seq_len, "dense": dense_ppl,
               "pruned": evaluate.perplexity(pruned, windows, "perplexity (pruned)")}
    cfg.log(f"perplexity: dense {quality['dense']:.3f} → pruned {quality['pruned']:.3f} "
            f"({quality['windows']} windows of {cfg.seq_len})")
    return quality


def _load(cfg, source):
    """Threads and seed set, then the model and tokenizer: the start of every job."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    return load.load_model(source)


def _mean_shape(masks):
    """The mean block of a per-layer layout: parameter counts and the roofline are linear in it."""
    from types import SimpleNamespace
    n = len(masks.blocks)
    return SimpleNamespace(**{k: sum(s[k] for s in layer_shapes(masks)) / n
                              for k in ("num_heads", "num_kv_heads", "intermediate_size")})


def _per_layer_retention(adapter, config, masks, costs) -> dict:
    from types import SimpleNamespace
    shapes = [SimpleNamespace(**s) for s in layer_shapes(masks)]  # a removed part counts 0 units
    dense = adapter.dense_shape(config)
    L = config.num_hidden_layers
    return {"retain": sum(adapter.block_params(config, s) for s in shapes) / (L * adapter.block_params(config, dense)),
            "retain_budget": sum(budget.block_cost(costs, s) for s in shapes) / (L * budget.block_cost(costs, dense))}


def _observe_activation(cfg, model, adapter, train: torch.Tensor):
    importance = ActivationImportance(model, adapter)
    # At retention 1 every unit stays whatever the scores, so there is nothing to observe.
    stats = train[: cfg.calib_windows] if cfg.retain < 1 else train[:0]
    for w in tqdm(stats, desc="calibrating", unit="win"):
        importance.add_batch(model, w[None])
    importance.remove_hooks()
    return importance, {"tokens": stats.numel()}


def _refit(cfg, model, adapter, masks, train: torch.Tensor, held_out: torch.Tensor, detail: dict):
    """--refit: the kept o_proj / down_proj columns refitted by least squares (optimizer/refit.py)
    on the calibration windows, kept only if the held-out calibration loss goes down.

    The guard is there because the refit can fail: on one uniform DDP export of SmolLM2 at 0.8 it
    took perplexity from 32.94 to 78.46 (bench/results/ddp-refit/README.md), though each
    projection's own error went down."""
    if not cfg.refit:
        return masks
    from optimizer.refit import refit_masks
    started, windows = time.time(), train[: cfg.calib_windows]
    refitted = refit_masks(model, adapter, masks, windows, damp=cfg.refit_damp)
    losses = {}
    for name, m in (("before", masks), ("after", refitted)):
        with masked(model, adapter, m):
            losses[name] = _loss(model, held_out)
    applied = losses["after"] < losses["before"]
    detail["refit"] = {"tokens": windows.numel(), "damp": cfg.refit_damp, "wall_s": round(time.time() - started, 1),
                       "held_out_loss_before": losses["before"], "held_out_loss_after": losses["after"],
                       "applied": applied}
    cfg.log(f"refit: o_proj / down_proj kept columns refitted on {windows.numel()} tokens in "
            f"{detail['refit']['wall_s']:.0f} s; held-out loss {losses['before']:.4f} → {losses['after']:.4f}"
            + ("" if applied else ": worse, so the package keeps the unrefitted weights"))
    return refitted if applied else masks


def _choose_uniform(cfg, model, adapter, method, held_out: torch.Tensor, costs, candidates=None):
    """The uniform shape meeting --retain whose masks (method.decide) lose least on held-out
    calibration text. Returns (shape, masks, chosen, tried)."""
    config = model.config
    candidates = candidates or budget.uniform_candidates(adapter, config, cfg.retain, costs=costs)
    if not candidates:
        raise UserError(f"--retain {cfg.retain} leaves too little of each block for a uniform layout")
    tried = []
    for shape in tqdm(candidates, desc="choosing shape", unit="shape"):
        with masked(model, adapter, method.decide(shape)):
            loss = _loss(model, held_out)
        tried.append({"shape": shape.__dict__, "retain": budget.retention(adapter, config, shape),
                      "retain_budget": budget.retention(adapter, config, shape, costs), "held_out_loss": loss})
    best = min(range(len(candidates)), key=lambda i: tried[i]["held_out_loss"])
    return candidates[best], method.decide(candidates[best]), tried[best], tried


def _observe_ddp(cfg, model, adapter, train: torch.Tensor, held_out: torch.Tensor, costs, source, calib_text):
    baseline_start = cfg.ddp_start == "baseline"
    start = None
    if baseline_start:
        # The one-shot baseline's own choice (same importance, same shape search), then DDP
        # refines it: which units, in which layers, at which scale.
        importance, _ = _observe_activation(cfg, model, adapter, train)
        shape, start_masks, chosen, _ = _choose_uniform(cfg, model, adapter, importance, held_out, costs)
        start = {"shape": shape.__dict__, "held_out_loss": chosen["held_out_loss"]}
    # The uniform layout trains held to the baseline's shape: by default one budget per layer
    # and kind (ddp_layer_budget); optionally projected onto that shape every step, which on
    # SmolLM2 won at 0.7 and 0.5 and lost at 0.8 and under the latency budget (README, "How DDP
    # got here").
    projected = cfg.ddp_project_uniform and baseline_start and cfg.layout == "uniform"
    layer_budget = cfg.ddp_layer_budget and baseline_start and cfg.layout == "uniform" and not projected
    batch, lr_end = _ddp_by_layout(cfg, layer_budget)
    ddp_cfg = DDPConfig(retain=cfg.retain, steps=cfg.ddp_steps, batch=batch, seed=cfg.seed,
                        lr=cfg.ddp_lr, lr_end=lr_end, beta=cfg.ddp_beta, beta_start=cfg.ddp_beta_start, warmup=0.0 if baseline_start else 0.5,
                        dtype=str(calibration_dtype(cfg.calib_dtype)).removeprefix("torch."),
                        shape=dict(start["shape"]) if projected else None,
                        layer_shape=dict(start["shape"]) if layer_budget else None)
    ddp = DDP(model, adapter, ddp_cfg, UnitCosts(*costs))
    if baseline_start:
        ddp.start_from(start_masks)
    seq = cfg.ddp_seq_len
    seq = seq if cfg.seq_len % seq == 0 else cfg.seq_len
    chunks = train.reshape(-1, seq)
    ckpt = _ddp_checkpoint([str(source.hf_dir), calib_text.description, cfg.seq_len, seq, cfg.budget,
                            list(costs), vars(ddp_cfg), start])
    resumed = cfg.resume and ddp.load(ckpt)
    if cfg.resume and not resumed:
        cfg.log(f"--resume: no checkpoint of this exact run at {ckpt}; starting from step 0")
    start_step = ddp.step_count
    started = time.time()
    bar = tqdm(total=ddp_cfg.steps, initial=ddp.step_count, desc="DDP gates", unit="step")
    stats = {}
    while ddp.step_count < ddp_cfg.steps:
        stats = ddp.step(chunks[_batch_indices(len(chunks), ddp_cfg.batch, ddp.step_count, cfg.seed)])
        bar.set_postfix(kd=f"{stats['kd']:.3f}", retain=f"{stats['retain']:.3f}", lam=f"{stats['lambda']:.2f}")
        bar.update(1)
        if ddp.step_count % cfg.checkpoint_every == 0 or ddp.step_count == ddp_cfg.steps:
            ddp.save(ckpt)
    bar.close()
    ddp.remove_hooks()
    for p in model.parameters():
        p.requires_grad_(False)
    detail = {"tokens": ddp_cfg.steps * ddp_cfg.batch * seq,
              "ddp": {**vars(ddp_cfg), "start": cfg.ddp_start, "start_from": start, "seq_len": seq, "wall_s": round(time.time() - started, 1),
                      "resumed_from_step": start_step, "final": stats,
                      "peak_rss_gib": round(peak_rss_gib(), 2), "checkpoint": str(ckpt),
                      "positive_gates": _positive_gates(ddp)}}
    return ddp, detail


def _ddp_by_layout(cfg, layer_budget: bool) -> tuple[int, float | None]:
    """(sequences a step, the learning rate's end) where the config leaves them to the layout:
    held to one shape, 4 and a cosine to lr / 10; per layer, 1 and a constant rate."""
    batch = cfg.ddp_batch if cfg.ddp_batch is not None else 4 if layer_budget else 1
    lr_end = cfg.ddp_lr_end if cfg.ddp_lr_end is not None else cfg.ddp_lr / 10 if layer_budget else None
    return batch, lr_end


def _ddp_checkpoint(run: list) -> Path:
    """One checkpoint per exact run: everything that changes what the gates learn is in `run`
    (the training sequence length too — runs at two lengths once shared a file)."""
    key = hashlib.sha256(json.dumps(run, default=str).encode()).hexdigest()[:16]
    return load.cache_dir() / "runs" / f"ddp-{key}.pt"


def _positive_gates(ddp) -> dict:
    heads, chans = ddp.unit_values()
    return {"heads": sum(int((h > 0).sum()) for h in heads), "channels": sum(int((c > 0).sum()) for c in chans)}


def _batch_indices(n: int, batch: int, step: int, seed: int) -> torch.Tensor:
    """Batch `step` of a seeded reshuffle per pass over the data: deterministic and resumable."""
    idx = []
    for k in range(step * batch, (step + 1) * batch):
        epoch, pos = divmod(k, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        idx.append(int(perm[pos]))
    return torch.tensor(idx)


def _dense_perplexity(model, windows: torch.Tensor, source) -> float:
    """The source model's perplexity on these exact windows, computed once per machine.

    A full WikiText-2 pass takes minutes on a CPU and the dense model does not change
    between runs at different retentions, so the figure is cached beside the converted model.
    """
    key = hashlib.sha256(str(source.hf_dir).encode() + windows.numpy().tobytes()).hexdigest()[:24]
    path = load.cache_dir() / "perplexity" / f"{key}.json"
    if path.is_file():
        return json.loads(path.read_text())["perplexity"]
    ppl = evaluate.perplexity(model, windows, "perplexity (dense)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"perplexity": ppl, "model": str(source.hf_dir), "windows": len(windows)}))
    os.replace(tmp, path)
    return ppl


@torch.inference_mode()
def _loss(model, windows: torch.Tensor) -> float:
    return sum(model(w[None], labels=w[None]).loss.item() for w in windows) / len(windows)
