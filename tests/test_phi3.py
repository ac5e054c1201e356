"""Phi-3: the job works on the unfused model Phi-3 computes (a Mistral model), and the package is
Phi-3 again, its fused qkv_proj / gate_up_proj cut at the kept rows of each part (optimizer/adapters/phi3.py)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Phi3Config

from optimizer import data, evaluate, load
from optimizer.adapters import get_adapter
from optimizer.cli import optimize
from optimizer.masks import BlockMask, Masks
from optimizer.surgery import masked, prune

SHAPE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=96,
             num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=False)


def tiny_phi3(vocab: int = 512, seed: int = 0, **extra):
    cfg = Phi3Config(vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2, **{**SHAPE, **extra})
    cfg.architectures = ["Phi3ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random norms: nothing trivially 1
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("extra", [{}, {"sliding_window": 8}])
def test_the_working_model_computes_what_phi3_computes(extra):
    phi3 = tiny_phi3(**extra)
    working = get_adapter(phi3.config).working_model(phi3)
    assert type(working).__name__ == "MistralForCausalLM"
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        assert torch.allclose(working(ids).logits, phi3(ids).logits, atol=1e-5)


def test_masked_equals_pruned_on_the_working_model():
    adapter = get_adapter(tiny_phi3().config)
    model = adapter.working_model(tiny_phi3())
    masks = Masks([BlockMask([0, 1, 4, 5], [0, 1], list(range(0, 96, 2))),
                   BlockMask([2, 3, 6, 7], [0, 1], list(range(48)))])
    ids = torch.randint(0, 512, (1, 16))
    with torch.no_grad(), masked(model, adapter, masks):
        want = model(ids).logits
    with torch.no_grad():
        assert (prune(model, adapter, masks)(ids).logits - want).abs().max() < 1e-4


def test_a_partial_rotary_phi3_is_refused_in_one_line():
    from optimizer.errors import UserError
    model = tiny_phi3(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})
    with pytest.raises(UserError, match="partial rotary"):
        get_adapter(model.config).working_model(model)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("phi3") / "src"
    tiny_phi3(len(tokenizer)).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.mark.parametrize("quant", ["none", "int8"])
@pytest.mark.slow
def test_optimize_writes_a_fused_phi3_package_that_computes_what_the_job_measured(phi3_dir, text_file, tmp_path, quant):
    out = tmp_path / "pkg"
    r = CliRunner().invoke(optimize, [str(phi3_dir), "--target", "a100", "--method", "activation", "--retain", "0.6",
                                      "--calib", str(text_file), "--eval", str(text_file), "--set", "data.seq_len=64",
                                      "--set", "data.calib_windows=2", "--set", "data.eval_windows=1", "--no-heal",
                                      "--quant", quant,
                                      "-o", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["source"]["family"] == "phi3" and m["checks"]["masked_vs_pruned_max_abs_logit_diff"] < 1e-3
    shape = m["method"]["shape"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "phi3" and config["architectures"] == ["Phi3ForCausalLM"]
    assert (config["num_attention_heads"], config["intermediate_size"]) == (shape["num_heads"], shape["intermediate_size"])
    assert ("quantization_config" in config) == (quant != "none")
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        qkv = f.get_tensor("model.layers.0.self_attn.qkv_proj.weight")
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    assert qkv.shape == ((shape["num_heads"] + 2 * shape["num_kv_heads"]) * SHAPE["head_dim"], SHAPE["hidden_size"])
    if quant == "int8":
        assert qkv.dtype == torch.int8 and "model.layers.0.mlp.gate_up_proj.weight_scale" in names
    # transformers reads the package as Phi-3, and it computes what the job measured
    model, tok = load.load_model(load.resolve(str(out)))
    assert type(model).__name__ == "Phi3ForCausalLM"
    windows = data.token_windows(tok, text_file.read_text(), 64, 1)
    assert evaluate.perplexity(model, windows) == pytest.approx(m["quality"]["perplexity"]["pruned"], rel=2e-2)
