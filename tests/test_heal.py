"""Healing: distillation of the pruned student from the dense teacher (optimizer/heal.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from optimizer import budget
from optimizer.adapters import get_adapter
from optimizer.config import HealSettings
from optimizer.errors import UserError
from optimizer.methods.distill import Distillation, HealConfig, cast_heads, kd_eval, kd_loss_backward, zero_masks
from optimizer.methods.activation import ActivationImportance
from optimizer.sequential import prune_blockwise
from optimizer.methods.magnitude import Magnitude
from optimizer.sparsity import parse
from optimizer.surgery import prune
from tests.conftest import tiny_model


def _data(model, n=8, seq=32, seed=0):
    return torch.randint(0, model.config.vocab_size, (n, seq), generator=torch.Generator().manual_seed(seed))


def _pruned(teacher, retain=0.6):
    adapter = get_adapter(teacher.config)
    imp = ActivationImportance(teacher, adapter)
    imp.observe(_data(teacher, 4))
    imp.close()
    shape = budget.uniform_candidates(adapter, teacher.config, retain)[0]
    return prune(teacher, adapter, imp.decide(shape))


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # Gemma 2 softcaps its logits after the head
def test_the_chunked_kl_is_the_kl_and_its_gradient(family):
    teacher = tiny_model(family)
    student = _pruned(teacher)
    ids = _data(teacher, 1, 40)
    for p in student.parameters():
        p.requires_grad_(True)
    kl = kd_loss_backward(student, teacher, ids, chunk=7)
    chunked = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    student.zero_grad()
    with torch.no_grad():
        t = F.log_softmax(teacher(ids).logits.float(), -1)
    s = F.log_softmax(student(ids).logits.float(), -1)
    whole = F.kl_div(s.flatten(0, 1), t.flatten(0, 1), log_target=True, reduction="batchmean")
    whole.backward()
    assert kl == pytest.approx(whole.item(), rel=1e-5)
    for n, g in chunked.items():
        torch.testing.assert_close(g, dict(student.named_parameters())[n].grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_heads_cast_once_give_the_bf16_kl_and_gradient_autocast_gives(family):
    teacher = tiny_model(family)
    student = _pruned(teacher)
    ids = _data(teacher, 1, 40)
    distil = Distillation(student, teacher, HealConfig(steps=1, dtype="bfloat16"))
    assert all(w is not None and w.dtype == torch.bfloat16 for w in distil.heads)  # both heads frozen
    grads = []
    for heads in ((None, None), distil.heads):
        student.zero_grad()
        kl = kd_loss_backward(student, teacher, ids, chunk=7, dtype="bfloat16", heads=heads)
        grads.append((kl, {n: p.grad.clone() for n, p in distil.params.items()}))
    assert grads[0][0] == grads[1][0]
    for n, g in grads[0][1].items():
        assert torch.equal(g, grads[1][1][n]), n
    assert cast_heads(teacher, student, "float32") == (None, None)
    student.get_output_embeddings().weight.requires_grad_(True)  # a head that trains is left to autocast
    assert cast_heads(teacher, student, "bfloat16")[1] is None
    teacher.to(torch.bfloat16)  # the lean recipe's teacher: its head is used as it is, not copied
    assert cast_heads(teacher, student, "bfloat16")[0].data_ptr() == teacher.get_output_embeddings().weight.data_ptr()
    with pytest.raises(ValueError, match="one sequence"):
        kd_loss_backward(student, teacher, _data(teacher, 2, 8), chunk=7)


def test_a_steps_kd_is_the_batchs_mean_kl():
    teacher = tiny_model("llama")
    student = _pruned(teacher)
    batch = _data(teacher, 3, 32)
    expected = kd_eval(student, teacher, batch)
    assert Distillation(student, teacher, HealConfig(steps=1)).step(batch)["kd"] == pytest.approx(expected, rel=1e-5)


def test_healing_lowers_the_kd_loss_on_held_out_text_and_leaves_the_teacher_and_the_head_alone():
    teacher = tiny_model("llama")
    student = _pruned(teacher)
    before_teacher = copy.deepcopy(teacher.state_dict())
    head = student.get_output_embeddings().weight.detach().clone()
    # repeated text: held-out windows share its statistics, as real text does
    train = _data(teacher, 4, 64).repeat(4, 1)
    held_out = train[:2, :48].clone()
    start = kd_eval(student, teacher, held_out)
    distil = Distillation(student, teacher, HealConfig(steps=12, lr=3e-3, lr_end=3e-4))
    for i in range(12):
        distil.step(train[i % len(train)][None])
    distil.close()
    assert kd_eval(student, teacher, held_out) < 0.7 * start
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before_teacher.items())
    assert torch.equal(student.get_output_embeddings().weight, head)  # tied embedding frozen
    assert student.get_output_embeddings().weight is student.get_input_embeddings().weight


def test_recomputed_activations_give_the_same_step_and_unwrap_on_close():
    """--heal-memory lean's activation checkpointing changes the memory, not the training."""
    teacher = tiny_model("llama")
    batch = _data(teacher, 2, 40)
    steps = {}
    for recompute in (False, True):
        student = _pruned(teacher)
        blocks = get_adapter(student.config).blocks(student)
        d = Distillation(student, teacher, HealConfig(steps=2, lr=1e-2, dtype="bfloat16", checkpointing=recompute),
                         blocks=blocks)
        assert all(("forward" in b.__dict__) == recompute for b in blocks)
        steps[recompute] = [d.step(batch)["kd"] for _ in range(2)], dict(d.params)
        d.close()
        assert not any("forward" in b.__dict__ for b in blocks)
    (kd_kept, kept), (kd_recomputed, recomputed) = steps[False], steps[True]
    assert kd_kept == pytest.approx(kd_recomputed, rel=1e-6)
    for n, p in kept.items():
        torch.testing.assert_close(p, recomputed[n], atol=1e-6, rtol=1e-5)


