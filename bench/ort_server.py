"""The ONNX package's server on FastAPI/uvicorn against the one it replaced: load, identical answers, fuzz.

    .venv/bin/python bench/ort_server.py --package /tmp/ort-pkg --rounds 3 --label smollm2-fp32
    .venv/bin/python bench/ort_server.py --package PKG --concurrency 1,2 --requests 4 --rounds 1 \\
        --output-tokens 8 --fuzz 200 --out /tmp/smoke                                     # smoke run

Protocol, on one ONNX package (default: the embedded SmolLM2-135M, dense, fp32, built first when
--package names no package: `optimize --target cpu --format onnx --retain 1.0 --no-heal --quant none`):
  1. Both servers up at once on their own ports, each with `--threads T`: the earlier server, as
     committed at --old-commit (`git show COMMIT:runtime/ort_server.py`, the standard library's
     ThreadingHTTPServer; it has no API key and ignores the header), and runtime/ort_server.py with
     `--api-key`. Every request of the load generator carries the key, to both.
  2. Greedy answers: the same prompts (text and random token ids, whole and streamed) to both;
     their texts must be identical.
  3. Load: `bench`'s load generator (serve/loadgen.py: streamed /v1/completions, random-token
     prompts, `ignore_eos`, fixed output length) at each --concurrency level, the two servers
     measured in turn with the same prompts, the order alternating, over --rounds rounds that
     each start both anew (as `bench --interleave`); a warm-up at the highest level first. Every
     request is counted: the run fails (exit 1) when any is lost.
  4. Fuzz: --fuzz seeded malformed requests (--seed) against a fresh new server from 4 client
     threads: garbage and truncated bodies, wrong types and ranges, unknown fields, bad chat
     messages, wrong keys, paths and methods, oversized and lying bodies, clients that leave
     mid-stream, with a few valid requests among them. Pass: no answer >= 500, the process alive
     and still answering, its resident memory (VmRSS) after within 10% of before (after a warm-up).
Writes ort-server.json, ort-server.md, ort-server.png and README.md (the command, the CPU) into
a new run folder bench/results/ort-server/<date>-<commit>[-<label>]/ (or --out, which must not
hold an ort-server.json); the servers' logs beside them (*.log, not committed).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import random
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import benchlib  # from bench/, this script's directory
from benchlib import ROOT
from serve import launch, loadgen

KEY = "bench-" + "k3y"  # the key both servers are sent (the old one ignores it); not a secret
LABELS = ("old", "new")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--package", default=str(ROOT / "out" / "ort-server" / "smollm2-r1.00-onnx"),
                    help="an ONNX package (built there from the embedded model when it is none)")
    ap.add_argument("--old-commit", default="87298fc", help="the commit whose runtime/ort_server.py is the old server")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--requests", type=int, help="requests per measurement (default: bench's, max(8, 2 x c))")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="onnxruntime threads of each server")
    ap.add_argument("--fuzz", type=int, default=3000, help="malformed requests in the fuzz run (0: none)")
    ap.add_argument("--seed", type=int, default=0, help="the fuzz generator's seed")
    ap.add_argument("--port", type=int, default=8141, help="the old server's port; the new one takes the next")
    ap.add_argument("--label", help="appended to the run folder's name")
    ap.add_argument("--shared", action="store_true", help="other work ran on the machine meanwhile: the views say so")
    ap.add_argument("--out", help="run folder (default: a new bench/results/ort-server/<date>-<commit>[-label])")
    ap.add_argument("--report-only", metavar="RUN_DIR",
                    help="rebuild ort-server.md, ort-server.png and README.md (views) from RUN_DIR/ort-server.json; "
                         "run nothing")
    args = ap.parse_args()
    if args.report_only:
        out = Path(args.report_only)
        _write_views(benchlib.read_result(out / "ort-server.json"), out, rebuilt_by=benchlib.run_info())
        return
    levels = sorted({int(c) for c in args.concurrency.split(",")})

    out = benchlib.run_dir("ort-server", args.out, label=args.label)
    path = benchlib.new_file(out / "ort-server.json")
    package = _package(Path(args.package))
    vocab = json.loads((package / "config.json").read_text())["vocab_size"]
    served = json.loads((package / "manifest.json").read_text())["engine"]["served_model_name"]
    results = {"protocol": {"package": str(package), "old_commit": args.old_commit, "levels": levels,
                            "requests": args.requests, "prompt_tokens": args.prompt_tokens,
                            "output_tokens": args.output_tokens, "rounds": args.rounds, "threads": args.threads,
                            "fuzz_requests": args.fuzz, "fuzz_seed": args.seed, "api_key_sent": True,
                            "shared": args.shared,
                            "machine": _machine(), "stack": _stack(), "pythonpath": bool(os.environ.get("PYTHONPATH")),
                            **benchlib.run_info()}}
    with tempfile.TemporaryDirectory(prefix="ort-server-old-") as tmp:
        old_file = Path(tmp) / "ort_server.py"
        old_file.write_text(subprocess.run(["git", "show", f"{args.old_commit}:runtime/ort_server.py"], cwd=ROOT,
                                           capture_output=True, text=True, check=True).stdout)
        servers = {"old": [sys.executable, str(old_file), str(package), "--threads", str(args.threads)],
                   "new": [sys.executable, str(ROOT / "runtime" / "ort_server.py"), str(package), "--threads",
                           str(args.threads), "--api-key", KEY]}
        results["load"], results["identity"] = _load(servers, served, vocab, levels, args, out)
    results["summary"] = _summary(results["load"], levels)
    benchlib.update_result(path, results)
    if args.fuzz:
        results["fuzz"] = _fuzz(servers["new"], package, served, args, out)
        benchlib.update_result(path, results)
    _write_views(results, out)


def _write_views(results: dict, out: Path, rebuilt_by: dict | None = None) -> None:
    """ort-server.md, ort-server.png and README.md, all views of the JSON; exit 1 on a failed check."""
    _plot(results, out / "ort-server.png")
    benchlib.write_markdown(out / "ort-server.md", _markdown(results))
    benchlib.write_markdown(out / "README.md", _readme(results, out, rebuilt_by))
    print(_markdown(results))
    failed, _ = _checks(results)
    if failed:
        print("FAILED: " + "; ".join(failed), file=sys.stderr)
        sys.exit(1)


def _package(pkg: Path) -> Path:
    if (pkg / "manifest.json").is_file():
        return pkg.resolve()
    cmd = [str(ROOT / ".venv" / "bin" / "optimize"), "--target", "cpu", "--format", "onnx", "--retain", "1.0",
           "--no-heal", "--quant", "none", "-o", str(pkg)]
    print("building the package: " + " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    return pkg.resolve()


def _machine() -> dict:
    return {"cpu": benchlib.cpu_name() or platform.processor(), "cpus": os.cpu_count(), "host": platform.node(),
            "python": platform.python_version()}


def _stack() -> dict:
    import importlib
    versions = {}
    for name in ("onnxruntime", "fastapi", "uvicorn", "starlette", "pydantic", "uvloop", "httptools"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except (ImportError, AttributeError):
            versions[name] = None
    return versions


# --- load and identical answers ----------------------------------------------------------------

def _load(servers: dict, served: str, vocab: int, levels: list[int], args, out: Path) -> tuple[dict, dict]:
    """Both servers up at once, measured in turn (bench --interleave's protocol); the identity check
    on the first round's servers."""
    ports = {"old": args.port, "new": args.port + 1}
    runs = {label: {str(c): [] for c in levels} for label in LABELS}
    warmup = {label: [] for label in LABELS}
    identity = None
    for r in range(args.rounds):
        starts = list(LABELS) if r % 2 == 0 else list(LABELS[::-1])
        with contextlib.ExitStack() as stack:
            for label in starts:
                url = f"http://127.0.0.1:{ports[label]}"
                print(f"round {r + 1}/{args.rounds}: starting the {label} server at {url}", file=sys.stderr)
                stack.enter_context(launch.running(servers[label] + ["--port", str(ports[label])], dict(os.environ),
                                                   url, out / f"server-{label}-{r + 1}.log", timeout_s=300,
                                                   api_key=KEY))
            urls = {label: f"http://127.0.0.1:{ports[label]}" for label in LABELS}
            if identity is None:
                identity = _identity(urls, served, vocab)
                print(f"  greedy answers identical: {identity['identical']}/{identity['compared']}", file=sys.stderr)
            for label in starts:
                top = max(levels)
                warmup[label].append(loadgen.run_load(urls[label], served, loadgen.LoadSpec(
                    top, top, args.prompt_tokens, args.output_tokens), vocab, seed=10_000 + r, api_key=KEY))
            for i, c in enumerate(levels):
                order = starts if i % 2 == 0 else starts[::-1]
                n = args.requests or max(8, 2 * c)
                for label in order:  # the same prompts (seed) to both
                    res = loadgen.run_load(urls[label], served, loadgen.LoadSpec(
                        c, n, args.prompt_tokens, args.output_tokens), vocab, seed=r, api_key=KEY)
                    runs[label][str(c)].append(res)
                    print(f"  {label} c={c}: {res['output_tokens_per_s']:.1f} tok/s, {res['completed']}/{n} "
                          f"succeeded" + (f" ({res['errors'][0]})" if res["failed"] else ""), file=sys.stderr)
    return {"runs": runs, "warmup": warmup}, identity


def _identity(urls: dict, served: str, vocab: int) -> dict:
    """Greedy completions of the same prompts from both servers: texts and token counts identical."""
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,",
             "Water boils at", "List three colours:"]
    rng = random.Random(7)
    prompts = texts + [[rng.randrange(100, vocab - 100) for _ in range(n)] for n in (5, 40, 120)]
    rows, identical = [], 0
    for prompt in prompts:
        for stream in (False, True):
            body = {"model": served, "prompt": prompt, "max_tokens": 32, "temperature": 0, "stream": stream}
            got = {label: _complete(url, body) for label, url in urls.items()}
            same = got["old"] == got["new"]
            identical += same
            rows.append({"prompt": prompt if isinstance(prompt, str) else f"{len(prompt)} random token ids",
                         "stream": stream, "identical": same, **({} if same else got)})
    return {"compared": len(rows), "identical": identical, "max_tokens": 32,
            "differing": [r for r in rows if not r["identical"]]}


