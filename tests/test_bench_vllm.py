"""`bench` starts real vLLM servers for the dense and the pruned model in turn and reports ratios.

Its own module, so that test_vllm.py's server is stopped before these two start.
"""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from serve.cli import bench
from tests.test_vllm import _free_port

pytestmark = [pytest.mark.vllm, pytest.mark.real_model]


def test_bench_measures_pruned_against_dense(real_package, tmp_path):
    out = tmp_path / "bench"
    levels, requests, rounds = ("1", "2"), 4, 2
    # 2 rounds (dense, pruned, then pruned, dense) and best-of-2: one round disturbed by other work
    # on the shared CPUs does not decide the ratio; 16 output tokens so that decoding, which the
    # pruning speeds up, is most of each request
    r = CliRunner().invoke(bench, [str(real_package), "--baseline", "embedded", "--concurrency", ",".join(levels),
                                   "--requests", str(requests), "--rounds", str(rounds), "--prompt-tokens", "16",
                                   "--output-tokens", "16", "--port", str(_free_port()), "--out", str(out),
                                   "--vllm-args", "--enforce-eager"], catch_exceptions=False)
    assert r.exit_code == 0, r.output  # 1 would mean a lost request
    result = json.loads((out / "bench.json").read_text())
    summary = result["summary"]
    assert set(result["runs"]) == {"dense", "pruned"}

    # every request sent was answered: per model and level, and in the warm-ups (max level each)
    req = summary["requests"]
    assert req["all_succeeded"] and req["failed"] == 0 and req["lost"] == []
    for label in ("dense", "pruned"):
        for c in levels:
            assert req["levels"][label][c] == {"sent": rounds * requests, "succeeded": rounds * requests,
                                               "failed": 0}
        assert req["warmup"][label]["succeeded"] == rounds * int(max(levels))
    assert "none lost" in (out / "bench.md").read_text()

    # the ideal ratio is the package's own (the baseline is a model, not a package)
    manifest = json.loads((real_package / "manifest.json").read_text())
    ideal = manifest["size"]["ideal_ratio"]
    assert summary["ideal_ratio"] == pytest.approx(ideal) and ideal > 1.2  # retain 0.5: well under dense's bytes

    best, ratios = summary["best"], summary["ratios"]
    for c in levels:
        tok_ratio = ratios["pruned"][c]["tokens_per_s"]
        assert tok_ratio == pytest.approx(best["pruned"][c]["output_tokens_per_s"]
                                          / best["dense"][c]["output_tokens_per_s"])
        assert ratios["dense"][c]["tokens_per_s"] == pytest.approx(1.0)
        assert ratios["pruned"][c]["fraction_of_ideal"] == pytest.approx(tok_ratio / ideal)
        # TPOT is the per-token time: its ratio goes the other way round from tokens/s
        assert ratios["pruned"][c]["tpot_p50"] == pytest.approx(
            best["pruned"][c]["tpot_ms"]["p50"] / best["dense"][c]["tpot_ms"]["p50"])
        # Not grossly slower than dense at any level, even on a loaded machine...
        assert tok_ratio > 0.6, (c, tok_ratio, summary["best"])
    # ...and not slower over the levels. How much faster is a benchmark's figure (bench/spine.py:
    # 1.58-1.68x at 64 output tokens, ideal 1.70x), not this test's: 4 requests of 16 tokens on
    # shared CPUs measured 0.94x once in CI and 1.3x alone. A package that lost its size (saved in
    # fp32, or unpruned) would sit near 0.6x or 1/ideal and fail here.
    geo = math.prod(ratios["pruned"][c]["tokens_per_s"] for c in levels) ** (1 / len(levels))
    assert 0.85 < geo < ideal * 1.5, (geo, summary["best"])
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tok/s vs dense" in (out / "bench.md").read_text()