def test_lean_memory_heals_with_a_factored_optimizer_state():
    """Adafactor (--heal-memory lean) lowers the held-out KL too, with a state of a row and a
    column per matrix instead of AdamW's two full moments."""
    from optimizer.methods.distill import OPTIMIZER_LR
    teacher = tiny_model("llama")
    train = _data(teacher, 4, 64).repeat(4, 1)
    held_out = train[:2, :48].clone()
    mem = {}
    for opt in ("adamw", "adafactor"):
        student = _pruned(teacher)
        start = kd_eval(student, teacher, held_out)
        lr = OPTIMIZER_LR[opt][0] * 10  # the tiny model learns fast at ten times the default
        d = Distillation(student, teacher, HealConfig(steps=12, lr=lr, lr_end=lr / 10, optimizer=opt,
                                                      checkpointing=opt == "adafactor"),
                         blocks=get_adapter(student.config).blocks(student))
        for i in range(12):
            d.step(train[i % len(train)][None])
        d.close()
        assert kd_eval(student, teacher, held_out) < 0.7 * start, opt
        mem[opt] = d.state_bytes()
    assert mem["adamw"]["optimizer_state"] == 2 * mem["adamw"]["weights"]
    assert 0 < mem["adafactor"]["optimizer_state"] < 0.2 * mem["adafactor"]["weights"]


def test_semi_structured_zeros_stay_zero_bit_for_bit():
    teacher = tiny_model("llama")
    student = copy.deepcopy(teacher)
    adapter = get_adapter(student.config)
    prune_blockwise(student, adapter, _data(teacher, 2), Magnitude, parse("2:4"))
    keep = zero_masks(student, adapter)
    assert len(keep) == 2 * 7  # every Linear of both blocks
    zeros = {n: (p == 0) for n, p in student.named_parameters() if n in keep}
    start = {n: p.detach().clone() for n, p in student.named_parameters()}
    for opt in ("adamw", "adafactor"):  # --heal-memory fast and lean
        distil = Distillation(student, teacher, HealConfig(steps=5, lr=1e-2, optimizer=opt), keep)
        for i in range(5):
            stats = distil.step(_data(teacher, 2, 32, seed=i))
        params = dict(student.named_parameters())
        for n, z in zeros.items():
            assert (params[n][z] == 0).all() and not torch.equal(params[n], start[n]), opt
            assert (params[n].grad[z] == 0).all(), opt  # nor do they count in the clipped gradient norm
            assert parse("2:4").complies(params[n].detach().to(torch.bfloat16))
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in distil.params.values()]))
        assert float(norm) == pytest.approx(min(stats["grad_norm"], distil.cfg.grad_clip), rel=1e-4), opt


