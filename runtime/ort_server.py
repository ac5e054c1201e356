"""OpenAI-compatible server for an ONNX package: onnxruntime + a batching loop, behind FastAPI/uvicorn.

    python -m runtime.ort_server PACKAGE --host 127.0.0.1 --port 8000 [--api-key KEY]

Why our own server: onnxruntime runs a graph, not a service, and the ONNX package must answer
the same requests as the vLLM one so that `bench`, `serve/loadgen.py` and OpenAI clients work
against both unchanged. Routes, shaped as vLLM's OpenAI server answers them:
  POST /v1/completions       `prompt` (text or token ids), `max_tokens`, `min_tokens`, `ignore_eos`,
                             `temperature` (0 = greedy, else sampling with `top_p` / `top_k` /
                             `seed`), `stop`, `stream` (SSE chunks, `data: [DONE]`, a usage chunk
                             with `stream_options.include_usage`)
  POST /v1/chat/completions  the same for `messages`, rendered by the package's chat template
  GET  /v1/models, /metrics  the served model; counters in Prometheus' text format
  GET  /health (/ping)       200 while the engine runs; the only routes open without the API key

The file has two parts. The ENGINE (OrtDecoder, Sampling, Request, Engine): one thread owns the
onnxruntime session and runs continuous batching: a new request is prefilled alone, then joins
the running batch, whose KV cache is left-padded to a common length (the graph masks padding
through `attention_mask`); every step decodes one token for every running request, so concurrent
requests share each pass over the weights — what makes decode faster at concurrency > 1 on a
memory-bound CPU. The HTTP FRONT (everything after "the HTTP front" below) only validates,
tokenizes, detokenizes and writes; it runs on uvicorn's event loop, and the engine hands it
tokens through `loop.call_soon_threadsafe`, so no request holds a thread while it waits.

What the front guarantees, each refusal an OpenAI-style error body `{"error": {...}}`:
  401  a missing or wrong `Authorization: Bearer KEY` (`--api-key` or $VLLM_API_KEY, as vLLM)
  413  a body over --max-body-bytes: from Content-Length before any of it is read, else while reading
  408  a body not received within --read-timeout (a Content-Length larger than what is sent)
  400  not JSON, unknown fields, wrong types or ranges, a prompt that does not fit the context
  404  another model's name, an unknown route
  503  (with Retry-After) more than --max-waiting requests waiting for a place in the batch
A client that disconnects, or stops reading for --write-timeout, has its request cancelled in the
engine at its next step. SIGTERM: uvicorn stops accepting connections and lets the requests in
flight finish (up to --timeout-graceful-shutdown). One log line per request, never its headers.

This file depends on nothing else in the project — numpy, onnxruntime, tokenizers, fastapi /
starlette / pydantic, uvicorn, jinja2 (chat templates, imported when a package has one) and the
standard library — so that a package carries a copy of it and serves without the tool.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as _dt
import hashlib
import json
import logging
import os
import queue
import re
import secrets
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HttpRequest

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


# ============================================================================================
# the engine: the graph in a session, sampling, one thread doing continuous batching


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
    used: int | None = None  # the tokens the answer's text came from (a stop string: fewer than generated)


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
        if len(self.rows) >= self.max_batch:  # a full batch: still drop what left the queue, so that
            with self.inbox.mutex:            # requests whose clients left do not pile up until a slot frees
                if any(r.cancelled for r in self.inbox.queue):
                    self.inbox.queue = collections.deque(r for r in self.inbox.queue if not r.cancelled)
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
            try:  # a failure here is this request's alone: the rows in flight go on
                if not self._emit(req, logits):
                    self._join(req, past)
            except Exception as e:
                req.out.put(("error", f"{type(e).__name__}: {e}"))

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


# ============================================================================================
# the package: the engine on its graph, its tokenizer and chat template, its limits


class BadRequest(Exception):
    """A request the server refuses: its HTTP status and the one line the client reads."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Job:
    """A request checked against the package: token ids and settings, ready for the engine."""
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    sampling: dict            # Sampling's arguments; a Sampling is made per submission (it holds the RNG)
    stop: list[str]
    stream: bool
    include_usage: bool


