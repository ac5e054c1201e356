"""OpenAI-compatible completions server for an ONNX package: onnxruntime + a batching loop.

    python -m runtime.ort_server PACKAGE --host 127.0.0.1 --port 8000

Why our own server: onnxruntime runs a graph, not a service, and the ONNX package must answer
the same `/v1/completions` requests as the vLLM one so that `bench` and `serve/loadgen.py`
measure both the same way. The subset implemented is what clients and the load generator
use: `prompt` (text or token ids), `max_tokens`, `min_tokens`, `ignore_eos`, `temperature`
(0 = greedy, else sampling with `top_p` / `top_k` / `seed`), `stop`, `stream` (SSE chunks,
`data: [DONE]`, and a usage chunk with `stream_options.include_usage`); `GET /v1/models`.

One engine thread owns the session and runs continuous batching: a new request is prefilled
alone, then joins the running batch, whose KV cache is left-padded to a common length (the
graph masks padding through `attention_mask`); every step decodes one token for every
running request, so concurrent requests share each pass over the weights — what makes
decode faster at concurrency > 1 on a memory-bound CPU. HTTP threads only tokenize,
detokenize and write.

This file depends on nothing else in the project (numpy, onnxruntime, tokenizers and the
standard library only) so that a package can carry a copy of it and serve without the tool.
"""

from __future__ import annotations

