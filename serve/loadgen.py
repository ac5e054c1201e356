"""Load generator for an OpenAI-compatible ``/v1/completions`` endpoint (vLLM's server).

Standard library only: one ``http.client`` connection per worker thread, streaming SSE
responses, fixed output length (``min_tokens`` = ``max_tokens`` and ``ignore_eos``) so that
runs of a dense and a pruned model generate exactly the same amount of work.

Per request we record time to first token (TTFT), end-to-end latency (e2e), the number of
output tokens and time per output token (TPOT = (e2e - ttft) / (n_out - 1)); ``run_load``
aggregates them into throughput and p50/p99/mean latencies, and counts the requests sent,
succeeded and failed (a benchmark that loses requests must say so: see ``bench``).

With ``api_key`` every request carries ``Authorization: Bearer KEY``, as a server started with
``--api-key`` (vLLM's, or the onnxruntime server's) requires on every route but ``/health``.

A request succeeds when its stream ends with ``data: [DONE]`` and generated at least one token.
The token count is the final ``usage.completion_tokens`` (we always ask for it); only a server
that sends no usage falls back to counting chunks with text or token ids. A chunk's ``text`` can
be empty although it carries a token: vLLM streams one choice per engine step and its
incremental detokenizer holds back bytes that are not yet valid UTF-8 (a byte-level BPE token
that is part of a multi-byte character) and drops special tokens (``skip_special_tokens``), so
random-token prompts can make a whole stream of tokens show no text at all.
"""

from __future__ import annotations

import http.client
import json
import math
import queue
import random
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LoadSpec",
    "make_prompts",
    "run_load",
    "wait_for_server",
    "complete",
    "percentile",
]


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int
    num_requests: int  # total requests at this level (>= concurrency)
    prompt_tokens: int = 128
    output_tokens: int = 64

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.num_requests < self.concurrency:
            raise ValueError(
                f"num_requests ({self.num_requests}) must be >= concurrency ({self.concurrency})"
            )
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens must be >= 1")


# --------------------------------------------------------------------------------------------
# helpers


def percentile(values: list[float], p: float) -> float | None:
    """Percentile ``p`` (0..100) by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    k = (len(xs) - 1) * (p / 100.0)
    f = math.floor(k)
    c = min(f + 1, len(xs) - 1)
    return float(xs[f] + (xs[c] - xs[f]) * (k - f))


def _stats_ms(values_s: list[float]) -> dict[str, float | None]:
    ms = [v * 1000.0 for v in values_s]
    return {
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
        "mean": (sum(ms) / len(ms)) if ms else None,
    }


def make_prompts(n: int, prompt_tokens: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``n`` distinct random token-id prompts of ``prompt_tokens`` ids in ``[100, vocab_size-100)``.

    Random ids (rather than one repeated text) keep prefix caching from skipping prefill;
    the same ``seed`` always gives the same prompts.
    """
    lo, hi = 100, vocab_size - 100
    if hi <= lo:
        raise ValueError(f"vocab_size {vocab_size} too small (need > 200)")
    if prompt_tokens < 1:
        raise ValueError("prompt_tokens must be >= 1")
    space = hi - lo
    if prompt_tokens * math.log(space) < math.log(max(n, 1)):
        raise ValueError(f"cannot make {n} distinct prompts of {prompt_tokens} tokens")
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    while len(prompts) < n:
        p = [rng.randrange(lo, hi) for _ in range(prompt_tokens)]
        key = tuple(p)
        if key in seen:
            continue
        seen.add(key)
        prompts.append(p)
    return prompts


def _split_url(base_url: str) -> tuple[str, str, int | None, str]:
    u = urllib.parse.urlsplit(base_url.rstrip("/"))
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"bad base_url {base_url!r} (expected http(s)://host:port)")
    return u.scheme, u.hostname, u.port, u.path.rstrip("/")


