"""Masked model == physically pruned model, for every family, several shapes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimizer.adapters import BlockShape, get_adapter
from optimizer.methods.activation import ActivationImportance
from optimizer.masks import BlockMask, Masks
from optimizer.surgery import check_masks, check_same_logits, masked, prune
from tests.conftest import FAMILIES, tiny_model

SHAPES = [BlockShape(8, 2, 96), BlockShape(4, 2, 40), BlockShape(4, 1, 96), BlockShape(2, 2, 8), BlockShape(1, 1, 1)]


def _importance(model, adapter):
    imp = ActivationImportance(model, adapter)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        imp.add_batch(model, torch.randint(0, model.config.vocab_size, (2, 32), generator=g))
    imp.remove_hooks()
    return imp


@pytest.mark.parametrize("family", FAMILIES)
def test_masked_equals_pruned(family, tmp_path):
    model = tiny_model(family)
    adapter = get_adapter(model.config)
    imp = _importance(model, adapter)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        dense = model(x).logits
    for shape in SHAPES:
        masks = imp.decide(shape)
        check_masks(adapter, model.config, masks)
        with torch.inference_mode(), masked(model, adapter, masks):
            ref = model(x).logits
        pruned = prune(model, adapter, masks)
        with torch.inference_mode():
            got = pruned(x).logits
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        if shape != adapter.dense_shape(model.config):
            assert not torch.allclose(ref, dense, atol=1e-3), "masking must change something"
        # What is saved is what loads: same logits after a round trip through safetensors.
        pruned.save_pretrained(tmp_path / "p")
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "p").eval()
        with torch.inference_mode():
            torch.testing.assert_close(again(x).logits, ref, atol=1e-5, rtol=1e-5)


def test_the_jobs_internal_check_passes_a_true_surgery_and_stops_a_wrong_one():
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    imp = _importance(model, adapter)
    held_out = torch.randint(0, 512, (1, 300), generator=torch.Generator().manual_seed(3))
    masks = imp.decide(BlockShape(4, 1, 40))
    pruned = prune(model, adapter, masks)
    assert check_same_logits(pruned, masked(model, adapter, masks), held_out) < 1e-4
    other = prune(model, adapter, imp.decide(BlockShape(4, 1, 32)))  # not what these masks simulate
    with pytest.raises(RuntimeError, match="internal check failed: pruned model differs from the masked model"):
        check_same_logits(other, masked(model, adapter, masks), held_out)


def test_pruned_params_match_adapter_count():
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    masks = _importance(model, adapter).decide(BlockShape(4, 1, 40))
    pruned = prune(model, adapter, masks)
    blocks = sum(p.numel() for p in adapter.blocks(pruned).parameters())
    assert blocks == 2 * adapter.block_params(model.config, BlockShape(4, 1, 40))


def test_qwen2_with_fewer_heads_is_saved_as_llama_with_bias():
    model = tiny_model("qwen2")
    adapter = get_adapter(model.config)
    pruned = prune(model, adapter, _importance(model, adapter).decide(BlockShape(4, 2, 96)))
    assert pruned.config.model_type == "llama" and pruned.config.attention_bias
    assert pruned.config.architectures == ["LlamaForCausalLM"]
    same = prune(model, adapter, _importance(model, adapter).decide(BlockShape(8, 2, 48)))
    assert same.config.model_type == "qwen2"


def test_shapes_transformers_would_reject_are_refused():
    model = tiny_model("llama")  # hidden 64: LlamaConfig rejects 6 heads even with head_dim set
    adapter = get_adapter(model.config)
    assert not adapter.loadable(model.config, BlockShape(6, 2, 96))
    with pytest.raises(ValueError):
        prune(model, adapter, _importance(model, adapter).decide(BlockShape(6, 2, 96)))
    assert get_adapter(tiny_model("qwen3").config).loadable(model.config, BlockShape(6, 2, 96))


def test_gqa_rules_are_enforced():
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    full = list(range(96))
    bad = [
        [BlockMask([0, 1, 4], [0], full)] * 2,            # head 4 is in KV group 1, which is removed
        [BlockMask([0, 1, 2, 4], [0, 1], full)] * 2,      # 3 heads in group 0, 1 in group 1
        [BlockMask([1, 0], [0], full)] * 2,               # not ascending
    ]
    for blocks in bad:
        with pytest.raises(ValueError):
            check_masks(adapter, model.config, Masks(blocks))


def test_decide_keeps_the_most_important_units():
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    imp = _importance(model, adapter)
    imp.head_scores[0][:] = torch.tensor([0, 0, 0, 0, 5, 1, 9, 2.])  # group 1 (heads 4-7) wins
    imp.channel_scores[0][:] = torch.arange(96.)
    m = imp.decide(BlockShape(2, 1, 10)).blocks[0]
    assert m.kv_heads == [1] and m.heads == [4, 6] and m.channels == list(range(86, 96))


def test_a_llama3_config_rope_scaling_and_an_untied_head_prune_exactly(tmp_path):
    """LLaMA-3.x configs: llama3 rope scaling and an untied LM head survive surgery and the round
    trip (the head is not a block parameter and stays whole)."""
    from tests.conftest import tiny_config
    cfg = tiny_config("llama")
    cfg.tie_word_embeddings = False
    cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    adapter = get_adapter(model.config)
    masks = _importance(model, adapter).decide(BlockShape(4, 1, 40))
    x = torch.randint(0, 512, (2, 96), generator=torch.Generator().manual_seed(2))  # past the original 64 positions
    with torch.inference_mode(), masked(model, adapter, masks):
        ref = model(x).logits
    pruned = prune(model, adapter, masks)
    pruned.save_pretrained(tmp_path / "p")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "p").eval()
    assert not again.config.tie_word_embeddings and again.config.rope_parameters["rope_type"] == "llama3"
    with torch.inference_mode():
        torch.testing.assert_close(again(x).logits, ref, atol=1e-5, rtol=1e-5)
