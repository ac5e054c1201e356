"""The frontier search (optimizer/search.py): candidates, the choice within the budget, the package."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from optimizer import search
from optimizer.errors import UserError


def _cand(structure, retain, precision, ratio, b16, b1=None):
    plan = SimpleNamespace(prediction={"decode_speedup_b16": b16, "decode_speedup_b1": b1 or b16, "prefill_speedup": b16},
                           method="structured", quant_reason="", target=SimpleNamespace(kind="gpu"))
    return search.Candidate(structure, retain, precision, cfg=None, plan=plan, quality={"ppl_ratio": ratio, "kl": 0.0})


def _field():
    return [_cand("dense", 1.0, "none", 1.0, 1.0), _cand("dense", 1.0, "int8", 1.02, 1.3),
            _cand("dense", 1.0, "w4a16", 1.09, 1.5), _cand("width", 0.9, "int8", 1.20, 1.35),
            _cand("width", 0.9, "none", 1.05, 1.06)]


def test_the_choice_is_the_fastest_candidate_within_the_budget_and_never_one_over_it():
    for max_loss in (0.0, 0.01, 0.03, 0.05, 0.1, 0.2, 0.5):
        for heal in (False, True):
            cands = _field()
            chosen, why = search.choose(cands, search.Budget(max_loss), heal)
            within = [c for c in cands if c.expected_ratio(heal) <= 1 + max_loss]
            assert chosen in within and chosen.speedup_b16 == max(c.speedup_b16 for c in within)
            assert chosen.label() in why


def test_a_pruned_candidate_is_judged_by_what_healing_is_predicted_to_buy_back():
    cands = _field()
    chosen, _ = search.choose(cands, search.Budget(0.12), heal=False)
    assert chosen.label() == "no pruning, W4A16"  # 1.5x at +9%; width 90% INT8 at +20% is over
    chosen, why = search.choose(_field(), search.Budget(0.12), heal=True)
    assert chosen.label() == "no pruning, W4A16"  # +20% healed is expected at +12%: 1.35x, slower anyway
    cands = _field()
    cands[3].plan.prediction["decode_speedup_b16"] = 1.6
    chosen, why = search.choose(cands, search.Budget(0.12), heal=True)
    assert chosen.structure == "width" and "expected after" in why


def test_when_no_pruned_candidate_fits_the_reason_says_what_pruning_costs():
    chosen, why = search.choose(_field(), search.Budget(0.05), heal=True)
    assert chosen.label() == "no pruning, INT8 W8A8"
    assert "Pruning 10% (width in INT8 W8A8) costs +20.0% perplexity on this model" in why
    assert "(+12.0% expected after healing), over the 5% budget: INT8 W8A8 without pruning" in why


def test_min_speedup_takes_the_best_quality_that_reaches_it():
    chosen, _ = search.choose(_field(), search.Budget(0.1, min_speedup=1.25), heal=False)
    assert chosen.label() == "no pruning, INT8 W8A8"
    chosen, why = search.choose(_field(), search.Budget(0.01, min_speedup=1.25), heal=False)
    assert chosen.label() == "no pruning, 16-bit" and "none within it reaches 1.25x" in why


def test_the_frontier_section_marks_one_chosen_and_the_undominated():
    cands = _field()
    chosen, why = search.choose(cands, search.Budget(0.05), heal=False)
    chosen.chosen = True
    s = search.section(cands, search.Budget(0.05), why, False, None)
    assert [c["chosen"] for c in s["candidates"]].count(True) == 1
    assert s["frontier"] == [0, 1, 2]  # width 90% INT8 is slower than W4A16 and worse; 16-bit width 90% too


def _run(args, tmp_path):
    from optimizer.cli import optimize
    return CliRunner().invoke(optimize, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def eval_file(tmp_path):
    p = tmp_path / "eval.txt"  # other text than the calibration's, which the heal trains on
    p.write_text("\n".join(f"Line {i} of a held-out text about rivers, towns and the number {i * 7}." for i in range(600)))
    return p


def _common(tiny_dirs, text_file, eval_file):
    return [tiny_dirs["llama"], "--target", "a100", "--calib", text_file, "--eval", eval_file,
            "--set", "data.seq_len=128", "--set", "data.calib_windows=2", "--set", "data.eval_windows=1"]


@pytest.mark.slow
def test_optimize_without_retain_searches_and_ships_the_chosen_candidate(tiny_dirs, text_file, eval_file, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv("OPTIMIZER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "pkg"
    r = _run([*_common(tiny_dirs, text_file, eval_file), "--max-loss", "50%", "--heal-tokens", "512", "--set", "heal.chat=0",
              "-o", out], tmp_path)
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    f = m["frontier"]
    assert f["budget"]["max_loss"] == 0.5 and len(f["candidates"]) >= 4
    chosen = [c for c in f["candidates"] if c["chosen"]]
    assert len(chosen) == 1 and (out / "frontier.png").is_file()
    c = chosen[0]
    within = [x for x in f["candidates"] if x["quality"] and x["expected_ppl_ratio"] <= 1.5]
    if "chosen_checked" not in f or f["chosen_checked"]["ppl_ratio"] <= 1.5:
        # the fastest (speeds equal to 1%: the better quality) within the budget
        assert round(c["predicted"]["decode_speedup_b16"], 2) == max(round(x["predicted"]["decode_speedup_b16"], 2)
                                                                     for x in within)
    assert m["method"]["retain_requested"] == c["retain"]
    assert (m.get("quantization") or {}).get("precision", "none") == c["precision"]
    assert ("heal" in m) == (c["structure"] != "dense")  # nothing removed: nothing healed
    assert "## Search" in (out / "report.md").read_text()
    # the package is in place: no search record, no heal checkpoint left to resume
    assert not [p.name for p in (tmp_path / "cache" / "runs").glob("*")]


def test_the_search_never_ships_over_its_budget(tiny_dirs, text_file, eval_file, tmp_path):
    out = tmp_path / "pkg"
    r = _run([*_common(tiny_dirs, text_file, eval_file), "--max-loss", "0%", "--no-heal", "-o", out], tmp_path)
    assert r.exit_code == 0, r.output
    f = json.loads((out / "manifest.json").read_text())["frontier"]
    chosen = next(c for c in f["candidates"] if c["chosen"])
    assert chosen["expected_ppl_ratio"] <= 1.0
    assert all(c["quality"] is None or c["chosen"] or c["expected_ppl_ratio"] > 1.0
               or c["predicted"]["decode_speedup_b16"] <= chosen["predicted"]["decode_speedup_b16"] + 0.005
               for c in f["candidates"])


def test_explicit_retain_pins_the_candidate_and_nothing_removed_is_not_healed(tiny_dirs, text_file, eval_file, tmp_path):
    out = tmp_path / "pkg"
    r = _run([*_common(tiny_dirs, text_file, eval_file), "--retain", "1.0", "--quant", "int8", "--heal-tokens", "512",
              "--set", "heal.chat=0", "-o", out], tmp_path)
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    assert "frontier" not in m and "heal" not in m and m["quantization"]["precision"] == "int8"
    assert "heal: skipped, nothing was removed" in r.output


def test_dry_run_lists_the_candidates_with_their_predicted_speeds(tiny_dirs, text_file, eval_file, tmp_path):
    r = _run([*_common(tiny_dirs, text_file, eval_file), "--dry-run"], tmp_path)
    assert r.exit_code == 0, r.output
    assert "search: " in r.output and "| width 90%, INT8 W8A8 |" in r.output and not (tmp_path / "out").exists()


def test_bad_budgets_are_one_line_errors(tiny_dirs, text_file, eval_file, tmp_path):
    r = _run([*_common(tiny_dirs, text_file, eval_file), "--max-loss", "five", "--dry-run"], tmp_path)
    assert r.exit_code == 2 and "not a percentage" in r.output
    r = _run([*_common(tiny_dirs, text_file, eval_file), "--min-speedup", "-1", "--dry-run"], tmp_path)
    assert r.exit_code == 2 and "min_speedup must be > 0" in r.output


@pytest.mark.slow
def test_a_healed_candidate_that_misses_the_budget_falls_back_to_one_with_nothing_removed(
        tiny_dirs, text_file, eval_file, tmp_path, monkeypatch):
    """The re-check after healing and quantizing is the last word: here it is made to miss (every
    quality measured after the choice is 2x), and the package is the best unpruned candidate."""
    chose = []
    real_choose, real_quality = search.choose, search.Reference.quality

    def choose(cands, budget, heal, scatter=0.0):
        for c in cands:  # make a pruned candidate the fastest and (predicted) within the budget
            if c.pruned and c.scored:
                c.quality = {**c.quality, "ppl_ratio": 1.0}
                c.plan.prediction["decode_speedup_b16"] += 1
        chose.append(True)
        return real_choose(cands, budget, heal, scatter)

    def quality(self, model):
        q = real_quality(self, model)
        return {**q, "ppl_ratio": 2.0} if chose else q
    monkeypatch.setattr(search, "choose", choose)
    monkeypatch.setattr(search.Reference, "quality", quality)
    out = tmp_path / "pkg"
    r = _run([*_common(tiny_dirs, text_file, eval_file), "--heal-tokens", "512", "--set", "heal.chat=0", "-o", out],
             tmp_path)
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    f = m["frontier"]
    chosen = [c for c in f["candidates"] if c["chosen"]]
    assert len(chosen) == 1 and chosen[0]["structure"] == "dense"
    assert f["chosen_checked"]["ppl_ratio"] == 2.0 and "missed the budget" in f["why"]
    assert m["method"]["retain_requested"] == 1.0 and "heal" not in m


def test_a_quantized_head_ranks_as_less_precise_than_its_precision_alone_and_apart_from_4_bit():
    """The skip order's partial order: INT8 + LM head over the budget rules out nothing 4-bit
    (a different loss), but rules out itself pruned; INT8 alone over it rules out INT8 + LM head."""
    head = search.Candidate("dense", 1.0, "int8", head=True)
    assert head.rank() == (1, 1) and head.label() == "no pruning, INT8 W8A8 + LM head"
    worse_or_equal = lambda o, c: all(a <= b for a, b in zip(o.rank(), c.rank()))  # noqa: E731  (score's test)
    assert not worse_or_equal(head, search.Candidate("dense", 1.0, "w4a16"))
    assert worse_or_equal(search.Candidate("dense", 1.0, "int8"), head)


def test_a_candidate_is_not_measured_where_a_more_intact_more_precise_one_is_over_already(monkeypatch):
    """Cheap proxies first: once width 90% in 16-bit is over the budget, width 90% quantized and every
    narrower width are not built; W4A16 of the dense model over it skips every pruned W4A16."""
    measured = []

    class Ref:
        texts = {"text": None}

        def quality(self, model):
            return {"ppl_ratio": model["ratio"], "kl": 0.0, "texts": {}}

    ratios = {("dense", "int8"): 1.01, ("dense", "w4a16"): 1.4, ("width", "none"): 1.3}

    def build(job, retains):
        return lambda retain: {"structure": "width", "retain": retain}

    monkeypatch.setattr("optimizer.structured.Structured.searcher", staticmethod(build))

    def fake_quantize(m, adapter, windows, cfg, log=None):
        return {**m, "precision": cfg.precision}, search.quantize.QuantReport({})
    monkeypatch.setattr(search.quantize, "quantize", fake_quantize)
    monkeypatch.setattr(search.copy, "deepcopy", lambda m: dict(m))
    real_quality = Ref.quality

    def quality(self, m):
        key = (m.get("structure", "dense"), m.get("precision", "none"))
        measured.append((key, m.get("retain", 1.0)))
        return real_quality(self, {"ratio": ratios.get(key, 1.5)})
    monkeypatch.setattr(Ref, "quality", quality)
    job = SimpleNamespace(model={}, adapter=None, calib=SimpleNamespace(train=[]), log=lambda *a: None,
                          cfg=SimpleNamespace(data=SimpleNamespace(calib_windows=1), calib_dtype="auto", format="vllm"))
    cands = [_cand(s, r, p, None, {"none": 1.0, "int8": 1.3, "w4a16": 1.5}[p] + 1 - r)
             for s, r in (("dense", 1.0), ("width", 0.9), ("width", 0.8)) for p in ("none", "int8", "w4a16")]
    for c in cands:
        c.quality = {}
    search.score(job, cands, Ref(), limit=1.05, heal=True)
    assert [k for k in measured] == [(("dense", "int8"), 1.0), (("dense", "w4a16"), 1.0), (("width", "none"), 0.9)]
    skipped = [c.label() for c in cands if c.skipped]
    assert skipped == ["width 90%, INT8 W8A8", "width 90%, W4A16", "width 80%, 16-bit", "width 80%, INT8 W8A8",
                       "width 80%, W4A16"]
    chosen, why = search.choose(cands, search.Budget(0.05), heal=True)
    assert chosen.label() == "no pruning, INT8 W8A8" and "Pruning 10% (width) costs +30.0% perplexity" in why


@pytest.mark.parametrize("args, has, lacks", [
    (["--target", "cpu"], ["| blocks 90%, INT8 W8A8 |", "| width 70%, 16-bit |"], ["FP8"]),
    (["--target", "cpu", "--format", "onnx"], ["| width 90%, INT8 W8A8 |", "| no pruning, 16-bit |"],
     ["blocks", "W4A16", "per-layer"]),  # onnx: uniform shapes only
    (["--target", "a100"], ["| per-layer 90%, INT8 W8A8 |", "| per-layer 70%, 16-bit |"], []),  # DeciLM in stock vLLM
    (["--target", "a100", "--format", "onnx"], ["| width 80%, 16-bit |"], ["INT8", "blocks"]),
    (["--target", "h100"], ["FP8 W8A8"], ["blocks"]),
    (["--target", "a100", "--method", "depth"], ["| blocks 80%, INT8 W8A8 |"], ["width", "per-layer"]),
    (["--target", "a100", "--quant", "int8"], ["| width 90%, INT8 W8A8 |"], ["16-bit", "W4A16"]),
    (["--target", "a100", "--set", "quant_head=true"], ["| no pruning, INT8 W8A8 |", "| width 90%, INT8 W8A8 + LM head |"],
     ["16-bit + LM head", "W4A16 + LM head"]),
    (["--target", "cpu", "--format", "onnx"],  # quant_head's default: onnxruntime's INT8 head beside the blocks'
     ["| no pruning, INT8 W8A8 |", "| no pruning, INT8 W8A8 + LM head |", "| width 90%, INT8 W8A8 + LM head |"],
     ["16-bit + LM head"]),
    (["--target", "cpu", "--format", "onnx", "--set", "quant_head=false"], ["| no pruning, INT8 W8A8 |"], ["LM head"]),
    # onnx.int8=qdq is the INT8 candidates' form; the 16-bit ones are searched beside them, not refused
    (["--target", "cpu", "--format", "onnx", "--set", "onnx.int8=qdq"], ["| no pruning, 16-bit |", "| width 90%, 16-bit |",
                                                                        "| no pruning, INT8 W8A8 + LM head |"], ["blocks"]),
    (["--target", "cpu"], ["| no pruning, INT8 W8A8 |"], ["LM head"]),  # vLLM's: not yet served in a test
])
def test_the_candidates_are_the_structures_and_precisions_the_target_serves(tokenizer, text_file, eval_file, tmp_path,
                                                                           args, has, lacks):
    """Whole blocks only where the target has a fixed cost per block (the cpu profile, vLLM); onnxruntime's
    INT8 on the cpu target only; FP8 where the GPU has FP8 kernels; --method and --quant narrow the set."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import random_norms_and_biases, tiny_config
    config = tiny_config("llama", vocab_size=len(tokenizer))
    config.num_hidden_layers = 6  # blocks between the first and the last to remove
    deep = tmp_path / "deep"
    random_norms_and_biases(AutoModelForCausalLM.from_config(config)).save_pretrained(deep)
    tokenizer.save_pretrained(deep)
    common = [a for a in _common({"llama": deep}, text_file, eval_file) if a not in ("--target", "a100")]
    r = _run([*common, *args, "--dry-run"], tmp_path)
    assert r.exit_code == 0, r.output
    table = r.output[r.output.index("| candidate |"):]
    assert all(h in table for h in has) and not any(x in table for x in lacks), table


