"""The optimize job for the semi-structured family: N:M (2:4, 4:8, ...) or unstructured zeros.

Shapes do not change, so there is no surgery: the method zeroes weights in place (SparseGPT
also updates the survivors), every Linear of the blocks is checked against the pattern, and
the package is an ordinary checkpoint. Whether it is *faster* depends only on the engine:
the compressed-tensors `sparsity_config` that makes vLLM use its 2:4 kernel is written only
where the target profile says the engine version has one; everywhere else the report says
plainly that the zeros are served densely and no speedup is to be expected.
"""

from __future__ import annotations

import time

import torch

from core.manifest import Manifest
from exporters import vllm as vllm_export
from optimizer import plan as planner
from optimizer import registry, report
from optimizer.errors import UserError
from optimizer.job import MAX_MODEL_LEN, Decision, Job
from optimizer.methods.magnitude import Magnitude
from optimizer.methods.roi import RoI, RoIConfig, wanda_prior
from optimizer.methods.si import SIConfig, prune_with_si
from optimizer.methods.sparsegpt import SparseGPT
from optimizer.methods.wanda import Wanda
from optimizer.sequential import calibration_dtype, prune_blockwise
from optimizer.sparsity import Sparsity, parse

PRUNERS = {"magnitude": Magnitude, "wanda": Wanda, "sparsegpt": SparseGPT}


class SemiStructured:
    edits_in_place = True  # the zeros are written into job.model

    # --- planning (plan.resolve): what this kind refuses, and its prediction ----------------------
    @staticmethod
    def refuse(cfg, plan, adapter, hf_config) -> None:
        if cfg.format != "vllm":
            raise UserError(f"semi-structured packages are vLLM packages (onnxruntime has no 2:4 kernel); "
                            f"drop --format {cfg.format} or use --method structured")
        if cfg.refit.on:
            raise UserError(f"refit.on=true: the refit applies to structured methods (removed heads and channels), "
                            f"not semi-structured ones (the plan: {plan.method}): drop it or use --method structured")
        if cfg.quant not in ("none", "auto"):
            raise UserError(f"--quant applies to structured packages; semi-structured ones are not quantized yet "
                            f"(the plan: {plan.method}): use --method structured or --quant none")
        for name, width in adapter.input_widths(hf_config).items():
            parse(plan.sparsity).check_shape(width, name)

    @staticmethod
    def predict(cfg, plan, adapter, hf_config) -> dict:
        return planner.roofline_sparse(plan.target, adapter, hf_config, plan.sparse_kernel)

    # --- method: observe → decide, the zeros applied in place --------------------------------------
    def method(self, job: Job) -> Decision:
        sparsity = parse(job.plan.sparsity)
        windows = job.calib.train[: job.cfg.data.calib_windows]
        t0 = time.time()
        detail = prune(job, job.plan.method, windows, sparsity)
        detail["wall_s"] = round(time.time() - t0, 1)
        detail["calibration"] = {"source": job.calib.text.description, "tokens": windows.numel()}
        return Decision(None, detail, {"sparsity": sparsity})

    # --- surgery: shapes stay; the pattern is checked ------------------------------------------------
    def surgery(self, job: Job, decision: Decision):
        sparsity = decision.extra["sparsity"]
        decision.extra["achieved"] = achieved = check(job.model, job.adapter, sparsity)
        job.log(f"{job.plan.method} {sparsity}: {achieved['zero_fraction']:.3f} of the blocks' Linear weights are "
                f"zero ({decision.detail['wall_s']:.0f} s)")
        return job.model

    # --- the manifest's sections ---------------------------------------------------------------------
    def describe(self, job: Job, decision: Decision, model) -> dict:
        plan, target, cfg = job.plan, job.target, job.cfg
        sparsity, achieved = decision.extra["sparsity"], decision.extra["achieved"]
        engine = vllm_export.engine_section(target.kind, MAX_MODEL_LEN, job.out.name)
        engine["sparse24"] = {"config_written": bool(plan.sparse_kernel),
                              "kernel_versions": list(target.engines["vllm"].sparse24_kernel)
                              if "vllm" in target.engines else [],
                              "dense_fallback_args": vllm_export.DENSE_FALLBACK_ARGS}
        if plan.sparse_kernel:
            engine["image_version"] = _newest_allowed(engine["sparse24"]["kernel_versions"])
            engine["requires"] = (f"vLLM {' or '.join(engine['sparse24']['kernel_versions'])} on {target.short_name} "
                                  f"for the 2:4 kernel; `serve` falls back to dense serving on other versions")
        params = sum(p.numel() for p in model.parameters())
        return {
            "format": "vllm",
            "method": {"name": plan.method, "plan": plan.method, "layout": "semi-structured",
                       "sparsity": str(sparsity), "sparse_kernel": plan.sparse_kernel, "seed": cfg.seed,
                       **achieved, **decision.detail},
            "size": {"params_dense": params, "params_pruned": params, "bf16_bytes_dense": 2 * params,
                     "bf16_bytes_pruned": 2 * params,
                     "ideal_ratio": plan.prediction.get("weight_bytes_ratio", 1.0)},
            "engine": engine,
            "checks": {"pattern_complies": True, "zero_fraction": achieved["zero_fraction"]},
        }

    # --- export: an ordinary checkpoint, with the 2:4 config where the engine has the kernel -----------
    def export(self, job: Job, model, manifest: Manifest, quantized=None) -> None:
        config_extra = None
        if job.plan.sparse_kernel:
            config_extra = vllm_export.sparse24_quantization_config(manifest.checks["zero_fraction"])
        vllm_export.write_package(job.tmp, job.out, model, job.tok, manifest, report.render_sparse(manifest),
                                  config_extra=config_extra, finish_checkpoint=job.finish_checkpoint)