class Service:
    """The engine on the package's graph, and what the front needs to turn bodies into jobs."""

    def __init__(self, package: Path, served_name: str | None = None, threads: int | None = None,
                 max_batch: int = 8):
        from tokenizers import Tokenizer
        manifest = json.loads((package / "manifest.json").read_text())
        engine = manifest["engine"]
        self.warning = int8_saturation_warning(manifest)
        self.name = served_name or engine["served_model_name"]
        self.max_model_len = int(engine.get("max_model_len", 2048))
        self.max_batch = max_batch
        providers = [p for p in engine.get("providers", []) if p in ort.get_available_providers()]
        self.decoder = OrtDecoder(package / engine.get("model_file", "model.onnx"), threads=threads,
                                  providers=providers or ["CPUExecutionProvider"])
        self.tokenizer = Tokenizer.from_file(str(package / "tokenizer.json"))
        self.eos = set(engine.get("eos_token_ids") or [])
        self.chat_template, self.chat_unavailable = _chat_template(package)
        self.engine = Engine(self.decoder, self.eos, max_batch=max_batch)
        self.created = int(time.time())

    # --- bodies to jobs (called in a worker thread: tokenizing a long text takes a while) --------
    def completion_job(self, body: CompletionBody) -> Job:
        self._check_model(body.model)
        _refuse_unsupported(body, {"n": 1, "best_of": 1, "echo": False, "suffix": "", "logprobs": None})
        prompt = body.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self._encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            ids = prompt
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")
        return self._job(body, ids, body.max_tokens or 16)  # OpenAI's and vLLM's default for completions

    def chat_job(self, body: ChatBody) -> Job:
        self._check_model(body.model)
        _refuse_unsupported(body, {"n": 1, "logprobs": False, "top_logprobs": 0, "tools": [],
                                   "response_format": {"type": "text"}})
        if body.tool_choice not in (None, "none", "auto"):
            raise BadRequest("'tool_choice' is not supported by this server: it calls no tools")
        if self.chat_template is None:
            raise BadRequest(f"this model cannot chat: {self.chat_unavailable}; use /v1/completions")
        messages = []
        for i, m in enumerate(body.messages):
            if m.tool_calls:
                raise BadRequest(f"messages[{i}]: 'tool_calls' are not supported by this server")
            if isinstance(m.content, list):
                for part in m.content:
                    if part.type != "text" or not isinstance(part.text, str):
                        raise BadRequest(f"messages[{i}]: only text content parts ({{'type': 'text', 'text': ...}}) "
                                         f"are supported, got type {part.type!r}")
                content = "\n".join(part.text for part in m.content)  # one text, as vLLM joins them
            else:
                content = m.content or ""
            messages.append({"role": m.role, "content": content, **({"name": m.name} if m.name else {})})
        add_generation_prompt = True if body.add_generation_prompt is None else body.add_generation_prompt
        try:
            text = self.chat_template.render(messages, add_generation_prompt, body.chat_template_kwargs or {})
        except Exception as e:  # the template's own checks (raise_exception) or what it cannot handle
            raise BadRequest(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None
        ids = self._encode(text, add_special_tokens=False)  # the template wrote the special tokens itself
        max_tokens = body.max_completion_tokens or body.max_tokens
        # OpenAI and vLLM: without max_tokens a chat answer may fill the context
        return self._job(body, ids, max_tokens or max(1, self.max_model_len - len(ids)))

    def _check_model(self, model: str | None) -> None:
        if model not in (None, self.name):
            raise BadRequest(f"The model `{model[:100]}` does not exist.", 404)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as e:  # text tokenizers cannot take, e.g. a lone surrogate from a JSON escape
            raise BadRequest(f"the prompt cannot be tokenized: {type(e).__name__}: {e}") from None

    def _job(self, body: _GenerationBody, ids: list[int], max_tokens: int) -> Job:
        if not ids or min(ids) < 0 or max(ids) >= self.decoder.vocab_size:
            raise BadRequest(f"prompt token ids must be in [0, {self.decoder.vocab_size}) and not empty")
        min_tokens = body.min_tokens or 0
        if min_tokens > max_tokens:
            raise BadRequest("min_tokens must not exceed max_tokens")
        if len(ids) + max_tokens > self.max_model_len:
            raise BadRequest(f"This model's maximum context length is {self.max_model_len} tokens; the request "
                             f"asks for {len(ids) + max_tokens} ({len(ids)} prompt + {max_tokens} completion)")
        stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        options = body.stream_options
        if options is not None and not body.stream:  # as vLLM answers it
            raise BadRequest("Stream options can only be defined when `stream=True`.")
        if options is not None and options.continuous_usage_stats:
            raise BadRequest("'stream_options.continuous_usage_stats' is not supported by this server")
        sampling = {"temperature": 1.0 if body.temperature is None else body.temperature,
                    "top_p": 1.0 if body.top_p is None else body.top_p,
                    "top_k": -1 if body.top_k is None else body.top_k, "seed": body.seed}
        return Job(ids, max_tokens, min_tokens, bool(body.ignore_eos), sampling, [s for s in stop if s],
                   bool(body.stream), bool(options and options.include_usage))


def _refuse_unsupported(body: BaseModel, off: dict) -> None:
    """OpenAI's fields this engine does not implement are accepted at the value that means "off"
    (clients send the defaults, some explicitly); any other value is refused, not ignored."""
    for key, value in off.items():
        got = getattr(body, key)
        if got is not None and got != value and not (value in (0, "", []) and not got):
            raise BadRequest(f"'{key}' = {json.dumps(got)[:80]} is not supported by this server "
                             f"(only {json.dumps(value)})")
    for key, value in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1), ("min_p", 0)):
        got = getattr(body, key)
        if got is not None and got != value:
            raise BadRequest(f"'{key}' = {got} is not supported by this server (only {value})")
    if body.logit_bias:
        raise BadRequest("'logit_bias' is not supported by this server")


