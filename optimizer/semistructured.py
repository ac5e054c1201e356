"""The optimize job for the semi-structured family: N:M (2:4, 4:8, ...) or unstructured zeros.

Shapes do not change, so there is no surgery: the method zeroes weights in place (SparseGPT
also updates the survivors), every Linear of the blocks is checked against the pattern, and
the package is an ordinary checkpoint. Whether it is *faster* depends only on the engine:
the compressed-tensors `sparsity_config` that makes vLLM use its 2:4 kernel is written only
where the target profile says the engine version has one; everywhere else the report says
plainly that the zeros are served densely and no speedup is to be expected.
"""

from __future__ import annotations

import datetime as _dt
import time
from pathlib import Path

import torch

from exporters import vllm as vllm_export
from optimizer import plan as planner
from optimizer import report
from optimizer.methods.magnitude import Magnitude
from optimizer.methods.roi import RoI, RoIConfig, wanda_prior
from optimizer.methods.si import SIConfig, prune_with_si
from optimizer.methods.sparsegpt import SparseGPT
from optimizer.methods.wanda import Wanda
from optimizer.sequential import calibration_dtype, prune_blockwise
from optimizer.sparsity import Sparsity, parse

PRUNERS = {"magnitude": Magnitude, "wanda": Wanda, "sparsegpt": SparseGPT}


def run(cfg, target, plan, source, adapter, out: Path, tmp: Path) -> dict:
    from optimizer.pipeline import TOOL_VERSION, _calibration, _dense_perplexity, _evaluation, _load, _quality
    log = cfg.log
    started = time.time()
    sparsity = parse(plan.sparsity)
    model, tok = _load(cfg, source)
    config = model.config
    calib_text, train, _ = _calibration(cfg, model, tok)
    windows = train[: cfg.calib_windows]
    evaluation = _evaluation(cfg, tok)
    # measured before the weights change in place (cached per machine)
    dense_ppl = _dense_perplexity(model, evaluation[1], source) if evaluation else None

    t0 = time.time()
    detail = prune(cfg, plan.method, model, adapter, windows, sparsity)
    detail["wall_s"] = round(time.time() - t0, 1)
    detail["calibration"] = {"source": calib_text.description, "tokens": windows.numel()}
    achieved = check(model, adapter, sparsity)
    log(f"{plan.method} {sparsity}: {achieved['zero_fraction']:.3f} of the blocks' Linear weights are zero "
        f"({detail['wall_s']:.0f} s)")

    quality = _quality(cfg, evaluation, dense_ppl, model) if evaluation else {}
    config_extra = None
    if plan.sparse_kernel:
        config_extra = vllm_export.sparse24_quantization_config(achieved["zero_fraction"])
    engine = vllm_export.engine_section(target.kind, cfg.max_model_len, out.name)
    engine["sparse24"] = {"config_written": config_extra is not None,
                          "kernel_versions": list(target.engines["vllm"].sparse24_kernel)
                          if "vllm" in target.engines else [],
                          "dense_fallback_args": vllm_export.DENSE_FALLBACK_ARGS}
    if config_extra is not None:
        engine["image_version"] = _newest_allowed(engine["sparse24"]["kernel_versions"])
        engine["requires"] = (f"vLLM {' or '.join(engine['sparse24']['kernel_versions'])} on {target.short_name} "
                              f"for the 2:4 kernel; `serve` falls back to dense serving on other versions")
    params = sum(p.numel() for p in model.parameters())
    manifest = {
        "schema": vllm_export.SCHEMA,
        "format": "vllm",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "tool": {"name": "llm-deploy-optimizer", "version": TOOL_VERSION},
        "source": {"model": source.description, "hf_dir": str(source.hf_dir),
                   "architecture": (config.architectures or ["?"])[0], "family": adapter.family},
        "target": {"name": target.name, "display_name": target.display_name, "kind": target.kind,
                   "compute_capability": target.compute_capability},
        "method": {"name": plan.method, "plan": plan.method, "layout": "semi-structured",
                   "sparsity": str(sparsity), "sparse_kernel": plan.sparse_kernel, "seed": cfg.seed,
                   **achieved, **detail},
        "quality": {"perplexity": quality} if quality else {},
        "size": {"params_dense": params, "params_pruned": params, "bf16_bytes_dense": 2 * params,
                 "bf16_bytes_pruned": 2 * params,
                 "ideal_ratio": plan.prediction.get("weight_bytes_ratio", 1.0)},
        "plan": {"text": plan.text(), "reasons": plan.reasons, "prediction": plan.prediction,
                 "engine": plan.engine, "engine_version": plan.engine_version},
        "engine": engine,
        "checks": {"pattern_complies": True, "zero_fraction": achieved["zero_fraction"]},
        "wall_s": round(time.time() - started, 1),
    }
    vllm_export.write_package(tmp, out, model, tok, manifest, report.render_sparse(manifest),
                              config_extra=config_extra)
    log(f"package: {out.resolve()}  (serve it: serve {out})")
    return {"plan": plan, "manifest": manifest, "out": out}


