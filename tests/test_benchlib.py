"""bench/benchlib.py: run folders, result files that are never overwritten, tables, serving figures.

Fast: no model, no network (a fake tokenizer for the windows).
"""

from __future__ import annotations

import ast
import json
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Loaded from its file, not by putting bench/ on sys.path: there bench/onnx.py would shadow the
# onnx package for every test after this one.
_spec = importlib.util.spec_from_file_location("benchlib", ROOT / "bench" / "benchlib.py")
benchlib = importlib.util.module_from_spec(_spec)
sys.modules["benchlib"] = benchlib
_spec.loader.exec_module(benchlib)


# --- run folders ---------------------------------------------------------------------------------

def test_run_dir_makes_a_new_folder_each_call(tmp_path):
    first = benchlib.run_dir("spine", root=tmp_path)
    second = benchlib.run_dir("spine", root=tmp_path)
    third = benchlib.run_dir("spine", root=tmp_path)
    assert first.is_dir() and second.is_dir() and third.is_dir()
    assert len({first, second, third}) == 3
    assert first.parent == tmp_path / "spine"
    assert second.name == f"{first.name}-2" and third.name == f"{first.name}-3"
    name = benchlib.run_name()
    assert first.name == name and name[:4].isdigit()
    commit, dirty = benchlib.git_state()
    if commit:  # the checkout's short commit, -dirty when tracked files changed
        assert name.split("-")[3] == commit[:7]
        assert name.endswith("-dirty") == bool(dirty)


def test_run_dir_never_reuses_an_existing_folder(tmp_path):
    taken = tmp_path / "ddp" / benchlib.run_name()
    taken.mkdir(parents=True)
    (taken / "ddp-params-r0.70.json").write_text("{}")
    fresh = benchlib.run_dir("ddp", root=tmp_path)
    assert fresh != taken and fresh.name == f"{taken.name}-2" and not any(fresh.iterdir())
    assert (taken / "ddp-params-r0.70.json").read_text() == "{}"


def test_run_dir_with_a_label(tmp_path):
    first = benchlib.run_dir("ort-server", root=tmp_path, label="c64")
    second = benchlib.run_dir("ort-server", root=tmp_path, label="c64")
    assert first.name == f"{benchlib.run_name()}-c64" and second.name == f"{first.name}-2"


def test_run_dir_nested_bench_name(tmp_path):
    path = benchlib.run_dir("ddp-probes/trajectory", root=tmp_path)
    assert path.parent == tmp_path / "ddp-probes" / "trajectory"


def test_run_dir_explicit_out_is_used_as_is(tmp_path):
    out = tmp_path / "mine" / "run"
    assert benchlib.run_dir("sparse", out, root=tmp_path / "results") == out and out.is_dir()
    (out / "sparse.json").write_text("{}")
    assert benchlib.run_dir("sparse", str(out), root=tmp_path / "results") == out  # resuming: the same folder
    assert not (tmp_path / "results").exists()


def test_run_dir_without_git_uses_date_and_time(tmp_path, monkeypatch):
    monkeypatch.setattr(benchlib, "_git", lambda *a: None)
    benchlib.git_state.cache_clear()
    try:
        assert benchlib.run_info()["commit"] is None
        path = benchlib.run_dir("onnx", root=tmp_path)
        date, time = path.name.rsplit("-", 1)
        assert len(date.split("-")) == 3 and len(time) == 6 and time.isdigit()
    finally:
        benchlib.git_state.cache_clear()


def test_run_info_records_the_command_and_commit():
    info = benchlib.run_info()
    assert info["command"] == " ".join(sys.argv)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if commit:
        assert info["commit"] == commit  # HEAD as the process first asked (cached for the run)
    assert set(benchlib.RUN_KEYS) == set(info)


# --- result files ------------------------------------------------------------------------------