class ChatTemplate:
    """The tokenizer's chat template (Jinja), rendered as transformers renders it — in a sandbox, with
    trim_blocks / lstrip_blocks, loop controls, `raise_exception`, `strftime_now` and a `tojson`
    that keeps non-ASCII text — so a prompt here is the one the model was trained to read."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # the template is data: no file or attribute access

        def raise_exception(message):
            raise ValueError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: _dt.datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.special_tokens = special_tokens

    def render(self, messages: list[dict], add_generation_prompt: bool, extra: dict) -> str:
        # the client's chat_template_kwargs may add variables, never replace the messages or the tokens
        return self.template.render(**{**extra, **self.special_tokens, "messages": messages,
                                       "add_generation_prompt": add_generation_prompt})


def _chat_template(package: Path) -> tuple[ChatTemplate | None, str | None]:
    """The package's chat template (transformers writes chat_template.jinja; older tokenizers keep
    it in tokenizer_config.json), or None and why."""
    config_file = package / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    source = (package / "chat_template.jinja").read_text() if (package / "chat_template.jinja").is_file() \
        else config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source.strip():
        return None, "its tokenizer has no chat template"
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            special[key] = token
    try:
        return ChatTemplate(source, special), None
    except ImportError:
        return None, "jinja2 is not installed (pip install jinja2)"
    except Exception as e:  # jinja2's TemplateSyntaxError: the package's template is broken
        return None, f"its chat template does not compile ({type(e).__name__}: {e})"


class Detokenizer:
    """The generated ids as text, a piece a token, without decoding everything again each time.

    As vLLM's incremental detokenizer: each token is decoded in a short window of the tokens
    before it (`prefix`..`read` decoded to text already released), so that spaces and merges
    come out as the whole decode writes them; a window whose text ends in a partial character
    (U+FFFD) waits for the next token. Text is held back by one character less than the longest
    stop string, so that a stop string split across tokens is never partly sent."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.held = ""                     # decoded, not yet released (a stop string may start in it)
        self.stopped_by: str | None = None  # the stop string that ended the text
        self.used = 0                       # the tokens the released text came from (usage counts these)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> tuple[str, bool]:
        """The new text to send, and whether a stop string was reached (text cut before it)."""
        self.ids.append(token)
        before, now = self._decode(self.ids[self.prefix:self.read]), self._decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return "", False
        self.prefix, self.read = self.read, len(self.ids)
        return self._release(now[len(before):], final=False)

    def flush(self) -> tuple[str, bool]:
        """At the end: what was held back, and a partial character's replacement (as vLLM sends it)."""
        before, now = self._decode(self.ids[self.prefix:self.read]), self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return self._release(now[len(before):], final=True)

    def _release(self, text: str, final: bool) -> tuple[str, bool]:
        pending = self.held + text
        found = [(i, s) for s in self.stop if (i := pending.find(s)) >= 0]
        if found:
            i, self.stopped_by = min(found)
            self.held, self.used = "", len(self.ids)
            return pending[:i], True
        cut = len(pending) if final else max(0, len(pending) - self.hold)
        self.held, self.used = pending[cut:], len(self.ids)
        return pending[:cut], False


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


# ============================================================================================
# request bodies: checked at the edge, one clear message per refusal


