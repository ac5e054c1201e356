"""ONNX packages: functional decoder == transformers, export + validation, serving, CLI, genai.

Models are tiny and random. Most use a wide initialisation ("lively"): with transformers'
default 0.02 a tiny random decoder repeats its last token forever, which would make greedy
parity trivially true.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from core.engines import SERVER_MODULE, server_command
from core.manifest import SCHEMA, Manifest, Target
from exporters import onnx as onnx_export
from exporters.decoder import Decoder, layer_shapes
from exporters.onnx_check import ValidationError, validate
from serve import launch, loadgen
from runtime.ort_server import Engine, OrtDecoder, Request, Sampling
from tests.conftest import FAMILIES, tiny_config

ONNX_FAMILIES = [f for f in FAMILIES if not f.startswith("gemma")]  # the functional decoder is LLaMA's block


def lively(family: str, vocab_size: int = 512, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM
    cfg = tiny_config(family, vocab_size)
    cfg.initializer_range = 0.3
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _rows(units, d):
    return torch.cat([torch.arange(u * d, (u + 1) * d) for u in units])


def _sliced(lin: nn.Linear, rows=None, cols=None) -> nn.Linear:
    w = lin.weight.data
    w = w[rows] if rows is not None else w
    w = w[:, cols] if cols is not None else w
    new = nn.Linear(w.shape[1], w.shape[0], bias=lin.bias is not None)
    new.weight.data = w.clone()
    if lin.bias is not None:
        new.bias.data = (lin.bias.data[rows] if rows is not None else lin.bias.data).clone()
    return new


def per_layer_model(family: str, layout: list[tuple[int, int, int]], **kw):
    """A model whose layers keep different (heads, KV heads, MLP channels), config left global.

    This is what a per-layer method leaves in memory: each layer's Linear shapes differ while
    config.num_attention_heads stays the dense value; each attention module gets its own group size.
    """
    model = lively(family, **kw)
    d, group = model.config.head_dim, model.config.num_attention_heads // model.config.num_key_value_heads
    for layer, (heads, kv, chans) in zip(model.model.layers, layout):
        a, m = layer.self_attn, layer.mlp
        kept_kv = list(range(kv))
        kept_heads = [g * group + j for g in kept_kv for j in range(heads // kv)]
        q_rows, kv_rows, ch = _rows(kept_heads, d), _rows(kept_kv, d), torch.arange(chans)
        a.q_proj, a.k_proj, a.v_proj = _sliced(a.q_proj, q_rows), _sliced(a.k_proj, kv_rows), _sliced(a.v_proj, kv_rows)
        a.o_proj = _sliced(a.o_proj, cols=q_rows)
        m.gate_proj, m.up_proj, m.down_proj = _sliced(m.gate_proj, ch), _sliced(m.up_proj, ch), _sliced(m.down_proj, cols=ch)
        a.num_key_value_groups = heads // kv
    return model.eval()


def _inputs(vocab, b=2, s=9, pad=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, :pad] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def _assert_decoder_matches(model, steps=2):
    dec = Decoder(model).eval()
    ids, mask, pos = _inputs(model.config.vocab_size)
    ref = model(ids, attention_mask=mask, position_ids=pos, use_cache=True)
    out = dec(ids, mask, pos, *dec.empty_past(2))
    keep = mask.bool()
    assert (ref.logits[keep] - out[0][keep]).abs().max() < 1e-4
    cache, presents = ref.past_key_values, list(out[1:])
    for _ in range(steps):
        for i, layer in enumerate(cache.layers):
            # a sliding-window cache keeps only its window; padded positions hold garbage in both
            n = layer.keys.shape[2]
            real = mask[:, None, -n:, None].bool()
            for r, ours in ((layer.keys, presents[2 * i]), (layer.values, presents[2 * i + 1])):
                assert ((r - ours[:, :, -n:]) * real).abs().max() < 1e-4
        nxt = torch.randint(0, model.config.vocab_size, (2, 1))
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        pos = pos[:, -1:] + 1
        ref = model(nxt, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        out = dec(nxt, mask, pos, *presents)
        assert (ref.logits - out[0]).abs().max() < 1e-4
        cache, presents = ref.past_key_values, list(out[1:])


@pytest.mark.parametrize("family", ONNX_FAMILIES)
def test_functional_decoder_matches_transformers(family):
    _assert_decoder_matches(lively(family))


def test_sliding_window_matches_transformers():
    # 9 prompt tokens + 2 steps against a 5-token window: the window and the mask both matter
    _assert_decoder_matches(lively("mistral", sliding_window=5))


def test_tied_head_is_stored_once(tmp_path):
    import onnx
    model = lively("llama")
    info = onnx_export.export_decoder(model, tmp_path / "m.onnx")
    proto = onnx.load(tmp_path / "m.onnx")
    stored = sum(int(np.prod(t.dims)) for t in proto.graph.initializer)
    params = sum(p.numel() for p in model.parameters())  # the tied table counted once
    assert info["tied_embeddings"] and params <= stored <= params + 64


def test_unsupported_rope_is_refused(tmp_path):
    from optimizer.errors import UserError
    model = lively("llama")
    model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(UserError, match="default RoPE only"):
        onnx_export.export_decoder(model, tmp_path / "m.onnx")


# --------------------------------------------------------------------------------------------
# export + validation


@pytest.mark.parametrize("family", ONNX_FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.slow
def test_export_validates(family, dtype, tmp_path):
    model = lively(family)
    info = onnx_export.export_decoder(model, tmp_path / "model.onnx", dtype=dtype)
    assert info["dtype"] == dtype and not info["external_data"] and info["uniform"]
    checks = validate(model, tmp_path / "model.onnx", dtype=dtype)
    assert checks["reference"] == "transformers"
    assert checks["greedy"]["matched"] == 32 or checks["greedy"]["parted_at_near_tie"]
    dec = OrtDecoder(tmp_path / "model.onnx")
    assert dec.kv_dtype == (np.float16 if dtype == "float16" else np.float32)
    names = [i.name for i in dec.session.get_inputs()]
    assert names[:5] == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key",
                         "past_key_values.0.value"]
    assert dec.output_names[:3] == ["logits", "present.0.key", "present.0.value"]
    axes = [d for d in dec.session.get_inputs()[3].shape]
    assert axes == ["batch_size", 2, "past_sequence_length", 8]


def test_qwen2_saved_as_llama_with_attention_bias(tmp_path):
    # surgery saves a Qwen2 that lost query heads as LlamaForCausalLM with q/k/v/o biases
    model = lively("llama", attention_bias=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.bias.normal_(0, 0.5)
    _assert_decoder_matches(model)
    onnx_export.export_decoder(model, tmp_path / "model.onnx")
    assert validate(model, tmp_path / "model.onnx")["greedy"]["matched"] == 32


@pytest.mark.slow
def test_fp16_halves_the_file(tmp_path):
    model = lively("llama")
    a = onnx_export.export_decoder(model, tmp_path / "a.onnx", dtype="float32")
    b = onnx_export.export_decoder(model, tmp_path / "b.onnx", dtype="float16")
    assert 0.45 < b["bytes"] / a["bytes"] < 0.6


@pytest.mark.parametrize("layout", [[(4, 2, 40), (8, 2, 96)], [(2, 1, 40), (8, 2, 96)]])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.slow
def test_per_layer_shapes_export(family, layout, tmp_path):
    model = per_layer_model(family, layout)
    _assert_decoder_matches(model)
    assert [(s.num_heads, s.num_kv_heads, s.intermediate_size) for s in layer_shapes(model)] == layout
    info = onnx_export.export_decoder(model, tmp_path / "model.onnx")
    assert not info["uniform"]
    checks = validate(model, tmp_path / "model.onnx")
    assert checks["reference"] == "transformers" and checks["greedy"]["matched"] == 32
    dec = OrtDecoder(tmp_path / "model.onnx")
    assert dec.kv_shapes == [(kv, 8) for _, kv, _ in layout for _ in range(2)]


def test_an_export_whose_reference_cannot_run_fails_loudly(tmp_path):
    """Never compared with the functional decoder it was traced from: that would check it against itself."""
    model = per_layer_model("llama", [(2, 1, 40), (8, 2, 96)])
    for layer in model.model.layers:
        layer.self_attn.num_key_value_groups = 4  # the config's value: transformers' forward fails
    onnx_export.export_decoder(model, tmp_path / "model.onnx")
    with pytest.raises(ValidationError, match="the reference cannot run"):
        validate(model, tmp_path / "model.onnx")


def test_external_data_forced(tmp_path):
    model = lively("qwen3")
    info = onnx_export.export_decoder(model, tmp_path / "model.onnx", external_data=True)
    assert info["external_data"] and info["files"] == ["model.onnx", "model.onnx.data"]
    assert (tmp_path / "model.onnx").stat().st_size < 100_000 < (tmp_path / "model.onnx.data").stat().st_size
    assert validate(model, tmp_path / "model.onnx")["greedy"]["matched"] == 32


def _package(tmp_path: Path, model, tokenizer, name="pkg", **kw) -> Path:
    from optimizer.job import prepare_output
    out = tmp_path / name
    tmp = prepare_output(out)
    from core.manifest import Engine as EngineSection  # (runtime.ort_server's Engine is the decoding loop)
    manifest = Manifest(format="onnx", target=Target(kind="cpu"), size={"ideal_ratio": 1.0},
                        engine=EngineSection.from_dict(onnx_export.engine_section("cpu", 256, name)))
    onnx_export.write_package(tmp, out, model, tokenizer, manifest, f"# {name}", **kw)
    return out


@pytest.mark.slow
def test_package_with_external_data_and_fp16(tmp_path, tokenizer):
    out = _package(tmp_path, lively("llama", vocab_size=len(tokenizer)), tokenizer, dtype="float16",
                   external_data=True)
    m = json.loads((out / "manifest.json").read_text())
    assert m["engine"]["dtype"] == "float16" and m["engine"]["external_data"]
    assert m["onnx"]["files"] == ["model.onnx", "model.onnx.data"] and (out / "model.onnx.data").is_file()
    assert m["checks"]["onnx"]["greedy"]["tokens"] == 32
    # the manifest's byte count is the files' (fp16 halves the weights: their bytes are 2 a parameter)
    assert m["onnx"]["bytes"] == sum((out / f).stat().st_size for f in m["onnx"]["files"])
    n_params = sum(p.numel() for p in lively("llama", vocab_size=len(tokenizer)).parameters())
    assert m["onnx"]["weight_bytes"] < 2.1 * n_params
    report = (out / "report.md").read_text()
    assert report.startswith(f"# pkg\n\n## Serving (ONNX)\n") and "internal check" not in report
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _break_rope(path: Path) -> None:
    import onnx
    from onnx import numpy_helper
    proto = onnx.load(path)
    for t in proto.graph.initializer:
        if t.name == "inv_freq":
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 1.5, "inv_freq"))
    onnx.save(proto, path)


def test_validation_catches_a_broken_graph(tmp_path):
    model = lively("llama")
    onnx_export.export_decoder(model, tmp_path / "model.onnx")
    _break_rope(tmp_path / "model.onnx")
    with pytest.raises(ValidationError, match=r"^prefill: logits differ from PyTorch by up to [0-9.e-]+ \(tolerance"):
        validate(model, tmp_path / "model.onnx")


_ORT_GREEDY = OrtDecoder.greedy


def _greedy_steps_edited(monkeypatch, edit):
    """OrtDecoder.greedy, with `edit(step, logits)` applied to each step's logits (and the token
    each step picks recomputed): a graph whose prefill and decode checks pass and whose greedy path does not."""
    def greedy(self, prompt, n):
        _, steps = _ORT_GREEDY(self, prompt, n)
        steps = [edit(i, row.copy()) for i, row in enumerate(steps)]
        return [int(np.argmax(r)) for r in steps], steps
    monkeypatch.setattr(OrtDecoder, "greedy", greedy)


@pytest.mark.slow
def test_greedy_steps_are_held_to_the_tolerance(tmp_path, monkeypatch):
    from exporters import onnx_check
    model = lively("llama")
    onnx_export.export_decoder(model, tmp_path / "model.onnx")

    def off(i, row):  # the 6th step's logits far off at its least likely token: the same greedy token
        if i == 5:
            row[np.argmin(row)] += 0.5 * (row.max() - row.min())
        return row
    _greedy_steps_edited(monkeypatch, off)
    with pytest.raises(ValidationError, match=r"^greedy generation: token 6's logits differ from PyTorch by up to"):
        validate(model, tmp_path / "model.onnx")

    def flip(by):  # the 4th step picks its runner-up, `by` logits above the best
        def edit(i, row):
            if i == 3:
                first, second = np.argsort(row)[-2:][::-1]
                row[second] = row[first] + by
            return row
        return edit
    _greedy_steps_edited(monkeypatch, flip(1.0))
    with pytest.raises(ValidationError, match=r"^greedy generation: token 4's logits differ .* the tokens part there"):
        validate(model, tmp_path / "model.onnx")
    # by a hair, with the tolerance loosened so that this model's runner-up lies within it: a near-tie
    _greedy_steps_edited(monkeypatch, flip(1e-4))
    monkeypatch.setitem(onnx_check.TOLERANCE, "float32", 0.5)
    g = validate(model, tmp_path / "model.onnx")["greedy"]
    assert g["matched"] == 3 and g["parted_at_near_tie"]["step"] == 4 and g["logits_max_abs_diff"] > 0

    def nan(i, row):  # a step's logits not finite (fp16 overflowing late in the path): a failure, not a tie
        if i == 7:
            row[0] = np.nan
        return row
    _greedy_steps_edited(monkeypatch, nan)
    with pytest.raises(ValidationError, match=r"^greedy generation: token 8's logits differ from PyTorch by up to nan"):
        validate(model, tmp_path / "model.onnx")


def test_validation_catches_wrong_names(tmp_path):
    import onnx
    model = lively("llama")
    onnx_export.export_decoder(model, tmp_path / "model.onnx")
    proto = onnx.load(tmp_path / "model.onnx")
    proto.graph.output[0].name = "scores"
    for node in proto.graph.node:
        node.output[:] = ["scores" if o == "logits" else o for o in node.output]
    onnx.save(proto, tmp_path / "model.onnx")
    with pytest.raises(ValidationError, match="graph names differ"):
        validate(model, tmp_path / "model.onnx")


@pytest.mark.slow
def test_a_failed_validation_writes_no_package(tmp_path, tokenizer, monkeypatch):
    real_export = onnx_export.export_decoder

    def broken(model, path, **kw):
        info = real_export(model, path, **kw)
        _break_rope(path)
        return info
    monkeypatch.setattr(onnx_export, "export_decoder", broken)
    with pytest.raises(RuntimeError, match="ONNX validation failed, no package written: prefill: logits differ"):
        _package(tmp_path, lively("llama", vocab_size=len(tokenizer)), tokenizer)
    # the pipeline removes its temporary directory on failure; write_package never renamed it
    assert not (tmp_path / "pkg").exists()


# --------------------------------------------------------------------------------------------
# the generation engine and the server


@pytest.fixture(scope="module")
def lively_package(tmp_path_factory, tokenizer):
    model = lively("llama", vocab_size=len(tokenizer))
    return _package(tmp_path_factory.mktemp("lively"), model, tokenizer, name="lively"), model


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _collect(req: Request) -> tuple[list[int], str]:
    tokens = []
    while True:
        kind, value = req.out.get(timeout=60)
        if kind == "token":
            tokens.append(value)
        else:
            assert kind == "done", value
            return tokens, value


@pytest.mark.slow
def test_engine_batches_requests_like_single_runs(lively_package):
    pkg, model = lively_package
    dec = OrtDecoder(pkg / "model.onnx", threads=1)
    engine = Engine(dec, eos_ids=set(), max_batch=4)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (5, 11, 3, 8)]
    lengths = [12, 6, 16, 9]  # rows leave the batch at different steps
    reqs = [engine.submit(Request(p, n, Sampling(0.0))) for p, n in zip(prompts, lengths)]
    for p, n, r in zip(prompts, lengths, reqs):
        tokens, reason = _collect(r)
        assert reason == "length" and tokens == _hf_greedy(model, p, n)


def test_engine_min_tokens_and_ignore_eos(lively_package):
    pkg, model = lively_package
    prompt = [300, 4000, 50]
    first = _hf_greedy(model, prompt, 1)[0]
    engine = Engine(OrtDecoder(pkg / "model.onnx", threads=1), eos_ids={first})
    tokens, reason = _collect(engine.submit(Request(prompt, 5, Sampling(0.0))))
    assert tokens == [first] and reason == "stop"
    tokens, reason = _collect(engine.submit(Request(prompt, 5, Sampling(0.0), min_tokens=3)))
    assert first not in tokens[:3] and reason in ("stop", "length")
    tokens, reason = _collect(engine.submit(Request(prompt, 5, Sampling(0.0), ignore_eos=True)))
    assert tokens[0] == first and len(tokens) == 5 and reason == "length"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(base: str, body: dict) -> tuple[int, dict | list[str]]:
    import http.client
    conn = http.client.HTTPConnection(base.split("//")[1], timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    if body.get("stream") and resp.status == 200:
        return resp.status, [line[6:] for line in data.splitlines() if line.startswith("data: ")]
    return resp.status, json.loads(data)


@pytest.fixture(scope="module")
def server(lively_package, tmp_path_factory):
    """The package's own Dockerfile ENTRYPOINT, run outside a container (no Docker engine here)."""
    pkg, model = lively_package
    entry = [line.split(" ", 1)[1] for line in (pkg / "Dockerfile").read_text().splitlines()
             if line.startswith("ENTRYPOINT ")][0]
    cmd = [sys.executable if a == "python3" else a.replace("/package", str(pkg)) for a in json.loads(entry)]
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    log = tmp_path_factory.mktemp("ort") / "server.log"
    with launch.running(cmd + ["--host", "127.0.0.1", "--port", str(port), "--threads", "1"], env, base, log,
                        timeout_s=120):
        yield base, pkg, model


