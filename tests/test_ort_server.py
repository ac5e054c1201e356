"""The ONNX package's server (runtime/ort_server.py) over HTTP: the answers, the API key, the limits,
bad input, clients that leave, SIGTERM.

A tiny random model exported as a package (tests/test_onnx.py's helpers), served by the package's
own copy of the server through its launch.sh in a subprocess, without this project on the path: a
real uvicorn on a free port, reached with http.client, raw sockets (a Content-Length that lies) and
the OpenAI Python client. What cannot be provoked over a socket on one machine (a client that stops
reading: the kernel buffers a whole answer) is checked on the ASGI application directly.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from serve.loadgen import wait_for_server
from tests.test_onnx import _free_port, _hf_greedy, _package, lively

KEY = "test-key-9c1f"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def package(tmp_path_factory, tokenizer):
    model = lively("llama", vocab_size=len(tokenizer))
    return _package(tmp_path_factory.mktemp("ort-server"), model, tokenizer, name="lively"), model


def _start(pkg: Path, log: Path, *args: str) -> tuple[subprocess.Popen, int]:
    """The package's launch.sh, as a user runs it: its own ort_server.py copy, no project on the path."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_API_KEY")}
    env["PYTHON"] = sys.executable
    proc = subprocess.Popen(["sh", str(pkg / "launch.sh"), "--host", "127.0.0.1", "--port", str(port),
                             "--threads", "1", *args], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_for_server(f"http://127.0.0.1:{port}", 120, proc=proc, api_key=KEY)
    except RuntimeError:
        proc.kill()
        raise RuntimeError(log.read_text()[-3000:]) from None
    return proc, port


@pytest.fixture(scope="module")
def server(package, tmp_path_factory):
    """One server for the module: a batch of 2 and 2 waiting, so that the waiting bound is reachable;
    short read and write time-outs."""
    pkg, model = package
    log = tmp_path_factory.mktemp("ort-server-log") / "server.log"
    proc, port = _start(pkg, log, "--api-key", KEY, "--max-batch", "2", "--max-waiting", "2",
                        "--read-timeout", "2", "--write-timeout", "2")
    yield port, model, log
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


def _request(port: int, method: str, path: str, body=None, headers=AUTH, timeout=60) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def _post(port: int, path: str, body, headers=AUTH) -> tuple[int, dict]:
    status, _, data = _request(port, "POST", path, body, headers)
    if status == 200 and isinstance(body, dict) and body.get("stream"):
        return status, [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
    return status, json.loads(data)


def _metrics(port: int) -> dict[str, float]:
    _, _, data = _request(port, "GET", "/metrics")
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in data.decode().splitlines() if line and not line.startswith("#")}


def _still_serving(port: int) -> None:
    status, out = _post(port, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
    assert status == 200 and out["usage"]["completion_tokens"] == 2, out


def _raw(port: int, data: bytes, read_timeout: float = 10, then: bytes | None = None,
         then_after: tuple[float, bytes] | None = None) -> bytes:
    """Send bytes on a fresh socket (`then` right after, or `then_after` = (seconds, bytes)) and read
    what comes back until a JSON answer is complete, the server closes or it goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as s:
        s.sendall(data)
        if then_after is not None:
            time.sleep(then_after[0])
            then = then_after[1]
        if then is not None:
            try:
                s.sendall(then)
            except OSError:  # the server answered and closed while we were still sending
                pass
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and out.split(b"\r\n\r\n", 1)[1].endswith(b"}"):
                    break
        except (socket.timeout, ConnectionResetError):
            pass
        return out


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else 0


# --------------------------------------------------------------------------------------------
# answers


def test_greedy_answers_are_the_engines(server, tokenizer):
    """Whole and streamed, text and token-id prompts: transformers' greedy tokens (the engine's,
    tests/test_onnx.py), as the earlier server answered."""
    port, model, _ = server
    prompt = "The capital of France is"
    ids = tokenizer(prompt)["input_ids"]
    want = tokenizer.decode(_hf_greedy(model, ids, 12), skip_special_tokens=True)
    body = {"model": "lively", "prompt": prompt, "max_tokens": 12, "min_tokens": 12, "ignore_eos": True,
            "temperature": 0}
    status, whole = _post(port, "/v1/completions", body)
    assert status == 200 and whole["choices"][0]["text"] == want and whole["object"] == "text_completion"
    assert whole["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}
    assert _post(port, "/v1/completions", {**body, "prompt": ids})[1]["choices"][0]["text"] == want
    status, events = _post(port, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def _pieces(detok, ids: list[int]) -> tuple[list[str], bool]:
    out = []
    for t in ids:
        delta, stopped = detok.add(t)
        out.append(delta)
        if stopped:
            return out, True
    delta, stopped = detok.flush()
    return out + [delta], stopped


def test_the_detokenizer_writes_what_the_whole_decode_writes(tokenizer):
    """Piece by piece (each token decoded in a short window, not all again) the text is the whole
    decode's: spaces, merges, characters split across tokens (released whole, or as U+FFFD when
    the answer ends inside one, as vLLM sends it), random ids included."""
    import random

    from runtime.ort_server import Detokenizer
    tok = tokenizer.backend_tokenizer  # the `tokenizers` object the server uses
    rng = random.Random(0)
    texts = ["The capital of France is Paris.  Its   spaces\n\nand lines", "naïve café — 東京 🙂🙂 x",
             "def f(x):\n    return x ** 2"]
    cases = [tok.encode(t).ids for t in texts]
    cases += [[rng.randrange(tok.get_vocab_size()) for _ in range(40)] for _ in range(20)]
    emoji = tok.encode("🙂").ids
    assert len(emoji) > 1  # a character split across tokens
    cases.append(tok.encode("ok ").ids + emoji[:-1])  # the answer ends inside it
    for ids in cases:
        pieces, stopped = _pieces(Detokenizer(tok, []), ids)
        assert not stopped and "".join(pieces) == tok.decode(ids, skip_special_tokens=True), ids
    assert _pieces(Detokenizer(tok, []), cases[-1])[0][-1].endswith("\ufffd")


def test_a_stop_string_split_across_tokens_is_never_partly_sent(tokenizer):
    from runtime.ort_server import Detokenizer
    tok = tokenizer.backend_tokenizer
    text = "Hello there, general Kenobi. You are a bold one."
    ids = tok.encode(text).ids
    for stop in ["general Kenobi", "o", "bold one.", ". Y", "absent"]:
        detok = Detokenizer(tok, ["zzz", stop])
        pieces, stopped = _pieces(detok, ids)
        i = text.find(stop)
        assert "".join(pieces) == (text[:i] if i >= 0 else text) and stopped == (i >= 0)
        if stopped:
            assert detok.stopped_by == stop
            # the tokens used: as many as it took the whole decode to contain the stop string
            assert detok.used == next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))


def test_a_stop_string_ends_the_answer_with_its_reason_and_usage(server, tokenizer):
    port, model, _ = server
    ids = tokenizer("The capital of France is")["input_ids"]
    gen = _hf_greedy(model, ids, 24)
    want = tokenizer.decode(gen, skip_special_tokens=True)
    stop = want[len(want) // 2:len(want) // 2 + 3]
    used = next(k for k in range(1, len(gen) + 1) if stop in tokenizer.decode(gen[:k], skip_special_tokens=True))
    body = {"prompt": ids, "max_tokens": 24, "min_tokens": 24, "ignore_eos": True, "temperature": 0, "stop": stop}
    _, whole = _post(port, "/v1/completions", body)
    choice = whole["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (want[:want.index(stop)], "stop", stop)
    assert whole["usage"]["completion_tokens"] == used
    _, events = _post(port, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want[:want.index(stop)]
    assert chunks[-2]["choices"][0]["stop_reason"] == stop and chunks[-1]["usage"]["completion_tokens"] == used
    _, plain = _post(port, "/v1/completions", {**body, "stop": None})
    assert plain["choices"][0]["stop_reason"] is None and plain["usage"]["completion_tokens"] == 24


def test_chat_renders_the_packages_template(server, tokenizer):
    port, model, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    want = tokenizer.decode(_hf_greedy(model, list(ids), 10), skip_special_tokens=True)
    body = {"model": "lively", "messages": messages, "max_tokens": 10, "min_tokens": 10, "ignore_eos": True,
            "temperature": 0}
    status, out = _post(port, "/v1/chat/completions", body)
    assert status == 200 and out["object"] == "chat.completion", out
    assert out["choices"][0]["message"] == {"role": "assistant", "content": want, "tool_calls": []}
    assert out["usage"]["prompt_tokens"] == len(ids)
    # content as a list of text parts is the same message
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    out = _post(port, "/v1/chat/completions", {**body, "messages": parts})[1]
    assert out["choices"][0]["message"]["content"] == want
    status, events = _post(port, "/v1/chat/completions", {**body, "stream": True,
                                                          "stream_options": {"include_usage": True}})
    chunks = [json.loads(e) for e in events[:-1]]
    assert status == 200 and events[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == want
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    port, _, _ = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["lively"]
    whole = client.completions.create(model="lively", prompt="Hello", max_tokens=5, temperature=0)
    streamed = client.completions.create(model="lively", prompt="Hello", max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="lively", messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 6
    stream = client.chat.completions.create(model="lively", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="lively", prompt="Hello", max_tokens=100_000)


# --------------------------------------------------------------------------------------------
# the key


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
def test_every_route_but_health_needs_the_key(server, headers):
    port, _, _ = server
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/nowhere")):
        status, _, data = _request(port, method, path, {"prompt": "x"} if method == "POST" else None, headers)
        assert status == 401 and json.loads(data)["error"]["code"] == 401, (method, path)
    assert _request(port, "GET", "/health", headers={})[0] == 200
    _still_serving(port)


def test_the_load_generator_sends_the_key(server):
    """What `bench --api-key` runs: serve/loadgen.py with the key; without it every request is lost."""
    from serve import loadgen
    port, _, _ = server
    spec = loadgen.LoadSpec(concurrency=2, num_requests=4, prompt_tokens=8, output_tokens=4)
    res = loadgen.run_load(f"http://127.0.0.1:{port}", "lively", spec, vocab_size=49152, api_key=KEY)
    assert res["completed"] == 4 and res["failed"] == 0, res["errors"]
    res = loadgen.run_load(f"http://127.0.0.1:{port}", "lively", spec, vocab_size=49152)
    assert res["failed"] == 4 and "HTTP 401" in res["errors"][0]


def test_log_has_a_line_per_request_and_never_the_key(server):
    port, _, log = server
    _request(port, "GET", "/v1/models", headers={"Authorization": "Bearer not-the-key-either"})
    # the request id comes back (a plain token only: it goes into a response header)
    assert _request(port, "GET", "/health", headers={"X-Request-Id": "abc-123"})[1]["x-request-id"] == "abc-123"
    assert len(_request(port, "GET", "/health", headers={"X-Request-Id": "not one; " * 20})[1]["x-request-id"]) == 32
    _still_serving(port)
    text = log.read_text()
    assert KEY not in text and "not-the-key-either" not in text
    assert "GET /v1/models 401" in text and "POST /v1/completions 200" in text and "3 prompt + 2 completion" in text


# --------------------------------------------------------------------------------------------
# bad input: each one answered with its status and an OpenAI error body, the server still serving

BAD = [
    ("not JSON", "/v1/completions", b"{prompt: hello", 400, "not valid JSON"),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "not valid JSON"),
    ("a JSON array", "/v1/completions", [1, 2, 3], 400, "JSON object"),
    ("empty body", "/v1/completions", b"", 400, "not valid JSON"),
    ("deeply nested", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "JSON"),
    ("max_tokens a string", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("temperature a bool", "/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature"),
    ("stream a number", "/v1/completions", {"prompt": "x", "stream": 1}, 400, "stream"),
    ("prompt a number", "/v1/completions", {"prompt": 42}, 400, "'prompt' must be"),
    ("no prompt", "/v1/completions", {"max_tokens": 3}, 400, "'prompt' must be"),
    ("two prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("huge max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 10 ** 30}, 400, "maximum context length"),
    ("max_tokens past the context", "/v1/completions", {"prompt": "x", "max_tokens": 10_000}, 400,
     "maximum context length"),
    ("a prompt past the context", "/v1/completions", {"prompt": [7] * 300}, 400, "maximum context length"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("top_p of 0", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("negative seed", "/v1/completions", {"prompt": "x", "seed": -3}, 400, "seed"),
    ("NaN", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "finite"),
    ("a token id past the vocabulary", "/v1/completions", {"prompt": [10 ** 9]}, 400, "token ids"),
    ("negative token id", "/v1/completions", {"prompt": [-1, 5]}, 400, "token ids"),
    ("min_tokens over max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400,
     "min_tokens"),
    ("unknown field", "/v1/completions", {"prompt": "x", "temprature": 0}, 400, "temprature: unknown field"),
    ("stream_options without stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, "only be defined when `stream=True`"),
    ("unsupported n", "/v1/completions", {"prompt": "x", "n": 2}, 400, "'n' = 2 is not supported"),
    ("unsupported penalty", "/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("another model", "/v1/completions", {"prompt": "x", "model": "other"}, 404, "does not exist"),
    ("lone surrogate", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "tokenized"),
    ("messages a string", "/v1/chat/completions", {"messages": "hello"}, 400, "messages: Input should be a valid list"),
    ("messages of numbers", "/v1/chat/completions", {"messages": [1, 2]}, 400, "messages.0"),
    ("messages empty", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("a message without a role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "role"),
    ("an image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "only text content parts"),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}]}, 400,
     "'tools'"),
    ("chat max_tokens past the context", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400, "maximum context length"),
    ("a prompt on the chat route", "/v1/chat/completions", {"prompt": "hi"}, 400, "unknown field"),
]


@pytest.mark.parametrize("name,path,body,status,message", BAD, ids=[b[0] for b in BAD])
def test_bad_bodies(server, name, path, body, status, message):
    port, _, _ = server
    got, _, data = _request(port, "POST", path, body)
    error = json.loads(data)["error"]
    assert got == status and error["code"] == status and message in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def test_bad_bodies_leave_the_server_serving(server):
    port, _, _ = server
    for _, path, body, _, _ in BAD:
        _request(port, "POST", path, body)
    _still_serving(port)
    assert _request(port, "GET", "/v1/nothing")[0] == 404
    assert _request(port, "GET", "/v1/completions")[0] == 405


def test_a_10_mb_body_is_refused_before_it_is_read(server):
    port, _, _ = server
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {10 * 2 ** 20}\r\n\r\n").encode()
    raw = _raw(port, head)  # the headers only: the answer comes before any of the body is sent
    assert _status(raw) == 413 and b"limit of 1048576 bytes" in raw and b"connection: close" in raw.lower()
    # the whole 10 MB sent at once: the answer is the same, and the connection closed
    raw = _raw(port, head, then=b'{"prompt": "' + b"x" * (10 * 2 ** 20 - 14) + b'"}')
    assert _status(raw) == 413
    _still_serving(port)


def test_a_body_over_the_cap_without_content_length_is_refused_while_read(server):
    port, _, _ = server
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    chunk = b"x" * 65536
    body = (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 20  # 1.25 MiB, over the 1 MiB cap
    raw = _raw(port, head, then=body)
    assert _status(raw) == 413, raw[:300]
    _still_serving(port)


def test_a_content_length_that_lies(server):
    port, _, _ = server
    body = b'{"prompt": [5, 6], "max_tokens": 2}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Length: {n}\r\n\r\n")
    # more announced than sent: the body never completes, the read time-out (2 s here) answers
    t0 = time.monotonic()
    raw = _raw(port, head.format(n=len(body) + 100).encode() + body)
    assert _status(raw) == 408 and 1.5 < time.monotonic() - t0 < 10
    # less announced than sent: the body is cut short, the rest is no HTTP request: 400, from
    # uvicorn's parser when both arrive together, from the route (not JSON) when the rest comes later
    raw = _raw(port, head.format(n=10).encode() + body)
    assert _status(raw) == 400 and b"connection: close" in raw.lower()
    raw = _raw(port, head.format(n=10).encode() + body[:10], then_after=(0.5, body[10:]))
    assert _status(raw) == 400 and b"not valid JSON" in raw
    _still_serving(port)


# --------------------------------------------------------------------------------------------
# clients that leave, too many clients


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    port, _, _ = server
    before = _metrics(port)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 250, "ignore_eos": True, "temperature": 0, "stream": True})
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        got = b""
        while got.count(b"data: ") < 3:
            got += s.recv(4096)
    deadline = time.monotonic() + 5
    while (m := _metrics(port))["ort_server_requests_in_flight"] or m["ort_server_requests_running"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.02)
    assert m["ort_server_requests_cancelled_total"] == before["ort_server_requests_cancelled_total"] + 1
    assert m["ort_server_generation_tokens_total"] - before["ort_server_generation_tokens_total"] < 250
    _still_serving(port)


def test_a_client_that_leaves_before_its_answer_is_counted_499_not_500(server):
    """Not the server's error: no 5xx on a client's time-out (nginx's "client closed request")."""
    port, _, _ = server
    key = 'ort_server_requests_total{route="/v1/completions",status="499"}'
    before = _metrics(port).get(key, 0)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 250, "ignore_eos": True, "temperature": 0})
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        time.sleep(0.3)  # admitted and generating, then gone
    deadline = time.monotonic() + 10
    while _metrics(port).get(key, 0) == before:
        assert time.monotonic() < deadline, _metrics(port)
        time.sleep(0.05)
    assert not any(k.startswith("ort_server_requests_total") and 'status="5' in k for k in _metrics(port))
    _still_serving(port)


