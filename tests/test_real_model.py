"""The embedded SmolLM2-135M: masked == pruned on real weights, and a real package (shared)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimizer import budget, data
from optimizer.adapters import get_adapter
from optimizer.methods.activation import ActivationImportance
from optimizer.surgery import masked, prune

pytestmark = pytest.mark.real_model


def masked_and_pruned(model_dir, seq_len: int, retains):
    """For each retain: (shape, pruned logits, masked logits) of the one-shot method's masks on
    real weights, in float64 so the comparison is about what was removed, not summation order."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    adapter = get_adapter(model.config)
    windows = data.token_windows(tok, data.builtin_text("calib").text, seq_len, 3)
    imp = ActivationImportance(model, adapter)
    imp.add_batch(model, windows[:2])
    imp.remove_hooks()
    for retain in retains:
        shape = budget.uniform_candidates(adapter, model.config, retain)[0]
        masks = imp.decide(shape)
        with torch.inference_mode(), masked(model, adapter, masks):
            ref = model(windows[2:]).logits
        with torch.inference_mode():
            got = prune(model, adapter, masks)(windows[2:]).logits
        yield model.config, adapter, shape, got, ref


def test_masked_equals_pruned_on_the_real_model(real_model_dir):
    for retain, (config, adapter, shape, got, ref) in zip((0.7, 0.5), masked_and_pruned(real_model_dir, 256, (0.7, 0.5))):
        torch.testing.assert_close(got, ref, atol=1e-8, rtol=1e-8)
        assert budget.retention(adapter, config, shape) <= retain


def test_real_package(real_package, real_model_dir):
    m = json.loads((real_package / "manifest.json").read_text())
    assert m["source"]["model"].startswith("SmolLM2-135M-Instruct (embedded")
    assert m["method"]["calibration"]["source"].startswith("built-in corpus")
    assert m["method"]["retain_achieved"] <= 0.5
    q = m["quality"]["perplexity"]
    # pruned is worse, and not broken: one-shot at retain 0.5 is 11.9× the dense model's on
    # WikiText-2; a wrong head layout or scale folding lands in the hundreds
    assert 5 < q["dense"] < q["pruned"] < 20 * q["dense"]
    assert m["size"]["ideal_ratio"] > 1.3
    h = m["heal"]  # one heal step: the path, not the recovery (bench/heal.py measures that)
    assert h["tokens"] == 2048 and h["before"]["perplexity"] > 0 and len(h["chat"]) == 3
    assert "8 chat answers the dense model wrote" in h["data"]
    assert all(c["dense"] for c in h["chat"])  # the Instruct model answers its chat template
    # the package is a plain HF checkpoint: transformers loads it and it writes English
    model = AutoModelForCausalLM.from_pretrained(real_package).eval()
    tok = AutoTokenizer.from_pretrained(real_package)
    assert model.config.num_hidden_layers == 30 and model.dtype == torch.bfloat16
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5
