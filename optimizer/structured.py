"""The structured kind of job: remove query heads, KV groups and MLP channels.

method   the one-shot activation importance (`--method activation`), or DDP's gates trained
         from that baseline's selection (`--method ddp`); then, uniform layout, the shape that
         meets --retain and loses least on the held-out calibration window (DDP: the shape it
         was held to), or, per-layer layout, DDP's own shapes at the budget, or the one-shot
         importance's MLP widths per block (`choose_per_layer`); --refit last
surgery  physically remove the units (`surgery.prune` / `prune_per_layer`), checked against the
         masked model on the held-out window
export   a vLLM package (per layer: DeciLM or the plugin's architecture), or ONNX
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from tqdm import tqdm

from core.manifest import Manifest
from exporters import per_layer as per_layer_export
from exporters import vllm as vllm_export
from optimizer import budget, report
from optimizer import plan as planner
from optimizer.errors import UserError
from optimizer.evaluate import mean_loss
from optimizer.job import MAX_MODEL_LEN, Decision, Job
from optimizer.methods.activation import ActivationImportance
from optimizer.methods.ddp import DDP, DDPConfig, UnitCosts
from optimizer.resources import available_memory, peak_rss_gib
from optimizer.refit import RefitStatistics
from optimizer.sequential import calibration_dtype
from optimizer.surgery import check_same_logits, layer_shapes, masked, prune, prune_per_layer


def exporter(fmt: str):
    """The module that writes a package of this format: write_package(tmp, out, model, tok, manifest, report)."""
    if fmt == "onnx":
        from exporters import onnx as onnx_export
        return onnx_export
    return vllm_export


class Structured:
    edits_in_place = False  # surgery builds a new model; job.model stays the dense teacher

    # --- planning (plan.resolve): what this kind refuses, and its prediction ----------------------
    @staticmethod
    def refuse(cfg, plan, adapter, hf_config) -> None:
        if cfg.layout == "per-layer" and not adapter.per_layer:
            raise UserError(f"{adapter.family}: no per-layer model class for this family; use layout=uniform")

    @staticmethod
    def predict(cfg, plan, adapter, hf_config) -> dict:
        """The roofline of the uniform shape nearest --retain (surgery's may differ a little)."""
        nominal = budget.uniform_candidates(adapter, hf_config, cfg.retain)
        if not nominal:
            raise UserError(f"--retain {cfg.retain} leaves too little of each block for a uniform layout")
        return planner.roofline(plan.target, adapter, hf_config, nominal[0], **planner.quant_prediction(plan))

    @staticmethod
    def searcher(job: Job, retains: list[float]):
        """For the search (optimizer/search.py): one calibration pass (the one-shot importance and the
        refit's statistics), then a function of a retain that returns the pruned model at it (the
        shape that loses least on the held-out calibration window, refit where that helps)."""
        if not retains:
            return None
        importance, _, grams = observe_activation(job, observe=True)
        costs = (job.adapter.unit_params(job.model.config) if job.cfg.retain_by == "params"
                 else planner.unit_latency_costs(job.target, job.adapter, job.model.config))

        chosen_on = {}

        def build(retain: float, per_layer: bool = False):
            candidates = budget.uniform_candidates(job.adapter, job.model.config, retain, costs=costs)
            if not candidates:
                raise UserError(f"retain {retain} leaves too little of each block for a uniform layout")
            if per_layer:
                if "texts" not in chosen_on:  # what the per-layer widths are chosen on, once for every retain
                    chosen_on["texts"] = per_layer_texts(job)
                _, masks, _, _ = choose_per_layer(job, importance, costs, candidates, chosen_on["texts"])
            else:
                _, masks, _, _ = choose_uniform(job, importance, costs, candidates)
            masks = refit(job, grams, masks, {})
            return per_layer_model(job.model, job.adapter, masks)[0] if per_layer else prune(job.model, job.adapter, masks)
        return build

    # --- method: observe → decide ----------------------------------------------------------------
    def method(self, job: Job) -> Decision:
        cfg, model, adapter, calib = job.cfg, job.model, job.adapter, job.calib
        config = model.config
        costs = (adapter.unit_params(config) if cfg.retain_by == "params"
                 else planner.unit_latency_costs(job.target, adapter, config))
        if job.plan.method == "activation":
            method, detail, refit_stats = observe_activation(job)
        else:
            method, detail, refit_stats = train_ddp(job, costs)
        detail["calibration"] = {"source": calib.text.description, "tokens": detail.pop("tokens")}
        if cfg.layout == "per-layer" and job.plan.method == "activation":
            shape, masks, chosen, tried = choose_per_layer(job, method, costs)
        elif cfg.layout == "per-layer":
            # DDP's natural result: the units with z > 0, binarised to meet the budget (widths multiples the kernels take);
            # every block keeps its own shape.
            masks = method.budget_masks()
            tried, chosen, shape = [], per_layer_retention(adapter, config, masks, costs), mean_shape(masks)
        else:
            # DDP trained for the uniform layout was held to one shape throughout: that shape.
            held = getattr(method, "layer_shape", None)
            shape, masks, chosen, tried = choose_uniform(job, method, costs, [held] if held is not None else None)
            job.log(f"shape: {shape.num_heads} heads / {shape.num_kv_heads} KV heads / {shape.intermediate_size} "
                    f"channels per block (dense {adapter.dense_shape(config).__dict__}), "
                    f"retention {chosen['retain']:.3f} of block parameters"
                    + (f", {chosen['retain_budget']:.3f} of predicted latency" if cfg.retain_by == "latency" else ""))
        masks = refit(job, refit_stats, masks, detail)
        return Decision(masks, detail, {"shape": shape, "chosen": chosen, "tried": tried})

    # --- surgery ----------------------------------------------------------------------------------
    def surgery(self, job: Job, decision: Decision):
        model, adapter, masks = job.model, job.adapter, decision.masks
        if job.cfg.layout == "per-layer":
            pruned, fmt, why = per_layer_model(model, adapter, masks)
            decision.extra["per_layer"] = {"format": fmt, "format_reason": why, "layer_shapes": layer_shapes(masks)}
            shape = decision.extra["shape"]
            job.log(f"per-layer shapes (mean {shape.num_heads:.2f} heads / {shape.num_kv_heads:.2f} KV heads / "
                    f"{shape.intermediate_size:.1f} channels per block), retention "
                    f"{decision.extra['chosen']['retain']:.3f} of block parameters; package format: {why}")
        else:
            pruned = prune(model, adapter, masks)
        decision.extra["max_diff"] = check_same_logits(pruned, masked(model, adapter, masks), job.calib.held_out)
        return pruned

    # --- the manifest's sections ------------------------------------------------------------------
    def describe(self, job: Job, decision: Decision, pruned) -> dict:
        cfg, model, adapter, target = job.cfg, job.model, job.adapter, job.target
        config, x = model.config, decision.extra
        shape, chosen, per_layer = x["shape"], x["chosen"], x.get("per_layer")
        # the roofline of the shape surgery achieved (the plan's is of the nominal one)
        prediction = planner.roofline(target, adapter, config, shape, **planner.quant_prediction(job.plan))
        method = {"name": job.plan.method, "plan": job.plan.method, "layout": cfg.layout, "budget": cfg.retain_by,
                  "retain_requested": cfg.retain, "retain_achieved": chosen["retain"],
                  "retain_budget_achieved": chosen["retain_budget"],
                  "dense_shape": adapter.dense_shape(config).__dict__, "shape": shape.__dict__,
                  "candidates": x["tried"], "seed": cfg.seed, **decision.detail,
                  **({"per_layer_alpha": chosen["alpha"]} if "alpha" in chosen else {})}
        size = size_section(model, pruned,
                            config.num_hidden_layers * adapter.block_params(config, adapter.dense_shape(config)),
                            config.num_hidden_layers * adapter.block_params(config, shape))
        if per_layer:
            method.update(per_layer, shape={k: round(v, 2) for k, v in shape.__dict__.items()})
            size["block_params_pruned"] = sum(p.numel() for n, p in adapter.blocks(pruned).named_parameters()
                                              if not n.endswith(QUANT_PARAMS))
            engine = per_layer_export.engine_section(per_layer["format"], target.kind, MAX_MODEL_LEN, job.out.name)
        else:
            engine = exporter(cfg.format).engine_section(target.kind, MAX_MODEL_LEN, job.out.name)
        return {"format": cfg.format, "method": method, "size": size, "engine": engine, "prediction": prediction,
                "checks": {"masked_vs_pruned_max_abs_logit_diff": x["max_diff"]}}

    # --- export -----------------------------------------------------------------------------------
    def export(self, job: Job, pruned, manifest: Manifest, quantized=None) -> None:
        if job.cfg.layout == "per-layer":
            per_layer_export.write_package(job.tmp, job.out, pruned, job.tok, manifest, report.render(manifest),
                                           manifest.method["format"])
        else:
            exporter(job.cfg.format).write_package(job.tmp, job.out, pruned, job.tok, manifest, report.render(manifest),
                                                   **({"dtype": job.cfg.onnx.dtype,  # and the INT8 activation hooks
                                                       "int8": quantized.ort_int8 if quantized else None}
                                                      if job.cfg.format == "onnx"
                                                      else {"finish_checkpoint": job.finish_checkpoint}))


def per_layer_model(model, adapter, masks):
    """(the pruned model in its package's format, that format, why): surgery per layer, then DeciLM where
    stock vLLM serves the shapes, else the plugin's architecture (exporters/per_layer.py)."""
    pruned = prune_per_layer(model, adapter, masks)
    fmt, why = per_layer_export.choose(pruned, adapter.llama_layout)
    return per_layer_export.convert(pruned, fmt), fmt, why


QUANT_PARAMS = ("_scale", "_zero_point")  # what --quant attaches to a Linear: not the model's parameters


def size_section(model, pruned, block_params_dense: int, block_params_pruned: int) -> dict:
    """The manifest's `size` of a dense `model` and its `pruned` copy (not --quant's scales)."""
    dense_params = sum(p.numel() for p in model.parameters())
    pruned_params = sum(p.numel() for n, p in pruned.named_parameters() if not n.endswith(QUANT_PARAMS))
    # An untied input embedding is looked up, not streamed, at each decode step: it is in the
    # parameters but not in the ideal ratio (a tied one is read as the LM head). Each side its own:
    # quant_head unties the package's head from a tied dense model's embedding.
    lookup, lookup_pruned = _lookup_params(model), _lookup_params(pruned)
    return {"params_dense": dense_params, "params_pruned": pruned_params, "lookup_params": lookup,
            "lookup_params_pruned": lookup_pruned,
            "block_params_dense": block_params_dense, "block_params_pruned": block_params_pruned,
            "bf16_bytes_dense": 2 * dense_params, "bf16_bytes_pruned": 2 * pruned_params,
            "ideal_ratio": (dense_params - lookup) / (pruned_params - lookup_pruned)}


def _lookup_params(model) -> int:
    """The input embedding's parameters where it is not also the LM head (only looked up), else 0."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    return 0 if tied else embedding.weight.numel()


# --- the methods' stages ---------------------------------------------------------------------------

def observe_activation(job: Job, observe: bool | None = None):
    """The one-shot importance over the calibration windows, and in the same pass the refit's
    statistics (with --refit). Returns (importance, detail, refit statistics or None). `observe`:
    whether to read the windows (by default where --retain removes something)."""
    importance = ActivationImportance(job.model, job.adapter)
    # At retention 1 every unit stays whatever the scores, so there is nothing to observe.
    if observe is None:
        observe = job.cfg.retain < 1
    stats = job.calib.train[: job.cfg.data.calib_windows] if observe else job.calib.train[:0]
    grams = None
    if job.cfg.refit.on is not False and len(stats):
        need, room = RefitStatistics.bytes_needed(job.model, job.adapter), available_memory() // 4
        if need <= room:
            grams = RefitStatistics(job.model, job.adapter)
        else:
            job.log(f"refit: skipped, its statistics would take {need / 2**30:.1f} GiB, more than a quarter of the "
                    f"{4 * room / 2**30:.1f} GiB of memory available (refit.on=false silences this)")
    try:
        for w in tqdm(stats, desc="calibrating", unit="win"):
            importance.observe(w[None])
    finally:
        importance.close()
        if grams is not None:
            grams.close()
    return importance, {"tokens": stats.numel()}, grams


def train_ddp(job: Job, costs):
    """DDP's gates from the one-shot baseline's own choice (same importance, same shape search):
    training refines which units, in which layers, at which scale. The uniform layout holds every
    layer to the baseline's shape by multipliers of its own (DDPConfig.layer_shape)."""
    cfg, model, adapter = job.cfg, job.model, job.adapter
    importance, _, refit_stats = observe_activation(job)
    shape, start_masks, chosen, _ = choose_uniform(job, importance, costs)
    start = {"shape": shape.__dict__, "held_out_loss": chosen["held_out_loss"]}
    layer_budget = cfg.layout == "uniform"
    batch, lr_end = cfg.ddp.by_layout(cfg.layout)
    ddp_cfg = DDPConfig(retain=cfg.retain, steps=cfg.ddp.steps, batch=batch, seed=cfg.seed,
                        lr=cfg.ddp.lr, lr_end=lr_end, beta=cfg.ddp.beta, warmup=0.0,
                        dtype=str(calibration_dtype(cfg.calib_dtype)).removeprefix("torch."),
                        layer_shape=dict(start["shape"]) if layer_budget else None)
    ddp = DDP(model, adapter, ddp_cfg, UnitCosts(*costs))
    ddp.start_from(start_masks)
    d = cfg.data
    seq = cfg.ddp.seq_len if d.seq_len % cfg.ddp.seq_len == 0 else d.seq_len
    chunks = job.calib.train.reshape(-1, seq)
    ckpt = job.checkpoint("ddp", [seq, cfg.retain_by, list(costs), vars(ddp_cfg), start])
    run = job.trainer.train(ddp, chunks, ddp_cfg.steps, ddp_cfg.batch, ckpt, "DDP gates",
                    lambda s: {"kd": f"{s['kd']:.3f}", "retain": f"{s['retain']:.3f}", "lam": f"{s['lambda']:.2f}"})
    ddp.close()
    for p in model.parameters():
        p.requires_grad_(False)
    heads, chans = ddp.unit_values()
    detail = {"tokens": ddp_cfg.steps * ddp_cfg.batch * seq,
              "ddp": {**vars(ddp_cfg), "start": "baseline", "start_from": start, "seq_len": seq,
                      "wall_s": run["wall_s"], "resumed_from_step": run["resumed_from_step"], "final": run["final"],
                      "peak_rss_gib": round(peak_rss_gib(), 2), "checkpoint": run["checkpoint"],
                      "positive_gates": {"heads": sum(int((h > 0).sum()) for h in heads),
                                         "channels": sum(int((c > 0).sum()) for c in chans)}}}
    return ddp, detail, refit_stats


def choose_uniform(job: Job, method, costs, candidates=None):
    """The uniform shape meeting --retain whose masks (method.decide) lose least on the held-out
    calibration window. Returns (shape, masks, chosen, tried)."""
    cfg, model, adapter = job.cfg, job.model, job.adapter
    config = model.config
    candidates = candidates or budget.uniform_candidates(adapter, config, cfg.retain, costs=costs)
    if not candidates:
        raise UserError(f"--retain {cfg.retain} leaves too little of each block for a uniform layout")
    tried = []
    for shape in tqdm(candidates, desc="choosing shape", unit="shape"):
        with masked(model, adapter, method.decide(shape)):
            loss = mean_loss(model, job.calib.held_out)
        tried.append({"shape": shape.__dict__, "retain": budget.retention(adapter, config, shape),
                      "retain_budget": budget.retention(adapter, config, shape, costs), "held_out_loss": loss})
    best = min(range(len(candidates)), key=lambda i: tried[i]["held_out_loss"])
    return candidates[best], method.decide(candidates[best]), tried[best], tried


# How far the per-layer widths move from the uniform ones toward the global ranking's
# (ActivationImportance.decide_per_layer); the one whose worst excess loss over the texts of `per_layer_texts`
# is lowest is kept.
PER_LAYER_ALPHAS = (0.25, 0.5, 1.0)
PER_LAYER_PROMPTS = 8  # the heal's instructions whose dense answers the widths are also chosen on


def per_layer_texts(job: Job) -> dict:
    """What the per-layer widths are chosen on, as {name: (windows, the dense model's loss)}: the held-out
    calibration window, and for a model with a chat template the dense model's own answers to the heal's
    first instructions (moving channels between blocks by their ranking on prose can break chat: SmolLM2
    at 90%, bench/results/optimize-runs/2026-12-07-10f69ea-per-layer-per-token-smollm2). The search's
    held-out prompts stay unread."""
    from optimizer import data
    from optimizer.heal_data import INSTRUCTIONS
    from optimizer.search import CHAT_SEQ, dense_answers
    texts = {"text": job.calib.held_out}
    if getattr(job.tok, "chat_template", None):
        try:
            texts["chat"] = data.token_windows(job.tok, dense_answers(job.model, job.tok, INSTRUCTIONS[:PER_LAYER_PROMPTS]),
                                               CHAT_SEQ)
        except UserError:  # answers shorter than one window: the text alone
            pass
    return {k: (w, mean_loss(job.model, w)) for k, w in texts.items()}


def choose_per_layer(job: Job, importance, costs, candidates=None, texts: dict | None = None):
    """The per-layer layout of the one-shot method: the uniform shape choose_uniform picks (its attention
    in every block, so the package is DeciLM where the family allows it), its MLP channels moved between
    blocks by the importance's global ranking, as far (PER_LAYER_ALPHAS) as loses least over `texts`
    (per_layer_texts: the worst of their excess losses over the dense model's). Moving channels between
    blocks keeps the parameters and the roofline of the uniform shape. Returns (mean shape, masks, chosen,
    tried)."""
    model, adapter = job.model, job.adapter
    config = model.config
    texts = texts or per_layer_texts(job)
    shape, _, uniform, tried = choose_uniform(job, importance, costs, candidates)

    def excess(masks, keys=tuple(texts)) -> dict:
        with masked(model, adapter, masks):
            return {k: round(mean_loss(model, texts[k][0]) - texts[k][1], 5) for k in keys}
    multiple = budget.channel_multiple(adapter.dense_shape(config).intermediate_size)
    # the uniform shape's: its loss on the held-out window is choose_uniform's already
    before = {"text": round(uniform["held_out_loss"] - texts["text"][1], 5),
              **excess(importance.decide(shape), [k for k in texts if k != "text"])}
    best = None
    for alpha in tqdm(PER_LAYER_ALPHAS, desc="choosing widths", unit="step"):
        masks = importance.decide_per_layer(shape, alpha, multiple)
        losses = excess(masks)
        tried.append({"alpha": alpha, "widths": [len(b.channels) for b in masks.blocks],
                      "held_out_loss": texts["text"][1] + losses["text"], "excess_loss": losses})
        if best is None or max(losses.values()) < max(best[1].values()):
            best = (alpha, losses, masks)
    alpha, losses, masks = best
    chosen = {**per_layer_retention(adapter, config, masks, costs), "held_out_loss": texts["text"][1] + losses["text"],
              "alpha": alpha, "excess_loss": losses, "uniform_excess_loss": before}
    words = ", ".join(f"{k} +{v:.3f}" for k, v in losses.items())
    job.log(f"per-layer widths: {shape.num_heads} heads / {shape.num_kv_heads} KV heads every block, MLP channels "
            f"{min(len(b.channels) for b in masks.blocks)}-{max(len(b.channels) for b in masks.blocks)} "
            f"(uniform {shape.intermediate_size}, moved {alpha:.0%} of the way to the global ranking); excess loss "
            f"over the dense model {words} (uniform: {', '.join(f'{k} +{v:.3f}' for k, v in before.items())})")
    return mean_shape(masks), masks, chosen, tried


def refit(job: Job, stats, masks, detail: dict):
    """--refit: the kept o_proj / down_proj columns refitted by least squares (optimizer/refit.py)
    from the statistics the calibration pass gathered, kept only if the held-out calibration loss
    goes down: the refit can raise it though each projection's own error falls
    (bench/results/ddp-refit/README.md)."""
    settings = job.cfg.refit
    if settings.on is False or stats is None:
        return masks
    from optimizer.refit import refit_masks
    model, adapter = job.model, job.adapter
    started = time.time()
    refitted = refit_masks(stats, model, adapter, masks, damp=settings.damp)
    losses = {}
    for name, m in (("before", masks), ("after", refitted)):
        with masked(model, adapter, m):
            losses[name] = mean_loss(model, job.calib.held_out)
    applied = losses["after"] < losses["before"]
    detail["refit"] = {"tokens": stats.tokens, "damp": settings.damp, "wall_s": round(time.time() - started, 1),
                       "held_out_loss_before": losses["before"], "held_out_loss_after": losses["after"],
                       "applied": applied}
    job.log(f"refit: o_proj / down_proj kept columns refitted on {stats.tokens} calibration tokens in "
            f"{detail['refit']['wall_s']:.0f} s; held-out loss {losses['before']:.4f} → {losses['after']:.4f}"
            + ("" if applied else ": worse, so the package keeps the unrefitted weights"))
    return refitted if applied else masks


def mean_shape(masks):
    """The mean block of a per-layer layout: parameter counts and the roofline are linear in it."""
    n = len(masks.blocks)
    return SimpleNamespace(**{k: sum(s[k] for s in layer_shapes(masks)) / n
                              for k in ("num_heads", "num_kv_heads", "intermediate_size")})


def per_layer_retention(adapter, config, masks, costs) -> dict:
    shapes = [SimpleNamespace(**s) for s in layer_shapes(masks)]  # a removed part counts 0 units
    dense = adapter.dense_shape(config)
    n = config.num_hidden_layers
    return {"retain": sum(adapter.block_params(config, s) for s in shapes) / (n * adapter.block_params(config, dense)),
            "retain_budget": sum(budget.block_cost(costs, s) for s in shapes) / (n * budget.block_cost(costs, dense))}

