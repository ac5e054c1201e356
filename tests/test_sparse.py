"""The semi-structured family: patterns, the three one-shot pruners, the block runner, planner, package."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from conftest import FAMILIES, tiny_model
from optimizer import load, plan as planner
from optimizer.adapters import get_adapter
from optimizer.cli import optimize as optimize_cmd
from optimizer.errors import UserError
from optimizer.methods.magnitude import Magnitude
from optimizer.methods.sparsegpt import SparseGPT
from optimizer.methods.wanda import Wanda
from optimizer.profiles import load_profile
from optimizer.sequential import block_inputs, prune_blockwise
from optimizer.sparsity import Sparsity, parse
from core.manifest import Manifest
from serve.launch import sparse24_fallback

PATTERNS = ["2:4", "4:8", "2:8", "0.5"]


def test_parse_accepts_nm_and_fractions():
    assert parse("2:4") == Sparsity(n=2, m=4)
    assert parse(" 4 : 8 ") == Sparsity(n=4, m=8)
    assert parse("0.6") == Sparsity(fraction=0.6)
    assert parse("50%") == Sparsity(fraction=0.5)
    for bad in ("4:4", "0:4", "5:4", "2:128", "1.5", "0", "abc", "2-4"):
        with pytest.raises(UserError):
            parse(bad)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_mask_keeps_the_highest_scores_under_the_pattern(pattern):
    s = parse(pattern)
    scores = torch.rand(16, 32)
    keep = s.mask(scores)
    assert s.complies(scores * keep)
    assert keep.float().mean().item() == pytest.approx(s.density)
    if s.is_nm:  # each group keeps its own top n
        g = scores.reshape(16, -1, s.m)
        want = g.topk(s.n, dim=2).values.sum(-1)
        got = (g * keep.reshape(16, -1, s.m)).sum(-1)
        torch.testing.assert_close(got, want)


def test_pattern_rejects_layers_it_cannot_tile():
    with pytest.raises(UserError, match="groups of 8"):
        parse("2:8").check_shape(100, "down_proj")


def _layer_and_inputs(seed=0, d_in=64, d_out=48, n=512):
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(d_out, d_in, generator=g))
    # correlated inputs with a few large channels: where Wanda and SparseGPT should beat magnitude
    mix = torch.randn(d_in, d_in, generator=g) / d_in ** 0.5
    x = torch.randn(n, d_in, generator=g) @ mix * (1 + 5 * (torch.arange(d_in) % 9 == 0))
    return layer, x


@pytest.mark.parametrize("pattern", PATTERNS)
def test_calibrated_pruners_lose_less_output_than_magnitude(pattern):
    s = parse(pattern)
    errors = {}
    for cls in (Magnitude, Wanda, SparseGPT):
        layer, x = _layer_and_inputs()
        ref = layer(x).detach()
        p = cls(layer)
        for chunk in x.split(128):
            p.add_batch(chunk[None])
        keep = p.prune(s)
        assert s.complies(layer.weight), cls.__name__
        assert keep.float().mean().item() == pytest.approx(s.density)
        assert torch.equal(layer.weight != 0, keep & (layer.weight != 0))  # pruned weights are exactly zero
        errors[cls.__name__] = (layer(x) - ref).pow(2).mean().item()
    assert errors["Wanda"] < errors["Magnitude"]
    assert errors["SparseGPT"] < errors["Wanda"]


def test_sparsegpt_handles_dead_inputs_and_odd_block_sizes():
    layer, x = _layer_and_inputs(d_in=24)
    x[:, 3] = 0  # an input channel that never fires
    p = SparseGPT(layer, block_size=10)  # N:M groups must still align with blocks
    p.add_batch(x[None])
    p.prune(parse("2:4"))
    assert parse("2:4").complies(layer.weight)
    assert torch.isfinite(layer.weight).all()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cls", [Magnitude, Wanda, SparseGPT])
def test_blockwise_pruning_complies_in_every_linear(family, cls):
    model = tiny_model(family)
    adapter = get_adapter(model.config)
    windows = torch.randint(0, 512, (3, 32), generator=torch.Generator().manual_seed(0))
    masks = prune_blockwise(model, adapter, windows, cls, parse("2:4"))
    assert len(masks) == model.config.num_hidden_layers
    for block, block_masks in zip(adapter.blocks(model), masks):
        linears = adapter.linears(block)
        assert set(block_masks) == set(linears) and len(linears) == 7
        for name, lin in linears.items():
            assert parse("2:4").complies(lin.weight), name
    with torch.no_grad():
        assert torch.isfinite(model(windows[:1]).logits).all()


def test_each_block_is_calibrated_on_the_outputs_of_the_pruned_blocks_before_it():
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    windows = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    seen = {}

    class Recording(Wanda):
        def add_batch(self, inp):
            seen.setdefault(id(self.layer), []).append(inp.clone())
            super().add_batch(inp)

    prune_blockwise(model, adapter, windows, Recording, parse("2:4"))
    q1 = adapter.attention(adapter.blocks(model)[1]).q
    after = []
    h = q1.register_forward_hook(lambda m, a, y: after.append(a[0].clone()))
    with torch.no_grad():
        for w in windows:
            model(w[None])
    h.remove()
    for got, want in zip(seen[id(q1)], after):
        torch.testing.assert_close(got, want)


def test_block_inputs_match_the_model_forward():
    model = tiny_model("qwen3")
    adapter = get_adapter(model.config)
    windows = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    inputs, kwargs = block_inputs(model, adapter, windows)
    with torch.no_grad():
        x = inputs[0]
        for block in adapter.blocks(model):
            x = block(x, **kwargs)
            x = x[0] if isinstance(x, tuple) else x
        logits = model.lm_head(model.model.norm(x))
        torch.testing.assert_close(logits, model(windows[:1]).logits)


# --- planner ----------------------------------------------------------------------------

def test_auto_picks_2_4_only_where_the_engine_has_the_kernel():
    h100 = load_profile("h100")
    p = planner.choose(h100, "auto", engine_version="0.18.0")
    assert (p.method, p.sparsity, p.sparse_kernel) == (planner.SEMI_STRUCTURED, "2:4", True)
    for target, version in (("h100", "0.19.0"), ("h100", "0.32.0"), ("a100", "0.18.0"), ("l4", "0.10.0")):
        p = planner.choose(load_profile(target), "auto", engine_version=version)
        assert p.method == planner.STRUCTURED and p.sparsity is None, (target, version)


def test_requested_sparsity_without_a_kernel_says_no_speedup():
    p = planner.choose(load_profile("a100"), "wanda", engine_version="0.32.0", sparsity="2:4")
    assert p.method == "wanda" and not p.sparse_kernel
    assert "no speedup is to be expected" in p.text()
    p = planner.choose(load_profile("h100"), "sparsegpt", engine_version="0.18.0", sparsity="4:8")
    assert not p.sparse_kernel and "4:8" in p.text()


def test_sparse_roofline_is_one_without_a_kernel_and_faster_with_it(tiny_dirs):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(tiny_dirs["llama"])
    adapter = get_adapter(cfg)
    none = planner.roofline_sparse(load_profile("a100"), adapter, cfg, kernel=False)
    assert none["decode_speedup_b1"] == pytest.approx(1.0) and none["prefill_speedup"] == pytest.approx(1.0)
    some = planner.roofline_sparse(load_profile("h100"), adapter, cfg, kernel=True)
    assert 1.0 < some["decode_speedup_b1"] < 2.0 and 1.0 < some["prefill_speedup"] <= 2.0


# --- the product path -------------------------------------------------------------------

def _optimize(args, tmp_path):
    r = CliRunner().invoke(optimize_cmd, [*args, "--set", "data.seq_len=64", "--set", "data.calib_windows=2",
                           "--set", "data.eval_windows=1",
                                          "--set", "threads=1", "--no-heal"])
    return r


@pytest.mark.slow
def test_package_carries_the_2_4_config_only_for_an_engine_with_the_kernel(tiny_dirs, text_file, tmp_path):
    common = [str(tiny_dirs["llama"]), "--calib", str(text_file), "--eval", str(text_file)]
    r = _optimize([*common, "--target", "h100", "--set", "engine_version=0.18.0", "-o", str(tmp_path / "k")], tmp_path)
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "k" / "config.json").read_text())
    sc = cfg["quantization_config"]["sparsity_config"]
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert (sc["sparsity_structure"], sc["format"], sc["ignore"]) == ("2:4", "dense", ["lm_head"])
    man = Manifest.read(tmp_path / "k")
    assert man.method["name"] == "sparsegpt" and man.engine.sparse24["config_written"]
    assert "v0.18.0" in (tmp_path / "k" / "Dockerfile").read_text()
    assert sparse24_fallback(man, installed="0.18.0") == []
    assert sparse24_fallback(man, installed="0.32.0")[0] == "--hf-overrides"
    model, _ = load.load_model(load.resolve(str(tmp_path / "k")))  # evaluate / bench read it (no quantization)
    for block in get_adapter(model.config).blocks(model):
        for lin in get_adapter(model.config).linears(block).values():
            assert parse("2:4").complies(lin.weight)

    r = _optimize([*common, "--target", "a100", "--method", "wanda", "--set", "sparsity=4:8",
                   "-o", str(tmp_path / "n")],
                  tmp_path)
    assert r.exit_code == 0, r.output
    assert "quantization_config" not in json.loads((tmp_path / "n" / "config.json").read_text())
    assert sparse24_fallback(Manifest.read(tmp_path / "n"), installed="0.32.0") == []
    report = (tmp_path / "n" / "report.md").read_text()
    assert "No speedup is to be expected" in report and "## Serving" in report and "- internal check" not in report
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "n")
    for block in get_adapter(model.config).blocks(model):
        for lin in get_adapter(model.config).linears(block).values():
            assert parse("4:8").complies(lin.weight)


@pytest.mark.parametrize("args, message", [
    (["--method", "wanda", "--set", "sparsity=3:2"], "N:M pattern"),
    (["--method", "sparsegpt", "--set", "sparsity=half"], "expected N:M"),
    (["--method", "wanda", "--set", "layout=per-layer"], "layout=per-layer needs --method structured"),
    (["--method", "magnitude", "--format", "onnx"], "no 2:4 kernel"),
    (["--method", "sparsegpt", "--set", "sparsity=2:7"], "groups of 7"),
])
def test_bad_sparse_input_is_one_line(tiny_dirs, text_file, tmp_path, args, message):
    out = tmp_path / "never"
    r = _optimize([str(tiny_dirs["llama"]), "--target", "a100", "--calib", str(text_file), *args, "-o", str(out)],
                  tmp_path)
    assert r.exit_code == 2, r.output
    assert message in r.output and r.output.count("\n") == 1
    assert not out.exists() and not list(tmp_path.glob(".never*"))


@pytest.mark.slow
def test_si_package_keeps_the_pattern_and_its_biases(tiny_dirs, text_file, tmp_path):
    out = tmp_path / "si"
    r = _optimize([str(tiny_dirs["llama"]), "--target", "a100", "--method", "si+sparsegpt", "--set", "si.steps=2",
                   "--calib", str(text_file), "--eval", str(text_file), "-o", str(out)], tmp_path)
    assert r.exit_code == 0, r.output
    man = json.loads((out / "manifest.json").read_text())
    assert man["method"]["si"]["steps"] == 2 and man["method"]["si"]["attention_bias"]
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.attention_bias and model.config.mlp_bias
    adapter = get_adapter(model.config)
    for block in adapter.blocks(model):
        assert block.self_attn.q_proj.bias is not None and block.mlp.down_proj.bias is not None
        for lin in adapter.linears(block).values():
            assert parse("2:4").complies(lin.weight)


@pytest.mark.slow
def test_roi_package_trains_resumes_and_keeps_the_pattern(tiny_dirs, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZER_CACHE", str(tmp_path / "cache"))
    common = [str(tiny_dirs["llama"]), "--target", "h100", "--set", "engine_version=0.18.0", "--method", "roi",
              "--calib", str(text_file), "--eval", str(text_file)]
    r = _optimize([*common, "--set", "roi.steps=4", "--set", "keep_checkpoints=true", "-o", str(tmp_path / "a")], tmp_path)
    assert r.exit_code == 0, r.output
    roi = json.loads((tmp_path / "a" / "manifest.json").read_text())["method"]["roi"]
    assert roi["steps"] == 4 and roi["resumed_from_step"] == 0 and roi["state_to_model_ratio"] > 0
    # the same run again with --resume starts from the finished checkpoint and gives the same weights
    r = _optimize([*common, "--set", "roi.steps=4", "--resume", "-o", str(tmp_path / "b")], tmp_path)
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["method"]["roi"]["resumed_from_step"] == 4
    from safetensors.torch import load_file
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    for k, w in a.items():
        if k.endswith("proj.weight"):
            assert parse("2:4").complies(w), k
    r = _optimize([*common, "--set", "sparsity=0.5", "-o", str(tmp_path / "c")], tmp_path)
    assert r.exit_code == 2 and "unstructured" in r.output


@pytest.mark.slow
def test_roi_from_the_sparsegpt_prior_starts_exactly_at_sparsegpt(tiny_dirs, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZER_CACHE", str(tmp_path / "cache"))
    common = [str(tiny_dirs["qwen3"]), "--target", "a100", "--calib", str(text_file), "--eval", str(text_file)]
    assert _optimize([*common, "--method", "sparsegpt", "-o", str(tmp_path / "s")], tmp_path).exit_code == 0
    r = _optimize([*common, "--method", "roi", "--set", "roi.prior=sparsegpt", "--set", "roi.steps=0",
                   "-o", str(tmp_path / "r")],
                  tmp_path)
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file
    a, b = load_file(tmp_path / "s" / "model.safetensors"), load_file(tmp_path / "r" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    r = _optimize([*common, "--method", "roi", "--set", "roi.prior=wanda", "--set", "roi.steps=2",
                   "-o", str(tmp_path / "w")],
                  tmp_path)
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "w" / "manifest.json").read_text())["method"]["roi"]["prior"] == "wanda"
    # tokens per step: a chunk of each window when it divides the window, else the whole window
    for roi_seq, window, used in (("32", "64", 32), ("48", "64", 64)):
        r = _optimize([*common, "--method", "roi", "--set", "roi.steps=2", "--set", f"roi.seq_len={roi_seq}",
                       "--set", f"data.seq_len={window}",
                       "-o", str(tmp_path / f"q{roi_seq}")], tmp_path)
        assert r.exit_code == 0, r.output
        roi = json.loads((tmp_path / f"q{roi_seq}" / "manifest.json").read_text())["method"]["roi"]
        assert roi["seq_len"] == used and roi["tokens"] == 2 * used
    r = _optimize([*common, "--method", "roi", "--set", "roi.seq_len=8", "-o", str(tmp_path / "bad")], tmp_path)
    assert r.exit_code == 2 and "roi.seq_len" in r.output and not (tmp_path / "bad").exists()


def _textbook_sparsegpt(W: torch.Tensor, H: torch.Tensor, sparsity: Sparsity, damp=0.01) -> torch.Tensor:
    """SparseGPT column by column with no blocking or lazy updates: the reference the fast
    sweep (transposed weights, rank-1 updates, blocks of 128) must reproduce."""
    W = W.clone()
    H = H + damp * torch.diag(H).mean() * torch.eye(H.shape[0])
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    keep = torch.ones_like(W, dtype=torch.bool)
    for i in range(W.shape[1]):
        if sparsity.is_nm and i % sparsity.m == 0:
            g = slice(i, i + sparsity.m)
            keep[:, g] = sparsity.mask(W[:, g].pow(2) / torch.diag(U)[g].pow(2)[None, :])
        err = W[:, i] * ~keep[:, i] / U[i, i]
        W[:, i:] -= err[:, None] * U[i, i:][None, :]
    return W * keep


@pytest.mark.parametrize("pattern", ["2:4", "4:8"])
def test_sparsegpt_fast_sweep_equals_the_textbook_loop(pattern):
    layer, x = _layer_and_inputs(d_in=320, d_out=40)  # 320 columns: three blocks of 128, the last short
    W = layer.weight.detach().clone()
    p = SparseGPT(layer)
    p.add_batch(x[None])
    want = _textbook_sparsegpt(W, p.H, parse(pattern))
    p.prune(parse(pattern))
    torch.testing.assert_close(layer.weight.detach(), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("pattern", ["2:4", "0.5"])
def test_sparsegpt_with_its_own_mask_imposed_reproduces_itself(pattern):
    """An imposed keep-mask (RoI's learned one) only reconstructs: given the mask SparseGPT
    itself would choose, the weights come out identical; any other mask is kept exactly."""
    layer, x = _layer_and_inputs(d_in=320, d_out=40)
    W = layer.weight.detach().clone()
    p = SparseGPT(layer)
    p.add_batch(x[None])
    keep = p.prune(parse(pattern))
    chosen = layer.weight.detach().clone()
    with torch.no_grad():
        layer.weight.copy_(W)
    assert torch.equal(p.prune(parse(pattern), keep_mask=keep), keep)
    torch.testing.assert_close(layer.weight.detach(), chosen, atol=1e-6, rtol=1e-5)
    other = parse("2:4").mask(torch.rand(W.shape, generator=torch.Generator().manual_seed(3)))
    with torch.no_grad():
        layer.weight.copy_(W)
    assert torch.equal(p.prune(parse("2:4"), keep_mask=other), other)
    assert torch.equal(layer.weight != 0, other & (W != 0))
    ref = x @ W.t()
    naive = x @ (W * other).t()
    assert (x @ layer.weight.t() - ref).pow(2).mean() < (naive - ref).pow(2).mean()


def test_linears_reading_one_tensor_share_statistics_equal_to_their_own():
    """q/k/v (and gate/up) read the same tensor: one collects, the others adopt; every
    pruner must still hold exactly the statistics of its own input."""
    import contextlib

    from optimizer.sequential import observe_block
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    windows = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    inputs, kwargs = block_inputs(model, adapter, windows)
    block = adapter.blocks(model)[0]
    pruners = {n: SparseGPT(lin) for n, lin in adapter.linears(block).items()}
    observe_block(block, inputs, kwargs, pruners, contextlib.nullcontext())
    own = {n: SparseGPT(lin) for n, lin in adapter.linears(block).items()}
    handles = [lin.register_forward_hook(lambda m, a, y, p=own[n]: p.add_batch(a[0]))
               for n, lin in adapter.linears(block).items()]
    with torch.no_grad():
        for x in inputs:
            block(x, **kwargs)
    for h in handles:
        h.remove()
    q, k, v, o = adapter.attention(block)
    names = {lin: n for n, lin in adapter.linears(block).items()}
    assert pruners[names[k]].H is pruners[names[q]].H  # collected once
    assert pruners[names[o]].H is not pruners[names[q]].H
    for n in pruners:
        torch.testing.assert_close(pruners[n].H, own[n].H, msg=n)
        assert pruners[n].tokens == own[n].tokens


def test_bf16_calibration_passes_prune_to_the_pattern():
    from optimizer.sequential import calibration_dtype
    assert calibration_dtype("float32") == torch.float32
    assert calibration_dtype("auto") in (torch.float32, torch.bfloat16)
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    windows = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(3))
    prune_blockwise(model, adapter, windows, SparseGPT, parse("2:4"), dtype=torch.bfloat16)
    for block in adapter.blocks(model):
        for lin in adapter.linears(block).values():
            assert lin.weight.dtype == torch.float32 and parse("2:4").complies(lin.weight)
