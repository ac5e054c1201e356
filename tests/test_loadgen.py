"""Tests for serve.loadgen and serve.report against a tiny fake OpenAI-compatible server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from core.manifest import MANIFEST, SCHEMA, Manifest, Plan, Source, Target
from serve import loadgen
from serve.loadgen import LoadSpec, complete, make_prompts, run_load, wait_for_server

TOKEN_SLEEP = 0.004  # seconds per generated token
PREFILL_SLEEP = 0.010  # seconds before the first token
HELD_BACK = 3  # "held_back_first" mode: the first tokens stream with empty text,
HELD_BACK_GAP = 0.3  # then this long a pause before the first visible text


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive + chunked streaming
    disable_nagle_algorithm = True  # send each SSE chunk at once (as uvicorn does)

    def log_message(self, *args):  # keep pytest output quiet
        pass

    def setup(self):
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def _json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_GET(self):
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        with srv.lock:
            srv.bodies.append(body)
        if self.path != "/v1/completions":
            return self._json(404, {"error": "not found"})
        if srv.mode == "error":
            return self._json(500, {"error": {"message": "boom", "code": 500}})
        n = int(body["max_tokens"])
        if not body.get("stream"):
            text = " Paris" if "capital of France" in str(body["prompt"]) else " tok" * n
            return self._json(200, {"choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                                    "usage": {"completion_tokens": n}})
        with srv.lock:
            index = srv.streams
            srv.streams += 1
        mode = srv.mode
        if srv.lose_every and index % srv.lose_every == srv.lose_every - 1:
            mode = "usage0"  # this one generates nothing
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        time.sleep(PREFILL_SLEEP)
        for i in range(n):
            if i:
                time.sleep(HELD_BACK_GAP if mode == "held_back_first" and i == HELD_BACK else TOKEN_SLEEP)
            # vLLM streams a choice for every token; its text is empty while the detokenizer holds
            # the token's bytes back (part of a UTF-8 character, a skipped special token)
            empty = mode in ("empty_text", "usage0", "no_usage_no_text") or (
                mode == "held_back_first" and i < HELD_BACK)
            chunk = {"choices": [{"index": 0, "text": "" if empty else f" t{i}", "logprobs": None,
                                  "finish_reason": "length" if i == n - 1 else None, "stop_reason": None,
                                  "token_ids": None}], "usage": None}
            self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
        if mode not in ("no_usage", "no_usage_no_text"):
            m = 0 if mode == "usage0" else n
            usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                              "completion_tokens": m, "total_tokens": m + len(body["prompt"])}}
            self._chunk(f"data: {json.dumps(usage)}\n\n".encode())
        if mode != "no_done":
            self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")  # terminating zero-length chunk


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.mode = "ok"
    srv.lose_every = 0  # > 0: every lose_every-th stream generates no tokens (usage 0, no text)
    srv.streams = 0
    srv.bodies = []
    srv.connections = 0
    srv.lock = threading.Lock()
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("concurrency,num_requests", [(1, 3), (4, 8)])
def test_run_load_streams(server, concurrency, num_requests):
    srv, url = server
    out_tokens = 8
    spec = LoadSpec(concurrency=concurrency, num_requests=num_requests, prompt_tokens=32,
                    output_tokens=out_tokens)
    res = run_load(url, "fake", spec, vocab_size=1000, seed=1, timeout_s=30)

    assert res["completed"] == num_requests and res["failed"] == 0 and res["errors"] == []
    for k in ("concurrency", "num_requests", "prompt_tokens", "output_tokens"):
        assert res[k] == getattr(spec, k)
    # request bodies: fixed-length greedy streaming with token-id prompts
    assert len(srv.bodies) == num_requests
    for b in srv.bodies:
        assert b["model"] == "fake"
        assert b["max_tokens"] == b["min_tokens"] == out_tokens
        assert b["ignore_eos"] is True and b["temperature"] == 0 and b["stream"] is True
        assert b["stream_options"] == {"include_usage": True}
        assert len(b["prompt"]) == 32 and all(100 <= t < 900 for t in b["prompt"])
    assert len({tuple(b["prompt"]) for b in srv.bodies}) == num_requests
    assert srv.connections <= concurrency  # one keep-alive connection per worker

    ttft, tpot, e2e = res["ttft_ms"], res["tpot_ms"], res["e2e_ms"]
    assert PREFILL_SLEEP * 1000 * 0.9 <= ttft["p50"] < e2e["p50"]
    assert ttft["p99"] < e2e["p99"]
    assert TOKEN_SLEEP * 1000 * 0.9 <= tpot["p50"] < TOKEN_SLEEP * 1000 * 5
    min_e2e = (PREFILL_SLEEP + (out_tokens - 1) * TOKEN_SLEEP) * 1000
    assert e2e["p50"] >= min_e2e * 0.95
    for stats in (ttft, tpot, e2e):
        assert set(stats) == {"p50", "p99", "mean"}
        assert stats["p50"] <= stats["p99"]

    # throughput: all tokens counted, and no faster than `concurrency` streams can go
    waves = -(-num_requests // concurrency)
    assert res["wall_s"] >= waves * min_e2e / 1000 * 0.95
    assert res["output_tokens_per_s"] == pytest.approx(num_requests * out_tokens / res["wall_s"])
    per_stream_max = out_tokens / (min_e2e / 1000)
    assert res["output_tokens_per_s"] <= concurrency * per_stream_max * 1.05
    assert res["output_tokens_per_s"] >= concurrency * per_stream_max * 0.15
    assert res["requests_per_s"] == pytest.approx(num_requests / res["wall_s"])


def test_run_load_http_500_counts_failures(server):
    srv, url = server
    srv.mode = "error"
    res = run_load(url, "fake", LoadSpec(2, 5, prompt_tokens=8, output_tokens=4), vocab_size=500)
    assert res["completed"] == 0 and res["failed"] == 5
    assert len(res["errors"]) == 3 and all("500" in e for e in res["errors"])
    assert res["output_tokens_per_s"] == 0.0
    assert res["ttft_ms"]["p50"] is None


def test_run_load_connection_refused_does_not_crash():
    url = f"http://127.0.0.1:{_free_port()}"
    res = run_load(url, "fake", LoadSpec(2, 3, prompt_tokens=8, output_tokens=4), vocab_size=500,
                   timeout_s=5)
    assert res["completed"] == 0 and res["failed"] == 3 and res["errors"]


def test_tokens_streamed_with_empty_text_count_when_usage_has_them(server):
    """vLLM streams a token whose bytes its detokenizer holds back (part of a UTF-8 character, a
    skipped special token) as a chunk with empty text; a whole stream can look like that while
    usage counts every token. It generated what was asked: a success, not a lost request."""
    srv, url = server
    srv.mode = "empty_text"
    out_tokens = 6
    res = run_load(url, "fake", LoadSpec(2, 4, prompt_tokens=8, output_tokens=out_tokens), vocab_size=500,
                   timeout_s=30)
    assert res["failed"] == 0 and res["errors"] == [] and res["error_counts"] == {}
    assert res["completed"] == res["sent"] == 4
    assert res["output_tokens_per_s"] == pytest.approx(4 * out_tokens / res["wall_s"])
    ttft, tpot, e2e = res["ttft_ms"], res["tpot_ms"], res["e2e_ms"]
    assert PREFILL_SLEEP * 1000 * 0.9 <= ttft["p50"] < e2e["p50"]
    assert TOKEN_SLEEP * 1000 * 0.9 <= tpot["p50"]


def test_time_to_first_token_is_the_first_chunk_even_when_its_text_is_held_back(server):
    srv, url = server
    srv.mode = "held_back_first"  # HELD_BACK empty-text chunks, a long pause, then text
    res = run_load(url, "fake", LoadSpec(1, 2, prompt_tokens=8, output_tokens=HELD_BACK + 3), vocab_size=500,
                   timeout_s=30)
    assert res["completed"] == 2 and res["failed"] == 0
    assert res["e2e_ms"]["p50"] >= HELD_BACK_GAP * 1000  # the pause is inside the request...
    assert res["ttft_ms"]["p50"] < HELD_BACK_GAP * 1000 / 2  # ...but after its first token


@pytest.mark.parametrize("mode", ["usage0", "no_usage_no_text"])
def test_a_stream_without_any_token_still_fails(server, mode):
    """Empty chunks with usage completion_tokens 0, or with no usage at all: nothing generated."""
    srv, url = server
    srv.mode = mode
    res = run_load(url, "fake", LoadSpec(2, 3, prompt_tokens=8, output_tokens=4), vocab_size=500, timeout_s=30)
    assert res["completed"] == 0 and res["failed"] == res["sent"] == 3
    assert all("without any output tokens" in e for e in res["errors"])
    assert sum(res["error_counts"].values()) == 3
    assert res["output_tokens_per_s"] == 0.0 and res["ttft_ms"]["p50"] is None


def test_without_usage_the_chunks_with_text_are_the_tokens(server):
    srv, url = server
    srv.mode = "no_usage"
    res = run_load(url, "fake", LoadSpec(2, 4, prompt_tokens=8, output_tokens=5), vocab_size=500, timeout_s=30)
    assert res["completed"] == 4 and res["failed"] == 0
    assert res["output_tokens_per_s"] == pytest.approx(4 * 5 / res["wall_s"])


def test_a_stream_cut_before_done_is_lost(server):
    srv, url = server
    srv.mode = "no_done"  # text and usage, but the stream ends without data: [DONE]
    res = run_load(url, "fake", LoadSpec(1, 2, prompt_tokens=8, output_tokens=4), vocab_size=500, timeout_s=30)
    assert res["completed"] == 0 and res["failed"] == 2
    assert all("[DONE]" in e for e in res["errors"])


def test_lost_requests_are_counted_among_those_sent(server):
    srv, url = server
    srv.lose_every = 4  # streams 3, 7, 11 generate nothing
    res = run_load(url, "fake", LoadSpec(4, 12, prompt_tokens=8, output_tokens=4), vocab_size=500, timeout_s=30)
    assert res["sent"] == res["num_requests"] == 12 == len(srv.bodies)
    assert res["completed"] == 9 and res["failed"] == 3
    assert list(res["error_counts"].values()) == [3]
    assert res["output_tokens_per_s"] == pytest.approx(9 * 4 / res["wall_s"])


def test_complete_non_streaming(server):
    srv, url = server
    assert complete(url, "fake", "The capital of France is", max_tokens=4) == " Paris"
    assert srv.bodies[-1]["temperature"] == 0 and not srv.bodies[-1].get("stream")
    srv.mode = "error"
    with pytest.raises(RuntimeError, match="500"):
        complete(url, "fake", "x")


def test_make_prompts_distinct_and_deterministic():
    a = make_prompts(50, 16, vocab_size=1000, seed=3)
    assert a == make_prompts(50, 16, vocab_size=1000, seed=3)
    assert a != make_prompts(50, 16, vocab_size=1000, seed=4)
    assert len(a) == 50 and all(len(p) == 16 for p in a)
    assert len({tuple(p) for p in a}) == 50
    assert all(100 <= t < 900 for p in a for t in p)
    # even a tiny id space gives distinct prompts
    b = make_prompts(20, 2, vocab_size=205, seed=0)
    assert len({tuple(p) for p in b}) == 20


def test_percentile_linear_interpolation():
    assert loadgen.percentile([], 50) is None
    assert loadgen.percentile([5], 99) == 5
    assert loadgen.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert loadgen.percentile([10, 0, 20], 99) == pytest.approx(19.8)


def test_wait_for_server(server):
    _, url = server
    wait_for_server(url, timeout_s=5)  # up: returns
    dead = f"http://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="not ready"):
        wait_for_server(dead, timeout_s=0.6)
    assert time.monotonic() - t0 < 3


def test_wait_for_server_fails_fast_when_process_exited():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    proc.wait(timeout=10)
    dead = f"http://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 3"):
        wait_for_server(dead, timeout_s=60, proc=proc)
    assert time.monotonic() - t0 < 2


# --------------------------------------------------------------------------------------------
# report


def _run(tok_s, ttft, tpot, e2e, conc):
    return {
        "concurrency": conc, "num_requests": 4 * conc, "prompt_tokens": 128, "output_tokens": 64,
        "sent": 4 * conc, "completed": 4 * conc, "failed": 0, "errors": [], "wall_s": 1.0,
        "output_tokens_per_s": tok_s, "requests_per_s": tok_s / 64,
        "ttft_ms": {"p50": ttft, "p99": ttft * 2, "mean": ttft * 1.1},
        "tpot_ms": {"p50": tpot, "p99": tpot * 1.5, "mean": tpot},
        "e2e_ms": {"p50": e2e, "p99": e2e * 1.2, "mean": e2e},
    }


def _synthetic_results():
    return {
        "meta": {"model": "SmolLM2-135M", "hardware": "test CPU", "rounds": 2},
        "runs": {
            "dense": {
                "1": [_run(100, 20, 10, 650, 1), _run(90, 25, 11, 700, 1)],
                "16": [_run(800, 80, 18, 1200, 16), _run(1000, 60, 16, 1100, 16)],
            },
            "pruned": {
                "1": [_run(130, 16, 8, 520, 1), _run(120, 15, 9, 560, 1)],
                "16": [_run(1200, 50, 12, 800, 16), _run(1100, 55, 13, 900, 16)],
            },
        },
        "ideal_ratio": 1.5,
    }


def test_summarize_ratios():
    from serve.report import summarize

    s = summarize(_synthetic_results())
    assert s["baseline"] == "dense" and s["labels"] == ["dense", "pruned"]
    assert s["concurrencies"] == ["1", "16"]
    d1, p16 = s["best"]["dense"]["1"], s["best"]["pruned"]["16"]
    assert d1["output_tokens_per_s"] == 100 and d1["ttft_ms"]["p50"] == 20
    assert d1["tpot_ms"]["p50"] == 10 and d1["e2e_ms"]["p50"] == 650 and d1["rounds"] == 2
    assert p16["output_tokens_per_s"] == 1200 and p16["ttft_ms"]["p50"] == 50
    r1, r16 = s["ratios"]["pruned"]["1"], s["ratios"]["pruned"]["16"]
    assert r1["tokens_per_s"] == pytest.approx(1.3)
    assert r1["ttft_p50"] == pytest.approx(15 / 20)
    assert r1["tpot_p50"] == pytest.approx(0.8)
    assert r1["e2e_p50"] == pytest.approx(520 / 650)
    assert r1["fraction_of_ideal"] == pytest.approx(1.3 / 1.5)
    assert r16["tokens_per_s"] == pytest.approx(1.2)
    assert r16["fraction_of_ideal"] == pytest.approx(0.8)
    assert s["ratios"]["dense"]["1"]["tokens_per_s"] == pytest.approx(1.0)
    json.dumps(s)  # serialisable

    # paired: each measurement against the baseline's of the same index (1200/800, 1100/1000)
    assert r16["paired"] == {"median": pytest.approx(1.3), "min": pytest.approx(1.1), "max": pytest.approx(1.5), "n": 2}
    assert s["ratios"]["dense"]["16"]["paired"] is None
    uneven = _synthetic_results()
    uneven["runs"]["pruned"]["16"].append(_run(900, 50, 12, 800, 16))
    assert summarize(uneven)["ratios"]["pruned"]["16"]["paired"] is None  # no index to pair by
    uneven["runs"]["dense"]["16"].append(_run(600, 50, 12, 800, 16))  # three pairs: 1.5, 1.1, 1.5
    assert summarize(uneven)["ratios"]["pruned"]["16"]["paired"]["median"] == pytest.approx(1.5)

    no_ideal = summarize({**_synthetic_results(), "ideal_ratio": None})
    assert no_ideal["ratios"]["pruned"]["1"]["fraction_of_ideal"] is None


@pytest.mark.slow
def test_markdown_plot_and_write_report(tmp_path):
    from serve.report import markdown_table, plot, summarize, write_report

    results = _synthetic_results()
    s = summarize(results)
    md = markdown_table(s)
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and ln[2:3].isdigit()]
    assert len(rows) == 4  # 2 concurrencies x 2 labels
    assert rows[0].split("|")[1].strip() == "1" and rows[0].split("|")[2].strip() == "dense"
    pruned16 = [r for r in rows if "pruned" in r and r.split("|")[1].strip() == "16"][0]
    assert "1200.0" in pruned16 and "1.20×" in pruned16 and "80%" in pruned16
    assert "1.30×" in md and "87%" in md

    png = tmp_path / "plot.png"
    plot(s, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    out = tmp_path / "report"
    summary = write_report(results, out)
    assert summary["ratios"]["pruned"]["16"]["tokens_per_s"] == pytest.approx(1.2)
    saved = json.loads((out / "bench.json").read_text())
    assert saved["runs"] == results["runs"] and saved["summary"]["baseline"] == "dense"
    text = (out / "bench.md").read_text()
    assert "Best-of-N" in text and "1.20×" in text
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ideal_ratio_against_another_package_is_the_quotient_of_both_ideals():
    from serve.cli import ideal_ratio
    pkg = Manifest(size={"ideal_ratio": 1.33})
    assert ideal_ratio(pkg, None) == 1.33  # against the dense model
    assert ideal_ratio(pkg, Manifest(size={"ideal_ratio": 1.32})) == pytest.approx(1.33 / 1.32)


@pytest.mark.slow
def test_the_plans_prediction_stands_beside_the_measured_decode_speedup(tmp_path):
    """Against its dense source model, bench sets the plan's roofline decode speedup at batch 1 and
    16 beside the measured one (the TPOT p50 ratio); against anything else it has none to set."""
    from serve.cli import predicted_speedups
    from serve.report import write_report
    src = tmp_path / "src"
    src.mkdir()
    manifest = Manifest(target=Target(name="cpu", kind="cpu"), source=Source(hf_dir=str(src)),
                        plan=Plan(prediction={"prompt_tokens": 512, "context_tokens": 512,
                                              "decode_speedup_b1": 1.9, "decode_speedup_b16": 1.4}))
    predicted = predicted_speedups(manifest, None, src)
    assert predicted["decode"] == {"1": 1.9, "16": 1.4} and predicted["target"] == "cpu"
    assert predicted_speedups(manifest, None, tmp_path) is None  # another model: not what was predicted
    assert predicted_speedups(manifest, Manifest(), src) is None  # another package
    predicted["host"] = "cpu"  # as on this machine: the target's kind, so the figures stand side by side
    summary = write_report({**_synthetic_results(), "predicted": predicted}, tmp_path / "report")
    c1, c16 = summary["predicted"]["levels"]["1"], summary["predicted"]["levels"]["16"]
    assert c1["measured_decode"] == pytest.approx(1 / 0.8) and c16["measured_decode"] == pytest.approx(16 / 12)
    assert c16["predicted_decode"] == 1.4 and c16["measured_tokens_per_s"] == pytest.approx(1.2)
    text = (tmp_path / "report" / "bench.md").read_text()
    assert "predicted by the plan's roofline for cpu" in text and "c=16: 1.40× predicted, 1.33× measured" in text
    # a GPU target's roofline measured on a CPU: said, not set beside
    gpu = {**predicted, "target": "a100", "kind": "gpu"}
    write_report({**_synthetic_results(), "predicted": gpu}, tmp_path / "report-gpu")
    text = (tmp_path / "report-gpu" / "bench.md").read_text()
    assert "is for a100 (gpu); this machine served the models on its cpu: not set side by side" in text
    assert "× predicted" not in text


def test_requests_sent_succeeded_failed_per_level_and_a_failed_line():
    from serve.report import markdown_table, requests_line, summarize

    results = _synthetic_results()
    results["warmup"] = {"dense": [_run(50, 1, 1, 1, 16)], "pruned": [_run(50, 1, 1, 1, 16)]}
    s = summarize(results)
    req = s["requests"]
    assert req["all_succeeded"] and req["failed"] == 0 and req["lost"] == []
    assert req["levels"]["pruned"]["16"] == {"sent": 128, "succeeded": 128, "failed": 0}  # 2 rounds x 64
    assert req["warmup"]["dense"] == {"sent": 64, "succeeded": 64, "failed": 0}
    assert req["sent"] == req["succeeded"] == 2 * (2 * 4 + 2 * 64) + 2 * 64
    assert requests_line(s).startswith("Requests: ") and "none lost" in markdown_table(s)

    lossy = _run(900, 70, 17, 1150, 16)
    lossy.update(completed=63, failed=1, errors=["stream ended without any output tokens"],
                 error_counts={"stream ended without any output tokens": 1})
    results["runs"]["dense"]["16"][0] = lossy
    warm = _run(50, 1, 1, 1, 16)
    warm.update(sent=60, completed=60, failed=4, errors=["run deadline of 600s exceeded"])  # 4 never sent
    results["warmup"]["pruned"] = [warm]
    s = summarize(results)
    req = s["requests"]
    assert not req["all_succeeded"] and req["failed"] == 5
    assert req["levels"]["dense"]["16"] == {"sent": 128, "succeeded": 127, "failed": 1}
    assert req["warmup"]["pruned"] == {"sent": 60, "succeeded": 60, "failed": 4}
    assert [(x["label"], x["concurrency"], x["failed"]) for x in req["lost"]] == [
        ("dense", "16", 1), ("pruned", "warm-up", 4)]
    line = requests_line(s)
    assert line.startswith("FAILED: 5 of ")
    assert "dense c=16: 1 of 128 failed (stream ended without any output tokens)" in line
    assert "pruned warm-up: 4 of 64 failed" in line
    md = markdown_table(s)
    assert line in md and "| 1/128 |" in md
    assert s["best"]["dense"]["16"]["output_tokens_per_s"] == 1000  # best-of-N is unchanged


# --------------------------------------------------------------------------------------------
# bench, with the fake server standing in for both vLLM servers


def _fake_package(path, ideal):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    (path / MANIFEST).write_text(json.dumps({
        "schema": SCHEMA, "engine": {"served_model_name": path.name, "args": []},
        "size": {"ideal_ratio": ideal}}))
    return path


@pytest.mark.parametrize("mode,lose_every,exit_code", [("ok", 0, 0), ("empty_text", 0, 0), ("ok", 5, 1)])
def test_bench_states_lost_requests_and_fails_on_any(server, tmp_path, monkeypatch, mode, lose_every,
                                                     exit_code):
    import contextlib

    from click.testing import CliRunner

    from serve import cli

    srv, url = server
    srv.mode, srv.lose_every = mode, lose_every
    monkeypatch.setattr(cli.launch, "running", lambda *a, **k: contextlib.nullcontext())  # no vLLM
    pkg = _fake_package(tmp_path / "pruned-pkg", 1.5)
    base = _fake_package(tmp_path / "dense-pkg", 1.0)
    out = tmp_path / "bench"
    r = CliRunner().invoke(cli.bench, [str(pkg), "--baseline", str(base), "--concurrency", "1,3",
                                       "--requests", "5", "--rounds", "1", "--prompt-tokens", "8",
                                       "--output-tokens", "3", "--port", str(srv.server_address[1]),
                                       "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == exit_code, r.output
    # warm-up (3) and two levels (5 each), for each model
    assert len(srv.bodies) == 2 * (3 + 5 + 5)
    summary = json.loads((out / "bench.json").read_text())["summary"]
    req = summary["requests"]
    assert req["sent"] == 26 and req["succeeded"] + req["failed"] == 26
    assert set(req["levels"]) == {"dense", "pruned"} and set(req["levels"]["dense"]) == {"1", "3"}
    md = (out / "bench.md").read_text()
    if exit_code == 0:
        assert req["all_succeeded"] and req["failed"] == 0
        assert "Requests: 26 of 26 sent (including 6 warm-up) succeeded, none lost." in md
        assert "FAILED" not in r.output
    else:
        assert req["failed"] == 26 // 5 and not req["all_succeeded"]
        failed_lines = [ln for ln in r.output.splitlines() if ln.startswith("FAILED: ")]
        assert failed_lines and f"FAILED: {26 // 5} of 26 requests" in failed_lines[0]
        assert "without any output tokens" in failed_lines[0] and failed_lines[0] in md


def test_bench_repeat_measures_each_level_again_on_new_prompts(server, tmp_path, monkeypatch):
    import contextlib

    from click.testing import CliRunner

    from serve import cli

    srv, url = server
    srv.mode, srv.lose_every = "ok", 0
    monkeypatch.setattr(cli.launch, "running", lambda *a, **k: contextlib.nullcontext())  # no vLLM
    pkg, base = _fake_package(tmp_path / "pruned-pkg", 1.5), _fake_package(tmp_path / "dense-pkg", 1.0)
    r = CliRunner().invoke(cli.bench, [str(pkg), "--baseline", str(base), "--concurrency", "2", "--requests", "4",
                                       "--rounds", "1", "--repeat", "3", "--prompt-tokens", "8", "--output-tokens", "3",
                                       "--port", str(srv.server_address[1]), "--out", str(tmp_path / "b")],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    saved = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert [len(saved["runs"][label]["2"]) for label in ("dense", "pruned")] == [3, 3]
    assert saved["summary"]["best"]["pruned"]["2"]["rounds"] == 3 and saved["meta"]["repeat"] == 3
    prompts = [b["prompt"] for b in srv.bodies]
    assert len(prompts) == 2 * (2 + 3 * 4)  # warm-up, then three measurements of four requests, each model
    measured = [tuple(p) for p in prompts[2:14]]
    assert len(set(measured)) == 12  # no prompt again within a server's life: no prefix-cache hit
    r = CliRunner().invoke(cli.bench, [str(pkg), "--repeat", "0"])
    assert r.exit_code == 2 and "--repeat must be >= 1" in r.output


def test_bench_interleave_runs_both_servers_at_once_and_pairs_neighbours(tmp_path, monkeypatch):
    """--interleave: both servers up together (the package's at port + 1), started anew each round in
    alternating order, measurements alternating one by one with the same prompts to each; under a
    drift that halves the machine's speed from one pair to the next, the paired median still finds
    the package's 1.5x."""
    import contextlib

    from click.testing import CliRunner

    from serve import cli
    started, calls, events = [], [], []

    @contextlib.contextmanager
    def running(cmd, env, base_url, log_path, timeout_s=600, api_key=None):
        port = cmd[cmd.index("--port") + 1]
        started.append((port, base_url, log_path.name))
        events.append(("up", port))
        try:
            yield None
        finally:
            events.append(("down", port))

    def run_load(base_url, model, spec, vocab, seed=0, api_key=None):
        m = sum(c[2] == 8 for c in calls)  # measurements so far: a pair shares the machine's speed
        calls.append((base_url, model, spec.num_requests, seed))
        speed = (150.0 if base_url.endswith(":9001") else 100.0) * 0.5 ** (m // 2 % 2)
        return _run(speed, 10, 5, 100, spec.concurrency)
    monkeypatch.setattr(cli.launch, "running", running)
    monkeypatch.setattr(cli.loadgen, "run_load", run_load)
    pkg, base = _fake_package(tmp_path / "pruned-pkg", 1.5), _fake_package(tmp_path / "dense-pkg", 1.0)
    r = CliRunner().invoke(cli.bench, [str(pkg), "--baseline", str(base), "--concurrency", "4", "--rounds", "2",
                                       "--repeat", "2", "--port", "9000", "--interleave", "--out", str(tmp_path / "b")],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert started == [("9000", "http://127.0.0.1:9000", "server-dense-1.log"),
                       ("9001", "http://127.0.0.1:9001", "server-pruned-1.log"),
                       ("9001", "http://127.0.0.1:9001", "server-pruned-2.log"),  # round 2: the other first
                       ("9000", "http://127.0.0.1:9000", "server-dense-2.log")]
    measured = [c for c in calls if c[2] == 8]  # a warm-up sends 4 requests (the top level's), a measurement 8
    assert events == [("up", "9000"), ("up", "9001"), ("down", "9001"), ("down", "9000"),  # both up together,
                      ("up", "9001"), ("up", "9000"), ("down", "9000"), ("down", "9001")]  # both down each round
    assert [c[0][-4:] for c in measured] == ["9000", "9001", "9001", "9000", "9001", "9000", "9000", "9001"]
    assert [c[3] for c in measured[0::2]] == [c[3] for c in measured[1::2]]  # the same prompts to both
    saved = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert saved["meta"]["interleave"] is True and len(saved["runs"]["pruned"]["4"]) == 4
    assert saved["summary"]["ratios"]["pruned"]["4"]["paired"]["median"] == pytest.approx(1.5)
    md = (tmp_path / "b" / "bench.md").read_text()
    assert "1.50× (1.50–1.50, 4)" in md and "Interleaved (--interleave)" in md

    # a failure while measuring stops both servers; --port inside --vllm-args is refused in one line
    events.clear()

    def failing(*a, **k):
        raise RuntimeError("server gone")
    monkeypatch.setattr(cli.loadgen, "run_load", failing)
    with pytest.raises(RuntimeError, match="server gone"):
        CliRunner().invoke(cli.bench, [str(pkg), "--baseline", str(base), "--port", "9000", "--interleave",
                                       "--out", str(tmp_path / "c")], catch_exceptions=False)
    assert events == [("up", "9000"), ("up", "9001"), ("down", "9001"), ("down", "9000")]
    for args in ("--port 9005", "--port=9005"):
        r = CliRunner().invoke(cli.bench, [str(pkg), "--baseline", str(base), "--vllm-args", args])
        assert r.exit_code == 2 and "must not set --port" in r.output and len(r.output.strip().splitlines()) == 1


def test_bench_takes_a_model_directory_another_tool_wrote(tmp_path, tiny_dirs):
    """llm-compressor's W8A8 directory has no manifest: bench serves it with the packages' engine
    arguments, needs a --baseline for it (one line otherwise), and knows no ideal ratio for it."""
    from click.testing import CliRunner

    from serve.cli import MODEL_DIR_ARGS, _manifest_or_model, bench, ideal_ratio
    m, model_dir = _manifest_or_model(str(tiny_dirs["llama"]))
    assert model_dir and m.engine.args == MODEL_DIR_ARGS and "--dtype" in MODEL_DIR_ARGS
    assert ideal_ratio(m, None) is None
    r = CliRunner().invoke(bench, [str(tiny_dirs["llama"])])
    assert r.exit_code == 2 and "name its --baseline" in r.output and len(r.output.strip().splitlines()) == 1
    peer = tmp_path / "peer"
    peer.mkdir()
    (peer / "config.json").write_text('{"quantization_config": {"format": "int-quantized"}}')
    quantized = Manifest(size={"ideal_ratio": 1.33, "ideal_ratio_quantized": 2.08})
    assert ideal_ratio(quantized, None, peer) is None
    assert ideal_ratio(quantized, None) == 2.08
