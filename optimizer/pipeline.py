"""`optimize(OptimizeConfig(...))`: the one-verb API the CLI wraps.

validate the config → resolve the plan once (`plan.resolve`: target, method, kind, precision,
prediction, every refusal) → (dry run: stop) → run the job of the plan's kind (structured,
semi-structured, depth or experts: `optimizer/registry.py`, `optimizer/job.py`) into a temporary
directory that becomes the package only when complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Callable

from core.errors import UserError
from optimizer import distributed, load, measure, plan as planner, profiles, registry, search
from optimizer.adapters import get_adapter
from optimizer.config import (DEFAULT_RETAIN, DataConfig, DDPSettings, HealSettings, OnnxSettings, OptimizeConfig,
                              RefitSettings, RoISettings, SISettings, validate)
from optimizer.job import Job, staged

__all__ = ["optimize", "validate", "OptimizeConfig", "DataConfig", "DDPSettings", "RoISettings", "SISettings",
           "RefitSettings", "HealSettings", "OnnxSettings"]


def optimize(cfg: OptimizeConfig, *, dry_run: bool = False, log: Callable = print) -> dict:
    """Prune (and package) the model `cfg` names. Returns {"plan", "manifest" (the package's
    core.manifest.Manifest), "out"}, or {"plan", "dry_run": True} when `dry_run`; bad input raises
    UserError before any compute."""
    validate(cfg)
    distributed.start(cfg.heal.device, cfg.threads)  # under torchrun: join the process group before any work
    if not distributed.is_main():
        log = _silent
    target, why_target = target_profile(cfg.target)
    source = load.resolve(cfg.model)
    from transformers import AutoConfig
    try:
        hf_config = AutoConfig.from_pretrained(source.hf_dir)
    except Exception as e:
        raise UserError(f"{source.description}: unreadable config ({type(e).__name__})") from None
    adapter = get_adapter(hf_config)
    if why_target:
        log(why_target)
    if search.searches(cfg, adapter) and not planner.choose(target, cfg.method, engine_version=cfg.engine_version).sparsity:
        return _search(cfg, target, source, adapter, hf_config, dry_run, log)
    if cfg.measure:
        raise UserError("--measure times the search's candidates, and this run does not search (MoE, DDP, per-layer "
                        "and 2:4 runs take --retain); time the package with `bench PACKAGE --baseline MODEL`")
    if cfg.retain is None:  # a kind the search does not build
        cfg = dataclasses.replace(cfg, retain=DEFAULT_RETAIN)
    plan = planner.resolve(cfg, target, adapter, hf_config)
    log(plan.text())
    h = cfg.heal
    lean = ", lean memory (Adafactor, activations recomputed per block)" if h.memory == "lean" else ""
    log(f"heal: {h.tokens:,} tokens of distillation from the dense model after surgery{lean} (--no-heal to skip)"
        if h.tokens else "heal: off")
    if dry_run:
        return {"plan": plan, "dry_run": True}

    level = f"s{plan.sparsity.replace(':', 'of')}" if plan.sparsity else f"r{cfg.retain:.2f}"
    out = Path(cfg.out or f"out/{source.name}-{target.name}-{plan.method}-{level}")
    with staged(out) if distributed.is_main() else contextlib.nullcontext() as tmp:  # rank 0 writes
        return Job(cfg, target, plan, source, adapter, out, tmp, log).run(registry.kind_class(plan.kind)())


def _search(cfg, target, source, adapter, hf_config, dry_run: bool, log: Callable) -> dict:
    """No --retain: score the candidates (optimizer/search.py) and package the one chosen."""
    if cfg.measure and target.kind != "cpu":
        raise UserError(f"--measure times the candidates on this machine, the cpu target's kind; {target.display_name}'s "
                        f"speeds are its roofline's (drop --measure, or --target cpu)")
    budget = search.Budget(cfg.max_loss, cfg.min_speedup)
    cands = search.candidates(cfg, target, adapter, hf_config)
    heal = cfg.heal.tokens > 0
    first = cands[0].plan  # the target, the engine and why no 2:4 kernel serves it are every candidate's
    log("\n".join([*first.text().splitlines()[:2], f"  why: {first.reasons[0]}"]))
    log(f"search: {len(cands)} candidates (structure × precision) for {target.display_name}, {budget.text()}; "
        f"a pruned one is healed ({cfg.heal.tokens:,} tokens) and re-checked before it ships"
        if heal else f"search: {len(cands)} candidates (structure × precision) for {target.display_name}, "
        f"{budget.text()}; healing is off, so a pruned one is judged as it is")
    log(search.table([c.record(heal) for c in cands]))
    if cfg.measure:
        log(f"--measure: the candidates within the budget will be timed in onnxruntime on this CPU "
            f"({measure.cpu_name()}) and chosen by their measured decode speed at batch 16")
    if dry_run:
        return {"plan": cands[0].plan, "dry_run": True, "candidates": cands}
    out = Path(cfg.out or f"out/{source.name}-{target.name}")
    with staged(out) as tmp:
        return Job(cfg, target, cands[0].plan, source, adapter, out, tmp, log).run(candidates=cands, budget=budget)


def _silent(*args, **kwargs) -> None:
    """The log of a rank other than 0: one process speaks for all."""


def target_profile(name: str):
    """(profile, why) for --target; `why` explains an auto-detected choice, else None."""
    if name == "auto":
        return profiles.auto_profile()
    return profiles.load_profile(name), None