def test_resume_continues_the_same_run(tmp_path):
    teacher = tiny_model("llama")
    data = _data(teacher, 8, 32)
    cfg = HealConfig(steps=4, lr=1e-2)

    def run(steps, student, resume_from=None):
        d = Distillation(student, teacher, cfg)
        if resume_from is not None:
            assert d.load(resume_from)
        while d.step_count < steps:
            d.step(data[2 * d.step_count: 2 * d.step_count + 2])
        return d

    straight = run(4, _pruned(teacher))
    first = run(2, _pruned(teacher))
    first.save(tmp_path / "heal.pt")
    resumed = run(4, _pruned(teacher), resume_from=tmp_path / "heal.pt")
    for (n, a), b in zip(straight.params.items(), resumed.params.values()):
        assert torch.equal(a, b), n
    other = Distillation(_pruned(tiny_model("llama", seed=1)), teacher, cfg)
    assert not other.load(tmp_path / "heal.pt")  # another student: not this run's checkpoint


def _heal_tiny_llama(tiny_dirs, text_file, tmp_path, *heal_args):
    """`optimize` on the tiny LLaMA at retain 0.6, healed on a text of its own; (CLI result, package)."""
    from optimizer.cli import optimize
    other = tmp_path / "heal.txt"
    other.write_text(" ".join(f"word{i % 97} and more text number {i}." for i in range(3000)))
    out = tmp_path / "pkg"
    r = CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--target", "a100", "--method", "activation",
                                      "--retain", "0.6", "--calib", str(text_file), "--eval", str(text_file),
                                      "--set", f"heal.data={other}", *heal_args, "--set", "heal.chat=0",
                                      "--set", "data.seq_len=128",
                                      "--set", "data.calib_windows=2", "--set", "data.eval_windows=1",
                                      "--quant", "none", "-o", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r, out


