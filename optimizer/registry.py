"""Every pruning method and every kind of job, by name: the one table the planner, the CLI's help
and validation read (vLLM's `models/registry.py` is the model). Adding a method is one row here
and its module under `optimizer/methods/`; adding a kind, one row in KINDS and its module.

A *kind* is how a job runs and what its package is (`optimizer/job.py`, "The kind contract"):
    structured       heads, KV groups and MLP channels physically removed (optimizer/structured.py)
    depth            whole blocks removed (optimizer/depth.py)
    semi-structured  N:M or unstructured zeros, shapes kept (optimizer/semistructured.py)
    experts          routed experts (and expert channels) of an MoE model removed (optimizer/experts.py)
Kinds are imported only when a job of theirs runs (they pull in torch-heavy modules).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

STRUCTURED, DEPTH, SEMI_STRUCTURED, EXPERTS = "structured", "depth", "semi-structured", "experts"

KINDS = {  # kind → "module:class"
    STRUCTURED: "optimizer.structured:Structured",
    DEPTH: "optimizer.depth:Depth",
    SEMI_STRUCTURED: "optimizer.semistructured:SemiStructured",
    EXPERTS: "optimizer.experts:Experts",
}


@dataclass(frozen=True)
class MethodSpec:
    name: str
    kind: str                     # the kind of job it runs in (KINDS)
    help: str                     # one line for `optimize --help` and the docs
    pruner: str | None = None     # semi-structured: the per-Linear pruner (PRUNERS) it runs block by block
    transforms: bool = False      # semi-structured: SI's sparsity-inducing transforms before the pruner
    trained: bool = False         # trains through the checkpointed loop (--resume continues it)


_ONE_SHOT = {"magnitude": "largest |W|, no calibration data", "wanda": "|W| × input norm (Wanda)",
             "sparsegpt": "second-order, survivors updated (SparseGPT)"}

METHODS: dict[str, MethodSpec] = {m.name: m for m in (
    MethodSpec("activation", STRUCTURED, "one-shot activation importance of heads and channels (seconds)"),
    MethodSpec("ddp", STRUCTURED, "learned gates on heads and channels, from the one-shot start (hours on a CPU)",
               trained=True),
    MethodSpec("depth", DEPTH, "whole blocks removed by their influence on the next block's input"),
    *(MethodSpec(name, SEMI_STRUCTURED, f"N:M or unstructured zeros: {how}", pruner=name)
      for name, how in _ONE_SHOT.items()),
    *(MethodSpec(f"si+{name}", SEMI_STRUCTURED, f"sparsity-inducing transforms, then {name}", pruner=name,
                 transforms=True) for name in _ONE_SHOT),
    MethodSpec("roi", SEMI_STRUCTURED, "learned N:M masks from a one-shot prior (RoI)", trained=True),
    # MoE models: whole routed experts; the planner maps activation / structured / auto here
    MethodSpec("reap", EXPERTS, "MoE: routed experts by router-weighted output norms (REAP-style), one-shot"),
)}

# Names a user may give that the planner resolves (optimizer/plan.choose): the target decides `auto`.
ALIASES = {
    "auto": "the planner's choice for the target: 2:4 SparseGPT where a 2:4 kernel serves the package, "
            "else structured (or whole blocks where the target has a fixed cost per block)",
    "structured": "activation (heads and channels, one-shot), then heal",
    "semi-structured": "sparsegpt at --sparsity (2:4 by default)",
}


def choices() -> tuple[str, ...]:
    """What `--method` accepts: the aliases and every method but the MoE-only one (which the
    planner picks for an MoE model)."""
    return (*ALIASES, *(m.name for m in METHODS.values() if m.kind != EXPERTS))


def spec(name: str) -> MethodSpec:
    return METHODS[name]


def is_sparse(method: str) -> bool:
    """A semi-structured method (zeros, shapes kept)."""
    m = METHODS.get(method)
    return m is not None and m.kind == SEMI_STRUCTURED


def kind_class(kind: str) -> type:
    """The class that runs a job of `kind`, imported now."""
    module, cls = KINDS[kind].split(":")
    return getattr(importlib.import_module(module), cls)


def help_text() -> str:
    """`--method`'s help: every name with its one line."""
    return "; ".join([f"{name}: {line}" for name, line in ALIASES.items()]
                     + [f"{m.name}: {m.help}" for m in METHODS.values() if m.kind != EXPERTS])