def test_requests_past_the_waiting_bound_get_503_with_retry_after(server):
    """Batch 2 + 2 waiting: of 8 long requests at once, 4 run or wait and 4 are refused at once."""
    port, _, _ = server
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    results, start = [], threading.Barrier(8)

    def one():
        start.wait()
        status, headers, data = _request(port, "POST", "/v1/completions", body)
        results.append((status, headers.get("retry-after"), json.loads(data)))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(s for s, _, _ in results)
    assert statuses.count(200) >= 4 and set(statuses) <= {200, 503}, statuses
    refused = [r for r in results if r[0] == 503]
    assert refused and all(retry == "1" and "at capacity" in obj["error"]["message"] for _, retry, obj in refused)
    assert all(obj["usage"]["completion_tokens"] == 200 for s, _, obj in results if s == 200)
    _still_serving(port)


def test_a_client_that_stops_reading_is_cancelled(package):
    """On the ASGI application: a send that never returns (a client whose buffers are full) times out,
    the engine drops the request and the slot is free again."""
    from runtime.ort_server import Limits, Service, build_app
    pkg, _ = package
    service = Service(pkg, threads=1, max_batch=2)
    app = build_app(service, api_key=None, limits=Limits(write_timeout=0.5))
    front = app.state.front
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    sent = []

    async def run():
        gone = asyncio.Event()  # never set: the client stays connected
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await gone.wait()

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and len(sent) >= 3:
                await asyncio.Event().wait()  # the socket is full: this write never completes

        t0 = time.monotonic()
        await asyncio.wait_for(app(scope, receive, send), 30)
        return time.monotonic() - t0

    assert asyncio.run(run()) < 10
    assert sent[0]["status"] == 200 and front.in_flight == 0 and front.metrics.cancelled == 1
    deadline = time.monotonic() + 5
    while service.engine.rows:  # dropped at the engine's next step
        assert time.monotonic() < deadline
        time.sleep(0.01)


# --------------------------------------------------------------------------------------------
# SIGTERM


def test_sigterm_finishes_the_requests_in_flight(package, tmp_path):
    pkg, _ = package
    proc, port = _start(pkg, tmp_path / "server.log", "--api-key", KEY)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        got = s.recv(4096)
        proc.send_signal(signal.SIGTERM)  # (launch.sh execs python: the signal reaches the server)
        at_signal = got.count(b"data: ")
        deadline = time.monotonic() + 10
        while True:  # no new connections once it stops (within a tick of its loop)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
            except OSError:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        while chunk := s.recv(65536):
            got += chunk
    # the answer was in flight when the signal came, and finished: all 200 tokens, [DONE], the last chunk
    assert at_signal < 100 and got.rstrip().endswith(b"0") and b"data: [DONE]" in got
    assert b'"completion_tokens": 200' in got
    # uvicorn raises the signal again once it has shut down, so the exit status says SIGTERM
    assert proc.wait(30) in (0, -signal.SIGTERM)
    log = (tmp_path / "server.log").read_text()
    assert "POST /v1/completions 200" in log and "Finished server process" in log