def _complete(url: str, body: dict) -> str:
    conn = http.client.HTTPConnection(url.split("//")[1], timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        data = resp.read().decode()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {data[:300]}")
        if not body["stream"]:
            return json.loads(data)["choices"][0]["text"]
        chunks = [json.loads(line[6:]) for line in data.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    finally:
        conn.close()


def _summary(load: dict, levels: list[int]) -> dict:
    """Per level: each server's best-of-N tok/s (bench's figure) and its TTFT/TPOT p50, the new/old
    ratio of the bests and of each pair of neighbouring measurements, and every request counted."""
    out = {"levels": {}, "requests": {}}
    for c in map(str, levels):
        row = {}
        for label in LABELS:
            runs = load["runs"][label][c]
            best = max(runs, key=lambda x: x["output_tokens_per_s"])
            row[label] = {"best_tok_s": best["output_tokens_per_s"],
                          "median_tok_s": statistics.median(x["output_tokens_per_s"] for x in runs),
                          "ttft_p50_ms": best["ttft_ms"]["p50"], "tpot_p50_ms": best["tpot_ms"]["p50"],
                          "e2e_p99_ms": best["e2e_ms"]["p99"]}
        pairs = [n["output_tokens_per_s"] / o["output_tokens_per_s"]
                 for o, n in zip(load["runs"]["old"][c], load["runs"]["new"][c]) if o["output_tokens_per_s"]]
        row["ratio_best"] = row["new"]["best_tok_s"] / row["old"]["best_tok_s"]
        row["ratio_paired"] = {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs)} if pairs else None
        out["levels"][c] = row
    for label in LABELS:
        all_runs = [x for c in map(str, levels) for x in load["runs"][label][c]] + load["warmup"][label]
        out["requests"][label] = {"requested": sum(x["num_requests"] for x in all_runs),
                                  "sent": sum(x["sent"] for x in all_runs),
                                  "completed": sum(x["completed"] for x in all_runs),
                                  "failed": sum(x["failed"] for x in all_runs),
                                  "errors": sorted({e for x in all_runs for e in x["errors"]})[:5]}
    return out


# --- fuzz ----------------------------------------------------------------------------------------

SCHEMA_FIELDS = ["model", "prompt", "max_tokens", "min_tokens", "ignore_eos", "temperature", "top_p", "top_k",
                 "seed", "stop", "stream", "stream_options", "n", "echo", "logprobs", "presence_penalty", "user",
                 "messages", "max_completion_tokens", "tools", "response_format", "add_generation_prompt",
                 "chat_template_kwargs"]
# fields whose valid values could ask for a long generation: mutated to invalid or small values only
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")


class Fuzzer:
    """Seeded malformed requests, each a (category, method, path, headers, body bytes, how) tuple;
    `how` says how the client behaves ("normal", "leave" mid-stream, "lie" about the length)."""

    def __init__(self, seed: int, served: str):
        self.rng, self.served = random.Random(seed), served

    def value(self, depth: int = 0):
        """A random JSON value of any type, some of them edge cases."""
        r = self.rng
        kind = r.choice(["int", "bigint", "neg", "float", "str", "ustr", "surrogate", "bool", "null", "list", "dict",
                         "empty"])
        if kind == "int":
            return r.randint(0, 100_000)
        if kind == "bigint":
            return r.choice([2 ** 63, 2 ** 64 + 1, 10 ** 30, -(10 ** 30)])
        if kind == "neg":
            return -r.randint(1, 1000)
        if kind == "float":
            return r.choice([0.0, -0.5, 1e308, 1e-308, 3.5, 2.000001])
        if kind == "str":
            return "".join(r.choice("abc xyz{}[]\"'\\/\n\t0123") for _ in range(r.randint(0, 30)))
        if kind == "ustr":
            return "".join(chr(r.choice([r.randint(32, 126), r.randint(0x80, 0x7FF), r.randint(0x4E00, 0x9FFF),
                                         r.randint(0x1F300, 0x1F6FF), 0, 0xFFFD])) for _ in range(r.randint(1, 20)))
        if kind == "surrogate":  # valid JSON (an escape), no valid text: tokenizers cannot take it
            return "a\ud800b" if r.random() < 0.5 else "\udfff"
        if kind == "bool":
            return r.random() < 0.5
        if kind == "null":
            return None
        if kind == "list":
            return [] if depth > 2 else [self.value(depth + 1) for _ in range(r.randint(0, 4))]
        if kind == "dict":
            return {} if depth > 2 else {self.key(): self.value(depth + 1) for _ in range(r.randint(0, 3))}
        return ""

    def key(self) -> str:
        return self.rng.choice(SCHEMA_FIELDS + ["foo", "prompt ", "Prompt", "", "max-tokens", "__proto__", "x" * 300])

    def base(self, chat: bool) -> dict:
        """A valid body: short, so that the valid ones among the fuzz cost little engine time."""
        body = {"model": self.served, "max_tokens": self.rng.randint(1, 3), "temperature": 0}
        if chat:
            body["messages"] = [{"role": "user", "content": "Say hi."}]
        else:
            body["prompt"] = self.rng.choice(["Hello", [101, 202, 303]])
        if self.rng.random() < 0.3:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def case(self) -> tuple:
        r = self.rng
        chat = r.random() < 0.4
        path = "/v1/chat/completions" if chat else "/v1/completions"
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        body = self.base(chat)
        category = r.choices(["garbage", "truncated", "not-object", "mutate-field", "unknown-field", "drop-field",
                              "messages", "nested", "headers", "route", "big", "lie", "leave", "valid"],
                             weights=[8, 8, 4, 24, 8, 4, 12, 2, 8, 6, 1, 1, 2, 12])[0]
        how = "normal"
        if category == "garbage":
            raw = bytes(r.randrange(256) for _ in range(r.randint(0, 400)))
        elif category == "truncated":
            text = json.dumps(body).encode()
            raw = text[:r.randint(0, len(text) - 1)]
        elif category == "not-object":
            raw = json.dumps(r.choice([[body], 1, "x", None, True, [], 3.5])).encode()
        elif category == "mutate-field":
            key = r.choice(SCHEMA_FIELDS)
            value = self.value()
            if key in LENGTH_FIELDS and isinstance(value, int) and not isinstance(value, bool) and 4 < value < 4096:
                value = -value  # a valid length would only make a long generation
            body[key] = value
            raw = json.dumps(body).encode()
            if r.random() < 0.1:  # JSON's forbidden numbers, which Python's reader accepts
                raw = raw.replace(b'"temperature": 0', r.choice([b'"temperature": NaN', b'"temperature": Infinity',
                                                                 b'"temperature": -Infinity']))
        elif category == "unknown-field":
            body["".join(r.choice("abcdefgh_") for _ in range(r.randint(1, 12)))] = self.value()
            raw = json.dumps(body).encode()
        elif category == "drop-field":
            body.pop(r.choice(["prompt", "messages", "model", "temperature"]), None)
            raw = json.dumps(body).encode()
        elif category == "messages":
            path = "/v1/chat/completions"
            body.pop("prompt", None)
            body["messages"] = r.choice([
                self.value(), "hello", [], [1, 2], [None], [{"content": "hi"}], [{"role": 1, "content": "hi"}],
                [{"role": "user", "content": self.value()}], [{"role": "user", "content": [self.value()]}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
                [{"role": "user", "content": "hi", "tool_calls": [{"id": "x"}]}],
                [{"role": "user", "content": "x" * r.randint(5000, 20000)}],
                [{"role": r.choice(["tool", "assistant", "nobody", ""]), "content": "hi"}]])
            raw = json.dumps(body).encode()
        elif category == "nested":
            depth = r.randint(100, 50_000)
            raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
        elif category == "headers":
            raw = json.dumps(body).encode()
            variant = r.choice(["no-key", "wrong-key", "basic", "no-type", "form", "empty-bearer", "lowercase"])
            if variant == "no-key":
                headers.pop("Authorization")
            elif variant == "wrong-key":
                headers["Authorization"] = f"Bearer {KEY}x"
            elif variant == "basic":
                headers["Authorization"] = f"Basic {KEY}"
            elif variant == "no-type":
                headers.pop("Content-Type")
            elif variant == "form":
                headers["Content-Type"] = "application/x-www-form-urlencoded"
            elif variant == "empty-bearer":
                headers["Authorization"] = "Bearer "
            else:
                headers["Authorization"] = f"bearer {KEY}"
        elif category == "route":
            raw = json.dumps(body).encode()
            method, path = r.choice([("GET", path), ("PUT", path), ("DELETE", "/v1/models"), ("POST", "/v1/models"),
                                     ("POST", "/v1/completion"), ("POST", "/v2/completions"),
                                     ("POST", "/v1/completions/../chat/completions"), ("GET", "/%00%ff"),
                                     ("POST", "/" + "a" * 2000), ("GET", "/metrics"), ("GET", "/health")])
            return category, method, path, headers, raw, how
        elif category == "big":
            raw = b'{"prompt": "' + b"x" * r.choice([2 ** 20, 3 * 2 ** 20, 10 * 2 ** 20]) + b'"}'
            how = r.choice(["big-declared", "big-chunked"])
        elif category == "lie":
            raw, how = json.dumps(body).encode(), "lie"
        elif category == "leave":
            body.update(stream=True, max_tokens=50)
            raw, how = json.dumps(body).encode(), "leave"
        else:  # valid
            raw = json.dumps(body).encode()
        return category, "POST", path, headers, raw, how


def _send_case(port: int, case: tuple) -> tuple[int, str | None]:
    """One fuzz request; its status (0 where the server closed the connection without one, as it
    may for a lie about the length) and a client-side error."""
    category, method, path, headers, raw, how = case
    if how != "normal":
        return _raw_case(port, method, path, headers, raw, how)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body=raw if method != "GET" else None, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status, None
    except (OSError, http.client.HTTPException) as e:
        return 0, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def _raw_case(port: int, method: str, path: str, headers: dict, raw: bytes, how: str) -> tuple[int, str | None]:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        if how == "lie":  # more announced than sent, then silence: the server's read time-out answers
            s.sendall(f"{head}Content-Length: {len(raw) + 50}\r\n\r\n".encode() + raw)
        elif how == "leave":  # read the first event of a stream and hang up
            s.sendall(f"{head}Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        elif how == "big-declared":  # the server answers from the header: send the body only while it has not
            s.sendall(f"{head}Content-Length: {len(raw)}\r\n\r\n".encode())
            _send_until_answered(s, [raw[i:i + 65536] for i in range(0, len(raw), 65536)])
        else:  # big-chunked: no length to answer from, the server counts while it reads
            s.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
            _send_until_answered(s, [b"%x\r\n%s\r\n" % (len(raw[i:i + 65536]), raw[i:i + 65536])
                                     for i in range(0, len(raw), 65536)] + [b"0\r\n\r\n"])
        got = b""
        try:
            while b"\r\n\r\n" not in got or (how == "leave" and b"data: " not in got and b"HTTP/1.1 200" in got):
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        except OSError as e:
            return 0, f"{type(e).__name__}: {e}"
    return (int(got.split(b" ", 2)[1]), None) if got.startswith(b"HTTP/1.1 ") else (0, "no status line")


def _send_until_answered(s: socket.socket, chunks: list[bytes]) -> None:
    """Send chunks while the server has not answered (a careful client: once the answer is there,
    the rest would only meet a closed connection)."""
    for chunk in chunks:
        if select.select([s], [], [], 0)[0]:
            return
        try:
            s.sendall(chunk)
        except OSError:
            return


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def _fuzz(cmd: list[str], package: Path, served: str, args, out: Path) -> dict:
    port = args.port + 2
    url = f"http://127.0.0.1:{port}"
    fuzzer = Fuzzer(args.seed, served)
    cases = [fuzzer.case() for _ in range(args.fuzz)]
    manifest = json.loads((package / "manifest.json").read_text())
    vocab, context = json.loads((package / "config.json").read_text())["vocab_size"], manifest["engine"]["max_model_len"]
    with launch.running(cmd + ["--port", str(port), "--read-timeout", "5"], dict(os.environ), url,
                        out / "server-fuzz.log", timeout_s=300, api_key=KEY) as proc:
        rss_start = _rss_kib(proc.pid)
        # Warm-up, so that "before" is the server's working size and a change after is a leak:
        # onnxruntime's arena keeps the largest buffers it has needed (a full-context prefill's
        # logits alone are context x vocabulary floats), so first full-context prompts, alone and
        # 4 at once (the fuzz's client threads), then the fuzz's own mix from another seed.
        rng = random.Random(args.seed)
        full = [{"model": served, "prompt": [rng.randrange(100, vocab - 100) for _ in range(context - 2)],
                 "max_tokens": 2, "temperature": 0, "stream": False} for _ in range(5)]
        _complete(url, full[0])
        _in_threads([lambda b=b: _complete(url, b) for b in full[1:]])
        warm = Fuzzer(args.seed + 1, served)
        _in_threads([lambda c=warm.case(): _send_case(port, c) for _ in range(max(100, len(cases) // 5))])
        rss_before = _rss_kib(proc.pid)
        samples, done = [], []
        t0 = time.monotonic()
        stop = threading.Event()

        def sample():  # resident memory along the run: a leak grows with the requests, a cache does not
            while not stop.wait(2):
                samples.append([len(done), _rss_kib(proc.pid)])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        results = _in_threads([lambda c=c: done.append(1) or _send_case(port, c) for c in cases])
        stop.set()
        wall = time.monotonic() - t0
        time.sleep(2)  # the engine drops the last cancelled requests
        rss_after = _rss_kib(proc.pid)
        alive = proc.poll() is None
        after = _complete(url, {"model": served, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": False})
    by_category: dict = {}
    for (category, *_), (status, error) in zip(cases, results):
        row = by_category.setdefault(category, {"requests": 0, "statuses": {}, "client_errors": 0})
        row["requests"] += 1
        row["statuses"][str(status)] = row["statuses"].get(str(status), 0) + 1
        row["client_errors"] += error is not None
    statuses = [s for s, _ in results]
    return {"requests": len(cases), "seed": args.seed, "client_threads": 4, "wall_s": round(wall, 1),
            "server_errors_5xx": sum(s >= 500 for s in statuses),
            "no_status": sum(s == 0 for s in statuses),
            "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
            "by_category": dict(sorted(by_category.items())),
            "alive_after": alive, "answered_after": bool(after),
            "rss_kib_at_start": rss_start, "rss_kib_before": rss_before, "rss_kib_after": rss_after,
            "rss_change": (rss_after - rss_before) / rss_before,
            "rss_kib_samples": samples}  # [requests sent so far, VmRSS KiB] every 2 s


def _in_threads(calls: list, threads: int = 4) -> list:
    """Run the calls from `threads` client threads; their results in order."""
    results: list = [None] * len(calls)
    next_call = iter(range(len(calls)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(next_call, None)
            if i is None:
                return
            results[i] = calls[i]()

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return results


# --- reports -------------------------------------------------------------------------------------

def _checks(results: dict) -> tuple[list[str], list[str]]:
    """(the new server's failed checks, findings about the old one). The new server must lose no
    request; the old one losing some is what it did, reported, not a failure of this run."""
    out, findings = [], []
    for label, req in results["summary"]["requests"].items():
        if req["failed"] or req["completed"] != req["requested"]:
            (out if label == "new" else findings).append(
                f"{label} server: {req['requested'] - req['completed']} of {req['requested']} requests lost "
                f"({'; '.join(req['errors'])})")
    ident = results["identity"]
    if ident["identical"] != ident["compared"]:
        out.append(f"greedy answers: {ident['compared'] - ident['identical']} of {ident['compared']} differ")
    fz = results.get("fuzz")
    if fz:
        if fz["server_errors_5xx"]:
            out.append(f"fuzz: {fz['server_errors_5xx']} answers >= 500")
        if not (fz["alive_after"] and fz["answered_after"]):
            out.append("fuzz: the server did not survive")
        if abs(fz["rss_change"]) > 0.10:
            out.append(f"fuzz: resident memory changed by {fz['rss_change']:+.1%}")
    return out, findings


def _level_requests(load: dict, label: str, c: str) -> tuple[int, int]:
    """(succeeded, requested) at one level, over the rounds."""
    runs = load["runs"][label][c]
    return sum(x["completed"] for x in runs), sum(x["num_requests"] for x in runs)


def _markdown(results: dict) -> str:
    p, s = results["protocol"], results["summary"]
    st = p["stack"]
    lines = [f"# ort_server: FastAPI/uvicorn against the ThreadingHTTPServer of {p['old_commit']}", "",
             f"Package `{Path(p['package']).name}` ({p['package']}); onnxruntime {st['onnxruntime']}, "
             f"{p['threads']} threads each; new: fastapi {st['fastapi']}, uvicorn {st['uvicorn']}"
             f"{', uvloop ' + st['uvloop'] if st['uvloop'] else ''}{', httptools ' + st['httptools'] if st['httptools'] else ''}. "
             f"Prompts of {p['prompt_tokens']} random tokens, {p['output_tokens']} output tokens, both servers up at "
             f"once and measured in turn, {p['rounds']} rounds, best of the rounds; every request with the API key "
             f"(required by the new server). CPU: {p['machine']['cpu']}, {p['machine']['cpus']} cores "
             + ("(shared: other work ran on it)." if p.get("shared", True) else "(nothing else ran on it)."), "",
             "## Load", ""]
    rows, lossy = [], []
    for c, row in s["levels"].items():
        paired = row["ratio_paired"]
        ok = {label: _level_requests(results["load"], label, c) for label in LABELS}
        lost = [label for label in LABELS if ok[label][0] < ok[label][1]]
        lossy += [(label, c) for label in lost]
        mark = {label: "*" if label in lost else "" for label in LABELS}
        rows.append([c, f"{row['old']['best_tok_s']:.1f}{mark['old']}", f"{row['new']['best_tok_s']:.1f}{mark['new']}",
                     f"{row['ratio_best']:.2f}{'*' if lost else ''}",
                     f"{paired['median']:.2f} ({paired['min']:.2f}–{paired['max']:.2f})" if paired else None,
                     f"{row['old']['ttft_p50_ms']:.0f} / {row['new']['ttft_p50_ms']:.0f}",
                     f"{row['old']['tpot_p50_ms']:.1f} / {row['new']['tpot_p50_ms']:.1f}",
                     f"{ok['old'][0]}/{ok['old'][1]} · {ok['new'][0]}/{ok['new'][1]}"])
    lines.append(benchlib.markdown_table(
        ["concurrency", "old tok/s", "new tok/s", "new/old (best)", "new/old paired: median (range)",
         "TTFT p50 ms old / new", "TPOT p50 ms old / new", "succeeded old · new"], rows, align="rrrrrrrr"))
    if lossy:
        lines += ["", "\\* lost requests at this level (" + ", ".join(f"{label} c={c}" for label, c in lossy)
                  + "): tok/s counts only the requests that succeeded, over the measurement's wall time, so it is "
                  "not the same work as the other server's."]
    req = s["requests"]
    lines += ["", "Requests (levels and warm-ups, all rounds): " + "; ".join(
        f"{label} {r['completed']} of {r['requested']} succeeded, {r['failed']} failed"
        + (f" (first errors: {'; '.join(r['errors'])})" if r["errors"] else "") for label, r in req.items()), ""]
    ident = results["identity"]
    lines += ["## Greedy answers", "",
              f"{ident['identical']} of {ident['compared']} identical (text prompts and random token ids, whole and "
              f"streamed, {ident['max_tokens']} tokens, temperature 0).", ""]
    fz = results.get("fuzz")
    if fz:
        lines += ["## Fuzz", "",
                  f"{fz['requests']} seeded malformed requests (seed {fz['seed']}, {fz['client_threads']} client "
                  f"threads, {fz['wall_s']} s) against a live new server: **{fz['server_errors_5xx']} answers >= 500**; "
                  f"the process {'alive' if fz['alive_after'] else 'DEAD'} and "
                  f"{'answering' if fz['answered_after'] else 'NOT answering'} after; resident memory "
                  f"{fz['rss_kib_before'] / 1024:.0f} MiB before, {fz['rss_kib_after'] / 1024:.0f} MiB after "
                  f"({fz['rss_change']:+.1%}; {fz['rss_kib_at_start'] / 1024:.0f} MiB at the server's start, before "
                  "a warm-up of 5 full-context prompts and the fuzz mix from another seed: onnxruntime's arena keeps "
                  "the largest buffers it has needed). Statuses: "
                  + ", ".join(f"{k}: {v}" for k, v in fz["statuses"].items())
                  + " (0: the connection closed without a status line).", ""]
        rows = [[cat, row["requests"], ", ".join(f"{k}: {v}" for k, v in sorted(row["statuses"].items()))]
                for cat, row in fz["by_category"].items()]
        lines.append(benchlib.markdown_table(["category", "requests", "statuses"], rows, align="lrl"))
        lines.append("")
    failed, findings = _checks(results)
    lines.append("FAILED: " + "; ".join(failed) if failed else "All checks of the new server passed: no request "
                 "lost, greedy answers identical to the old server's"
                 + (", no 5xx in the fuzz run, resident memory within 10%." if fz else "."))
    if findings:
        lines += ["", "The old server: " + "; ".join(findings) + "."]
    return "\n".join(lines) + "\n"


def _readme(results: dict, out: Path, rebuilt_by: dict | None = None) -> str:
    p = results["protocol"]
    return "\n".join([
        f"# {out.name}", "",
        "The ONNX server on FastAPI/uvicorn (runtime/ort_server.py) against the one it replaced "
        f"(ThreadingHTTPServer, commit {p['old_commit']}): load, greedy answers, fuzz. Figures: "
        "[ort-server.md](ort-server.md) (from [ort-server.json](ort-server.json)), plot "
        "[ort-server.png](ort-server.png). Protocol: bench/ort_server.py's docstring.", "",
        "Command (from the repository root, at the commit in ort-server.json; PYTHONPATH: the checkout's "
        "`serve` package rather than the one the virtual environment has installed):", "",
        "```", f"{'PYTHONPATH=$PWD ' if p.get('pythonpath') else ''}.venv/bin/python {p['command']}", "```", "",
        f"Machine: {p['machine']['cpu']} (from /proc/cpuinfo), {p['machine']['cpus']} cores, "
        + ("shared with another engineer's work while this ran" if p.get("shared", True) else "nothing else running")
        + f"; Python {p['machine']['python']}.", "",
        f"Package: {p['package']}, made by `.venv/bin/optimize --target cpu --format onnx --retain 1.0 --no-heal "
        "--quant none -o PACKAGE` (the embedded SmolLM2-135M-Instruct, dense, fp32).", "",
        *([f"The views (ort-server.md, ort-server.png, this README) were rebuilt from ort-server.json at commit "
           f"{rebuilt_by['commit'][:7]} by `{'PYTHONPATH=$PWD ' if os.environ.get('PYTHONPATH') else ''}"
           f".venv/bin/python {rebuilt_by['command']}`.", ""] if rebuilt_by else [])])


def _plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    load, levels, fz = results["load"], results["protocol"]["levels"], results.get("fuzz")
    fig, axes = plt.subplots(1, 3 if fz else 2, figsize=(15 if fz else 10, 4))
    ax1, ax2 = axes[:2]
    for label, color, dx in (("old", "tab:gray", -0.04), ("new", "tab:blue", 0.04)):
        best = [max(x["output_tokens_per_s"] for x in load["runs"][label][str(c)]) for c in levels]
        ax1.plot(levels, best, "o-", color=color, label=f"{label} (best of rounds)")
        for c in levels:
            ys = [x["output_tokens_per_s"] for x in load["runs"][label][str(c)]]
            ax1.scatter([c * (1 + dx)] * len(ys), ys, color=color, alpha=0.35, s=14)
        ttft = [min(x["ttft_ms"]["p50"] for x in load["runs"][label][str(c)]) for c in levels]
        ax2.plot(levels, ttft, "o-", color=color, label=label)
        for c, y1, y2 in zip(levels, best, ttft):  # a server that lost requests did less work there: say so
            ok, n = _level_requests(load, label, str(c))
            if ok < n:
                for ax, y in ((ax1, y1), (ax2, y2)):
                    ax.annotate(f"{label}: {n - ok}/{n} lost", (c, y), textcoords="offset points", xytext=(-75, -14),
                                fontsize=8, color=color)
    for ax, title in ((ax1, "output tokens/s"), (ax2, "TTFT p50 (ms, best of rounds)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right" if ax is ax1 else "upper left")
    if fz:
        ax3 = axes[2]
        xs = [0] + [n for n, _ in fz["rss_kib_samples"]] + [fz["requests"]]
        ys = [fz["rss_kib_before"]] + [kib for _, kib in fz["rss_kib_samples"]] + [fz["rss_kib_after"]]
        ax3.plot(xs, [y / 1024 for y in ys], ".-", color="tab:blue")
        ax3.axhspan(fz["rss_kib_before"] * 0.9 / 1024, fz["rss_kib_before"] * 1.1 / 1024, color="tab:green", alpha=0.12,
                    label="before ± 10%")
        ax3.set_xlabel("fuzz requests sent")
        ax3.set_title(f"new server's VmRSS (MiB), fuzz: {fz['server_errors_5xx']} answers >= 500")
        ax3.grid(alpha=0.3)
        ax3.legend()
    fig.suptitle("ort_server: new (FastAPI/uvicorn, API key) vs old (ThreadingHTTPServer)")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