def test_write_result_writes_once(tmp_path):
    path = tmp_path / "run" / "onnx.json"
    benchlib.write_result(path, {"levels": [1, 2], "protocol": ("a", "b")})
    assert json.loads(path.read_text()) == {"levels": [1, 2], "protocol": ["a", "b"]}
    with pytest.raises(SystemExit, match="never overwritten"):
        benchlib.write_result(path, {"levels": []})
    assert json.loads(path.read_text())["levels"] == [1, 2]
    with pytest.raises(SystemExit, match="never overwritten"):
        benchlib.new_file(path)
    assert benchlib.new_file(tmp_path / "run" / "other.json") == tmp_path / "run" / "other.json"
    assert sorted(p.name for p in path.parent.iterdir()) == ["onnx.json"]  # no temporary file left


def test_update_result_adds_rows_and_keys(tmp_path):
    path = tmp_path / "ddp-params-r0.70.json"
    protocol = {"steps": 80, "command": "bench/ddp.py --layouts uniform", "commit": "a"}
    benchlib.update_result(path, {"protocol": protocol, "runs": {"ddp-uniform": {"ppl": 30.5}}})
    # another process of the same run (same settings, its own command) adds its row
    other = {**protocol, "command": "bench/ddp.py --layouts per-layer", "commit": "b"}
    keep = [f"protocol.{k}" for k in benchlib.RUN_KEYS]
    merged = benchlib.update_result(path, {"protocol": other, "runs": {"ddp-per-layer": {"ppl": 29.1}}}, keep)
    on_disk = json.loads(path.read_text())
    assert merged == on_disk
    assert on_disk["runs"] == {"ddp-uniform": {"ppl": 30.5}, "ddp-per-layer": {"ppl": 29.1}}
    assert on_disk["protocol"]["command"] == "bench/ddp.py --layouts uniform"  # the file's kept
    # a list grows (spine's levels), and a row of it gains a key (its serving figures)
    spine = tmp_path / "spine.json"
    doc = {"levels": [{"retain": 0.7, "ppl": 67.9}]}
    benchlib.update_result(spine, doc)
    doc["levels"].append({"retain": 0.5, "ppl": 318.2})
    doc["levels"][0]["serving"] = {"1": {"ratio": 1.25}}
    benchlib.update_result(spine, doc)
    assert json.loads(spine.read_text()) == doc
    benchlib.update_result(spine, doc)  # the same values again: fine
    assert json.loads(spine.read_text()) == doc


def test_update_result_refuses_to_replace_a_row(tmp_path):
    path = tmp_path / "sparse.json"
    benchlib.update_result(path, {"runs": {"wanda:2:4": {"ppl": 70.1, "wall_s": 12.0}}, "dense_ppl": 20.51})
    before = path.read_text()
    with pytest.raises(SystemExit, match=r"runs\.wanda:2:4\.ppl is already 70\.1"):
        benchlib.update_result(path, {"runs": {"wanda:2:4": {"ppl": 69.0, "wall_s": 12.0}}})
    with pytest.raises(SystemExit, match="never replaced"):
        benchlib.update_result(path, {"runs": {"sparsegpt:2:4": {"ppl": 65.3}}, "dense_ppl": 20.6})
    with pytest.raises(SystemExit):  # a list item replaced
        benchlib.update_result(tmp_path / "l.json", {"levels": [1]})
        benchlib.update_result(tmp_path / "l.json", {"levels": [2]})
    with pytest.raises(benchlib.ReplacedValue):  # checked before a run, nothing written
        benchlib.check_update(path, {"runs": {"wanda:2:4": {"ppl": 1.0}}})
    assert path.read_text() == before  # nothing added by the refused updates either
    benchlib.check_update(tmp_path / "absent.json", {"runs": {}})
    assert not (tmp_path / "absent.json").exists()
    # the file's value kept where the caller says any process's is as good
    merged = benchlib.update_result(path, {"dense_ppl": 20.6, "runs": {"x": {"ppl": 1}}}, keep_existing=["dense_ppl"])
    assert merged["dense_ppl"] == 20.51 and merged["runs"]["x"] == {"ppl": 1}


def test_markdown_is_a_view_and_may_be_rebuilt(tmp_path):
    path = tmp_path / "spine.md"
    benchlib.write_markdown(path, "a\n")
    benchlib.write_markdown(path, "a\nb\n")
    assert path.read_text() == "a\nb\n"


# --- tables --------------------------------------------------------------------------------------