@pytest.mark.slow
def test_optimize_heals_and_reports_it(tiny_dirs, text_file, tmp_path):
    r, out = _heal_tiny_llama(tiny_dirs, text_file, tmp_path, "--heal-tokens", "2048")
    m = json.loads((out / "manifest.json").read_text())
    h = m["heal"]
    defaults = HealSettings()
    assert h["tokens"] == 2048 and h["steps"] == 2048 // (defaults.batch * defaults.seq_len)
    assert h["data"].startswith("files ")
    assert h["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # --heal-device auto
    assert "perplexity" in h["before"] and h["before"]["perplexity"] != m["quality"]["perplexity"]["pruned"]
    assert h["memory_bytes"]["optimizer_state"] == 2 * h["memory_bytes"]["weights"]  # AdamW's two moments
    assert h["config"]["optimizer"] == "adamw" and h["config"]["lr_end"] == pytest.approx(h["config"]["lr"] / 30)
    assert "median RMS" in h["peak_rule"] and h["probe"] == []  # 4 steps: too few to probe
    assert f"AdamW at {h['config']['lr']:g}" in (out / "report.md").read_text()


@pytest.mark.slow
def test_a_heal_that_makes_the_held_out_kl_worse_is_not_shipped(tiny_dirs, text_file, tmp_path):
    """A learning rate far too high wrecks the student: the package keeps the unhealed weights and says so."""
    r, out = _heal_tiny_llama(tiny_dirs, text_file, tmp_path, "--heal-tokens", "1024", "--set", "heal.lr=1.0")
    assert "healing made the held-out KL worse: the package keeps the unhealed weights" in r.output
    m = json.loads((out / "manifest.json").read_text())
    h = m["heal"]
    assert h["kept_unhealed"] and h["after"]["held_out_kd"] > h["before"]["held_out_kd"]
    assert [a["lr"] for a in h["attempts"]] == [1.0]  # a --heal-lr the user set is not retried
    assert m["quality"]["perplexity"]["pruned"] == pytest.approx(h["before"]["perplexity"], rel=1e-5)
    assert "keeps the unhealed weights" in (out / "report.md").read_text()


def _heal_directly(tmp_path, monkeypatch, multiples, tokens=16 * 64, **settings):
    """heal.heal on a pruned tiny LLaMA with PROBE_PEAKS = `multiples` of the default peak (which the
    tests make AdamW's 3e-3: the tiny model heals at it in a few steps); (student, unhealed, report)."""
    from optimizer import heal
    from optimizer.heal_data import HealText
    from optimizer.training import Trainer
    monkeypatch.setitem(heal.OPTIMIZER_LR, "adamw", (3e-3, 3e-4))
    monkeypatch.setattr(heal, "REFERENCE_WEIGHT_RMS", None)  # set below: the tiny model's own RMS
    teacher = tiny_model("llama")
    student = _pruned(teacher)
    monkeypatch.setattr(heal, "REFERENCE_WEIGHT_RMS", heal.median_weight_rms(dict(student.named_parameters())))
    monkeypatch.setattr(heal, "PROBE_PEAKS", multiples)
    train = _data(teacher, 4, 64).repeat(4, 1)  # repeated: held-out windows share its statistics
    unhealed = copy.deepcopy(student.state_dict())
    s = HealSettings(tokens=tokens, **settings)
    student, report = heal.heal(student, teacher, HealText(train, "test text"), s, held_out=train[:2, :48].clone(),
                                trainer=Trainer(log=lambda *a: None), checkpoint=lambda kind, run: tmp_path / "c.pt",
                                adapter=get_adapter(teacher.config), tok=None, log=lambda *a: None)
    return student, unhealed, report


def test_the_default_peak_is_scaled_to_the_students_weights():
    from optimizer.heal import REFERENCE_WEIGHT_RMS, default_peak
    weights = lambda rms: {"w": torch.full((8, 8), rms), "norm": torch.full((8,), 5.0)}  # noqa: E731 (vectors ignored)
    assert default_peak("adamw", weights(REFERENCE_WEIGHT_RMS))[0] == 3e-4  # the model it was selected on
    assert default_peak("adamw", weights(0.0395))[0] == pytest.approx(6.2e-5)  # Gemma-3-270M's median RMS
    assert default_peak("adafactor", weights(0.0395))[0] == 1e-2  # relative to each weight already


def test_the_probe_picks_the_rate_that_heals_and_the_full_heal_runs_at_it(tmp_path, monkeypatch):
    """Of a wrecking rate (1e4 × the peak) and a healing one (the peak), the probe picks the second."""
    student, _, r = _heal_directly(tmp_path, monkeypatch, (1e4, 1.0))
    wreck, good = r.probe
    assert wreck["lr"] == pytest.approx(30.0) and good["lr"] == pytest.approx(3e-3)
    assert wreck["steps"] == good["steps"] == heal_probe_steps(r.steps_planned)
    assert not wreck["held_out_kd"] <= r.before["held_out_kd"]  # (diverged: NaN)
    assert good["held_out_kd"] < r.before["held_out_kd"]
    assert r.config["lr"] == pytest.approx(3e-3) and [a["lr"] for a in r.attempts] == [pytest.approx(3e-3)]
    assert r.steps == r.steps_planned and not r.kept_unhealed and not r.skipped_by_probe
    assert r.after["held_out_kd"] < r.before["held_out_kd"]
    assert "median RMS" in r.peak_rule


def test_a_heal_no_probed_rate_pays_for_is_skipped(tmp_path, monkeypatch):
    """Both probed rates wreck the student: nothing trains beyond the probe, the weights are the unhealed ones."""
    student, unhealed, r = _heal_directly(tmp_path, monkeypatch, (1e4, 3e4))
    assert r.skipped_by_probe and r.kept_unhealed and r.steps == 0 and r.attempts == []
    assert not any(p["held_out_kd"] <= r.before["held_out_kd"] for p in r.probe)  # worse, or NaN
    assert r.after == r.before and not (tmp_path / "c.pt").exists()  # no checkpoint: nothing to resume
    for n, t in student.state_dict().items():
        assert torch.equal(t, unhealed[n]), n


def test_the_report_says_what_the_probe_chose_and_when_it_skipped_the_heal(tmp_path, monkeypatch):
    from types import SimpleNamespace
    from optimizer.report import _heal_lines
    for multiples, says in (((1e4, 1.0), "Peak learning rate 3.0e-03, chosen by healing 4 steps"),
                            ((1e4, 3e4), "Not distilled: a probe of the learning rate")):
        _, _, r = _heal_directly(tmp_path, monkeypatch, multiples)
        text = "\n".join(_heal_lines(SimpleNamespace(heal=r.as_dict(), perplexity={})))
        assert says in text and "held-out KL after each" in text


def test_a_rate_the_user_sets_is_not_probed(tmp_path, monkeypatch):
    _, _, r = _heal_directly(tmp_path, monkeypatch, (1e4, 1.0), lr=3e-3)
    assert r.probe == [] and r.peak_rule == "heal.lr" and r.config["lr"] == 3e-3


def heal_probe_steps(steps: int) -> int:
    from optimizer.heal import MAX_PROBE_STEPS, MIN_PROBE_STEPS, PROBE_SHARE
    return min(MAX_PROBE_STEPS, max(MIN_PROBE_STEPS, round(steps * PROBE_SHARE)))


@pytest.mark.slow
def test_a_heal_checkpoint_resumes_only_the_same_heal_text(tiny_dirs, text_file, tmp_path):
    """The checkpoint is keyed by the heal text's content, not its name: the teacher's sampled chat
    answers can differ between thread counts, and a resume must not continue training on other data."""
    from optimizer.cli import optimize
    heal_file = tmp_path / "heal.txt"

    def run(text: str, name: str, keep: bool = True) -> dict:
        heal_file.write_text(text)
        r = CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--target", "a100", "--retain", "0.6",
                                          "--calib", str(text_file), "--eval", str(text_file), "--set",
                                          f"heal.data={heal_file}", "--heal-tokens", "1024", "--set", "heal.chat=0",
                                          "--set", "data.seq_len=128",
                                          "--set", "data.calib_windows=2", "--set", "data.eval_windows=1",
                                          "--quant", "none", "--set", f"keep_checkpoints={keep}",
                                          "--resume", "-o", str(tmp_path / name)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return json.loads((tmp_path / name / "manifest.json").read_text())["heal"]

    first = run(" ".join(f"word{i % 97} and more text number {i}." for i in range(3000)), "a")
    again = run(" ".join(f"word{i % 97} and more text number {i}." for i in range(3000)), "b", keep=False)
    other = run(" ".join(f"other{i % 89} words, another text {i}." for i in range(3000)), "c", keep=False)
    assert first["resumed_from_step"] == 0 and again["resumed_from_step"] == again["steps"]
    assert other["resumed_from_step"] == 0 and other["checkpoint"] != first["checkpoint"]
    # without keep_checkpoints a finished run leaves no checkpoint behind: nothing is left to resume
    assert not Path(first["checkpoint"]).exists() and not Path(other["checkpoint"]).exists()


@pytest.mark.slow
def test_optimize_heals_with_lean_memory(tiny_dirs, text_file, tmp_path):
    from optimizer.cli import optimize
    other = tmp_path / "heal.txt"
    other.write_text(" ".join(f"word{i % 97} and more text number {i}." for i in range(3000)))
    out = tmp_path / "pkg"
    r = CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--target", "a100", "--method", "activation",
                                      "--retain", "0.6", "--calib", str(text_file), "--eval", str(text_file),
                                      "--set", f"heal.data={other}", "--heal-tokens", "4096", "--set", "heal.chat=0",
                                      "--set", "data.seq_len=128",
                                      "--set", "heal.memory=lean", "--set", "data.calib_windows=2",
                                      "--set", "data.eval_windows=1",
                                      "--quant", "none", "-o", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "lean memory (Adafactor, activations recomputed per block)" in r.output
    h = json.loads((out / "manifest.json").read_text())["heal"]
    assert h["config"]["optimizer"] == "adafactor" and h["config"]["checkpointing"] and h["config"]["lr"] == 1e-2
    assert h["after"]["held_out_kd"] < h["before"]["held_out_kd"]
    assert "Adafactor at 0.01, activations recomputed per block" in (out / "report.md").read_text()


@pytest.mark.slow
def test_optimize_scores_zero_shot_dense_before_and_after_healing(tiny_dirs, text_file, tmp_path):
    from optimizer.cli import optimize
    other = tmp_path / "eval.txt"
    other.write_text("\n".join(f"Line {i} of another text, about other things than the calibration." for i in range(300)))
    out = tmp_path / "pkg"
    r = CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--target", "a100", "--retain", "0.6",
                                      "--calib", str(text_file), "--eval", str(other), "--set", "data.seq_len=64",
                                      "--set", "data.calib_windows=2", "--set", "data.eval_windows=1",
                                      "--heal-tokens", "512",
                                      "--set", "heal.chat=0", "--set", "zeroshot=3", "--quant", "none",
                                      "-o", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    z = m["quality"]["zeroshot"]
    assert z["tasks"] == ["arc_easy", "piqa", "hellaswag"] and z["limit"] == 3
    for scored in (z["dense"], z["pruned"], m["heal"]["before"]["zeroshot"]):
        assert set(scored["tasks"]) == set(z["tasks"]) and 0 <= scored["mean"] <= 1
    report = (out / "report.md").read_text()
    assert "Zero-shot accuracy (3 seeded documents a task" in report and "| before healing |" in report


def test_the_default_heal_budget_and_chat_answers(tokenizer):
    from optimizer.config import HealSettings
    from optimizer.heal_data import AUTO_CHAT, chat_answers
    # the CLI has no defaults of its own: an option it is not given leaves the dataclass's
    assert HealSettings().tokens > 0 and HealSettings().memory == "fast"
    assert HealSettings().lr is None and HealSettings().chat is None  # the optimizer's; auto
    chat = copy.copy(tokenizer)
    chat.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    plain = copy.copy(tokenizer)
    plain.chat_template = None
    assert chat_answers(HealSettings(), chat) == AUTO_CHAT and chat_answers(HealSettings(), plain) == 0
    assert chat_answers(HealSettings(chat=0), chat) == 0 and chat_answers(HealSettings(chat=5), plain) == 5


@pytest.mark.slow
def test_the_default_heal_text_adds_the_built_in_samples_to_the_built_in_corpus_only(tokenizer):
    """Without --heal-data: the built-in calibration half and the first 90% of exllamav2's other samples
    (their last 10% held out: the heal's settings were chosen on it); a user's --calib alone."""
    from types import SimpleNamespace

    from optimizer import data
    from optimizer.config import HealSettings
    from optimizer.heal_data import heal_text
    calib = data.builtin_text("calib")
    if calib is None:
        pytest.skip("no exllamav2 wheel: no built-in corpus")
    train = data.token_windows(tokenizer, calib.text[:20000], 512)

    def heal_chunks():
        return heal_text(HealSettings(chat=0, seq_len=512), tokenizer, SimpleNamespace(train=train, text=calib), None)
    chunks, what = heal_chunks()
    samples = data.builtin_heal_samples()
    assert list(samples) == list(data.HEAL_SAMPLES) and "tiny / technical / code / multilingual" in what
    want = len(train) + sum(len(data.token_windows(tokenizer, t, 512)) for t in samples.values())
    assert chunks.shape == (want, 512) and torch.equal(chunks[:len(train)], train)
    for name, text in samples.items():
        full = data.builtin_sample(name).read_text(encoding="utf-8")
        assert full.startswith(text) and 0.85 * len(full) < len(text) <= 0.9 * len(full)
    calib = data.Text(calib.text, "file my-calibration.txt")  # the user's calibration text: their domain
    chunks, what = heal_chunks()
    assert torch.equal(chunks, train) and "samples" not in what


@pytest.mark.parametrize("args, message", [
    (["--heal-tokens", "-5"], "--heal-tokens must be >= 0, got -5"),
    (["--set", "heal.chat=-1"], "heal.chat must be >= 0, got -1"),
    (["--set", "heal.batch=0"], "heal.batch must be >= 1, got 0"),
    (["--heal-tokens", "100"], "less than one step"),
    (["--heal-tokens", "8192", "--set", "heal.time_s=0"], "heal.time_s"),
    (["--heal-tokens", "8192", "--set", "heal.data=/no/such/file.txt"], "no such file"),
    (["--heal-tokens", "8192", "--set", "heal.lr=0"], "heal.lr must be > 0, got 0"),
    (["--set", "heal.memory=tiny"], "heal.memory"),
    (["--set", "heal.device=tpu"], "unknown heal.device 'tpu'"),
    (["--set", "heal.device=cuda:99"], "heal.device=cuda:99: torch sees"),  # no machine has 100 GPUs
])
def test_bad_heal_settings_are_one_line_errors(tiny_dirs, text_file, tmp_path, args, message):
    from optimizer.cli import optimize
    r = CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--target", "a100", "--calib", str(text_file),
                                      "-o", str(tmp_path / "pkg"), *args])
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_heal_data_reads_jsonl_and_json_records_text_and_chat(tmp_path):
    """`text` records as they are, chat `messages` through the model's chat template; a `.json`
    file of JSON lines or one JSON array alike; plain text otherwise."""
    from optimizer.heal_data import read_heal_file

    class Tok:  # a chat template that shows what it was given
        chat_template = "stub"

        @staticmethod
        def apply_chat_template(messages, tokenize):
            assert tokenize is False
            return " | ".join(f"{m['role']}: {m['content']}" for m in messages)

    chat = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    records = [{"text": "First text."}, {"messages": chat}]
    want = "First text.\n\nuser: Hi? | assistant: Hello."
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    (tmp_path / "b.json").write_text("\n".join(json.dumps(r) for r in records))
    (tmp_path / "c.json").write_text(json.dumps(records, indent=2))
    (tmp_path / "d.txt").write_text('{"text": "kept as it is"}')
    (tmp_path / "e.json").write_text("\ufeff" + json.dumps(records[0], indent=2))  # one record, a byte-order mark
    for name in ("a.jsonl", "b.json", "c.json"):
        assert read_heal_file(tmp_path / name, Tok()) == want
    assert read_heal_file(tmp_path / "d.txt", Tok()) == '{"text": "kept as it is"}'
    assert read_heal_file(tmp_path / "e.json", Tok()) == "First text."
    Tok.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        read_heal_file(tmp_path / "a.jsonl", Tok())