def prune(job: Job, method: str, windows: torch.Tensor, sparsity: Sparsity) -> dict:
    """Run `method` on the job's model in place; return what the manifest should say about the run."""
    cfg, model, adapter = job.cfg, job.model, job.adapter
    dtype = calibration_dtype(cfg.calib_dtype)
    # a pruner that looks at no data (magnitude alone) makes no calibration passes
    no_passes = method in PRUNERS and not PRUNERS[method].needs_data
    passes = {"calib_dtype": None if no_passes else str(dtype).removeprefix("torch.")}
    spec = registry.spec(method)
    if spec.pruner and not spec.transforms:
        prune_blockwise(model, adapter, windows, PRUNERS[method], sparsity, desc=f"{method} {sparsity}", dtype=dtype)
        return passes
    if spec.transforms:
        si_cfg = SIConfig(steps=cfg.si.steps, seed=cfg.seed)
        _, si = prune_with_si(model, adapter, windows, PRUNERS[spec.pruner], sparsity, si_cfg, dtype=dtype)
        chosen = [h["chosen"] for h in si.history]
        return {**passes, "si": {**vars(si_cfg), "blocks_learned": chosen.count("learned"), "blocks_init": chosen.count("init"),
                       "blocks_identity": chosen.count("identity"),
                       "attention_bias": bool(getattr(model.config, "attention_bias", False)),
                       "mlp_bias": bool(getattr(model.config, "mlp_bias", False))}}
    if method == "roi":
        return train_roi(job, windows, sparsity, dtype)
    raise NotImplementedError(method)


def train_roi(job: Job, windows: torch.Tensor, sparsity: Sparsity, dtype: torch.dtype) -> dict:
    """A one-shot prior, then RoI's mask training on chunks of the calibration windows, through
    the job's checkpointed loop (--resume).

    Priors (--roi-prior):
      wanda      Wanda scores from one dense pass; the frozen weights are the original ones.
      sparsegpt  SparseGPT's block-by-block mask *and* its weight update: the frozen weights are
                 SparseGPT's where it kept a weight and the original where it pruned one, so
                 RoI starts exactly at SparseGPT's model and can still swap any weight back in.
                 Costs one copy of the blocks' Linear weights in host memory while pruning.
    """
    model, adapter, settings = job.model, job.adapter, job.cfg.roi
    roi_cfg = RoIConfig(steps=settings.steps, seed=job.cfg.seed)
    seq = settings.seq_len if windows.shape[1] % settings.seq_len == 0 else windows.shape[1]
    chunks = windows.reshape(-1, seq)
    t0 = time.time()
    if settings.prior == "sparsegpt":
        linears = [adapter.linears(b) for b in adapter.blocks(model)]
        original = [{n: lin.weight.detach().clone() for n, lin in d.items()} for d in linears]
        keeps = prune_blockwise(model, adapter, windows, SparseGPT, sparsity, desc=f"RoI prior: sparsegpt {sparsity}",
                                dtype=dtype)
        prior = []
        with torch.no_grad():
            for d, orig, keep in zip(linears, original, keeps):
                for n, lin in d.items():
                    lin.weight.copy_(torch.where(keep[n], lin.weight, orig[n]))
                prior.append({n: keep[n].float().mul(2).exp() for n in d})  # kept e², pruned 1
        del original, keeps
    else:
        prior = wanda_prior(model, adapter, windows)
    prior_s = time.time() - t0
    roi = RoI(model, adapter, sparsity, roi_cfg)
    roi.init_from_scores(prior)
    del prior
    ckpt = job.checkpoint("roi", [str(sparsity), vars(roi_cfg), seq, settings.prior, job.cfg.data.calib_windows])
    run = job.trainer.train(roi, chunks, roi_cfg.steps, 1, ckpt, f"RoI {sparsity} masks",
                    lambda s: {"kd": f"{s['loss']:.3f}", "tau": f"{s['tau']:.2f}", "scale": f"{s['scale']:.1f}"})
    memory = roi.state_bytes()
    roi.apply()
    return {"roi": {**vars(roi_cfg), "prior": settings.prior, "prior_s": round(prior_s, 1),
                    "seq_len": seq, "tokens": roi_cfg.steps * seq, "resumed_from_step": run["resumed_from_step"],
                    "final": run["final"], "checkpoint": run["checkpoint"],
                    "trainable_state_bytes": memory["total"], "model_bytes": memory["model"],
                    "state_to_model_ratio": round(memory["ratio"], 3)}}


def check(model, adapter, sparsity: Sparsity) -> dict:
    """Every pruned Linear complies with the pattern once cast to the package's bf16."""
    zeros = total = 0
    for i, block in enumerate(adapter.blocks(model)):
        for name, lin in adapter.linears(block).items():
            w = lin.weight.detach().to(torch.bfloat16)
            if not sparsity.complies(w):
                raise RuntimeError(f"internal check failed: block {i} {name} does not satisfy {sparsity}")
            zeros += int((w == 0).sum())
            total += w.numel()
    return {"zero_fraction": zeros / total, "pruned_linear_params": total}


def _newest_allowed(specs: list[str]) -> str:
    """The Docker image for a package with the 2:4 config: the newest release the profile allows."""
    for spec in specs:
        for clause in spec.split(","):
            if clause.strip().startswith("<="):
                return clause.strip()[2:]
    return planner.DEFAULT_VLLM