def test_markdown_table():
    text = benchlib.markdown_table(["retain", "PPL", "ratio"], [["0.70", "67.98", None], [0.5, 318.2, "1.68×"]],
                                   align="lrc")
    assert text == ("| retain | PPL | ratio |\n"
                    "|---|---:|:---:|\n"
                    "| 0.70 | 67.98 | — |\n"
                    "| 0.5 | 318.2 | 1.68× |")
    assert benchlib.markdown_table(["a", "b"], []) == "| a | b |\n|---|---|"
    assert benchlib.markdown_table(["a", "b"], [[1, 2]], align=["r", "r"]).splitlines()[1] == "|---:|---:|"
    with pytest.raises(ValueError):
        benchlib.markdown_table(["a", "b"], [[1]])
    with pytest.raises(ValueError):
        benchlib.markdown_table(["a", "b"], [[1, 2]], align="l")
    with pytest.raises(ValueError):
        benchlib.markdown_table(["a"], [[1]], align="x")


# --- serving figures --------------------------------------------------------------------------------

def _cell(tok_s: float, tpot: float) -> dict:
    return {"rounds": 3, "output_tokens_per_s": tok_s, "requests_per_s": 1.0, "sent": 8, "completed": 8, "failed": 0,
            "ttft_ms": {"p50": 10.0, "p99": 12.0}, "tpot_ms": {"p50": tpot, "p99": tpot * 1.1},
            "e2e_ms": {"p50": 100.0, "p99": 120.0}}


def _summary(ideal: float | None = 1.5) -> dict:
    """The shape serve/report.py summarize() returns, for a dense baseline and a pruned label."""
    best = {"dense": {"1": _cell(20.0, 50.0), "16": _cell(200.0, 80.0)},
            "pruned": {"1": _cell(25.0, 40.0), "16": _cell(270.0, 60.0)}}
    ratios = {label: {c: {"tokens_per_s": best[label][c]["output_tokens_per_s"] / best["dense"][c]["output_tokens_per_s"],
                          "ttft_p50": 1.0, "tpot_p50": 1.0, "e2e_p50": 1.0,
                          "fraction_of_ideal": None if label == "dense" or not ideal else
                          best[label][c]["output_tokens_per_s"] / best["dense"][c]["output_tokens_per_s"] / ideal}
                      for c in ("1", "16")} for label in best}
    return {"baseline": "dense", "labels": ["dense", "pruned"], "concurrencies": ["1", "16"], "ideal_ratio": ideal,
            "meta": {}, "best": best, "ratios": ratios, "requests": {}}


def test_serving_figures():
    fig = benchlib.serving_figures(_summary(), 2.0)
    assert set(fig) == {"1", "16"}
    assert fig["16"] == {"dense_tok_s": 200.0, "pruned_tok_s": 270.0, "ratio": 1.35, "fraction_of_ideal": 1.35 / 2.0,
                         "paired": None, "tpot_p50_ms": {"dense": 80.0, "pruned": 60.0}}
    assert fig["1"]["ratio"] == 1.25 and fig["1"]["fraction_of_ideal"] == 1.25 / 2.0
    # the ideal defaults to the summary's own: then the fraction is summarize()'s
    fig = benchlib.serving_figures(_summary(1.5))
    assert fig["16"]["fraction_of_ideal"] == _summary(1.5)["ratios"]["pruned"]["16"]["fraction_of_ideal"]
    assert benchlib.serving_figures(_summary(None))["16"]["fraction_of_ideal"] is None
    paired = _summary()
    paired["ratios"]["pruned"]["16"]["paired"] = {"median": 1.3, "min": 1.2, "max": 1.4, "n": 6}
    assert benchlib.serving_figures(paired)["16"]["paired"]["median"] == 1.3