class _Body(BaseModel):
    # strict: "16" is not a number and true is not 1 (as this server always answered); forbid: a
    # misspelt field is an error, not silently ignored; finite: Python's json reads NaN and Infinity.
    # Every field may be null (some clients send their defaults as null): None means the default.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: refused when true


class _GenerationBody(_Body):
    """The fields both routes share: OpenAI's, and vLLM's extras that this engine implements."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)  # numpy's generator takes no negative seed
    # bounded: each stop string is searched for after every token, on the event loop
    stop: str | Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=16)] | None = \
        Field(None, max_length=256)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # not implemented by this engine, accepted at the value that means "off" (_refuse_unsupported)
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionBody(_GenerationBody):
    prompt: Any = None  # text or token ids, or a list of one of them: Service.completion_job says what is wrong
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Body):
    model_config = ConfigDict(extra="allow")  # an image part's fields: refused by Service.chat_job with its type
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an empty list only
    tool_call_id: str | None = None


class ChatBody(_GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _validation_message(e: ValidationError | RequestValidationError) -> str:
    """pydantic's errors as one line: `field.path: what is wrong`, the first three."""
    parts = []
    for err in e.errors()[:3]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        what = "unknown field" if err.get("type") == "extra_forbidden" else err.get("msg", "invalid")
        parts.append(f"{where}: {what}")
    more = len(e.errors()) - 3
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


# ============================================================================================
# the HTTP front: FastAPI routes on uvicorn, and an edge middleware for what comes before any route


@dataclass
class Limits:
    """What one client may ask of the server (main's options say why each default)."""
    max_body_bytes: int = 1 << 20
    max_waiting: int = 256
    read_timeout: float = 30.0
    write_timeout: float = 60.0


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/health", "/ping")
OPEN_ROUTES = ("/health", "/ping")  # a load balancer's probe carries no key
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
                408: "RequestTimeout", 413: "RequestTooLarge", 503: "ServiceUnavailableError"}

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

log = logging.getLogger("ort_server")


def error_response(status: int, message: str, scope: dict | None = None, headers: dict | None = None) -> Response:
    """OpenAI's error shape (what vLLM answers and OpenAI's client raises from); the message also goes
    to the request's log line. Written with JSON's escapes (ensure_ascii): a message may quote the
    client's text, which may hold a lone surrogate that UTF-8 cannot encode."""
    if scope is not None:
        scope.setdefault("state", {}).setdefault("note", {})["error"] = message
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "InternalServerError"), "param": None,
                      "code": status}}
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")