@pytest.mark.parametrize("content, message", [
    ('{"text": "fine"}\nnot json\n', "line 2 is not JSON"),
    ('{"prompt": "no text field"}\n', "record 1 has neither a `text` string nor `messages`"),
])
def test_a_malformed_heal_data_file_fails_before_the_model_loads(tiny_dirs, text_file, tmp_path, content, message):
    from optimizer.cli import optimize
    bad = tmp_path / "data" / "heal.jsonl"
    bad.parent.mkdir()
    bad.write_text(content)
    for extra in (["--dry-run"], ["-o", str(tmp_path / "out" / "pkg")]):
        r = CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--target", "a100", "--calib", str(text_file),
                                          "--set", f"heal.data={bad}", *extra])
        assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_heal_data_holding_the_evaluation_text_is_refused(tiny_dirs, text_file, tmp_path):
    from optimizer.cli import optimize
    r = CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--target", "a100", "--method", "activation",
                                      "--calib", str(text_file), "--eval", str(text_file), "--set", "data.seq_len=64",
                                      "--heal-tokens", "8192", "-o", str(tmp_path / "pkg")])
    assert r.exit_code == 2 and "memory test" in r.output
    assert list(tmp_path.iterdir()) == []


def test_the_overlap_check_finds_the_evaluation_text_reflowed_or_inside_other_text():
    from optimizer.heal_data import eval_overlap
    lines = [f"line {i}: the quick brown fox jumps over the lazy dog number {i} again" for i in range(10)]
    evaluation = "\n".join(lines + ["short"])  # a line under 40 characters is not counted
    reflowed = " ".join(lines[:5]).replace(" over ", "\n over ")  # five lines, rejoined and rebroken
    assert eval_overlap(reflowed, evaluation) == 0.5
    assert eval_overlap("before it, " + lines[3] + " and after it", evaluation) == 0.1  # inside a longer line
    assert eval_overlap(lines[3].replace("lazy", "sleepy"), evaluation) == 0.0  # a changed word: not the line
    assert eval_overlap("\n".join(lines), "no line here is long enough") == 0.0