def test_serving_figures_decode_step_model():
    # t = overhead + bytes * ms_per_byte: 50 ms at 1000 bytes, 40 ms at 600 -> 0.025 ms/byte, 25 ms overhead
    fig = benchlib.serving_figures(_summary(), 1.5, {"dense": 1000, "pruned": 600})
    m = fig["decode_step_model"]
    assert m["overhead_ms"] == pytest.approx(25.0) and m["weights_ms_dense"] == pytest.approx(25.0)
    assert m["overhead_share_dense"] == pytest.approx(0.5) and m["effective_GBps"] == pytest.approx(1e-6 / 0.025)
    slower = _summary()
    slower["best"]["pruned"]["1"]["tpot_ms"]["p50"] = 55.0  # no model when the pruned step is not faster
    assert "decode_step_model" not in benchlib.serving_figures(slower, 1.5, {"dense": 1000, "pruned": 600})


# --- data ----------------------------------------------------------------------------------------

class _Tok:
    """One token per character: enough to check the windows come from the right file, in order."""

    def __call__(self, text, return_attention_mask=False, verbose=False):
        return {"input_ids": [ord(c) for c in text]}


def test_wikitext_windows(tmp_path):
    (tmp_path / benchlib.CALIB_FILE).write_text("v" * 10)
    (tmp_path / benchlib.TEST_FILE).write_text("abcdefghij")
    test = benchlib.wikitext_windows(_Tok(), "test", 2, seq_len=4, data_dir=tmp_path)
    assert test.tolist() == [[97, 98, 99, 100], [101, 102, 103, 104]]
    assert benchlib.wikitext_windows(_Tok(), "valid", None, seq_len=3, data_dir=tmp_path).shape == (3, 3)
    assert benchlib.data_file("valid", tmp_path) == tmp_path / "wikitext2-valid.txt"
    assert benchlib.data_file("test") == ROOT.parent / "shared" / "data" / "wikitext2-raw-test.txt"
    with pytest.raises(ValueError):
        benchlib.data_file("train")


# --- the scripts ---------------------------------------------------------------------------------

PRODUCT = ("optimizer", "exporters", "serve", "runtime")


def test_bench_scripts_import_no_private_product_names():
    for script in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text(), str(script))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PRODUCT:
                assert not any(part.startswith("_") for part in node.module.split(".")), (script.name, node.module)
                assert not any(a.name.startswith("_") for a in node.names), (script.name, node.module)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in PRODUCT:
                        assert not any(p.startswith("_") for p in a.name.split(".")), (script.name, a.name)
        text = script.read_text()
        assert "sys.path.insert" not in text, script.name


def test_benchlib_imports_only_the_standard_library():
    """bench/peer_llmcompressor.py imports it in .venv-peer, where neither torch's build nor the product may be."""
    code = ("import sys; sys.path.insert(0, 'bench'); import benchlib; "
            "print([m for m in ('torch', 'optimizer', 'serve', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_heal_dense_from_copies_a_matching_dense_row_and_refuses_another_protocol(tmp_path):
    """bench/heal.py --dense-from: the dense row of a folder measured on the same texts, windows and
    zero-shot documents is copied, marked measured_in; any difference is a one-line refusal."""
    spec = importlib.util.spec_from_file_location("bench_heal", ROOT / "bench" / "heal.py")
    heal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heal)
    protocol = {"eval": "/a/wikitext2-raw-test.txt", "c4": "/b/c4.utf8", "eval_windows": 16,
                "zeroshot": {"tasks": ["arc_easy"], "limit": 500, "seed": 1234}}
    folder = tmp_path / "earlier"
    folder.mkdir()
    dense = {"wikitext2": 20.5, "c4": 32.4}
    (folder / "heal.json").write_text(json.dumps({"protocol": {**protocol, "eval": "/other/wikitext2-raw-test.txt"},
                                                  "dense": dense}))
    assert heal._dense_from(folder, protocol) == {**dense, "measured_in": str(folder)}  # another machine's path
    with pytest.raises(SystemExit, match="its eval_windows is 16, this run's 8"):
        heal._dense_from(folder, {**protocol, "eval_windows": 8})
    with pytest.raises(SystemExit, match="its zeroshot is"):
        heal._dense_from(folder, {**protocol, "zeroshot": {"tasks": ["arc_easy"], "limit": 100, "seed": 1234}})
    # a run without zero-shot (--zeroshot-limit 0) takes the dense row without its zero-shot scores
    (folder / "heal.json").write_text(json.dumps({"protocol": protocol, "dense": {**dense, "zeroshot": {"mean": 0.5}}}))
    no_zeroshot = {**protocol, "zeroshot": {"tasks": ["arc_easy"], "limit": 0, "seed": 1234}}
    assert heal._dense_from(folder, no_zeroshot) == {**dense, "measured_in": str(folder)}
    with pytest.raises(SystemExit, match="no heal.json"):
        heal._dense_from(tmp_path, protocol)