class Metrics:
    """Counters in Prometheus' text format, written by hand: the package needs no client library for
    a few numbers. Only the event loop's thread writes them."""

    def __init__(self):
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.generation_tokens = 0
        self.duration_sum, self.ttft_sum, self.ttft_count = 0.0, 0.0, 0
        self.cancelled = 0

    def render(self, front: Front) -> str:
        engine = front.service.engine
        out = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP ort_server_{name} {help_}", f"# TYPE ort_server_{name} {kind}"])
            out.extend(f"ort_server_{name}{labels} {value:g}" if isinstance(value, float) else
                       f"ort_server_{name}{labels} {value}" for labels, value in samples)

        metric("requests_total", "counter", "HTTP requests answered, by route and status.",
               [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())])
        metric("requests_in_flight", "gauge", "Generation requests accepted and not yet answered.",
               [("", front.in_flight)])
        metric("requests_running", "gauge", "Requests in the engine's batch.", [("", len(engine.rows))])
        metric("requests_waiting", "gauge", "Requests waiting for a place in the batch.",
               [("", engine.inbox.qsize())])
        metric("requests_cancelled_total", "counter", "Generations stopped because the client left or stopped "
               "reading.", [("", self.cancelled)])
        metric("prompt_tokens_total", "counter", "Prompt tokens of the generation requests.",
               [("", self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated.", [("", self.generation_tokens)])
        metric("request_duration_seconds", "summary", "Time from a request's arrival to the end of its answer.",
               [("_sum", self.duration_sum), ("_count", sum(self.requests.values()))])
        metric("time_to_first_token_seconds", "summary", "Time from a generation request's arrival to its first "
               "token.", [("_sum", self.ttft_sum), ("_count", self.ttft_count)])
        return "\n".join(out) + "\n"


class Front:
    """The HTTP side's state: the service, the key, the limits, the requests in flight, the counters."""

    def __init__(self, service: Service, api_key: str | None, limits: Limits):
        self.service, self.limits = service, limits
        # only a digest is kept, compared in constant time (vLLM does the same)
        self.key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self.in_flight = 0  # generation requests between admission and their last byte
        self.capacity = service.max_batch + limits.max_waiting
        self.metrics = Metrics()

    def authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(
            hashlib.sha256(token.strip().encode("latin-1")).digest(), self.key_digest)

    def busy(self, scope: dict) -> Response:
        return error_response(503, f"the server is at capacity ({self.in_flight} requests in flight, at most "
                                   f"{self.limits.max_waiting} waiting for the batch of {self.service.max_batch}); "
                                   "retry later", scope, {"Retry-After": "1"})

    async def generate(self, request: HttpRequest, schema: type[_GenerationBody], kind: str) -> Response:
        """Parse and check a body (400/404 with one message), tokenize it off the event loop, and
        return the response that runs it through the engine."""
        if self.in_flight >= self.capacity:  # before any work: a flood costs no tokenizing
            return self.busy(request.scope)
        raw = await request.body()
        try:
            payload = json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: a deeply nested document
            raise BadRequest(f"the body is not valid JSON: {e}") from None
        if not isinstance(payload, dict):
            raise BadRequest("the body must be a JSON object")
        try:
            body = schema.model_validate(payload)
        except ValidationError as e:
            raise BadRequest(_validation_message(e)) from None
        to_job = self.service.chat_job if kind == "chat" else self.service.completion_job
        job = await asyncio.to_thread(to_job, body)
        return GenerationResponse(self, job, kind)

    def log_request(self, scope: dict, status: int, seconds: float, note: dict, request_id: str) -> None:
        route = scope["path"] if scope["path"] in ROUTES else "other"  # fuzzed paths must not grow the counters
        m = self.metrics
        m.requests[(route, status)] = m.requests.get((route, status), 0) + 1
        m.duration_sum += seconds
        if "ttft" in note:
            m.ttft_sum, m.ttft_count = m.ttft_sum + note["ttft"], m.ttft_count + 1
        parts = [f'{scope["method"]} {scope["path"]} {status} in {seconds:.3f} s']
        if "ttft" in note:
            parts.append(f"first token {note['ttft']:.3f} s")
        if "prompt_tokens" in note:
            parts.append(f"{note['prompt_tokens']} prompt + {note['completion_tokens']} completion tokens")
        client = scope.get("client")
        parts.append(f"client {client[0]}:{client[1]}" if client else "client ?")
        parts.append(f"id {request_id}")
        line = ", ".join(parts) + (f": {note['error'][:300]}" if note.get("error") else "")
        # the path and the messages may quote the client: escape what a terminal or a log reader would
        # take for something else (control characters, NUL, lone surrogates)
        line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
        (log.warning if status >= 500 else log.info)(line)


class Edge:
    """ASGI middleware: what every request meets before a route, in this order — the API key (401),
    a declared Content-Length over the cap (413, the body left unread), then the body read whole
    under the cap and the read time-out (413, 408) and handed to the route; after it, one log line
    and the counters. Pure ASGI rather than FastAPI's @middleware: that one reads and wraps the
    body itself, and cannot refuse it while it arrives."""

    def __init__(self, app, front: Front):
        self.app, self.front = app, front

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # lifespan
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        note = {"t0": t0}  # what the route adds for the log line (tokens, first token, error)
        scope.setdefault("state", {})["note"] = note
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        # the client's X-Request-Id when it is a plain token (it goes back in a header), else our own
        request_id = headers.get("x-request-id", "")
        request_id = request_id if _REQUEST_ID.fullmatch(request_id) else uuid.uuid4().hex
        status = [0]

        async def send_noted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        try:
            refusal = self._refusal(scope, headers)
            if refusal is not None:
                await refusal(scope, receive, send_noted)
            elif scope["method"] in ("POST", "PUT", "PATCH"):
                body = await self._read_body(scope, receive)
                if isinstance(body, Response):
                    await body(scope, receive, send_noted)
                elif body is not None:
                    await self.app(scope, _replay(body, receive), send_noted)
                else:  # the client left before its body arrived
                    note["client_left"] = True
            else:
                await self.app(scope, receive, send_noted)
        finally:
            # status 0: the client left before any answer (499, nginx's "client closed request": not the
            # server's error, so no 5xx alert fires on clients' time-outs), or an exception escaped the route
            # and the server's error middleware answers 500
            unanswered = 499 if note.get("client_left") else 500
            self.front.log_request(scope, status[0] or unanswered, time.perf_counter() - t0, note, request_id)

    def _refusal(self, scope: dict, headers: dict[str, str]) -> Response | None:
        front = self.front
        if front.key_digest is not None and scope["path"] not in OPEN_ROUTES and not front.authorized(headers):
            return error_response(401, "a valid API key is required (header Authorization: Bearer <key>)", scope,
                                  {"WWW-Authenticate": "Bearer"})
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > front.limits.max_body_bytes:
            # answered before reading; the connection is closed rather than read to its end
            return error_response(413, f"the body ({int(declared)} bytes) is over this server's limit of "
                                       f"{front.limits.max_body_bytes} bytes", scope, {"Connection": "close"})
        return None

    async def _read_body(self, scope: dict, receive) -> bytes | Response | None:
        """The whole body, or the refusal when it grows over the cap (a missing or false
        Content-Length, chunked encoding) or takes longer than the read time-out to arrive
        (a Content-Length larger than what is sent); None when the client disconnected."""
        limits, loop = self.front.limits, asyncio.get_running_loop()
        deadline = loop.time() + limits.read_timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return error_response(408, f"the request body did not arrive within {limits.read_timeout:g} s",
                                      scope, {"Connection": "close"})
            if message["type"] == "http.disconnect":
                scope["state"]["note"]["error"] = "the client disconnected while sending its body"
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limits.max_body_bytes:
                return error_response(413, f"the body is over this server's limit of {limits.max_body_bytes} "
                                           "bytes", scope, {"Connection": "close"})
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    """`receive` for the route: the body read by Edge, then the connection's own events (disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()
    return replayed


class _ToLoop:
    """A Request's `out` for the HTTP front: the engine thread's put() lands in an asyncio.Queue
    on the event loop, so a waiting request holds no thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue):
        self.loop, self.events = loop, events

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server has shut down
            pass


class _ClientGone(Exception):
    """The client disconnected or stopped reading: its generation is cancelled."""


class _EngineFailed(Exception):
    pass


class GenerationResponse(Response):
    """One generation, from admission to its last byte: submitted to the engine, its tokens
    detokenized and written (whole, or as server-sent events), the client watched all along. On
    any way out — finished, disconnected, stalled, failed — the engine's request is cancelled,
    which drops it from the batch at the next step (a no-op once it finished)."""

    background = None  # FastAPI attaches its background tasks here; there are none

    def __init__(self, front: Front, job: Job, kind: str):  # no Response.__init__: __call__ writes everything
        self.front, self.job, self.kind = front, job, kind
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    async def __call__(self, scope, receive, send):
        front, job = self.front, self.job
        if front.in_flight >= front.capacity:  # the authoritative check: admission and count with no await between
            return await front.busy(scope)(scope, receive, send)
        note = scope["state"]["note"]
        events: asyncio.Queue = asyncio.Queue()
        req = Request(job.prompt, job.max_tokens, Sampling(**job.sampling), min_tokens=job.min_tokens,
                      ignore_eos=job.ignore_eos, out=_ToLoop(asyncio.get_running_loop(), events))
        front.in_flight += 1
        watcher = asyncio.create_task(_watch_disconnect(receive, req, events))
        try:
            front.service.engine.submit(req)
            if job.stream:
                await self._stream(send, req, events, note)
            else:
                await self._whole(send, req, events, note)
        except _ClientGone as e:
            front.metrics.cancelled += 1
            note["error"], note["client_left"] = str(e), True
        finally:
            req.cancelled = True
            watcher.cancel()
            front.in_flight -= 1
            note["prompt_tokens"], note["completion_tokens"] = len(job.prompt), len(req.generated)
            front.metrics.prompt_tokens += len(job.prompt)
            front.metrics.generation_tokens += len(req.generated)

    async def _events(self, req: Request, events: asyncio.Queue, note: dict):
        """(text delta, finish_reason or None, the stop string that finished it or None) until the
        request finishes."""
        detok = Detokenizer(self.front.service.tokenizer, self.job.stop)
        while True:
            kind, value = await events.get()
            if kind == "gone":
                raise _ClientGone(f"the client disconnected after {len(req.generated)} tokens")
            if kind == "error":
                raise _EngineFailed(value)
            if kind == "done":
                delta, stopped = detok.flush()
                req.used = detok.used
                yield delta, "stop" if stopped else value, detok.stopped_by
                return
            note.setdefault("ttft", time.perf_counter() - note["t0"])
            delta, stopped = detok.add(value)
            if stopped:
                req.cancelled, req.used = True, detok.used  # the engine may be a token ahead: not counted
                yield delta, "stop", detok.stopped_by
                return
            yield delta, None, None

    async def _send(self, send, message: dict) -> None:
        """send, bounded: a client that stops reading fills the socket's buffers and uvicorn's send
        then waits for them to drain, for ever without this."""
        try:
            await asyncio.wait_for(send(message), self.front.limits.write_timeout)
        except asyncio.TimeoutError:
            raise _ClientGone(f"the client stopped reading for {self.front.limits.write_timeout:g} s") from None

    async def _whole(self, send, req: Request, events: asyncio.Queue, note: dict) -> None:
        text, reason, stop = [], None, None
        try:
            async for delta, reason, stop in self._events(req, events, note):
                text.append(delta)
        except _EngineFailed as e:
            status, obj = 500, {"error": {"message": str(e), "type": "InternalServerError", "param": None, "code": 500}}
            note["error"] = str(e)
        else:
            status, obj = 200, self._shape(text="".join(text), reason=reason, stop=stop, usage=_usage(req))
        data = json.dumps(obj).encode()
        await self._send(send, {"type": "http.response.start", "status": status,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(data)).encode())]})
        await self._send(send, {"type": "http.response.body", "body": data})

    async def _stream(self, send, req: Request, events: asyncio.Queue, note: dict) -> None:
        await self._send(send, {"type": "http.response.start", "status": 200,
                                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                            (b"cache-control", b"no-cache")]})

        async def event(obj) -> None:
            data = "data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n"
            await self._send(send, {"type": "http.response.body", "body": data.encode(), "more_body": True})

        if self.kind == "chat":  # vLLM and OpenAI open a chat stream with the role
            await event(self._shape(delta={"role": "assistant", "content": ""}, reason=None))
        try:
            async for delta, reason, stop in self._events(req, events, note):
                # a choice only with text or a finish reason (serve/loadgen.py's TTFT reads the first choice)
                if delta or reason:
                    await event(self._shape(text=delta, delta={"content": delta} if delta else {}, reason=reason,
                                            stop=stop))
        except _EngineFailed as e:
            note["error"] = str(e)
            await event({"error": {"message": str(e), "type": "InternalServerError", "param": None, "code": 500}})
        if self.job.include_usage:
            await event({**self._shape(reason=None, usage=_usage(req)), "choices": []})
        await event("[DONE]")
        await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})

    def _shape(self, reason: str | None, text: str = "", delta: dict | None = None, usage: dict | None = None,
               stop: str | None = None) -> dict:
        """A response or chunk as vLLM's OpenAI server shapes it; `stop_reason` is the stop string
        that ended the text (null for the end-of-sequence token or the length)."""
        if self.kind == "chat" and self.job.stream:
            obj, choice = "chat.completion.chunk", {"index": 0, "delta": delta or {}, "logprobs": None,
                                                   "finish_reason": reason, "stop_reason": stop}
        elif self.kind == "chat":
            obj, choice = "chat.completion", {"index": 0, "message": {"role": "assistant", "content": text,
                                                                      "tool_calls": []},
                                              "logprobs": None, "finish_reason": reason, "stop_reason": stop}
        else:
            obj, choice = "text_completion", {"index": 0, "text": text, "logprobs": None, "finish_reason": reason,
                                              "stop_reason": stop}
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.front.service.name,
               "choices": [choice]}
        if usage is not None:
            out["usage"] = usage
        return out


