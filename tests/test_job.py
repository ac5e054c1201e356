"""The job skeleton's own promises: caches and checkpoints keyed by content, a resumable batch order."""

from __future__ import annotations

import pytest
import torch

from optimizer import load
from optimizer.job import dense_perplexity
from optimizer.training import batch_indices
from tests.conftest import FAMILIES, tiny_model


def _model_dir(tmp_path, fill: float):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(bytes([int(fill)]) * 4096)
    import os
    os.utime(d / "model.safetensors", ns=(int(fill) * 10**9, int(fill) * 10**9))  # replaced: a new mtime
    return d


def test_the_fingerprint_follows_the_content_not_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZER_CACHE", str(tmp_path / "cache"))
    d = _model_dir(tmp_path, 1)
    first = load.fingerprint(d)
    assert load.fingerprint(d) == first  # remembered, and stable
    _model_dir(tmp_path, 2)  # replaced in place: same path, same size
    assert load.fingerprint(d) != first


def test_the_dense_perplexity_of_a_replaced_model_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZER_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr("optimizer.evaluate.perplexity", lambda model, w, desc="": calls.append(1) or 10.0 + len(calls))
    source = load.ModelSource(_model_dir(tmp_path, 1), "test model", "test")
    windows = torch.arange(32).view(2, 16)
    assert dense_perplexity(None, windows, source) == 11.0
    assert dense_perplexity(None, windows, source) == 11.0 and len(calls) == 1  # cached
    _model_dir(tmp_path, 3)
    assert dense_perplexity(None, windows, source) == 12.0  # not the stale figure


def test_batch_order_is_seeded_covers_every_chunk_per_pass_and_resumes_anywhere():
    n, batch = 10, 3
    order = torch.cat([batch_indices(n, batch, step, seed=7) for step in range(10)])
    for epoch in range(3):
        assert sorted(order[epoch * n:(epoch + 1) * n].tolist()) == list(range(n))
    assert torch.equal(batch_indices(n, batch, 5, seed=7), order[15:18])  # step 5 alone = step 5 in a run
    assert not torch.equal(torch.cat([batch_indices(n, batch, s, seed=8) for s in range(10)]), order)


def test_training_checkpoints_by_elapsed_time_and_at_the_end(tmp_path, monkeypatch):
    """Trainer.train saves when CHECKPOINT_EVERY_S seconds have passed since the last save, and after the last
    step, whatever the number of steps."""
    from types import SimpleNamespace

    from optimizer import training

    class Counting:
        def __init__(self):
            self.step_count, self.saved_at = 0, []

        def load(self, path):
            return False

        def step(self, batch):
            self.step_count += 1
            clock[0] += 50.0  # each step "takes" 50 s
            return {}

        def save(self, path):
            self.saved_at.append(self.step_count)

    clock = [0.0]
    monkeypatch.setattr(training, "time", SimpleNamespace(time=lambda: clock[0]))  # training.py's clock alone
    method = Counting()
    run = training.Trainer().train(method, torch.zeros(4, 8), 7, 1, tmp_path / "ckpt.pt", "test", lambda s: {})
    assert method.step_count == 7 and run["wall_s"] == 350.0
    assert method.saved_at == [3, 6, 7]  # 150 s and 300 s since the last save (120 s apart at least), and the end


def test_a_checkpoint_is_keyed_by_the_calibration_text_and_the_model_not_their_paths(tmp_path, monkeypatch):
    from pathlib import Path

    from optimizer.config import OptimizeConfig
    from optimizer.data import Text
    from optimizer.job import Calibration, Job
    monkeypatch.setenv("OPTIMIZER_CACHE", str(tmp_path / "cache"))
    source = load.ModelSource(_model_dir(tmp_path, 1), "test model", "test")
    job = Job(OptimizeConfig(), None, None, source, None, Path("out"), Path("tmp"))
    keys = []
    for text in ("the same path, one text", "the same path, another text"):
        job.calib = Calibration(Text(text, "file /same/path.txt"), torch.zeros(1, 16), torch.zeros(1, 16))
        keys.append(job.checkpoint("ddp", ["settings"]))
    assert keys[0] != keys[1]
    _model_dir(tmp_path, 5)
    assert job.checkpoint("ddp", ["settings"]) != keys[1]


def _family_model(family: str):
    if family == "phi3":
        from tests.test_phi3 import tiny_phi3
        return tiny_phi3()
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        from tests.test_moe import tiny_moe
        return tiny_moe(family)
    model = tiny_model(family.removesuffix("-softcap"))
    if family.endswith("-softcap"):
        model.config.final_logit_softcapping = 5.0
    return model


@pytest.mark.parametrize("family", [*FAMILIES, "gemma2-softcap", "phi3", "mixtral", "qwen2_moe", "qwen3_moe",
                                    "scaled-after-the-head"])
def test_perplexity_and_loss_computed_a_chunk_of_logits_at_a_time_are_the_full_logits(family, monkeypatch):
    """evaluate.perplexity and mean_loss hold LOGIT_CHUNK positions' logits at a time (a 262k
    vocabulary is gigabytes a window): the same figures as the model's own full logits and loss,
    final softcapping included; a model whose logits are more than its head's (here scaled after
    it, as Granite's are) is found out by the first window's check and scored on its full logits."""
    import math

    import torch.nn.functional as F

    from optimizer import evaluate as ev
    model = _family_model("llama" if family == "scaled-after-the-head" else family)
    if family == "scaled-after-the-head":
        forward = model.forward

        def scaled(*a, **k):
            out = forward(*a, **k)
            out.logits = out.logits * 0.5
            return out
        monkeypatch.setattr(model, "forward", scaled)
    monkeypatch.setattr(ev, "LOGIT_CHUNK", 7)  # windows of 40 tokens: several chunks and a ragged last one
    windows = torch.randint(0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ev.logits_decoder(model, windows[0]) is None) == (family == "scaled-after-the-head")
        full = [F.cross_entropy(model(w[None]).logits[0, :-1].float(), w[1:], reduction="sum").item()
                for w in windows]
    assert ev.mean_loss(model, windows) == pytest.approx(sum(full) / (3 * 39), rel=1e-5)
    assert ev.perplexity(model, windows) == pytest.approx(math.exp(sum(full) / (3 * 39)), rel=1e-5)