def test_server_answers_like_transformers(server, tokenizer):
    base, pkg, model = server
    prompt = "The capital of France is"
    ids = tokenizer(prompt)["input_ids"]
    want = tokenizer.decode(_hf_greedy(model, ids, 12), skip_special_tokens=True)
    body = {"model": "lively", "prompt": prompt, "max_tokens": 12, "min_tokens": 12, "ignore_eos": True,
            "temperature": 0}
    status, whole = _post(base, body)
    assert status == 200 and whole["choices"][0]["text"] == want
    assert whole["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}
    status, events = _post(base, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert loadgen.complete(base, "lively", prompt, max_tokens=4) == \
        tokenizer.decode(_hf_greedy(model, ids, 4), skip_special_tokens=True)


def test_server_sampling_token_ids_and_errors(server):
    base, _, _ = server
    body = {"prompt": [101, 2020, 3030], "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    a, b = _post(base, body)[1], _post(base, body)[1]
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"]["completion_tokens"] == 8
    assert _post(base, {"prompt": [1, 2], "n": 2})[0] == 400
    assert _post(base, {"prompt": "x", "model": "other"})[0] == 404
    assert _post(base, {"prompt": "x", "max_tokens": 10_000})[0] == 400
    assert _post(base, {"prompt": [10 ** 9]})[0] == 400


def test_server_under_the_load_generator(server):
    base, _, _ = server
    res = loadgen.run_load(base, "lively", loadgen.LoadSpec(concurrency=3, num_requests=6, prompt_tokens=16,
                                                           output_tokens=8), vocab_size=49152)
    assert res["completed"] == 6 and res["failed"] == 0, res["errors"]
    assert res["output_tokens_per_s"] > 0 and res["ttft_ms"]["p50"] <= res["e2e_ms"]["p50"]


def test_launch_sh_runs_the_server_copy(lively_package):
    pkg, _ = lively_package
    out = subprocess.run(["sh", str(pkg / "launch.sh"), "--port", "1"], capture_output=True, text=True,
                         env={**os.environ, "PYTHON": "echo"}, check=True).stdout.split()
    assert out == [str(pkg.resolve() / "ort_server.py"), str(pkg.resolve()), "--served-model-name", "lively",
                   "--port", "1"]
    source = (pkg / "ort_server.py").read_text()
    assert source == Path(onnx_export.SERVER_FILE).read_text()
    # the copy serves without this project: standard library + the model's runtime and the web stack
    # (fastapi brings pydantic and starlette), each of which the Dockerfile installs
    import ast
    tree = ast.parse(source)
    mods = {n.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for n in node.names} | \
        {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert mods - set(sys.stdlib_module_names) == \
        {"numpy", "onnxruntime", "tokenizers", "fastapi", "pydantic", "starlette", "uvicorn", "jinja2"}
    docker = (pkg / "Dockerfile").read_text()
    assert all(f'"{r}==' in docker for r in onnx_export.SERVER_REQUIRES)
    assert "VLLM_API_KEY" in (pkg / "launch.sh").read_text() and "--api-key" in (pkg / "launch.sh").read_text()
    assert "fastapi, uvicorn, jinja2" in json.loads((pkg / "manifest.json").read_text())["engine"]["requires"]


def test_genai_runs_the_package(lively_package):
    og = pytest.importorskip("onnxruntime_genai")
    pkg, model = lively_package
    prompt = [120, 4400, 310, 77]
    genai = og.Model(str(pkg))
    params = og.GeneratorParams(genai)
    params.set_search_options(max_length=len(prompt) + 12, do_sample=False)
    gen = og.Generator(genai, params)
    gen.append_tokens(prompt)
    while not gen.is_done():
        gen.generate_next_token()
    got = [int(t) for t in gen.get_sequence(0)][len(prompt):]
    want = _hf_greedy(model, prompt, 12)
    assert got == want[:len(got)] and len(got) >= 6  # genai stops at EOS; the rest must agree


@pytest.mark.slow
def test_per_layer_package_has_no_genai_config(tmp_path, tokenizer):
    out = _package(tmp_path, per_layer_model("llama", [(4, 2, 40), (8, 2, 96)], vocab_size=len(tokenizer)),
                   tokenizer)
    m = json.loads((out / "manifest.json").read_text())
    assert not (out / "genai_config.json").exists()
    assert "one global num_key_value_heads" in m["engine"]["onnxruntime_genai"]["unsupported"]
    assert [(x["num_heads"], x["num_kv_heads"], x["intermediate_size"]) for x in m["onnx"]["layers"]] == \
        [(4, 2, 40), (8, 2, 96)]


# --------------------------------------------------------------------------------------------
# through the CLI: optimize --format onnx, serve, bench


def _optimize(tiny_dir, text_file, out, retain, *extra):
    from optimizer.cli import optimize
    args = [tiny_dir, "--target", "cpu", "--method", "activation", "--retain", retain, "--calib", text_file,
            "--eval", text_file, "--set", "data.seq_len=64", "--set", "data.calib_windows=2",
            "--set", "data.eval_windows=1",
            "--format", "onnx", "--no-heal", *(() if "--quant" in extra else ("--quant", "none")), *extra, "-o", out]
    return CliRunner().invoke(optimize, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def cli_packages(tiny_dirs, text_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    for name, retain in (("pruned", 0.6), ("dense", 1.0)):
        r = _optimize(tiny_dirs["qwen2"], text_file, root / name, retain)
        assert r.exit_code == 0, r.output
    return root / "pruned", root / "dense"


def test_optimize_format_onnx_through_the_cli(cli_packages):
    from serve.cli import serve
    pkg, _ = cli_packages
    for f in ("model.onnx", "config.json", "tokenizer.json", "manifest.json", "report.md", "launch.sh", "Dockerfile",
              "ort_server.py", "genai_config.json"):
        assert (pkg / f).is_file(), f
    m = json.loads((pkg / "manifest.json").read_text())
    assert m["format"] == "onnx" and m["engine"]["name"] == "onnxruntime"
    assert m["checks"]["onnx"]["greedy"]["tokens"] == 32 and m["checks"]["onnx"]["prefill"]["logits_max_abs_diff"] < 1e-3
    assert m["size"]["params_pruned"] < m["size"]["params_dense"]
    r = CliRunner().invoke(serve, [str(pkg), "--print-command", "--port", "9999"])
    assert r.exit_code == 0
    cmd = shlex.split(r.output)
    assert cmd[1:4] == ["-m", "runtime.ort_server", str(pkg.resolve())]
    assert cmd[-4:] == ["--host", "127.0.0.1", "--port", "9999"]
    r = CliRunner().invoke(serve, [str(pkg), "-tp", "2"])
    assert r.exit_code == 2 and "vLLM tensor parallelism" in r.output
    # the API key reaches the server in its environment, never on its command line
    r = CliRunner().invoke(serve, [str(pkg), "--print-command", "--api-key", "s3cret"])
    assert r.exit_code == 0 and "s3cret" not in r.stdout and "VLLM_API_KEY" in r.stderr
    r = CliRunner().invoke(serve, [str(pkg), "--print-command", "--api-key", "s3cret", "--", "--api-key", "x"])
    assert r.exit_code == 2 and "serve's own --api-key" in r.output
    assert launch.server_env(Manifest.read(pkg), "s3cret")["VLLM_API_KEY"] == "s3cret"


@pytest.mark.slow
def test_optimize_onnx_float16_through_the_cli(tiny_dirs, text_file, tmp_path):
    r = _optimize(tiny_dirs["llama"], text_file, tmp_path / "fp16", 0.6, "--set", "onnx.dtype=float16")
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "fp16" / "manifest.json").read_text())
    assert m["onnx"]["dtype"] == "float16" and m["checks"]["onnx"]["greedy"]["tokens"] == 32


def test_vllm_packages_keep_their_command():
    manifest = {"schema": SCHEMA, "format": "vllm", "engine": {"served_model_name": "p", "args": ["--dtype", "bfloat16"]}}
    assert launch.package_command("/x/p", Manifest.from_dict(manifest), "h", 1, ["--enforce-eager"]) == \
        server_command(str(Path("/x/p").resolve()), "p", ["--dtype", "bfloat16"]) + \
        ["--host", "h", "--port", "1", "--enforce-eager"]
    del manifest["format"]  # packages written before the format entry existed
    assert launch.package_command("/x/p", Manifest.from_dict(manifest), "h", 1)[1:3] == ["-m", SERVER_MODULE]


def test_bench_needs_an_onnx_baseline(cli_packages, tiny_dirs):
    from serve.cli import bench
    pkg, _ = cli_packages
    r = CliRunner().invoke(bench, [str(pkg), "--baseline", str(tiny_dirs["qwen2"])])
    assert r.exit_code == 2 and "ONNX baseline" in r.output


@pytest.mark.slow
def test_bench_onnx_package_against_onnx_baseline(cli_packages, tmp_path):
    from serve.cli import bench
    pkg, dense = cli_packages
    out = tmp_path / "bench"
    # with an API key: both servers require it (from their environment) and the load generator sends it
    r = CliRunner().invoke(bench, [str(pkg), "--baseline", str(dense), "--concurrency", "1,2", "--requests", "2",
                                   "--rounds", "1", "--prompt-tokens", "16", "--output-tokens", "4",
                                   "--port", str(_free_port()), "--out", str(out), "--vllm-args", "--threads 1",
                                   "--api-key", "bench-key"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    result = json.loads((out / "bench.json").read_text())
    assert result["meta"]["engine"].startswith("onnxruntime ") and result["meta"]["api_key"] is True
    assert "bench-key" not in json.dumps(result) and "API key required" in (out / "server-pruned-1.log").read_text()
    assert all(result["summary"]["ratios"]["pruned"][c]["tokens_per_s"] > 0 for c in ("1", "2"))


# --------------------------------------------------------------------------------------------
# the real model


@pytest.mark.slow
def test_optimize_onnx_int8_through_the_cli(tiny_dirs, text_file, tmp_path):
    """--format onnx --quant int8: the fp32 graph validated against the model with float activations,
    onnxruntime's INT8 graph (MatMulInteger) against the same model fake-quantized in PyTorch."""
    import onnx
    from optimizer.quantize import dynamic_quantize_linear
    r = _optimize(tiny_dirs["llama"], text_file, tmp_path / "int8", 0.6, "--quant", "int8")
    assert r.exit_code == 0, r.output
    pkg = tmp_path / "int8"
    m = json.loads((pkg / "manifest.json").read_text())
    c = m["checks"]["onnx"]
    assert c["tolerance_of_scale"] >= 5e-2 and c["float_graph"]["tolerance_of_scale"] == 1e-3
    assert 0 <= c["positions_loosened_by_float_noise"] <= c["positions"] == 2 * 12 + 2
    assert c["float_graph"]["greedy"]["tokens"] == 32 and c["greedy"]["tokens"] == 32
    assert c["prefill"]["logits_max_abs_diff"] <= max(c["tolerance_of_scale"] * max(1.0, c["prefill"]["logits_max_abs"]),
                                                      2 * c["reference_twin_noise"])
    # q, k, v, o, gate, up in each of the two blocks; down_proj stays fp32 (optimizer.quantize.ORT_INT8_ROLES)
    assert m["quantization"]["scheme"].startswith("onnxruntime dynamic INT8") and m["onnx"]["int8_matmuls"] == 2 * 6
    assert m["size"]["ideal_ratio_quantized"] > m["size"]["ideal_ratio"]
    graph = onnx.load(str(pkg / "model.onnx"))
    ops = {n.op_type for n in graph.graph.node}
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= ops and not list(pkg.glob(".float*"))
    assert "onnxruntime dynamic INT8" in (pkg / "report.md").read_text() and "in fp32" in (pkg / "report.md").read_text()
    # the PyTorch twin's activation rounding is DynamicQuantizeLinear's
    x = torch.tensor([[-1.0, 0.25, 3.0, 0.0]])
    s = 4.0 / 255
    zp = round(1.0 / s)
    torch.testing.assert_close(dynamic_quantize_linear(x), ((x / s).round() + zp).clamp(0, 255).sub(zp).mul(s))
    assert torch.equal(dynamic_quantize_linear(torch.zeros(3)), torch.zeros(3))
    # the int8 weights onnxruntime wrote are those the twin was put on: [-m, m] for this CPU
    from onnx import numpy_helper
    from optimizer.quantize import ort_weight_max
    quantized = [numpy_helper.to_array(i) for i in graph.graph.initializer if i.name.endswith("_quantized")]
    assert quantized and max(int(abs(q.astype(int)).max()) for q in quantized) == ort_weight_max() == \
        m["onnx"]["int8_weight_max"]


@pytest.mark.slow
def test_optimize_onnx_int8_qdq_through_the_cli(tiny_dirs, text_file, tmp_path):
    """--onnx-int8 qdq: a QuantizeLinear / DequantizeLinear pair with a static scale (q, k and v's equal:
    they read one tensor) and zero point 0 in front of every INT8 MatMul, int8 weights behind a
    DequantizeLinear, no dynamic quantization left, every INT8 MatMul fused by onnxruntime; validated
    against the twin with the padded row kept (the scales compared bit for bit with the twin's by the
    exporter: the next test), and a row's logits independent of its batch."""
    import onnx
    from onnx import numpy_helper
    from optimizer.quantize import quantize_linear
    r = _optimize(tiny_dirs["llama"], text_file, tmp_path / "qdq", 0.6, "--quant", "int8", "--set", "onnx.int8=qdq")
    assert r.exit_code == 0, r.output
    pkg = tmp_path / "qdq"
    m = json.loads((pkg / "manifest.json").read_text())
    c = m["checks"]["onnx"]
    assert m["quantization"]["scheme"].startswith("onnxruntime static INT8, QDQ")
    assert m["onnx"]["int8_activations"] == "qdq" and m["onnx"]["int8_matmuls"] == 2 * 6
    assert c["prefill_left_padding"] == 4  # the left-padded row is checked (its 4 pads are not compared)
    # the graph as written, with onnxruntime's own roundings taken at near-ties, agrees with the twin as an
    # fp32 export does, caches included
    exact = c["as_written"]
    for step in ("prefill", "decode"):
        assert exact[step]["logits_max_abs_diff"] < 1e-3 * max(1.0, exact[step]["logits_max_abs"])
        assert exact[step]["present_max_abs_diff"] < 1e-3 * max(1.0, exact[step]["logits_max_abs"])
    assert 0 <= exact["near_ties_taken_from_onnxruntime"] <= 1e-3 * exact["activations_compared"]
    assert c["prefill"]["present_max_abs_diff"] is None  # the served graph's caches: held by the exact check
    assert "the QDQ graph as written, rounding as onnxruntime did at" in (pkg / "report.md").read_text()
    assert c["greedy"]["tokens"] == 32 and c["float_graph"]["tolerance_of_scale"] == 1e-3
    graph = onnx.load(str(pkg / "model.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert "MatMulInteger" not in ops and "DynamicQuantizeLinear" not in ops
    producer = {o: n for n in graph.node for o in n.output}
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    scales = {}
    for n in graph.node:
        if n.op_type != "MatMul" or not n.name.startswith("/layers."):
            continue
        a, w = producer.get(n.input[0]), producer.get(n.input[1])
        if a is None or a.op_type != "DequantizeLinear":
            continue  # an fp32 MatMul: down_proj, attention's products
        q = producer[a.input[0]]
        assert q.op_type == "QuantizeLinear" and w.op_type == "DequantizeLinear"
        assert inits[w.input[0]].dtype == np.int8 and inits[w.input[1]].ndim == 1  # int8, one scale per channel
        assert inits[q.input[2]].dtype == np.int8 and int(inits[q.input[2]]) == 0  # symmetric
        scales[n.name] = float(inits[q.input[1]])
    assert len(scales) == 2 * 6 and len({scales[f"/layers.0/{r}/MatMul"] for r in "qkv"}) == 1
    # onnxruntime runs every INT8 MatMul in its integer kernel (the next test: why the pairs' constants
    # are not shared)
    assert _fused_int8_matmuls(pkg / "model.onnx", tmp_path) == 2 * 6
    # the twin's activation rounding is QuantizeLinear's: half to even, saturated at -128 / 127
    x = torch.tensor([0.5, 1.5, -2.5, 300.0, -300.0, 0.2])
    torch.testing.assert_close(quantize_linear(x, 1.0), torch.tensor([0.0, 2.0, -2.0, 127.0, -128.0, 0.0]))
    # static scales: a row's logits do not depend on what else is in its batch
    dec = OrtDecoder(pkg / "model.onnx", threads=1)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, dec.vocab_size, (2, 8))
    ones = np.ones((2, 8), dtype=np.int64)
    pos = np.tile(np.arange(8), (2, 1))
    both, _ = dec.run(ids, ones, pos, dec.empty_past(2))
    alone, _ = dec.run(ids[:1], ones[:1], pos[:1], dec.empty_past(1))
    np.testing.assert_allclose(both[0], alone[0], rtol=0, atol=1e-4)


def _fused_int8_matmuls(graph_path: Path, tmp_path: Path) -> int:
    import onnx
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(graph_path), opts, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node].count("MatMulIntegerToFloat")


@pytest.mark.slow
@pytest.mark.parametrize("form", ["dynamic", "qdq"])
def test_optimize_onnx_int8_with_the_lm_head(tiny_dirs, text_file, tmp_path, form):
    """quant_head=true: the LM head untied from the embedding (whose lookup keeps the fp32 table) and its
    MatMul in onnxruntime's INT8 like the blocks' (MatMulInteger, or behind a QDQ pair with the twin's
    scale), validated against the twin whose head input is fake-quantized the same way."""
    import onnx
    from onnx import numpy_helper
    r = _optimize(tiny_dirs["llama"], text_file, tmp_path / "head", 0.6, "--quant", "int8",
                  "--set", "quant_head=true", "--set", f"onnx.int8={form}")
    assert r.exit_code == 0, r.output
    pkg = tmp_path / "head"
    m = json.loads((pkg / "manifest.json").read_text())
    assert m["onnx"]["int8_matmuls"] == 2 * 6 + 1 and m["onnx"]["tied_embeddings"] is False
    q = m["quantization"]
    assert q["linears"] == 2 * 6 + 1 and q["ignore"] == ["down_proj"] and q["head"].startswith("int8")
    assert "the LM head's input" in q["smoothing"]["points"] and "the LM head too" in (pkg / "report.md").read_text()
    graph = onnx.load(str(pkg / "model.onnx")).graph
    producer = {o: n for n in graph.node for o in n.output}
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    assert inits["embed"].dtype == np.float32  # the lookup's table
    if form == "dynamic":
        head = [n for n in graph.node if n.name.startswith(onnx_export.HEAD_MATMUL) and n.op_type == "MatMulInteger"]
        assert len(head) == 1 and inits[head[0].input[1]].dtype == np.int8
        assert not any(n.name == onnx_export.HEAD_MATMUL for n in graph.node)  # the float MatMul replaced
    else:
        head = next(n for n in graph.node if n.name == onnx_export.HEAD_MATMUL)
        dq_x, dq_w = producer[head.input[0]], producer[head.input[1]]
        assert dq_x.op_type == dq_w.op_type == "DequantizeLinear" and inits[dq_w.input[0]].dtype == np.int8
        assert onnx_export.HEAD_KEY in onnx_export.qdq_pairs(graph)  # its scale checked bit for bit by the exporter
    c = m["checks"]["onnx"]
    assert c["greedy"]["tokens"] == 32 and c["prefill"]["logits_max_abs_diff"] <= max(
        c["tolerance_of_scale"] * max(1.0, c["prefill"]["logits_max_abs"]), 2 * c["reference_twin_noise"])


def test_the_int8_matmuls_are_the_roles_asked_for_and_the_head_only_untied(tmp_path):
    assert onnx_export.is_int8_matmul("/layers.3/q/MatMul", ("q", "k")) and onnx_export.int8_key("/layers.3/q/MatMul") == (3, "q")
    assert not onnx_export.is_int8_matmul("/layers.3/down/MatMul", ("q", "k"))
    assert not onnx_export.is_int8_matmul("/layers.3/attn/MatMul_1", ("q", "k"))  # attention's own products
    assert not onnx_export.is_int8_matmul(onnx_export.HEAD_MATMUL, ("q",))
    assert onnx_export.is_int8_matmul(onnx_export.HEAD_MATMUL, ("q", onnx_export.HEAD_ROLE))
    assert onnx_export.int8_key(onnx_export.HEAD_MATMUL) == onnx_export.HEAD_KEY
    # a tied head is `embed @ x^T`: no MatMul of its own to quantize, said in one line
    from tests.conftest import tiny_model
    model = tiny_model("llama")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    graph = onnx_export.export_decoder(model, tmp_path / "tied.onnx")
    with pytest.raises(ValidationError, match="untie it first"):
        onnx_export.quantize_graph(tmp_path / "tied.onnx", tmp_path / "int8.onnx", graph["external_data"], ("q", "head"))


@pytest.mark.slow
def test_qdq_pairs_sharing_constants_are_not_fused(tiny_dirs, text_file, tmp_path, monkeypatch):
    """Why each pair gets its own scale and zero point: q, k and v's dedicated pairs with shared
    constants are merged back into one by onnxruntime, which then fuses only o_proj's MatMul (the
    only pair no other MatMul reads) into its integer kernel, 2 of the 12 in two blocks."""
    monkeypatch.setattr(onnx_export, "_unshare_pair_constants", lambda path: None)
    r = _optimize(tiny_dirs["llama"], text_file, tmp_path / "shared", 0.6, "--quant", "int8", "--set", "onnx.int8=qdq")
    assert r.exit_code == 0, r.output
    assert _fused_int8_matmuls(tmp_path / "shared" / "model.onnx", tmp_path) == 2


@pytest.mark.parametrize("read_back", [True, False])
@pytest.mark.slow
def test_qdq_graph_with_other_scales_than_the_twin_is_refused(tiny_dirs, text_file, tmp_path, monkeypatch, read_back):
    """A QDQ graph whose activation scales are 1% off the twin's fails validation and leaves no package:
    at the scales' read-back, and without it at the exact check, where onnxruntime rounds values the
    twin does not, away from any tie (the looser end-to-end checks before it let such a graph through)."""
    real = onnx_export._activation_overrides
    monkeypatch.setattr(onnx_export, "_activation_overrides",
                        lambda matmuls, scales: {t: s * 1.01 for t, s in real(matmuls, scales).items()})
    if not read_back:
        monkeypatch.setattr(onnx_export, "_check_qdq_scales", lambda *a: None)
    why = ("/layers.0/q/MatMul: activation scale .* in the graph's QuantizeLinear, .* in the PyTorch twin" if read_back else
           "onnxruntime rounded [0-9]+ of [0-9,]+ int8 activations differently from the PyTorch twin, away "
           "from any near-tie")
    with pytest.raises(RuntimeError, match="ONNX validation failed, no package written: " + why):
        _optimize(tiny_dirs["llama"], text_file, tmp_path / "bad", 0.6, "--quant", "int8", "--set", "onnx.int8=qdq")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".*"))


def test_onnx_int8_form_needs_an_int8_onnx_package(tiny_dirs, text_file, tmp_path):
    r = _optimize(tiny_dirs["llama"], text_file, tmp_path / "x", 0.6, "--set", "onnx.int8=qdq", "--quant", "none")
    assert r.exit_code != 0 and "onnx.int8=qdq applies to ONNX packages quantized to INT8" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_ort_weight_grid_follows_the_cpu(monkeypatch):
    """onnxruntime's u8s8 kernel saturates on x86 without VNNI: the weights take its reduced range there."""
    import optimizer.quantize as quantize
    for flags, m in (({"avx2", "fma"}, 64), ({"avx2", "avx512f", "avx512_vnni"}, 127), ({"avx2", "avx_vnni"}, 127),
                     (set(), 127)):
        monkeypatch.setattr(quantize, "cpu_flags", lambda f=flags: f)
        assert quantize.ort_weight_max() == m
    # a package with the full grid served on such a CPU: the server warns; with the reduced grid it does not
    from runtime.ort_server import int8_saturation_warning
    full, reduced = {"onnx": {"int8_matmuls": 12, "int8_weight_max": 127}}, {"onnx": {"int8_matmuls": 12, "int8_weight_max": 64}}
    assert "no VNNI" in int8_saturation_warning(full, {"avx2"})
    assert int8_saturation_warning(full, {"avx2", "avx512_vnni"}) is None
    assert int8_saturation_warning(reduced, {"avx2"}) is None
    assert int8_saturation_warning({"onnx": {"int8_matmuls": 12}}, {"avx2"})  # written before the grid was recorded
    assert int8_saturation_warning({"onnx": {}}, {"avx2"}) is None  # an fp32 package


@pytest.mark.real_model
def test_real_model_onnx_package(real_model_dir, tmp_path):
    from optimizer.pipeline import DataConfig, HealSettings, OptimizeConfig, optimize
    out = tmp_path / "smollm2-onnx-r0.50"
    res = optimize(OptimizeConfig(target="cpu", method="activation", retain=0.5, out=str(out), format="onnx", threads=1,
                                  quant="none",
                                  heal=HealSettings(tokens=0),
                                  data=DataConfig(calib_windows=2, eval_windows=1, seq_len=512)), log=lambda *_: None)
    checks = res["manifest"].checks["onnx"]
    assert checks["reference"] == "transformers"
    assert checks["prefill"]["logits_max_abs_diff"] < 1e-3 * checks["prefill"]["logits_max_abs"]
    assert checks["greedy"]["matched"] == 32 or checks["greedy"]["parted_at_near_tie"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["checks"]["onnx"]["export_s"] > 0 and m["onnx"]["bytes"] < 0.8 * 4 * m["size"]["params_dense"]
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(out))
    tok = og.Tokenizer(model)
    params = og.GeneratorParams(model)
    prompt = list(tok.encode("The capital of France is"))
    params.set_search_options(max_length=len(prompt) + 8, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    while not gen.is_done():
        gen.generate_next_token()
    got = [int(t) for t in gen.get_sequence(0)][len(prompt):]
    want, _ = OrtDecoder(out / "model.onnx", threads=1).greedy(prompt, len(got))
    assert got and got == want


@pytest.mark.real_model
@pytest.mark.parametrize("form", ["dynamic", "qdq"])
def test_real_model_onnx_int8_package(real_model_dir, tmp_path, form):
    """SmolLM2 at 0.7, --quant int8, either form: onnxruntime's INT8 graph answers greedily like its
    PyTorch twin, and differs from it by no more than the twin differs from itself when perturbed at
    the level of float rounding (twice that at most)."""
    from optimizer.pipeline import DataConfig, HealSettings, OnnxSettings, OptimizeConfig, optimize
    out = tmp_path / "smollm2-onnx-int8"
    res = optimize(OptimizeConfig(target="cpu", method="activation", retain=0.7, out=str(out), format="onnx",
                                  quant="int8", onnx=OnnxSettings(int8=form), threads=1, heal=HealSettings(tokens=0),
                                  data=DataConfig(calib_windows=4, eval_windows=1, seq_len=512)), log=lambda *_: None)
    m = res["manifest"]
    c = m.checks["onnx"]
    scale = max(1.0, c["prefill"]["logits_max_abs"])
    assert c["float_graph"]["prefill"]["logits_max_abs_diff"] < 1e-3 * scale  # the graph itself is exact
    if form == "dynamic":
        assert c["prefill"]["logits_max_abs_diff"] <= 2 * c["reference_twin_noise"] or \
            c["prefill"]["logits_max_abs_diff"] <= 5e-2 * scale  # (a QDQ graph's flips cascade further: its perturbed twins' limits are looser)
        assert c["tolerance_of_scale"] < 0.3  # the twin's own float noise stays a fraction of the scale
        assert c["positions_loosened_by_float_noise"] <= c["positions"] // 4  # and sets the limit at a few positions only
    else:  # QDQ: the graph as written, with onnxruntime's roundings at near-ties, holds to the fp32 tolerance
        exact = c["as_written"]
        assert exact["prefill"]["logits_max_abs_diff"] < 1e-3 * scale and exact["decode"]["present_max_abs_diff"] < 1e-2
        assert exact["near_ties_taken_from_onnxruntime"] < 1e-4 * exact["activations_compared"]
        assert c["prefill"]["present_max_abs_diff"] is None  # the served graph's caches: held by the exact check
        assert _fused_int8_matmuls(out / "model.onnx", tmp_path) == 30 * 6  # each in onnxruntime's integer kernel
    assert c["greedy"]["matched"] == 32 or c["greedy"]["parted_at_near_tie"]
    assert m.onnx["int8_matmuls"] == 30 * 6 and m.onnx["bytes"] < 0.5 * 4 * m.size["params_dense"]
    assert m.onnx["int8_activations"] == form and c["prefill_left_padding"] == (4 if form == "qdq" else 0)
    assert m.size["ideal_ratio_quantized"] > 1.5 * m.size["ideal_ratio"]
    got, _ = OrtDecoder(out / "model.onnx", threads=1).greedy([1, 504, 3458, 282], 4)
    assert len(got) == 4