async def _watch_disconnect(receive, req: Request, events: asyncio.Queue) -> None:
    """Wait for the client to disconnect (uvicorn reports it as soon as the socket closes), then
    cancel its request: the engine drops it at its next step, not when its answer is done."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            req.cancelled = True
            events.put_nowait(("gone", None))
            return


def _usage(req: Request) -> dict:
    n, m = len(req.prompt), req.used if req.used is not None else len(req.generated)
    return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def build_app(service: Service, api_key: str | None = None, limits: Limits | None = None) -> FastAPI:
    """The ASGI application: run it with uvicorn (main) or any ASGI server."""
    front = Front(service, api_key, limits or Limits())
    # no /docs or /openapi.json: this is an API for programs, its shape OpenAI's (docs/onnx.md)
    app = FastAPI(title="ort_server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = front

    @app.exception_handler(BadRequest)
    async def bad_request(request: HttpRequest, e: BadRequest):
        return error_response(e.status, str(e), request.scope)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HttpRequest, e: RequestValidationError):  # FastAPI's 422, answered 400 as vLLM does
        return error_response(400, _validation_message(e), request.scope)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, e: StarletteHTTPException):  # unknown route, wrong method
        message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return error_response(e.status_code, message, request.scope, e.headers)

    @app.exception_handler(Exception)
    async def failed(request: HttpRequest, e: Exception):  # a bug: logged with its traceback by uvicorn
        return error_response(500, f"internal error: {type(e).__name__}: {e}", request.scope)

    @app.get("/health")
    @app.get("/ping")
    async def health():
        if not service.engine.thread.is_alive():
            return error_response(503, "the engine thread has stopped")
        return JSONResponse({})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": service.name, "object": "model", "created": service.created, "owned_by": "llm-deploy-optimizer",
             "root": service.name, "parent": None, "max_model_len": service.max_model_len, "permission": []}]}

    @app.get("/metrics")
    async def metrics():
        return Response(front.metrics.render(front), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await front.generate(request, CompletionBody, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await front.generate(request, ChatBody, "chat")

    app.add_middleware(Edge, front=front)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Serve an ONNX package with onnxruntime behind an OpenAI-compatible "
                                             "API (completions, chat completions).")
    ap.add_argument("package", type=Path)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", help="Model name clients send (default: the manifest's).")
    ap.add_argument("--threads", type=int, help="onnxruntime intra-op threads (default: one per physical core).")
    ap.add_argument("--max-batch", type=int, default=8, help="Requests decoded together at most.")
    ap.add_argument("--api-key", help="Require `Authorization: Bearer KEY` on every route but /health "
                                      "(default: $VLLM_API_KEY, as vLLM; neither: no key).")
    ap.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes,
                    help="Largest request body (413 above it). A full context of token ids is well under it.")
    ap.add_argument("--max-waiting", type=int, default=Limits.max_waiting,
                    help="Requests that may wait for a place in the batch (503 with Retry-After beyond); "
                         "the default leaves `bench` at concurrency 64 unrefused.")
    ap.add_argument("--read-timeout", type=float, default=Limits.read_timeout,
                    help="Seconds a request body may take to arrive (408 after).")
    ap.add_argument("--write-timeout", type=float, default=Limits.write_timeout,
                    help="Seconds a client may stop reading its answer before it is cancelled and the "
                         "connection closed.")
    ap.add_argument("--timeout-graceful-shutdown", type=float, default=30,
                    help="On SIGTERM, seconds the requests in flight have to finish (Kubernetes' default "
                         "grace period) before they are cancelled.")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = ap.parse_args(argv)
    if not (args.package / "manifest.json").is_file():
        sys.exit(f"error: {args.package}: not a package (no manifest.json)")
    for name in ("max_batch", "max_body_bytes", "max_waiting", "read_timeout", "write_timeout"):
        if getattr(args, name) < 0 or (getattr(args, name) == 0 and name != "max_waiting"):
            sys.exit(f"error: --{name.replace('_', '-')} must be positive")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(args.log_level.upper())
    log.propagate = False
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
    service = Service(args.package.resolve(), args.served_model_name, args.threads, args.max_batch)
    if service.warning:
        print(service.warning, file=sys.stderr, flush=True)
    if service.chat_template is None:
        print(f"note: /v1/chat/completions answers 400: this model cannot chat: {service.chat_unavailable}",
              file=sys.stderr, flush=True)
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host} without an API key: anyone who reaches this port can use it "
              "(--api-key or $VLLM_API_KEY)", file=sys.stderr, flush=True)
    limits = Limits(args.max_body_bytes, args.max_waiting, args.read_timeout, args.write_timeout)
    print(f"serving {service.name} on http://{args.host}:{args.port}/v1 (onnxruntime {ort.__version__}, "
          f"{args.package.resolve()}, API key {'required' if api_key else 'not required'})", file=sys.stderr,
          flush=True)
    # uvicorn handles SIGTERM / SIGINT: it stops accepting, lets the requests in flight finish, then exits
    # limit_concurrency: connections past what the engine can hold or queue, plus a margin for /health and
    # refusals, get uvicorn's 503 before anything is read (requests still sending their body are not
    # counted in our own bound)
    uvicorn.run(build_app(service, api_key, limits), host=args.host, port=args.port, log_level=args.log_level,
                access_log=False, timeout_graceful_shutdown=args.timeout_graceful_shutdown,
                limit_concurrency=service.max_batch + limits.max_waiting + 64)


if __name__ == "__main__":
    main()
