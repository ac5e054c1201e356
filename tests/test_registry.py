"""The method registry: one table the planner, the CLI help and validation read."""

from __future__ import annotations

import pytest

from optimizer import plan as planner
from optimizer import registry
from optimizer.errors import UserError
from optimizer.profiles import load_profile


def test_every_method_names_a_kind_that_loads_and_a_pruner_that_exists():
    from optimizer.methods.base import LinearPruner
    from optimizer.semistructured import PRUNERS
    for m in registry.METHODS.values():
        kind = registry.kind_class(m.kind)
        assert all(hasattr(kind, f) for f in ("method", "surgery", "describe", "export", "edits_in_place"))
        if m.pruner:
            assert m.kind == registry.SEMI_STRUCTURED and issubclass(PRUNERS[m.pruner], LinearPruner)
        assert m.help and m.name in registry.help_text() or m.kind == registry.EXPERTS


@pytest.mark.parametrize("method", registry.choices())
def test_the_planner_accepts_every_choice_and_resolves_it_to_a_registered_method(method):
    plan = planner.choose(load_profile("a100"), method)
    assert plan.method in registry.METHODS
    assert bool(plan.sparsity) == registry.is_sparse(plan.method)


def test_an_unknown_method_lists_the_registry_s_choices():
    with pytest.raises(UserError, match="choose from: auto, structured, semi-structured, activation"):
        planner.choose(load_profile("a100"), "prune-harder")


def test_no_stage_or_kind_writes_into_the_job():
    """The job collects what stages return; nothing outside optimizer/job.py assigns to it."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "optimizer"
    writes = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "job.py"
              for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bjob\.\w+(\[[^]]*\])? = ", line)]
    assert writes == []
