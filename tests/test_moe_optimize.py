"""MoE models through `optimize` (the expert kind, optimizer/experts.py) on tiny random models:
the REAP-style importance, the package (fewer experts, same logits as the masked model), DDP's
expert gates and healing on an MoE student, the roofline of expert removal, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from optimizer import plan as planner
from optimizer.adapters import get_adapter
from optimizer.cli import optimize
from optimizer.errors import UserError
from optimizer.methods.reap import ChannelImportance, ExpertImportance, expert_outputs
from optimizer.moe_surgery import expert_width_to_keep, experts_to_keep, masked_experts, moe_parts
from optimizer.profiles import load_profile
from tests.test_moe import E, MOE_FAMILIES, TOP_K, _inputs, tiny_moe, tiny_moe_config


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, tokenizer):
    dirs = {}
    for family in MOE_FAMILIES:
        d = tmp_path_factory.mktemp(f"tiny-{family}")
        tiny_moe(family, vocab_size=len(tokenizer)).save_pretrained(d)
        tokenizer.save_pretrained(d)
        dirs[family] = d
    return dirs


def _optimize(src, out, *args):
    return CliRunner().invoke(optimize, [str(src), "--target", "h100", "--set", "data.seq_len=64",
                              "--set", "data.calib_windows=2",
                                         "--set", "data.eval_windows=1", "-o", str(out), *args], catch_exceptions=False)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_outputs_rebuild_the_experts_module(family):
    """What REAP scores is what the experts module computes: Σ_j w_j f_{e_j}(x) is its output."""
    model = tiny_moe(family)
    adapter = get_adapter(model.config)
    seen = []
    parts = moe_parts(model, adapter)
    hooks = [p.experts.register_forward_hook(lambda m, args, out: seen.append((m, args, out))) for p in parts]
    with torch.inference_mode():
        model(_inputs())
    for h in hooks:
        h.remove()
    assert len(seen) == len(parts)
    for experts, (hidden, index, weights), out in seen:
        rebuilt = torch.zeros_like(hidden)
        with torch.inference_mode():
            for t in range(hidden.shape[0]):
                for j in range(index.shape[1]):
                    rebuilt[t] += weights[t, j] * expert_outputs(experts, hidden[t:t + 1], int(index[t, j]))[0]
        torch.testing.assert_close(rebuilt, out, atol=1e-5, rtol=1e-5)


def test_reap_removes_the_experts_that_contribute_least():
    model = tiny_moe("mixtral")
    adapter = get_adapter(model.config)
    with torch.no_grad():  # expert 1's output is zero and expert 4's is tiny in every layer
        for p in moe_parts(model, adapter):
            p.experts.down_proj[1].zero_()
            p.experts.down_proj[4].mul_(1e-3)
    importance = ExpertImportance(model, adapter)
    for seed in range(3):
        importance.observe(_inputs(seed))
    importance.close()
    scores = importance.scores()
    assert scores.shape == (3, E) and (scores[:, 1] == 0).all() and (importance.tokens > 0).all()
    keep, scales, channels = importance.decide(E - 2)
    assert scales is None and channels is None and all(k == [0, 2, 3, 5] for k in keep)
    with torch.no_grad():  # the hooks are gone: observing again changes nothing
        model(_inputs())
    assert torch.equal(importance.scores(), scores)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.slow
def test_optimize_writes_an_moe_package_with_fewer_experts(moe_dirs, text_file, tmp_path, family):
    out = tmp_path / "pkg"
    r = _optimize(moe_dirs[family], out, "--retain", "0.7", "--calib", str(text_file), "--eval", str(text_file),
                  "--no-heal")
    assert r.exit_code == 0, r.output
    assert "method: reap" in r.output and "4 of 6 per MoE layer" in r.output
    assert "MoE packages are not quantized yet (--quant auto)" in r.output
    m = json.loads((out / "manifest.json").read_text())
    e = m["method"]["experts"]
    assert m["method"]["name"] == "reap" and e["dense"] == E and e["kept"] == 4 and e["top_k"] == TOP_K
    assert all(len(k) == 4 for k in e["keep"]) and len(e["keep"]) == len(e["moe_layers"])
    assert m["checks"]["masked_vs_pruned_max_abs_logit_diff"] < 1e-4
    assert m["size"]["params_pruned"] < m["size"]["params_dense"]
    # a token still runs top-k experts: only the router's removed rows leave its active parameters
    assert m["size"]["active_params_pruned"] == pytest.approx(m["size"]["active_params_dense"], rel=1e-2)
    assert m["size"]["active_params_pruned"] <= m["size"]["params_pruned"]
    p = m["plan"]["prediction"]
    assert p["decode_speedup_b1"] == pytest.approx(1.0, rel=1e-2) and p["decode_speedup_b16"] > 1.0
    assert "quantization" not in m and m["quality"]["perplexity"]["pruned"] > 0
    report = (out / "report.md").read_text()
    assert "## Experts kept" in report and "share of routed-expert parameters kept" in report
    assert "- internal check: masked (removed experts' router logits at -inf)" in report
    pruned = AutoModelForCausalLM.from_pretrained(out)
    adapter = get_adapter(pruned.config)
    assert adapter.num_experts(pruned.config) == 4 and adapter.experts_per_token(pruned.config) == TOP_K
    assert sum(x.numel() for x in pruned.parameters()) == m["size"]["params_pruned"]


@pytest.mark.slow
def test_ddp_expert_gates_and_healing_on_an_moe_model(moe_dirs, text_file, tmp_path):
    """DDP's expert gates (scales folded into the kept experts), then healing trains the MoE
    student, experts, routers and all; the masked == pruned check holds with the scales."""
    out, other = tmp_path / "pkg", tmp_path / "eval.txt"
    other.write_text("\n".join(f"Line {i} of another text, about other things than the calibration." for i in range(300)))
    r = _optimize(moe_dirs["qwen2_moe"], out, "--method", "ddp", "--set", "ddp.steps=4", "--retain", "0.5",
                  "--calib", str(text_file), "--eval", str(other), "--heal-tokens", "4096", "--set", "heal.chat=0")
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["method"]["name"] == "ddp" and m["method"]["experts"]["kept"] == 3
    assert m["method"]["ddp"]["steps"] == 4 and m["checks"]["masked_vs_pruned_max_abs_logit_diff"] < 1e-4
    assert m["heal"]["steps"] >= 1 and m["heal"]["tokens"] > 0 and not m["heal"]["kept_unhealed"]
    dense, pruned = (AutoModelForCausalLM.from_pretrained(d) for d in (moe_dirs["qwen2_moe"], out))
    adapter = get_adapter(dense.config)
    for old, new, keep in zip(moe_parts(dense, adapter), moe_parts(pruned, adapter), m["method"]["experts"]["keep"]):
        assert new.experts.gate_up_proj.shape == old.experts.gate_up_proj[keep].shape
        assert not torch.equal(new.experts.gate_up_proj.float(), old.experts.gate_up_proj[keep].bfloat16().float())
    assert "## Healing" in (out / "report.md").read_text()


def test_the_experts_roofline():
    from tests.test_moe import tiny_moe_config
    config = tiny_moe_config("mixtral", vocab_size=64, hidden_size=256, expert_width=512)
    adapter = get_adapter(config)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    h100 = load_profile("h100")
    assert planner.experts_touched(E, TOP_K, 1) == pytest.approx(TOP_K)
    assert planner.experts_touched(E, TOP_K, 16) == pytest.approx(E * (1 - (1 - TOP_K / E) ** 16))
    same = planner.roofline_experts(h100, adapter, config, E, params)
    assert same["decode_speedup_b16"] == pytest.approx(1.0) and same["weight_bytes_ratio"] == pytest.approx(1.0)
    p = planner.roofline_experts(h100, adapter, config, 3, params)
    assert p["decode_speedup_b1"] == pytest.approx(1.0, rel=1e-2)  # one token reads k experts either way
    assert p["experts"]["active_params_pruned"] == p["experts"]["active_params"] - (E - 3) * len(
        adapter.moe_layers(config)) * config.hidden_size  # less only the router's removed rows
    assert 1.0 < p["decode_speedup_b16"] <= p["weight_bytes_ratio"] + 1e-9
    assert p["experts"]["touched_b16"][1] == pytest.approx(planner.experts_touched(3, TOP_K, 16))
    removed = (E - 3) * len(adapter.moe_layers(config)) * (3 * 512 + 1) * config.hidden_size  # the experts, their router rows
    lookup = config.vocab_size * config.hidden_size  # untied: the input embedding is looked up, not streamed
    assert p["weight_bytes_ratio"] == pytest.approx((params - lookup) / (params - lookup - removed), rel=1e-9)


@pytest.mark.parametrize("args, message", [
    (["--format", "onnx"], "MoE packages are vLLM packages"),
    (["--method", "ddp", "--set", "layout=per-layer"], "same number of experts in every layer"),
    (["--set", "refit.on=true"], "they are not refit"),
    (["--quant", "int8"], "MoE packages are not quantized yet"),
    (["--method", "sparsegpt"], "not written for them"),
    (["--retain", "0.01"], "leaves less than 8 of 24 channels in each of the 2 experts"),
])
def test_what_the_expert_kind_refuses_before_any_work(moe_dirs, tmp_path, args, message):
    out = tmp_path / "pkg"
    r = CliRunner().invoke(optimize, [str(moe_dirs["mixtral"]), "--target", "h100", "-o", str(out), *args])
    assert r.exit_code != 0 and message in r.output, r.output
    assert not out.exists() and not list(tmp_path.glob(".pkg.tmp-*"))


def test_retain_goes_to_whole_experts_first_then_to_channels():
    config = tiny_moe("mixtral").config
    adapter = get_adapter(config)
    assert [experts_to_keep(adapter, config, r) for r in (1.0, 0.7, 0.5, 0.34, 0.2)] == [6, 4, 3, 2, 2]
    assert [expert_width_to_keep(adapter, config, r) for r in (1.0, 0.34, 0.3, 0.2)] == [24, 24, 16, 8]
    aligned = tiny_moe_config("mixtral", expert_width=128)  # a multiple of 32 stays one
    assert expert_width_to_keep(adapter, aligned, 0.25) == 96 and expert_width_to_keep(adapter, aligned, 0.2) == 64
    with pytest.raises(UserError, match="use --retain 0.09 or more"):
        expert_width_to_keep(adapter, aligned, 0.05)


def test_channel_importance_removes_the_channels_that_add_least():
    model = tiny_moe("mixtral")
    adapter = get_adapter(model.config)
    with torch.no_grad():  # channels 3 and 7 of every expert write nothing; channel 5 almost nothing
        for p in moe_parts(model, adapter):
            p.experts.down_proj[:, :, [3, 7]] = 0
            p.experts.down_proj[:, :, 5] *= 1e-4
    keep = [[0, 2, 4]] * len(moe_parts(model, adapter))
    importance = ChannelImportance(model, adapter)
    with masked_experts(model, adapter, keep):
        for seed in range(3):
            importance.observe(_inputs(seed))
    importance.close()
    channels = importance.decide(keep, 21)  # (a width ExpertImportance's caller would align; any works here)
    assert all(ch == [c for c in range(24) if c not in (3, 5, 7)] for per in channels for ch in per)
    assert (importance.energy[:, [1, 3, 5]] == 0).all() and (importance.energy[:, [0, 2, 4]] > 0).all()


@pytest.mark.parametrize("method", [["--method", "activation"], ["--method", "ddp", "--set", "ddp.steps=4"]])
@pytest.mark.slow
def test_optimize_narrows_the_experts_when_retain_is_below_top_k(moe_dirs, text_file, tmp_path, method):
    out = tmp_path / "pkg"
    r = _optimize(moe_dirs["qwen3_moe"], out, "--retain", "0.3", "--calib", str(text_file), "--eval", str(text_file),
                  "--no-heal", *method)
    assert r.exit_code == 0, r.output
    assert "16 of 24 channels kept in each kept expert" in r.output
    m = json.loads((out / "manifest.json").read_text())
    e = m["method"]["experts"]
    assert e["kept"] == TOP_K and e["width_kept"] == 16 and e["width_dense"] == 24
    assert m["method"]["retain_achieved"] == pytest.approx(2 * 16 / (6 * 24))
    assert m["method"]["budget"] == "routed experts, then expert channels"
    assert len(e["channels"]) == len(e["moe_layers"]) and all(len(ch) == 16 for per in e["channels"] for ch in per)
    if "ddp" in method:  # the gates aim at the whole-expert share (top-k of 6), the channels take the rest
        assert m["method"]["ddp"]["retain"] == pytest.approx(TOP_K / E)
    assert m["checks"]["masked_vs_pruned_max_abs_logit_diff"] < 1e-4
    assert m["size"]["active_params_pruned"] < m["size"]["active_params_dense"]
    assert m["size"]["active_params_pruned"] <= m["size"]["params_pruned"]  # top-k of top-k experts: all of them
    assert m["plan"]["prediction"]["decode_speedup_b1"] > 1.0  # narrower experts: a token reads less
    assert "each narrowed to 16 of 24 channels" in (out / "report.md").read_text()
    pruned = AutoModelForCausalLM.from_pretrained(out)
    assert pruned.config.moe_intermediate_size == 16 and pruned.config.num_experts == TOP_K
    assert sum(x.numel() for x in pruned.parameters()) == m["size"]["params_pruned"]