def _heal_three_steps(rank: int, world: int, init: str, out: str) -> None:
    """One rank of a data-parallel heal (gloo on CPU); world 1 is the single process."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    teacher = tiny_model("llama")
    student = _pruned(teacher)
    distil = Distillation(student, teacher, HealConfig(steps=3, lr=1e-2))
    data = _data(teacher, 12, 32)
    losses = [distil.step(data[4 * i: 4 * i + 4])["kd"] for i in range(3)]
    if rank == 0:
        torch.save({"losses": losses, "params": {n: p.detach() for n, p in distil.params.items()}}, out)
    if world > 1:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_processes_heal_as_one(tmp_path):
    """Data parallel through torch.distributed: each rank takes half the batch, gradients summed."""
    import torch.multiprocessing as mp
    _heal_three_steps(0, 1, "", str(tmp_path / "one.pt"))
    mp.spawn(_heal_three_steps, args=(2, f"file://{tmp_path / 'store'}", str(tmp_path / "two.pt")), nprocs=2)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    for n, p in one["params"].items():
        torch.testing.assert_close(two["params"][n], p, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_optimize_under_torchrun_heals_on_two_processes_and_writes_one_package(tiny_dirs, text_file, tmp_path):
    """`torchrun --nproc-per-node 2 optimize ...` (gloo on CPU): both ranks prune and heal, rank 0 writes the
    package alone, and its weights are those of one process healing the same batch of 2 sequences a step."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file
    from optimizer.cli import optimize
    other = tmp_path / "heal.txt"
    other.write_text(" ".join(f"word{i % 97} and more text number {i}." for i in range(3000)))
    args = [str(tiny_dirs["llama"]), "--target", "a100", "--retain", "0.6", "--calib", str(text_file),
            "--eval", str(text_file), "--set", f"heal.data={other}", "--heal-tokens", "4096", "--set", "heal.chat=0",
            "--set", "data.seq_len=128", "--set", "data.calib_windows=2", "--set", "data.eval_windows=1",
            "--quant", "none", "--set", "threads=1"]
    r = CliRunner().invoke(optimize, [*args, "--set", "heal.batch=2",
                           "-o", str(tmp_path / "one")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    script = Path(sys.executable).parent / "optimize"
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), *args, "-o", str(tmp_path / "two")],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("package: ") == 1  # one process speaks and writes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heal.txt", "one", "two"]  # no temporary directory left
    h1, h2 = (json.loads((tmp_path / d / "manifest.json").read_text())["heal"] for d in ("one", "two"))
    assert (h1["processes"], h2["processes"]) == (1, 2) and h1["batch"] == h2["batch"] == 2
    assert h2["steps"] == h1["steps"] == 4
    assert h2["final"]["kd"] == pytest.approx(h1["final"]["kd"], rel=1e-4)
    w1, w2 = (load_file(tmp_path / d / "model.safetensors") for d in ("one", "two"))
    assert w1.keys() == w2.keys()
    for name, w in w1.items():
        torch.testing.assert_close(w2[name], w, atol=1e-4, rtol=1e-3)