@pytest.mark.slow
def test_a_killed_search_resumes_without_measuring_again_and_chooses_the_same(tiny_dirs, text_file, eval_file,
                                                                               tmp_path, monkeypatch):
    """SIGTERM (here: Terminated raised) after the third candidate measured; `--resume` takes the three
    from the search's record, measures the rest, ships the same choice as an uninterrupted run, and
    leaves no record behind."""
    from core.errors import Terminated
    monkeypatch.setenv("OPTIMIZER_CACHE", str(tmp_path / "cache"))
    args = [*_common(tiny_dirs, text_file, eval_file), "--no-heal", "--max-loss", "50%"]
    whole = tmp_path / "whole"
    assert _run([*args, "-o", whole], tmp_path).exit_code == 0
    expected = json.loads((whole / "manifest.json").read_text())["frontier"]

    real_quality, measured = search.Reference.quality, []

    def quality(self, model):
        if len(measured) == 3:
            raise Terminated("SIGTERM")
        measured.append(True)
        return real_quality(self, model)
    monkeypatch.setattr(search.Reference, "quality", quality)
    out = tmp_path / "pkg"
    assert _run([*args, "-o", out], tmp_path).exit_code != 0 and not out.exists()
    monkeypatch.setattr(search.Reference, "quality", real_quality)
    records = list((tmp_path / "cache" / "runs").glob("search-*.json"))
    assert len(records) == 1 and len(json.loads(records[0].read_text())) == 4  # and the dense model, unmeasured

    r = _run([*args, "--resume", "-o", out], tmp_path)
    assert r.exit_code == 0, r.output
    assert r.output.count("(scored before the interruption)") == 4
    f = json.loads((out / "manifest.json").read_text())["frontier"]
    assert [c["label"] for c in f["candidates"] if c["chosen"]] == [c["label"] for c in expected["candidates"]
                                                                   if c["chosen"]]
    assert [c["quality"] for c in f["candidates"]] == [c["quality"] for c in expected["candidates"]]
    assert not records[0].exists()