import argparse
import json
import queue
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import onnxruntime as ort

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class OrtDecoder:
    """An exported decoder (our names: input_ids, attention_mask, position_ids, past/present) in a session."""

    def __init__(self, path: str | Path, threads: int | None = None, providers: list[str] | None = None,
                 optimized: bool = True):
        opts = ort.SessionOptions()
        if not optimized:  # the graph's operators as written, none fused (the exporter's exact INT8 check)
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), opts, providers=providers or ["CPUExecutionProvider"])
        inputs = self.session.get_inputs()
        self.past_names = [i.name for i in inputs if i.name.startswith("past_key_values.")]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.kv_shapes = [(i.shape[1], i.shape[3]) for i in inputs if i.name.startswith("past_key_values.")]
        self.kv_dtype = _NP[next(i.type for i in inputs if i.name.startswith("past_key_values."))]
        self.vocab_size = self.session.get_outputs()[0].shape[-1]

    def empty_past(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, kv, 0, d), self.kv_dtype) for kv, d in self.kv_shapes]

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {"input_ids": input_ids.astype(np.int64), "attention_mask": attention_mask.astype(np.int64),
                 "position_ids": position_ids.astype(np.int64), **dict(zip(self.past_names, past))}
        out = self.session.run(None, feeds)
        return out[0], out[1:]

    def prefill(self, prompt: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Last-position logits (float32) and the cache of one prompt."""
        n = len(prompt)
        logits, past = self.run(np.array([prompt]), np.ones((1, n)), np.arange(n)[None], self.empty_past(1))
        return logits[0, -1].astype(np.float32), past

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
        """n greedy tokens (EOS not special) and each step's logits: the validation's generation loop."""
        logits, past = self.prefill(prompt)
        tokens, steps, pos = [], [], len(prompt)
        for _ in range(n):
            steps.append(logits)
            tokens.append(int(np.argmax(logits)))
            if len(tokens) == n:
                break
            out, past = self.run(np.array([[tokens[-1]]]), np.ones((1, pos + 1)), np.array([[pos]]), past)
            logits, pos = out[0, -1].astype(np.float32), pos + 1
        return tokens, steps


# --------------------------------------------------------------------------------------------
# sampling


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    def pick(self, logits: np.ndarray) -> int:
        if self.temperature < 1e-5:
            return int(np.argmax(logits))
        x = logits.astype(np.float64) / self.temperature
        if 0 < self.top_k < x.size:
            x[x < np.partition(x, -self.top_k)[-self.top_k]] = -np.inf
        p = np.exp(x - x.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p)
            keep = np.cumsum(p[order]) - p[order] < self.top_p  # the smallest set reaching top_p
            mask = np.zeros_like(p, dtype=bool)
            mask[order[keep]] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        return int(self.rng.choice(p.size, p=p))


# --------------------------------------------------------------------------------------------
# engine: one thread, continuous batching


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    min_tokens: int = 0
    ignore_eos: bool = False
    out: queue.Queue = field(default_factory=queue.Queue)   # ("token", id) ... ("done", reason) | ("error", msg)
    cancelled: bool = False
    generated: list[int] = field(default_factory=list)
    pos: int = 0          # next position id = tokens in the context so far


class Engine:
    def __init__(self, decoder: OrtDecoder, eos_ids: set[int], max_batch: int = 8):
        self.dec, self.eos, self.max_batch = decoder, eos_ids, max_batch
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.rows: list[Request] = []
        self.past: list[np.ndarray] = []
        self.mask = np.zeros((0, 0), np.int64)
        self.thread = threading.Thread(target=self._loop, name="ort-engine", daemon=True)
        self.thread.start()

    def submit(self, req: Request) -> Request:
        self.inbox.put(req)
        return req

    def _loop(self) -> None:
        while True:
            try:
                self._admit()
                if self.rows:
                    self._decode_step()
            except Exception as e:  # a failed run fails the requests in flight, not the server
                msg = f"{type(e).__name__}: {e}"
                for r in self.rows:
                    r.out.put(("error", msg))
                self.rows, self.past, self.mask = [], [], np.zeros((0, 0), np.int64)

    def _admit(self) -> None:
        while len(self.rows) < self.max_batch:
            try:
                req = self.inbox.get(block=not self.rows)
            except queue.Empty:
                return
            if req.cancelled:
                continue
            try:
                logits, past = self.dec.prefill(req.prompt)
            except Exception as e:
                req.out.put(("error", f"{type(e).__name__}: {e}"))
                continue
            req.pos = len(req.prompt)
            if not self._emit(req, logits):
                self._join(req, past)

    def _emit(self, req: Request, logits: np.ndarray) -> bool:
        """Pick and send the next token; True when the request is finished."""
        if self.eos and len(req.generated) < req.min_tokens:
            logits = logits.copy()
            logits[list(self.eos)] = -np.inf
        tok = req.sampling.pick(logits)
        req.generated.append(tok)
        req.out.put(("token", tok))
        if tok in self.eos and not req.ignore_eos:
            req.out.put(("done", "stop"))
            return True
        if len(req.generated) >= req.max_tokens:
            req.out.put(("done", "length"))
            return True
        return req.cancelled

    def _join(self, req: Request, past: list[np.ndarray]) -> None:
        t = past[0].shape[2]
        if not self.rows:
            self.rows, self.past, self.mask = [req], past, np.ones((1, t), np.int64)
            return
        T = max(t, self.mask.shape[1])
        self.past = [np.concatenate([_left_pad(a, T), _left_pad(b, T)]) for a, b in zip(self.past, past)]
        self.mask = np.concatenate([_left_pad(self.mask, T, axis=1), _left_pad(np.ones((1, t), np.int64), T, axis=1)])
        self.rows.append(req)

    def _decode_step(self) -> None:
        ids = np.array([[r.generated[-1]] for r in self.rows])
        pos = np.array([[r.pos] for r in self.rows])
        mask = np.concatenate([self.mask, np.ones((len(self.rows), 1), np.int64)], axis=1)
        logits, self.past = self.dec.run(ids, mask, pos, self.past)
        self.mask = mask
        keep = []
        for i, r in enumerate(self.rows):
            r.pos += 1
            if not self._emit(r, logits[i, -1].astype(np.float32)):
                keep.append(i)
        if len(keep) < len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            self.past = [p[keep] for p in self.past]
            self.mask = self.mask[keep]
            if self.rows:  # drop the columns that are padding for every remaining row
                first = int(np.argmax(self.mask.any(axis=0)))
                self.past = [p[:, :, first:] for p in self.past]
                self.mask = self.mask[:, first:]


def _left_pad(a: np.ndarray, length: int, axis: int = 2) -> np.ndarray:
    extra = length - a.shape[axis]
    if extra == 0:
        return a
    shape = list(a.shape)
    shape[axis] = extra
    return np.concatenate([np.zeros(shape, a.dtype), a], axis=axis)


# --------------------------------------------------------------------------------------------
# the package and the HTTP front


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class Service:
    """What the HTTP handler needs: the engine, the tokenizer, the names and limits."""

    def __init__(self, package: Path, served_name: str | None = None, threads: int | None = None,
                 max_batch: int = 8):
        from tokenizers import Tokenizer
        manifest = json.loads((package / "manifest.json").read_text())
        engine = manifest["engine"]
        self.warning = int8_saturation_warning(manifest)
        self.name = served_name or engine["served_model_name"]
        self.max_model_len = int(engine.get("max_model_len", 2048))
        providers = [p for p in engine.get("providers", []) if p in ort.get_available_providers()]
        self.decoder = OrtDecoder(package / engine.get("model_file", "model.onnx"), threads=threads,
                                  providers=providers or ["CPUExecutionProvider"])
        self.tokenizer = Tokenizer.from_file(str(package / "tokenizer.json"))
        self.eos = set(engine.get("eos_token_ids") or [])
        self.engine = Engine(self.decoder, self.eos, max_batch=max_batch)
        self.created = int(time.time())

    def parse(self, body: dict) -> tuple[Request, dict]:
        if body.get("model") not in (None, self.name):
            raise BadRequest(f"The model `{body.get('model')}` does not exist.", 404)
        for key, bad in (("n", lambda v: v not in (None, 1)), ("best_of", lambda v: v not in (None, 1)),
                         ("echo", bool), ("logprobs", lambda v: v is not None), ("suffix", bool)):
            if bad(body.get(key)):
                raise BadRequest(f"'{key}' is not supported by this server")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt).ids
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")
        if not ids or min(ids) < 0 or max(ids) >= self.decoder.vocab_size:
            raise BadRequest(f"prompt token ids must be in [0, {self.decoder.vocab_size}) and not empty")
        max_tokens = _int(body, "max_tokens", 16, lo=1)
        min_tokens = _int(body, "min_tokens", 0, lo=0)
        if min_tokens > max_tokens:
            raise BadRequest("min_tokens must not exceed max_tokens")
        if len(ids) + max_tokens > self.max_model_len:
            raise BadRequest(f"This model's maximum context length is {self.max_model_len} tokens; the request "
                             f"asks for {len(ids) + max_tokens} ({len(ids)} prompt + {max_tokens} completion)")
        temperature = _num(body, "temperature", 1.0, lo=0.0)
        top_p = _num(body, "top_p", 1.0, lo=1e-9, hi=1.0)
        top_k = _int(body, "top_k", -1, lo=-1)
        seed = body.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise BadRequest("'seed' must be an integer")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("'stop' must be a string or a list of strings")
        req = Request(ids, max_tokens, Sampling(temperature, top_p, top_k, seed), min_tokens=min_tokens,
                      ignore_eos=bool(body.get("ignore_eos", False)))
        stream_opts = body.get("stream_options") or {}
        return req, {"stream": bool(body.get("stream", False)), "stop": [s for s in stop if s],
                     "include_usage": bool(stream_opts.get("include_usage", False))}


def _num(body: dict, key: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (lo is not None and v < lo) or \
            (hi is not None and v > hi):
        raise BadRequest(f"'{key}' must be a number in [{lo}, {hi if hi is not None else 'inf'}], got {v!r}")
    return float(v)


def _int(body: dict, key: str, default: int, lo: int) -> int:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise BadRequest(f"'{key}' must be an integer >= {lo}, got {v!r}")
    return v


class Detokenizer:
    """Text of the generated ids so far, released only when it does not end in a partial character."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop, self.ids, self.sent = tokenizer, stop, [], ""

    def add(self, token: int) -> tuple[str, bool]:
        """The new text to send, and whether a stop string was reached (text cut before it)."""
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            i = text.find(s, max(0, len(self.sent) - len(s) + 1))
            if i >= 0:
                delta, self.sent = text[len(self.sent):i], text[:i]
                return delta, True
        if text.endswith("\ufffd"):
            return "", False
        delta, self.sent = text[len(self.sent):], text
        return delta, False


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive: the load generator reuses connections
    service: Service = None  # set by serve()

    def setup(self):
        super().setup()
        # Each SSE chunk is one small write: without TCP_NODELAY, Nagle's algorithm holds it until
        # the client's delayed ACK (~40 ms), which would show up as time to first token.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt, *args):  # one line per request is noise under load
        pass

    def do_GET(self):
        s = self.service
        if self.path.rstrip("/") == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": s.name, "object": "model", "created": s.created, "owned_by": "llm-deploy-optimizer",
                 "root": s.name, "max_model_len": s.max_model_len}]})
        elif self.path in ("/health", "/ping"):
            self._json(200, {})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self):
        if self.path.rstrip("/") != "/v1/completions":
            return self._error(404, f"no route {self.path}")
        try:
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"{}")
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            req, opts = self.service.parse(body)
        except ValueError as e:
            return self._error(400, f"invalid JSON: {e}")
        except BadRequest as e:
            return self._error(e.status, str(e))
        self.service.engine.submit(req)
        (self._stream if opts["stream"] else self._whole)(req, opts)

    # --- responses ---------------------------------------------------------------------
    def _events(self, req: Request, opts: dict):
        """(text delta, finish_reason or None) until the request finishes."""
        detok = Detokenizer(self.service.tokenizer, opts["stop"])
        while True:
            kind, value = req.out.get()
            if kind == "error":
                raise RuntimeError(value)
            if kind == "done":
                yield "", value
                return
            delta, stopped = detok.add(value)
            if stopped:
                req.cancelled = True
                yield delta, "stop"
                return
            yield delta, None

    def _whole(self, req: Request, opts: dict):
        cid, text, reason = f"cmpl-{uuid.uuid4().hex}", [], None
        try:
            for delta, reason in self._events(req, opts):
                text.append(delta)
        except RuntimeError as e:
            return self._error(500, str(e))
        self._json(200, {"id": cid, "object": "text_completion", "created": int(time.time()),
                         "model": self.service.name,
                         "choices": [{"index": 0, "text": "".join(text), "logprobs": None,
                                      "finish_reason": reason, "stop_reason": None}],
                         "usage": _usage(req)})

    def _stream(self, req: Request, opts: dict):
        cid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.service.name
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(obj) -> None:
            data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        try:
            try:
                for delta, reason in self._events(req, opts):
                    if delta or reason:
                        chunk({"id": cid, "object": "text_completion", "created": created, "model": name,
                               "choices": [{"index": 0, "text": delta, "logprobs": None,
                                            "finish_reason": reason, "stop_reason": None}]})
            except RuntimeError as e:
                chunk({"error": {"message": str(e), "type": "InternalServerError", "code": 500}})
            if opts["include_usage"]:
                chunk({"id": cid, "object": "text_completion", "created": created, "model": name,
                       "choices": [], "usage": _usage(req)})
            chunk("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            req.cancelled = True  # the engine drops it at its next step
            self.close_connection = True

    def _json(self, status: int, obj: dict):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str):
        kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
        self._json(status, {"error": {"message": message, "type": kind, "code": status}})