def test_several_processes_are_refused_where_they_cannot_share_a_heal(tiny_dirs, text_file, tmp_path, monkeypatch):
    from optimizer import distributed
    from optimizer.cli import optimize
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.launched() == 1  # WORLD_SIZE alone (another launcher's) is not torchrun's launch
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert distributed.launched() == 2
    base = [str(tiny_dirs["llama"]), "--target", "a100", "--calib", str(text_file), "-o", str(tmp_path / "pkg")]
    for extra, message in ((["--no-heal"], "healing is off"), (["--set", "heal.device=cuda:1"], "names one GPU")):
        r = CliRunner().invoke(optimize, [*base, *extra])
        assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_the_teachers_chat_answers_are_rendered_turns_of_built_in_instructions(tokenizer):
    from optimizer.heal_data import CHAT_PROMPTS, INSTRUCTIONS, teacher_chat
    teacher = tiny_model("llama", vocab_size=len(tokenizer))
    text = teacher_chat(teacher, tokenizer, 3, seed=0, max_new_tokens=4, batch=2)
    assert text.count("<|im_start|>user") == 3 and text.count("<|im_start|>assistant") == 3
    assert all(p in text for p in INSTRUCTIONS[:3])
    assert not set(CHAT_PROMPTS) & set(INSTRUCTIONS)  # the report's check stays unseen
    assert teacher_chat(teacher, tokenizer, 3, seed=0, max_new_tokens=4, batch=2) == text  # seeded


@pytest.mark.slow
def test_heal_time_caps_the_heal_and_the_manifest_counts_what_was_done(tiny_dirs, text_file, tmp_path):
    """--heal-time stops a heal whose --heal-tokens would run far longer; the package is written with
    the steps done, and the manifest and report say the cap stopped it."""
    seq = HealSettings().seq_len
    r, out = _heal_tiny_llama(tiny_dirs, text_file, tmp_path, "--heal-tokens", str(seq * 100_000),
                              "--set", "heal.time_s=2")
    h = json.loads((out / "manifest.json").read_text())["heal"]  # 100,000 steps: hours on the tiny model
    assert h["stopped_by_time"] and 0 < h["steps"] < 100_000 and h["tokens"] == h["steps"] * seq
    assert "stopped by the time cap" in r.output and "stopped by the time cap" in (out / "report.md").read_text()
