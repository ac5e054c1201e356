"""`bench` starts real vLLM servers for the dense and the pruned model in turn and reports ratios.

Its own module, so that test_vllm.py's server is stopped before these two start.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from serve.cli import bench
from tests.test_vllm import _free_port

pytestmark = [pytest.mark.vllm, pytest.mark.real_model]


def test_bench_measures_pruned_against_dense(real_package, tmp_path):
    out = tmp_path / "bench"
    r = CliRunner().invoke(bench, [str(real_package), "--baseline", "embedded", "--concurrency", "1,2",
                                   "--requests", "2", "--rounds", "1", "--prompt-tokens", "16",
                                   "--output-tokens", "4", "--port", str(_free_port()), "--out", str(out),
                                   "--vllm-args", "--enforce-eager"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    result = json.loads((out / "bench.json").read_text())
    ratios = result["summary"]["ratios"]
    assert set(result["runs"]) == {"dense", "pruned"}
    assert all(ratios["pruned"][c]["tokens_per_s"] > 0 for c in ("1", "2"))
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tok/s vs dense" in (out / "bench.md").read_text()
