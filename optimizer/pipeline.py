"""`optimize(OptimizeConfig(...))`: the one-verb API the CLI wraps.

validate the config → choose the target and the plan → (dry run: stop) → run the job of the
plan's kind (structured, semi-structured, depth or experts; `optimizer/job.py`) into a temporary directory
that becomes the package only when complete.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

from core.errors import UserError
from optimizer import budget, distributed, load, plan as planner, profiles, registry, sparsity
from optimizer.adapters import MoEAdapter, get_adapter, onnx_families
from optimizer.config import (DataConfig, DDPSettings, HealSettings, OnnxSettings, OptimizeConfig, RefitSettings,
                              RoISettings, SISettings, validate)
from optimizer.job import Job, staged
from optimizer.moe_surgery import expert_width_to_keep, experts_to_keep

__all__ = ["optimize", "validate", "OptimizeConfig", "DataConfig", "DDPSettings", "RoISettings", "SISettings",
           "RefitSettings", "HealSettings", "OnnxSettings"]


def _depth_would_run(cfg: OptimizeConfig, adapter, hf_config) -> bool:
    """Whether --method depth accepts this model and these options (optimizer.depth.check)."""
    from optimizer.depth import check
    try:
        check(cfg, adapter, hf_config)
    except UserError:
        return False
    return True


def _marlin_note(hidden: int) -> str:
    """W4A16 on a GPU: vLLM's Marlin kernel wants every input width a multiple of 128, which the
    hidden size (the input of q/k/v and gate/up) decides before any pruning."""
    if hidden % 128 == 0:
        return (" (groups of the largest of 128 / 64 / 32 every pruned input width takes; vLLM's Marlin kernel "
                "wants each a multiple of 128: the quantize stage names those that are not)")
    return (f" (the hidden size {hidden} is not a multiple of 128, which vLLM's Marlin kernel wants of every input "
            f"width: q/k/v and gate/up need another of its 4-bit kernels, or vLLM refuses to load them; not run on "
            f"a GPU here)")


def _whole_blocks_prediction(target, adapter, hf_config, retain: float, plan) -> tuple[int, dict]:
    """(blocks kept, roofline) of --method depth at `retain`: that many blocks at full width."""
    from optimizer.depth import blocks_to_keep
    kept = blocks_to_keep(hf_config.num_hidden_layers, retain)
    return kept, planner.roofline(target, adapter, hf_config, adapter.dense_shape(hf_config), layers=kept,
                                  **planner.quant_prediction(plan))


def optimize(cfg: OptimizeConfig, *, dry_run: bool = False, log: Callable = print) -> dict:
    """Prune (and package) the model `cfg` names. Returns {"plan", "manifest" (the package's
    core.manifest.Manifest), "out"}, or
    {"plan", "dry_run": True} when `dry_run`; bad input raises UserError before any compute."""
    validate(cfg)
    distributed.start(cfg.heal.device, cfg.threads)  # under torchrun: join the process group before any work
    if not distributed.is_main():
        log = _silent
    target, why_target = target_profile(cfg.target)
    plan = planner.choose(target, cfg.method, engine_version=cfg.engine_version, sparsity=cfg.sparsity)
    if plan.sparsity and cfg.format != "vllm":
        raise UserError(f"semi-structured packages are vLLM packages (onnxruntime has no 2:4 kernel); "
                        f"drop --format {cfg.format} or use --method structured")
    if plan.sparsity and cfg.refit.on:
        raise UserError(f"refit.on=true: the refit applies to structured methods (removed heads and channels); the "
                        f"plan is semi-structured ({plan.method}): drop it or use --method structured")
    if plan.sparsity and cfg.quant not in ("none", "auto"):
        raise UserError(f"the plan is semi-structured ({plan.method}), which is not quantized yet: "
                        f"use --method structured or --quant none")
    source = load.resolve(cfg.model)
    from transformers import AutoConfig
    try:
        hf_config = AutoConfig.from_pretrained(source.hf_dir)
    except Exception as e:
        raise UserError(f"{source.description}: unreadable config ({type(e).__name__})") from None
    adapter = get_adapter(hf_config)
    moe = isinstance(adapter, MoEAdapter)
    if moe:
        check_moe(cfg, adapter)
        planner.for_experts(plan, cfg.method, adapter.family)
    planner.choose_quant(plan, cfg.quant, not_quantized=_not_quantized(cfg, plan, moe))
    if plan.quant == "w4a16" and target.kind != "cpu":  # the cpu target refuses shapes its kernel cannot take
        plan.quant_reason += _marlin_note(hf_config.hidden_size)
    if cfg.format == "onnx" and plan.quant == "int8":  # not vLLM's kernel table: onnxruntime's own INT8
        form = ("dynamic INT8 (MatMulInteger" if cfg.onnx.int8 == "dynamic" else
                "static INT8 in QDQ form (QuantizeLinear / DequantizeLinear pairs")
        plan.quant_reason = (f"--quant int8 requested: onnxruntime's {form}, run by onnxruntime on the CPU), "
                             f"whatever kernels the target's GPU has" if cfg.quant == "int8" else
                             f"the cpu target's INT8 kernels (VNNI / AMX) through onnxruntime's {form}, its CPU "
                             f"provider's integer kernels)")
    if cfg.onnx.int8 != "dynamic" and plan.quant != "int8":
        raise UserError(f"onnx.int8={cfg.onnx.int8} needs INT8 weights, but "
                        f"{plan.quant_reason.removesuffix(' (--quant auto)')}")
    if cfg.format == "onnx" and not adapter.onnx_export:
        raise UserError(f"{adapter.family}: ONNX export covers the LLaMA-shaped families "
                        f"({', '.join(onnx_families())}); use --format vllm")
    depth = plan.method == planner.DEPTH and not moe
    if depth:
        from optimizer.depth import check
        check(cfg, adapter, hf_config)
    if cfg.layout == "per-layer" and not adapter.per_layer:
        raise UserError(f"{adapter.family}: no per-layer model class for this family; use layout=uniform")
    if moe:
        n_keep, width = experts_to_keep(adapter, hf_config, cfg.retain), expert_width_to_keep(adapter, hf_config, cfg.retain)
        plan.prediction = planner.roofline_experts(target, adapter, hf_config, n_keep, meta_params(hf_config), width=width)
    elif plan.sparsity:
        for name, width in adapter.input_widths(hf_config).items():
            sparsity.parse(plan.sparsity).check_shape(width, name)
        plan.prediction = planner.roofline_sparse(target, adapter, hf_config, plan.sparse_kernel)
    elif depth:
        plan.prediction = _whole_blocks_prediction(target, adapter, hf_config, cfg.retain, plan)[1]
    else:
        nominal = budget.uniform_candidates(adapter, hf_config, cfg.retain)
        if not nominal:
            raise UserError(f"--retain {cfg.retain} leaves too little of each block for a uniform layout")
        plan.prediction = planner.roofline(target, adapter, hf_config, nominal[0], **planner.quant_prediction(plan))
        # a target where every kept block costs time beyond its matmuls (measured under vLLM); not for
        # onnxruntime, nor where --method depth would be refused (which includes a --retain keeping every block)
        if target.block_overhead_ms and cfg.format == "vllm" and _depth_would_run(cfg, adapter, hf_config):
            kept, whole = _whole_blocks_prediction(target, adapter, hf_config, cfg.retain, plan)
            depth = cfg.method == "auto" and planner.prefers_fewer_blocks(plan.prediction, whole, cfg.retain)
            plan.reasons.append(planner.fewer_blocks_reason(target, plan.prediction, whole, kept,
                                                            hf_config.num_hidden_layers, chosen=depth))
            if depth:
                plan.method, plan.prediction = planner.DEPTH, whole
    if why_target:
        log(why_target)
    log(plan.text())
    h = cfg.heal
    lean = ", lean memory (Adafactor, activations recomputed per block)" if h.memory == "lean" else ""
    log(f"heal: {h.tokens:,} tokens of distillation from the dense model after surgery{lean} (--no-heal to skip)"
        if h.tokens else "heal: off")
    if dry_run:
        return {"plan": plan, "dry_run": True}

    level = f"s{plan.sparsity.replace(':', 'of')}" if plan.sparsity else f"r{cfg.retain:.2f}"
    out = Path(cfg.out or f"out/{source.name}-{target.name}-{plan.method}-{level}")
    kind = registry.EXPERTS if moe else registry.spec(plan.method).kind
    with staged(out) if distributed.is_main() else contextlib.nullcontext() as tmp:  # rank 0 writes
        return Job(cfg, target, plan, source, adapter, out, tmp, log).run(registry.kind_class(kind)())


def _silent(*args, **kwargs) -> None:
    """The log of a rank other than 0: one process speaks for all."""


def check_moe(cfg: OptimizeConfig, adapter) -> None:
    """What the expert kind does not do, refused in one line before any work."""
    if cfg.format != "vllm":
        raise UserError(f"{adapter.family}: MoE packages are vLLM packages (the ONNX decoder has no MoE block); "
                        f"drop --format {cfg.format}")
    if cfg.layout != "uniform":
        raise UserError(f"{adapter.family}: MoE models keep the same number of experts in every layer "
                        f"(a stock config); use layout=uniform")
    if cfg.refit.on:
        raise UserError("refit.on=true: the refit refits the kept columns of pruned heads and channels of dense "
                        "blocks; MoE packages (whole experts removed) are not refit: drop it")
    if cfg.retain_by != "params":
        raise UserError("retain_by=latency applies to heads and channels; for MoE models --retain is the share "
                        "of routed-expert parameters kept: drop it")
    if cfg.quant not in ("none", "auto"):
        raise UserError(f"{adapter.family}: MoE packages are not quantized yet (the fused 3-D expert tensors "
                        f"need their own scheme): use --quant none or auto")


def meta_params(hf_config) -> int:
    """The model's parameter count from its config alone (built on the meta device: no memory)."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config).parameters())


def _not_quantized(cfg: OptimizeConfig, plan, moe: bool = False) -> str | None:
    """Why this kind of package keeps 16-bit weights whatever the target accelerates, or None."""
    if moe:
        return "MoE packages are not quantized yet"
    if cfg.format != "vllm" and plan.target.kind != "cpu":
        return ("ONNX packages for a GPU keep fp32 weights (onnxruntime's INT8 kernels are its CPU provider's; "
                "--quant int8 to ask)")
    if cfg.format != "vllm" and cfg.onnx.dtype != "float32":
        return "a float16 ONNX package is not quantized (INT8 is quantized from the float32 graph)"
    if plan.sparsity:
        return "2:4 packages keep 16-bit weights (vLLM's 2:4 kernels are unquantized)"
    return None


def target_profile(name: str):
    """(profile, why) for --target; `why` explains an auto-detected choice, else None."""
    if name == "auto":
        return profiles.auto_profile()
    return profiles.load_profile(name), None
