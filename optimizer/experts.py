"""The expert kind of job, for MoE models: remove whole routed experts, the same number per layer
(and, below top-k / E, narrow the kept ones).

method   the one-shot REAP-style importance (`--method activation`, the default: router-weighted
         expert output norms on the calibration windows, `methods/reap.py`), or DDP's expert gates
         (`--method ddp`, `methods/ddp_experts.py`: the gates' ReLU(z) ship as scales folded
         into the kept experts); either keeps max(top-k, floor(--retain · E)) experts in every
         MoE layer, then `ChannelImportance` the channels when the budget asks for fewer
surgery  router rows and both 3-D expert tensors sliced (`moe_surgery.prune_experts`), checked
         against the masked model (removed experts' router logits at −inf) on the held-out window
export   a vLLM package of the same architecture with fewer experts in its config

How `--retain` is split: it is the share of *routed-expert parameters* kept (nearly all of an
MoE model's), uniform across MoE layers so the package is a stock config. Whole experts go
first, floor(--retain · E) per layer, but never fewer than the top-k every token is routed to;
a budget below k/E then narrows every kept expert to floor(--retain · E · I / k) channels
(`moe_surgery.expert_width_to_keep`; channels ranked by `methods/reap.ChannelImportance` with
the removed experts already masked). Attention heads, shared experts, dense layers and the
routers' kept rows stay whole: attention is a few percent of an MoE model's parameters. The
report gives the split, the parameters, the active parameters per token (less only the router's removed
rows, unless the experts are narrowed) and the roofline's account of what the removal saves.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from core.manifest import Manifest
from exporters import vllm as vllm_export
from optimizer import plan as planner
from optimizer import report
from optimizer.config import refuse_width_settings
from optimizer.errors import UserError
from optimizer.job import MAX_MODEL_LEN, Decision, Job
from optimizer.methods.ddp import DDPConfig
from optimizer.resources import peak_rss_gib
from optimizer.methods.ddp_experts import ExpertGates
from optimizer.masks import ExpertMasks
from optimizer.methods.reap import ChannelImportance, ExpertImportance
from optimizer.moe_surgery import expert_width_to_keep, experts_to_keep, masked_experts, prune_experts
from optimizer.sequential import calibration_dtype
from optimizer.surgery import check_same_logits


class Experts:
    edits_in_place = False  # surgery builds a new model; job.model stays the dense teacher

    # --- planning (plan.resolve): what this kind refuses, and its prediction ----------------------
    @staticmethod
    def refuse(cfg, plan, adapter, hf_config) -> None:
        if cfg.format != "vllm":
            raise UserError(f"{adapter.family}: MoE packages are vLLM packages (the ONNX decoder has no MoE block); "
                            f"drop --format {cfg.format}")
        if cfg.layout != "uniform":
            raise UserError(f"{adapter.family}: MoE models keep the same number of experts in every layer "
                            f"(a stock config); use layout=uniform")
        refuse_width_settings(cfg, "MoE models lose whole routed experts (--retain: the share of their "
                                   "parameters kept)")
        if cfg.quant not in ("none", "auto"):
            raise UserError(f"{adapter.family}: MoE packages are not quantized yet (the fused 3-D expert tensors "
                            f"need their own scheme): use --quant none or auto")

    @staticmethod
    def predict(cfg, plan, adapter, hf_config) -> dict:
        n_keep, width = experts_to_keep(adapter, hf_config, cfg.retain), expert_width_to_keep(adapter, hf_config, cfg.retain)
        return planner.roofline_experts(plan.target, adapter, hf_config, n_keep, meta_params(hf_config), width=width)

    # --- method: observe → decide ----------------------------------------------------------------
    def method(self, job: Job) -> Decision:
        cfg, model, adapter = job.cfg, job.model, job.adapter
        n_keep = experts_to_keep(adapter, model.config, cfg.retain)
        if job.plan.method == "ddp":
            method, detail = train_expert_gates(job)
        else:
            method = ExpertImportance(model, adapter)
            windows = job.calib.train[: cfg.data.calib_windows]
            for w in tqdm(windows, desc="calibrating", unit="win"):
                method.observe(w[None])
            method.close()
            detail = {"tokens": windows.numel(),
                      "scores": [[round(float(v), 6) for v in layer] for layer in method.scores()],
                      "tokens_routed": method.tokens.tolist()}
        masks = method.decide(n_keep)
        detail["calibration"] = {"source": job.calib.text.description, "tokens": detail.pop("tokens")}
        n = adapter.num_experts(model.config)
        job.log(f"experts: {n_keep} of {n} routed experts kept in each of {len(masks.keep)} MoE layers "
                f"(top-{adapter.experts_per_token(model.config)} routing kept)")
        width, full = expert_width_to_keep(adapter, model.config, cfg.retain), adapter.expert_intermediate(model.config)
        if width < full:
            masks = ExpertMasks(masks.keep, masks.scales, expert_channels(job, masks, width))
            job.log(f"experts: {width} of {full} channels kept in each kept expert (--retain {cfg.retain:g} is below "
                    f"top-k / experts, {adapter.experts_per_token(model.config)}/{n})")
        return Decision(masks, detail, {"n_keep": n_keep, "width": width})

    # --- surgery ----------------------------------------------------------------------------------
    def surgery(self, job: Job, decision: Decision):
        model, adapter, masks = job.model, job.adapter, decision.masks
        pruned = prune_experts(model, adapter, masks.keep, masks.scales, masks.channels)
        simulated = masked_experts(model, adapter, masks.keep, masks.scales, masks.channels)
        decision.extra["max_diff"] = check_same_logits(pruned, simulated, job.calib.held_out)
        return pruned

    # --- the manifest's sections ------------------------------------------------------------------
    def describe(self, job: Job, decision: Decision, pruned) -> dict:
        cfg, model, adapter = job.cfg, job.model, job.adapter
        config, n_keep, width = model.config, decision.extra["n_keep"], decision.extra["width"]
        dense_params = sum(p.numel() for p in model.parameters())
        pruned_params = sum(p.numel() for p in pruned.parameters())
        prediction = planner.roofline_experts(job.target, adapter, config, n_keep, dense_params, width=width)
        e = prediction["experts"]
        n, full = adapter.num_experts(config), adapter.expert_intermediate(config)
        method = {"name": job.plan.method, "plan": job.plan.method, "layout": "uniform",
                  "budget": "routed experts" if width == full else "routed experts, then expert channels",
                  "retain_requested": cfg.retain, "retain_achieved": n_keep * width / (n * full), "seed": cfg.seed,
                  "experts": {"dense": n, "kept": n_keep, "top_k": e["top_k"], "moe_layers": adapter.moe_layers(config),
                              "keep": decision.masks.keep, "width_dense": full, "width_kept": width,
                              **({"channels": decision.masks.channels} if decision.masks.channels else {})},
                  **decision.detail}
        lookup = 0 if config.tie_word_embeddings else model.get_input_embeddings().weight.numel()
        # top-k unchanged: as many experts per token, each narrower when channels went
        size = {"params_dense": dense_params, "params_pruned": pruned_params, "lookup_params": lookup,
                "active_params_dense": e["active_params"] + lookup, "active_params_pruned": e["active_params_pruned"] + lookup,
                "bf16_bytes_dense": 2 * dense_params, "bf16_bytes_pruned": 2 * pruned_params,
                # every expert read: the large-batch limit (the roofline gives batch 1 and 16)
                "ideal_ratio": (dense_params - lookup) / (pruned_params - lookup)}
        engine = vllm_export.engine_section(job.target.kind, MAX_MODEL_LEN, job.out.name)
        return {"format": "vllm", "method": method, "size": size, "engine": engine, "prediction": prediction,
                "checks": {"masked_vs_pruned_max_abs_logit_diff": decision.extra["max_diff"]}}

    # --- export -----------------------------------------------------------------------------------
    def export(self, job: Job, pruned, manifest: Manifest, quantized=None) -> None:
        vllm_export.write_package(job.tmp, job.out, pruned, job.tok, manifest, report.render_experts(manifest),
                                  finish_checkpoint=job.finish_checkpoint)


def expert_channels(job: Job, masks: ExpertMasks, width: int) -> list[list[list[int]]]:
    """Each kept expert's `width` channels, from a calibration pass with the removed experts
    masked (and the kept ones scaled), so a kept expert is scored on the tokens it will get."""
    cfg, model, adapter = job.cfg, job.model, job.adapter
    method = ChannelImportance(model, adapter)
    with masked_experts(model, adapter, masks.keep, masks.scales):
        for w in tqdm(job.calib.train[: cfg.data.calib_windows], desc="expert channels", unit="win"):
            method.observe(w[None])
    method.close()
    return method.decide(masks.keep, width)


def train_expert_gates(job: Job):
    """DDP's expert gates from the dense model (z = 1), trained by KD to the dense model under
    the whole-expert share of the --retain budget (checkpointed, resumable): below top-k / E the
    gates aim at top-k experts and the channels take the rest, so no kept expert ships a zero gate."""
    cfg, model, adapter = job.cfg, job.model, job.adapter
    batch, lr_end = cfg.ddp.by_layout("uniform")
    experts_share = experts_to_keep(adapter, model.config, cfg.retain) / adapter.num_experts(model.config)
    ddp_cfg = DDPConfig(retain=experts_share, steps=cfg.ddp.steps, batch=batch, seed=cfg.seed, lr=cfg.ddp.lr,
                        lr_end=lr_end, beta=cfg.ddp.beta,
                        dtype=str(calibration_dtype(cfg.calib_dtype)).removeprefix("torch."))
    gates = ExpertGates(model, adapter, ddp_cfg)
    d = cfg.data
    seq = cfg.ddp.seq_len if d.seq_len % cfg.ddp.seq_len == 0 else d.seq_len
    chunks = job.calib.train.reshape(-1, seq)
    ckpt = job.checkpoint("ddp-experts", [seq, vars(ddp_cfg)])
    run = job.trainer.train(gates, chunks, ddp_cfg.steps, ddp_cfg.batch, ckpt, "DDP expert gates",
                    lambda s: {"kd": f"{s['kd']:.3f}", "retain": f"{s['retain']:.3f}", "lam": f"{s['lambda']:.2f}"})
    gates.close()
    for p in model.parameters():
        p.requires_grad_(False)
    detail = {"tokens": ddp_cfg.steps * ddp_cfg.batch * seq,
              "ddp": {**vars(ddp_cfg), "seq_len": seq, "wall_s": run["wall_s"],
                      "resumed_from_step": run["resumed_from_step"], "final": run["final"],
                      "peak_rss_gib": round(peak_rss_gib(), 2), "checkpoint": run["checkpoint"],
                      "positive_gates": int((gates.values() > 0).sum())}}
    return gates, detail


def meta_params(hf_config) -> int:
    """The model's parameter count from its config alone (built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config).parameters())