def _usage(req: Request) -> dict:
    n, m = len(req.prompt), len(req.generated)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def saturates_full_int8_grid(flags: set[str]) -> bool:
    """Whether onnxruntime's u8s8 MatMulInteger saturates with int8 weights on [-127, 127] on a CPU
    with these flags: x86 without VNNI, where it adds two uint8 x int8 products into a saturating
    int16 (VPMADDUBSW). No flags (not x86 Linux): taken as no."""
    return bool(flags) and not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}


def int8_saturation_warning(manifest: dict, flags: set[str] | None = None) -> str | None:
    """A warning for an INT8 package whose weights use onnxruntime's full int8 grid, served on a CPU
    where that saturates (`saturates_full_int8_grid`): its answers drift from those the package was
    validated with. A package built on such a CPU uses the reduced grid [-64, 64] (`int8_weight_max`)."""
    graph = manifest.get("onnx") or {}
    if not graph.get("int8_matmuls") or graph.get("int8_weight_max", 127) <= 64:
        return None
    if not saturates_full_int8_grid(_cpu_flags() if flags is None else flags):
        return None
    return ("warning: this INT8 package's weights use the full int8 grid and this CPU has no VNNI, where "
            "onnxruntime's kernel saturates: its answers drift from the validated ones. Rebuild the package "
            "on this machine (it then takes onnxruntime's reduced range) or serve it on a CPU with VNNI.")


def _cpu_flags() -> set[str]:
    """x86 Linux's CPU feature flags; empty elsewhere (this file runs inside a package, without the optimizer)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Serve an ONNX package with onnxruntime (OpenAI-compatible completions).")
    ap.add_argument("package", type=Path)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", help="Model name clients send (default: the manifest's).")
    ap.add_argument("--threads", type=int, help="onnxruntime intra-op threads (default: one per physical core).")
    ap.add_argument("--max-batch", type=int, default=8, help="Requests decoded together at most.")
    args = ap.parse_args(argv)
    if not (args.package / "manifest.json").is_file():
        sys.exit(f"error: {args.package}: not a package (no manifest.json)")
    Handler.service = Service(args.package.resolve(), args.served_model_name, args.threads, args.max_batch)
    if Handler.service.warning:
        print(Handler.service.warning, file=sys.stderr, flush=True)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"serving {Handler.service.name} on http://{args.host}:{args.port}/v1 (onnxruntime {ort.__version__}, "
          f"{args.package.resolve()})", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