def prune(cfg, method: str, model, adapter, windows: torch.Tensor, sparsity: Sparsity) -> dict:
    """Run `method` on `model` in place; return what the manifest should say about the run."""
    dtype = calibration_dtype(cfg.calib_dtype)
    # a pruner that looks at no data (magnitude alone) makes no calibration passes
    no_passes = method in PRUNERS and not PRUNERS[method].needs_data
    passes = {"calib_dtype": None if no_passes else str(dtype).removeprefix("torch.")}
    if method in PRUNERS:
        prune_blockwise(model, adapter, windows, PRUNERS[method], sparsity, desc=f"{method} {sparsity}", dtype=dtype)
        return passes
    if method.startswith("si+"):
        si_cfg = SIConfig(steps=cfg.si_steps, seed=cfg.seed)
        _, si = prune_with_si(model, adapter, windows, PRUNERS[method[3:]], sparsity, si_cfg, dtype=dtype)
        chosen = [h["chosen"] for h in si.history]
        return {**passes, "si": {**vars(si_cfg), "blocks_learned": chosen.count("learned"), "blocks_init": chosen.count("init"),
                       "blocks_identity": chosen.count("identity"),
                       "attention_bias": bool(getattr(model.config, "attention_bias", False)),
                       "mlp_bias": bool(getattr(model.config, "mlp_bias", False))}}
    if method == "roi":
        return _train_roi(cfg, model, adapter, windows, sparsity, dtype)
    raise NotImplementedError(method)


def _train_roi(cfg, model, adapter, windows: torch.Tensor, sparsity: Sparsity, dtype: torch.dtype) -> dict:
    """A one-shot prior, then cfg.roi_steps of mask training on cfg.roi_seq_len-token chunks of
    the calibration windows (checkpointed every cfg.checkpoint_every steps; --resume).

    Priors (cfg.roi_prior):
      wanda      Wanda scores from one dense pass; the frozen weights are the original ones.
      sparsegpt  SparseGPT's block-by-block mask *and* its weight update: the frozen weights are
                 SparseGPT's where it kept a weight and the original where it pruned one, so
                 RoI starts exactly at SparseGPT's model and can still swap any weight back in.
                 Costs one copy of the blocks' Linear weights in host memory while pruning.
    """
    import hashlib
    import json

    from tqdm import tqdm

    from optimizer import load
    from optimizer.pipeline import _batch_indices
    roi_cfg = RoIConfig(steps=cfg.roi_steps, seed=cfg.seed)
    seq = cfg.roi_seq_len if windows.shape[1] % cfg.roi_seq_len == 0 else windows.shape[1]
    chunks = windows.reshape(-1, seq)
    t0 = time.time()
    if cfg.roi_prior == "sparsegpt":
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
    key = hashlib.sha256(json.dumps([str(model.config._name_or_path), str(sparsity), vars(roi_cfg), seq, cfg.roi_prior,
                                     windows[:, :64].tolist()], default=str).encode()).hexdigest()[:16]
    ckpt = load.cache_dir() / "runs" / f"roi-{key}.pt"
    resumed_from = roi.step_count if (cfg.resume and roi.load(ckpt)) else 0
    bar = tqdm(total=roi_cfg.steps, initial=roi.step_count, desc=f"RoI {sparsity} masks", unit="step")
    stats = {}
    while roi.step_count < roi_cfg.steps:
        stats = roi.step(chunks[_batch_indices(len(chunks), 1, roi.step_count, cfg.seed)])
        bar.set_postfix(kd=f"{stats['loss']:.3f}", tau=f"{stats['tau']:.2f}", scale=f"{stats['scale']:.1f}")
        bar.update(1)
        if roi.step_count % cfg.checkpoint_every == 0 or roi.step_count == roi_cfg.steps:
            roi.save(ckpt)
    bar.close()
    memory = roi.state_bytes()
    roi.apply()
    return {"roi": {**vars(roi_cfg), "prior": cfg.roi_prior, "prior_s": round(prior_s, 1),
                    "seq_len": seq, "tokens": roi_cfg.steps * seq, "resumed_from_step": resumed_from,
                    "final": stats, "checkpoint": str(ckpt),
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