# --- the bench scripts' tables -------------------------------------------------------------------

def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quant_table_gives_the_paired_ratio_and_says_what_it_is():
    quant = _load_script("quant")
    run = json.loads((ROOT / "bench/results/quant/2026-12-06-c01e3c5-cpu-interleave/quant.json").read_text())
    md = quant.markdown(run)
    assert "| 1.96 (paired 1.86, 1.41–2.33) |" in md and "| 1.23 (paired 1.29, 0.90–1.60) |" in md
    assert "paired: the median and range" in md and "neighbours in time" in md  # an interleaved run
    run["protocol"]["interleave"] = False
    assert "paired: the median and range" in quant.markdown(run) and "neighbours in time" not in quant.markdown(run)
    row = run["variants"]["cpu0.70"]
    row["serving"]["vs_dense"]["16"]["paired"] = None  # a run from before the paired ratio: best-of-N alone
    assert quant._ratio(row, "dense", "16") == "1.96"


def test_onnx_table_names_a_greedy_parting_at_a_near_tie():
    onnx_script = _load_script("onnx")
    run = json.loads((ROOT / "bench/results/onnx/2026-12-06-c01e3c5-int8/onnx.json").read_text())
    run["levels"][0]["validation"]["greedy_parted_at_near_tie"] = {"step": 2, "logit_margin": 0.0496}
    md = onnx_script._markdown(run)
    assert "- r=0.70: 3.60e+00 / 7.31e-01; greedy 1/32, parted at a near-tie at token 2 (logit margin 0.050)" in md
    assert "- r=1.00: 3.85e-04 / 5.53e-05; greedy 32/32\n" in md  # the dense graph matched all the way
    # a QDQ package's exact check, from the manifest the run kept
    manifest = json.loads((ROOT / "bench/results/onnx/2026-12-06-7d44414-qdq-checks/manifest-r0.70-int8-qdq.json")
                          .read_text())
    run["levels"][0]["validation"]["as_written"] = manifest["checks"]["onnx"]["as_written"]
    assert ("; the QDQ graph as written, rounding as onnxruntime did at 8 near-ties of 2,280,960 quantized values: "
            "8.94e-05 / 4.01e-05, caches 1.14e-05") in onnx_script._markdown(run)


# --- plots: every maintained benchmark's run gets one, a view of its table --------------------------

VIEWS = ["sparse-peer-fixed/sparse.md", "spine/2026-12-02-gemma3-270m/spine.md", "moe/2026-12-04-321f420/moe.md",
         "heal-memory/2026-12-02-28c2d8e-dirty/heal-memory.md", "onnx/2026-12-06-c01e3c5-int8/onnx.md",
         "vllm-profile/2026-12-05-2a981cf/profile.md", "ddp/ddp-params.md"]


def test_table_columns_reads_a_views_numbers():
    labels, columns = benchlib.table_columns("text\n\n| model | PPL | note | ratio |\n|---|---:|---|---:|\n"
                                             "| **dense** | 20.51 | fine | — |\n| `r0.70` | 1,448.5 | x | 1.33× (1.29×) |\n")
    assert labels == ["dense", "r0.70"]
    assert columns == {"PPL": [20.51, 1448.5], "ratio": [None, 1.33]}
    assert benchlib.table_columns("no table") == ([], {})


@pytest.mark.parametrize("view", VIEWS)
def test_plot_table_draws_each_benchmarks_committed_view(view, tmp_path):
    text = (benchlib.RESULTS / view).read_text()
    assert benchlib.table_columns(text)[1], view  # the view has numbers to plot
    path = benchlib.plot_table(text, tmp_path / "x.png", view)
    assert path == tmp_path / "x.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["x.png"]  # no temporary left