def _connection(base_url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    scheme, host, port, prefix = _split_url(base_url)
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    return cls(host, port, timeout=timeout), prefix


def _headers(api_key: str | None, **extra: str) -> dict[str, str]:
    return {**extra, **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def _short(msg: str, limit: int = 300) -> str:
    msg = " ".join(msg.split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------
# server readiness / single completion


def wait_for_server(base_url: str, timeout_s: float, proc=None, api_key: str | None = None) -> None:
    """Poll ``GET {base_url}/v1/models`` until it answers 200.

    Raises RuntimeError as soon as ``proc`` (a ``subprocess.Popen``) has exited, or when
    ``timeout_s`` seconds pass without a 200.
    """
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"server process exited with code {proc.returncode} before {base_url} was ready"
            )
        remaining = deadline - time.monotonic()
        try:
            conn, prefix = _connection(base_url, timeout=max(0.2, min(5.0, remaining)))
            try:
                conn.request("GET", prefix + "/v1/models", headers=_headers(api_key))
                resp = conn.getresponse()
                resp.read()
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
            finally:
                conn.close()
        except (OSError, http.client.HTTPException) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise RuntimeError(f"server at {base_url} not ready after {timeout_s:g}s (last: {last})")
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def complete(
    base_url: str, model: str, prompt: str, max_tokens: int = 16, timeout_s: float = 300,
    api_key: str | None = None,
) -> str:
    """One non-streaming greedy completion; returns the generated text."""
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    ).encode()
    conn, prefix = _connection(base_url, timeout=timeout_s)
    try:
        conn.request(
            "POST", prefix + "/v1/completions", body=body,
            headers=_headers(api_key, **{"Content-Type": "application/json"}),
        )
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(
                f"completion failed: HTTP {resp.status}: {_short(data.decode('utf-8', 'replace'))}"
            )
        return json.loads(data)["choices"][0]["text"]
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------
# load run


@dataclass
class _Result:
    ok: bool
    t_start: float
    t_end: float
    ttft: float | None = None
    n_out: int = 0
    error: str | None = None
    sent: bool = True  # False: never sent (the run's deadline had passed)


class _StreamError(Exception):
    pass


_RETRYABLE_ON_REUSE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


def _one_request(conn: http.client.HTTPConnection, path: str, body: bytes, headers: dict[str, str]) -> _Result:
    """Send one streaming completion on ``conn`` and read the SSE stream to the end."""
    t0 = time.perf_counter()
    conn.request(
        "POST", path, body=body,
        headers=headers,
    )
    resp = conn.getresponse()
    if resp.status != 200:
        data = resp.read()
        raise _StreamError(f"HTTP {resp.status}: {_short(data.decode('utf-8', 'replace'))}")

    # TTFT is the arrival of the first chunk that carries a choice, whether its text is visible
    # or empty. In a /v1/completions stream vLLM sends a choice only for an engine step that
    # produced tokens, never an empty one before the first token ("Chunked prefill case, don't
    # return empty chunks" in vllm/entrypoints/openai/completion/serving.py), so that chunk is
    # the first token even when the detokenizer holds its text back; this is also the moment
    # vLLM's own TTFT metric measures. (The onnxruntime server sends a choice only with text or a
    # finish reason.) A stream whose usage reports tokens but that carried no choice at all gets
    # the arrival of its usage chunk.
    t_first: float | None = None
    t_usage: float | None = None
    token_chunks = 0  # chunks with visible text or token ids: the count when usage is absent
    usage_tokens: int | None = None
    done = False
    while True:
        raw = resp.readline()
        if not raw:
            break  # EOF
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments, "event:" lines
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            break
        now = time.perf_counter()
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError as e:
            raise _StreamError(f"bad SSE payload {payload[:100]!r}: {e}") from None
        if not isinstance(obj, dict):
            raise _StreamError(f"bad SSE payload {payload[:100]!r}: not a JSON object")
        if obj.get("error"):
            raise _StreamError(f"error in stream: {_short(json.dumps(obj['error']))}")
        for ch in obj.get("choices") or []:
            if t_first is None:
                t_first = now
            if ch.get("text") or ch.get("token_ids"):
                token_chunks += 1
        usage = obj.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            usage_tokens = int(usage["completion_tokens"])
            t_usage = now
    t_end = time.perf_counter()
    if not done:
        conn.close()
        raise _StreamError(
            f"stream ended before data: [DONE] ({token_chunks} chunks with text, "
            f"usage completion_tokens {usage_tokens})"
        )
    resp.read()  # drain the (chunked) body so the keep-alive connection can be reused
    n_out = usage_tokens if usage_tokens is not None else token_chunks
    if n_out <= 0:
        raise _StreamError(
            "stream ended without any output tokens "
            + ("(usage completion_tokens 0)" if usage_tokens is not None
               else "(no chunk with text and no usage)")
        )
    ttft = (t_first if t_first is not None else t_usage) - t0
    return _Result(ok=True, t_start=t0, t_end=t_end, ttft=ttft, n_out=n_out)


def run_load(
    base_url: str,
    model: str,
    spec: LoadSpec,
    vocab_size: int,
    seed: int = 0,
    timeout_s: float = 600,
    api_key: str | None = None,
) -> dict:
    """Send ``spec.num_requests`` streaming completions with ``spec.concurrency`` workers.

    Prompts come from ``make_prompts`` with a seed mixed from ``seed`` and the concurrency, so
    different concurrency levels on the same server don't reuse each other's prompts (prefix
    cache); use a different ``seed`` per round for the same reason.

    ``timeout_s`` is both the socket timeout of each request and the deadline of the whole run:
    requests not started by then are recorded as failed. ``api_key``: sent as a bearer token.
    """
    prompts = make_prompts(
        spec.num_requests, spec.prompt_tokens, vocab_size, seed=seed * 100_003 + spec.concurrency
    )
    headers = _headers(api_key, **{"Content-Type": "application/json", "Accept": "text/event-stream"})
    work: queue.Queue = queue.Queue()
    for p in prompts:
        work.put(p)
    results: list[_Result] = []
    lock = threading.Lock()
    run_start = time.perf_counter()
    deadline = run_start + timeout_s

    def body_for(prompt: list[int]) -> bytes:
        return json.dumps(
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": spec.output_tokens,
                "min_tokens": spec.output_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()

    def worker() -> None:
        conn: http.client.HTTPConnection | None = None
        path = ""
        used = 0  # requests already sent on the current connection
        while True:
            try:
                prompt = work.get_nowait()
            except queue.Empty:
                break
            if time.perf_counter() > deadline:
                now = time.perf_counter()
                res = _Result(False, now, now, error=f"run deadline of {timeout_s:g}s exceeded",
                              sent=False)
                with lock:
                    results.append(res)
                continue
            body = body_for(prompt)
            for attempt in range(2):
                if conn is None:
                    conn, prefix = _connection(base_url, timeout=timeout_s)
                    path = prefix + "/v1/completions"
                    used = 0
                t0 = time.perf_counter()
                try:
                    res = _one_request(conn, path, body, headers)
                    used += 1
                    break
                except _StreamError as e:
                    # the response may be partly unread: don't reuse this connection
                    res = _Result(False, t0, time.perf_counter(), error=str(e))
                    conn.close()
                    conn = None
                    break
                except Exception as e:  # connection errors, timeouts, protocol errors
                    conn.close()
                    conn = None
                    if attempt == 0 and used > 0 and isinstance(e, _RETRYABLE_ON_REUSE):
                        continue  # stale keep-alive connection: retry once on a fresh one
                    res = _Result(
                        False, t0, time.perf_counter(), error=_short(f"{type(e).__name__}: {e}")
                    )
                    break
            with lock:
                results.append(res)
        if conn is not None:
            conn.close()

    threads = [
        threading.Thread(target=worker, name=f"loadgen-{i}", daemon=True)
        for i in range(spec.concurrency)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    error_counts: dict[str, int] = {}
    for r in failed:
        error_counts[r.error or "unknown"] = error_counts.get(r.error or "unknown", 0) + 1
    # wall time: first send to last completion
    wall_s = (max(r.t_end for r in results) - min(r.t_start for r in results)) if results else 0.0
    total_out = sum(r.n_out for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    e2es = [r.t_end - r.t_start for r in ok]
    tpots = [
        (r.t_end - r.t_start - r.ttft) / (r.n_out - 1)
        for r in ok
        if r.ttft is not None and r.n_out > 1
    ]
    return {
        "concurrency": spec.concurrency,
        "num_requests": spec.num_requests,
        "prompt_tokens": spec.prompt_tokens,
        "output_tokens": spec.output_tokens,
        # num_requests == completed + failed; "sent" leaves out requests never sent because the
        # run's deadline had passed (they count as failed)
        "sent": sum(1 for r in results if r.sent),
        "completed": len(ok),
        "failed": len(failed),
        "errors": [r.error for r in failed[:3]],
        "error_counts": error_counts,  # each distinct error message and how many requests had it
        "wall_s": wall_s,
        "output_tokens_per_s": (total_out / wall_s) if wall_s > 0 else 0.0,
        "requests_per_s": (len(ok) / wall_s) if wall_s > 0 else 0.0,
        "ttft_ms": _stats_ms(ttfts),
        "tpot_ms": _stats_ms(tpots),
        "e2e_ms": _stats_ms(e2es),
    }
