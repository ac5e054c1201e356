"""The CLI on tiny models: a working package, and bad input → one line, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from optimizer.cli import detect, optimize, profiles


def _run(cmd, args):
    return CliRunner().invoke(cmd, [str(a) for a in args], catch_exceptions=False)


def _leftovers(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.slow
def test_optimize_writes_a_complete_package(tiny_dirs, text_file, tmp_path, family):
    """The default path: the planner's method (one-shot and its refit, then heal, then the target's
    precision: FP8 W8A8 on an L4) on a small heal budget."""
    out = tmp_path / "pkg"
    other = tmp_path / "eval.txt"  # the evaluation text is never the heal (calibration) text
    other.write_text("\n".join(f"Line {i} of another text, on other things than the calibration." for i in range(300)))
    r = _run(optimize, [tiny_dirs[family], "--target", "l4", "--retain", "0.6", "--calib", text_file,
                        "--eval", other, "--set", "data.seq_len=64", "--set", "data.calib_windows=4",
                        "--set", "data.eval_windows=2",
                        "--heal-tokens", "1024", "-o", out,
                        # the teacher's chat answers (on by default: the tokenizer has a chat template)
                        # cost ~20 s on the tiny model: once is enough
                        *(["--set", "heal.chat=0"] if family == "qwen2" else [])])
    assert r.exit_code == 0, r.output
    for f in ("config.json", "model.safetensors", "tokenizer.json", "manifest.json", "report.md",
              "launch.sh", "Dockerfile"):
        assert (out / f).is_file(), f
    m = json.loads((out / "manifest.json").read_text())
    assert m["target"]["name"] == "l4" and m["method"]["plan"] == "activation"
    assert m["heal"]["steps"] == 16 and m["heal"]["tokens"] == 1024  # 1 sequence of 64 a step
    assert "applied" in m["method"]["refit"]  # the refit is on by default
    assert m["quantization"]["precision"] == "fp8" and "quantization: FP8 W8A8" in r.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    assert 0.45 < m["method"]["retain_achieved"] <= 0.6
    assert m["size"]["params_pruned"] < m["size"]["params_dense"]
    assert m["quality"]["perplexity"]["pruned"] > 1
    assert m["checks"]["masked_vs_pruned_max_abs_logit_diff"] < 1e-3
    assert m["method"]["calibration"]["source"].startswith("file ")
    assert "no 2:4 kernel" in m["plan"]["text"] and "roofline on l4" in m["plan"]["text"]
    report = (out / "report.md").read_text()
    assert "Perplexity" in report and "- internal check: masked vs physically pruned logits" in report
    assert "- `Dockerfile` builds the same on the official vLLM image v" in report
    assert _leftovers(tmp_path) == []


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_dirs, tmp_path):
    r = _run(optimize, [tiny_dirs["llama"], "--target", "a100", "--retain", "0.7", "--dry-run", "-o", tmp_path / "x"])
    assert r.exit_code == 0
    assert "A100 (SM 8.0) + vLLM" in r.output and "no 2:4 kernel" in r.output and "structured" in r.output
    assert "prefill" in r.output and "decode" in r.output
    assert "method: activation" in r.output and "heal: 36,864 tokens" in r.output  # the default plan
    assert list(tmp_path.iterdir()) == []


def test_on_the_cpu_target_auto_removes_whole_blocks_where_they_pay():
    """cpu's profile charges every kept block a fixed cost a decode step: for the embedded model at
    0.7, --method auto keeps 21 of 30 whole blocks (depth) and says why; --method structured keeps
    the narrower layout and names depth beside it; where the gain is small (0.9: 27 blocks) or --retain
    is below FEWER_BLOCKS_MIN_RETAIN (0.5) auto stays structured. A GPU profile (no fixed cost measured), an onnxruntime package (the cost was measured
    under vLLM) and options --method depth refuses never see depth."""
    r = _run(optimize, ["--target", "cpu", "--retain", "0.7", "--dry-run"])
    assert r.exit_code == 0 and "method: depth" in r.output
    assert "beyond its matmuls" in r.output and "→ 21 of 30 whole blocks (depth): predicted" in r.output
    r = _run(optimize, ["--target", "cpu", "--method", "structured", "--retain", "0.7", "--dry-run"])
    assert r.exit_code == 0 and "method: activation" in r.output
    assert "21 of 30 whole blocks instead (--method depth)" in r.output
    for retain, kept in (("0.9", 27), ("0.5", 15)):  # too little gain; below FEWER_BLOCKS_MIN_RETAIN
        r = _run(optimize, ["--target", "cpu", "--retain", retain, "--dry-run"])
        assert r.exit_code == 0 and "method: activation" in r.output
        assert f"{kept} of 30 whole blocks instead (--method depth)" in r.output
    for other in (["--target", "a100"], ["--target", "cpu", "--format", "onnx"],  # not measured there
                  ["--target", "cpu", "--set", "refit.on=true"],  # depth refuses these two
                  ["--target", "cpu", "--set", "retain_by=latency"]):
        r = _run(optimize, [*other, "--retain", "0.7", "--dry-run"])
        assert r.exit_code == 0 and "method: activation" in r.output and "depth" not in r.output, other


def test_h100_with_an_old_vllm_sees_the_2to4_kernel(tiny_dirs):
    r = _run(optimize, [tiny_dirs["llama"], "--target", "h100", "--dry-run", "--set", "engine_version=0.18.0"])
    assert r.exit_code == 0 and "2:4 kernel available" in r.output


def test_help_is_a_page_and_help_all_lists_every_setting():
    """--help: the options a person reads, the frontier search's --max-loss, --min-speedup and
    --measure among them; every other setting is --set / --config, listed by --help-all from the dataclasses."""
    import click
    from optimizer import config
    ctx = click.Context(optimize)
    names = {name for p in optimize.get_params(ctx) if isinstance(p, click.Option) for name in p.opts}
    working = [p for p in optimize.get_params(ctx) if isinstance(p, click.Option)
               and not {"--help", "--help-all"} & set(p.opts)]
    assert len(working) <= 17, [p.opts for p in working]
    assert {"--target", "-t", "-o", "--out", "--format", "--retain", "--method", "--quant", "--max-loss",
            "--min-speedup", "--measure", "--heal-tokens",
            "--no-heal", "--calib", "--eval", "--resume", "--dry-run", "--set", "--config", "--help-all"} <= names
    r = _run(optimize, ["--help"])
    assert r.exit_code == 0 and "--set KEY=VALUE" in r.output and "[default: 5%]" in r.output
    assert "--ddp-lr" not in r.output and "--budget" not in r.output
    r = _run(optimize, ["--help-all"])
    assert r.exit_code == 0
    lines = r.output.splitlines()
    for key, _, _, _ in config.all_settings():
        assert any(line.split()[:1] == [key] for line in lines), key
    steps = next(line for line in lines if line.split()[:1] == ["ddp.steps"])
    assert steps.split()[1:3] == ["int", "80"] and "gate-training steps" in steps
    assert "(--heal-tokens, --no-heal: 0)" in r.output


def _settings(monkeypatch, args):
    """The OptimizeConfig the CLI builds from `args` (the pipeline not run)."""
    import optimizer.pipeline
    seen = {}
    monkeypatch.setattr(optimizer.pipeline, "optimize", lambda cfg, dry_run: seen.update(cfg=cfg, dry_run=dry_run))
    r = _run(optimize, args)
    assert r.exit_code == 0, r.output
    return seen["cfg"]


def test_set_parses_each_settings_type(monkeypatch):
    cfg = _settings(monkeypatch, ["--set", "ddp.steps=120", "--set", "heal.lr=1e-4", "--set", "data.seq_len=1024",
                                  "--set", "seed=3", "--set", "onnx.int8=qdq", "--set", "data.eval_windows=none",
                                  "--set", "refit.on=false", "--set", "heal.data=a.txt, b.jsonl", "--set", "sparsity=4:8",
                                  "--set", "heal.seq-len=64", "--set", "ddp.lr_end=0"])
    assert (cfg.ddp.steps, cfg.heal.lr, cfg.data.seq_len, cfg.seed, cfg.onnx.int8) == (120, 1e-4, 1024, 3, "qdq")
    assert cfg.data.eval_windows is None and cfg.refit.on is False and cfg.heal.data == ["a.txt", "b.jsonl"]
    assert (cfg.sparsity, cfg.heal.seq_len, cfg.ddp.lr_end) == ("4:8", 64, 0.0)
    assert isinstance(cfg.ddp.steps, int) and isinstance(cfg.ddp.lr_end, float)
    default = _settings(monkeypatch, [])
    assert default.refit.on is None and default.heal.tokens == 36_864 and default.retain is None


def test_a_config_file_nested_or_dotted_then_set_then_options(monkeypatch, tmp_path):
    """--config first, --set over it, the command line's options over both; YAML's own typing is not
    used (an unquoted 2:4 stays the pattern, not the base-60 number 124); JSON is YAML."""
    f = tmp_path / "run.yaml"
    f.write_text("ddp:\n  steps: 120\n  lr: 0.1\nheal.lr: 1e-4\nheal:\n  data: [a.txt, b.txt]\nsparsity: 2:4\n"
                 "retain: 0.5\nrefit: {on: true}\n")
    cfg = _settings(monkeypatch, ["--config", f, "--set", "ddp.steps=7", "--retain", "0.6"])
    assert (cfg.ddp.steps, cfg.ddp.lr, cfg.heal.lr, cfg.heal.data) == (7, 0.1, 1e-4, ["a.txt", "b.txt"])
    assert (cfg.sparsity, cfg.retain, cfg.refit.on) == ("2:4", 0.6, True)
    j = tmp_path / "run.json"
    j.write_text(json.dumps({"ddp": {"steps": 9}, "heal.tokens": 0, "threads": None, "resume": True}))
    cfg = _settings(monkeypatch, ["--config", j, "--heal-tokens", "512"])
    assert (cfg.ddp.steps, cfg.heal.tokens, cfg.threads, cfg.resume) == (9, 512, None, True)
    assert _settings(monkeypatch, ["--config", j, "--heal-tokens", "512", "--no-heal"]).heal.tokens == 0


@pytest.mark.parametrize("args, expect", [
    (["--set", "ddp.step=3"], "unknown setting 'ddp.step' (did you mean ddp.steps"),
    (["--set", "ddp.step=3"], "ddp has: steps, batch, seq_len, lr, lr_end, beta"),
    (["--set", "seq_len=64"], "did you mean data.seq_len"),
    (["--set", "dpp.steps=3"], "sections: data, refit, ddp"),
    (["--set", "ddp=3"], "'ddp' is a section"),
    (["--set", "ddp.steps=abc"], "ddp.steps takes an integer, got 'abc'"),
    (["--set", "ddp.steps=1.5"], "ddp.steps takes an integer"),
    (["--set", "heal.lr=fast"], "heal.lr takes a number or none, got 'fast'"),
    (["--set", "resume=maybe"], "resume takes true or false"),
    (["--set", "ddp.steps"], "--set takes KEY=VALUE"),
    (["--config", "/no/such/file.yaml"], "--config /no/such/file.yaml: No such file"),
    (["--set", "onnx.int8=static", "--dry-run"], "unknown onnx.int8 'static'"),
])
def test_a_bad_setting_is_one_line_exit_2(tmp_path, args, expect):
    _bad(tmp_path, ["--target", "a100", *args], expect)


def test_a_bad_config_file_is_one_line_exit_2(tmp_path):
    f = tmp_path / "bad.yaml"
    for text, expect in (("ddp: {steps: [1, 2]}", "ddp.steps takes an integer"), ("- a\n- b", "expected a mapping"),
                         ("ddp: {steps: 1", "not YAML or JSON"), ("heal: {tokns: 5}", "did you mean heal.tokens")):
        f.write_text(text)
        _bad(tmp_path, ["--config", f], expect)


@pytest.mark.parametrize("args", [["--method", "wanda", "--set", "refit.on=true"],
                                  ["--method", "semi-structured", "--set", "refit.on=yes", "--set", "refit.damp=0.2"]])
def test_a_refit_asked_for_where_it_does_not_apply_is_refused(tmp_path, args):
    """The default refit (refit.on none) is skipped quietly where it does not apply; one asked for is refused."""
    _bad(tmp_path, ["--target", "a100", "--dry-run", *args], "refit.on=true: the refit applies to structured methods")


def _bad(tmp_path, args, expect):
    out = tmp_path / "out"
    r = CliRunner().invoke(optimize, [str(a) for a in args] + ["-o", str(out)])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and expect in lines[0], r.output
    assert not out.exists() and _leftovers(tmp_path) == []


def test_unknown_target(tiny_dirs, tmp_path):
    _bad(tmp_path, [tiny_dirs["llama"], "--target", "a999"], "unknown target 'a999'")


@pytest.mark.parametrize("retain", ["0", "-0.1", "1.5"])
def test_retention_out_of_range(tiny_dirs, tmp_path, retain):
    _bad(tmp_path, [tiny_dirs["llama"], "--target", "a100", "--retain", retain], "--retain must be in (0, 1]")


def test_missing_model(tmp_path):
    _bad(tmp_path, [tmp_path / "nope", "--target", "a100"], "no such file or directory")


def test_corrupt_model(tmp_path, tiny_dirs):
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    _bad(tmp_path, [bad, "--target", "a100"], "config.json is not valid JSON")
    (bad / "config.json").write_text((tiny_dirs["llama"] / "config.json").read_text())
    _bad(tmp_path, [bad, "--target", "a100"], "no weights")
    (bad / "model.safetensors").write_bytes(b"garbage" * 100)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bad / f).write_text((tiny_dirs["llama"] / f).read_text())
    _bad(tmp_path, [bad, "--target", "a100", "--set", "data.calib_windows=1",
         "--set", "data.eval_windows=1"], "could not load the model")


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\x00" * 10)
    _bad(tmp_path, [f, "--target", "a100"], "must be GGUF")


def test_a_gguf_of_an_unknown_architecture_is_refused_from_its_metadata(tmp_path, monkeypatch):
    """Before anything is de-quantised: the header alone says 'falcon' (no adapter: not a LLaMA-style
    decoder; a real GGUF's metadata, here without its tensors), and a .gguf that is not one is a
    one-line error too."""
    import gguf

    from optimizer import load
    monkeypatch.setattr(load, "cache_dir", lambda: tmp_path / "cache")
    f = tmp_path / "falcon-7b.gguf"
    w = gguf.GGUFWriter(str(f), "falcon")
    w.add_block_count(18)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert load.gguf_metadata(f, "falcon.block_count") == 18
    _bad(tmp_path, [f, "--target", "a100"], "unsupported architecture 'falcon' (GGUF metadata)")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00" * 10)
    _bad(tmp_path, [junk, "--target", "a100"], "could not read the GGUF metadata")
    assert not (tmp_path / "cache").exists()


def test_unsupported_architecture(tmp_path, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel
    d = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(d)
    _bad(tmp_path, [d, "--target", "a100"], "unsupported architecture 'gpt2'")


def test_hub_id_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _bad(tmp_path, ["someorg/some-model-that-is-not-cached", "--target", "a100"], "could not download")


def test_empty_and_binary_calibration_files(tiny_dirs, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    _bad(tmp_path, [tiny_dirs["llama"], "--target", "a100", "--calib", empty], "the file is empty")
    binary = tmp_path / "calib.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    _bad(tmp_path, [tiny_dirs["llama"], "--target", "a100", "--calib", binary], "not a text file")
    _bad(tmp_path, [tiny_dirs["llama"], "--target", "a100", "--calib", tmp_path / "missing.txt"], "no such file")


def test_unwritable_output_directory(tiny_dirs, tmp_path, text_file):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")  # a file where a directory is needed fails even for root
    r = CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--target", "a100", "--calib", str(text_file),
                                      "--no-heal", "-o", str(blocker / "pkg")])
    assert r.exit_code == 2 and "cannot write to" in r.output


def test_existing_output_directory_is_not_overwritten(tiny_dirs, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--target", "a100", "-o", str(out)])
    assert r.exit_code == 2 and "already exists" in r.output
    assert (out / "keep.txt").read_text() == "mine"


def test_failure_mid_run_leaves_no_partial_output(tiny_dirs, tmp_path, text_file, monkeypatch):
    import optimizer.evaluate

    def boom(*a, **k):
        raise RuntimeError("simulated crash during evaluation")
    monkeypatch.setattr(optimizer.evaluate, "perplexity", boom)
    with pytest.raises(RuntimeError):
        CliRunner().invoke(optimize, [str(tiny_dirs["llama"]), "--target", "a100", "--calib", str(text_file),
                                      "--eval", str(text_file), "--set", "data.seq_len=64", "--no-heal",
                                      "-o", str(tmp_path / "new" / "dirs" / "pkg")],
                           catch_exceptions=False)
    assert list(tmp_path.iterdir()) == []  # nor the directories -o asked for above the package


@pytest.mark.slow
def test_sigterm_mid_run_leaves_no_partial_output(tiny_dirs, tmp_path, text_file):
    """`kill` (what docker stop, Kubernetes and batch schedulers send) cleans up like Ctrl-C."""
    import os
    import signal
    import subprocess
    import sys
    import time
    cmd = [sys.executable, "-c", "from optimizer.cli import optimize; optimize()", str(tiny_dirs["llama"]),
           "--target", "a100", "--method", "ddp", "--calib", str(text_file), "--eval", str(text_file),
           "--set", "data.seq_len=64", "--set", "ddp.steps=100000", "--no-heal", "--set", "threads=1",
           "-o", str(tmp_path / "pkg")]
    env = {**os.environ, "OPTIMIZER_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.time() + 120
        while not any(p.name.startswith(".pkg.tmp-") for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.time() < deadline, "the run ended before its temporary directory appeared"
            time.sleep(0.2)
        time.sleep(1.0)  # into the training loop
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 143, output
    assert "terminated (SIGTERM); no output was written" in output
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == []


def test_a_sigterm_something_swallowed_still_stops_the_job(tmp_path):
    """`staged`'s handler's exception can land in a finaliser that ignores it (before training, or off
    the main thread, where `StopAfterStep` does not hold the signal); the training loop stops on the
    flag after that step, checkpointed, and the temporary directory goes as for any other end."""
    import torch

    from optimizer import job, training
    from optimizer.errors import Terminated

    class SwallowsTheSignal:  # a method whose first step receives SIGTERM inside a finaliser
        step_count = 0
        saved = []

        def load(self, ckpt):
            return False

        def save(self, ckpt):
            self.saved.append(self.step_count)

        def step(self, batch):
            if self.step_count == 0:
                try:
                    training.terminated(15, None)
                except Terminated:
                    pass  # "Exception ignored in: <function __del__ ...>"
            self.step_count += 1
            return {}

    method = SwallowsTheSignal()
    with pytest.raises(Terminated):
        with job.staged(tmp_path / "pkg"):
            training.Trainer().train(method, torch.zeros(4, 8, dtype=torch.long), steps=100, batch=1,
                                     ckpt=tmp_path / "ckpt", desc="t", postfix=lambda stats: {})
    assert method.step_count == 1 and method.saved == [1]  # stopped after the first step, checkpointed
    assert list(tmp_path.iterdir()) == []
    with job.staged(tmp_path / "next"):
        training.stop_if_terminated()  # the next job starts without the old request


class _SignalledMethod:
    """A TrainedMethod stand-in whose step `at` sends itself `signals` (os.kill) mid-step."""

    def __init__(self, at: int, signals: list[int]):
        self.step_count, self.at, self.signals, self.saved = 0, at, signals, []

    def load(self, ckpt):
        return False

    def save(self, ckpt):
        self.saved.append(self.step_count)

    def step(self, batch):
        import os
        if self.step_count == self.at:
            for sig in self.signals:
                os.kill(os.getpid(), sig)
        x = sum(range(1000))  # bytecodes after the signal: the handler has run by the step's end
        self.step_count += 1
        return {"x": x}


def _train(method, tmp_path, steps=100, log=print, resume=False, max_time_s=None):
    import torch

    from optimizer.training import Trainer
    return Trainer(resume=resume, seed=0, log=log).train(
        method, torch.zeros(4, 8, dtype=torch.long), steps=steps, batch=1, ckpt=tmp_path / "ckpt", desc="healing",
        postfix=lambda stats: {}, max_time_s=max_time_s)


def test_the_time_cap_checkpoints_and_a_finished_checkpoint_is_not_written_again(tmp_path):
    capped = _SignalledMethod(at=-1, signals=[])
    assert _train(capped, tmp_path, max_time_s=0)["resumed_from_step"] == 0
    assert capped.step_count == 1 and capped.saved == [1]  # stopped by the cap after one step, checkpointed
    done = _SignalledMethod(at=-1, signals=[])
    done.load = lambda ckpt: setattr(done, "step_count", 4) or True  # a checkpoint of the finished run
    assert _train(done, tmp_path, steps=4, resume=True)["resumed_from_step"] == 4
    assert done.step_count == 4 and done.saved == []


def test_a_checkpoint_write_stopped_by_an_exception_leaves_no_partial_file(tmp_path, monkeypatch):
    import torch

    from optimizer.methods.base import TrainedMethod

    class Tiny(TrainedMethod):
        def identity(self):
            return {"run": "tiny"}

        def state(self):
            return {"step_count": self.step_count}

    method = Tiny()
    method.save(tmp_path / "ckpt.pt")  # the previous checkpoint

    def interrupted(obj, path):
        open(path, "wb").write(b"half")
        raise KeyboardInterrupt()  # a second Ctrl-C while the stop's checkpoint is written
    monkeypatch.setattr(torch, "save", interrupted)
    method.step_count = 5
    with pytest.raises(KeyboardInterrupt):
        method.save(tmp_path / "ckpt.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert torch.load(tmp_path / "ckpt.pt")["step_count"] == 0


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_mid_training_ends_the_step_checkpoints_it_and_stops(tmp_path, sig, monkeypatch, capfd):
    """SIGTERM or Ctrl-C during a step lets that step finish, writes the checkpoint (whole steps, so
    --resume continues the same run) and then unwinds as before; the handlers are put back."""
    import signal

    from optimizer import training
    from optimizer.errors import Terminated
    monkeypatch.setattr(training, "_termination_requested", False)  # put back whatever this test leaves
    name = "Ctrl-C" if sig == "SIGINT" else "SIGTERM"
    logged = []
    method = _SignalledMethod(at=2, signals=[getattr(signal, sig)])
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(Terminated if sig == "SIGTERM" else KeyboardInterrupt):
        _train(method, tmp_path, log=logged.append)
    assert method.step_count == 3 and method.saved == [3]  # the signalled step finished, then its checkpoint
    assert logged[-1] == (f"healing: stopped by {name} after step 3 of 100, "
                          "checkpointed: the same command with --resume continues from there")
    assert f"{name}: stopping after this training step" in capfd.readouterr().err
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_signal_in_the_last_step_checkpoints_it_once(tmp_path, monkeypatch):
    import signal

    from optimizer import training
    from optimizer.errors import Terminated
    monkeypatch.setattr(training, "_termination_requested", False)
    method = _SignalledMethod(at=3, signals=[signal.SIGTERM])
    with pytest.raises(Terminated):
        _train(method, tmp_path, steps=4)
    assert method.step_count == 4 and method.saved == [4]  # the end's checkpoint, not written again


def test_a_second_signal_stops_training_at_once(tmp_path, monkeypatch):
    import signal

    from optimizer import training
    from optimizer.errors import Terminated
    monkeypatch.setattr(training, "_termination_requested", False)
    method = _SignalledMethod(at=1, signals=[signal.SIGTERM, signal.SIGTERM])
    with pytest.raises(Terminated):
        _train(method, tmp_path)
    assert method.step_count == 1 and method.saved == []  # not a whole step: no checkpoint of it


def test_an_ignored_ctrl_c_stays_ignored_while_training(tmp_path):
    """A job started with `&` ignores SIGINT; training must not start heeding it."""
    import signal
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        method = _SignalledMethod(at=1, signals=[signal.SIGINT])
        _train(method, tmp_path, steps=4)
        assert method.step_count == 4 and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_killed_runs_temporary_directory_is_swept_at_the_next_start(tmp_path):
    """SIGKILL cannot be trapped: the next run beside it removes what the dead process left."""
    import subprocess
    import sys

    from optimizer.job import prepare_output
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".old.tmp-{int(dead.stdout)}-abcd"
    stale.mkdir()
    (stale / "model.safetensors").write_text("half")
    mine = tmp_path / ".mine.tmp-1-abcd"  # pid 1 lives: not ours to remove
    mine.mkdir()
    tmp = prepare_output(tmp_path / "new")
    assert not stale.exists() and mine.exists() and tmp.exists()


def test_profiles_and_detect_commands():
    r = _run(profiles, [])
    assert r.exit_code == 0 and "h200" in r.output and "rtx5090" in r.output
    r = _run(profiles, ["--engine-version", "0.18.0"])  # the choice matrix at another vLLM
    assert r.exit_code == 0 and "--quant auto (vLLM 0.18.0)" in r.output
    r = _run(profiles, ["--engine-version", "latest"])
    assert r.exit_code == 2 and "not a version" in r.output
    r = _run(detect, [])
    assert r.exit_code == 0 and ("No NVIDIA driver" in r.output or "GPU" in r.output)


def test_a_gguf_head_that_is_the_embedding_quantised_again_is_tied_back():
    """llama.cpp may store a tied model's head as its own tensor; the converted model must not gain
    an untied vocab × hidden matrix (a distinct head stays untied)."""
    import copy

    import torch

    from optimizer.load import retie_duplicated_head
    from tests.conftest import tiny_config
    from transformers import AutoModelForCausalLM
    cfg = tiny_config("llama")
    cfg.tie_word_embeddings = False
    model, distinct = AutoModelForCausalLM.from_config(cfg), AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        model.lm_head.weight.copy_(embed + 0.05 * embed.std() * torch.randn_like(embed))
    params = sum(p.numel() for p in model.parameters())
    assert retie_duplicated_head(model) and model.config.tie_word_embeddings
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert sum(p.numel() for p in model.parameters()) == params - embed.numel()
    assert not retie_duplicated_head(distinct) and distinct.lm_head.weight is not distinct.get_input_embeddings().weight


@pytest.mark.slow
def test_the_ideal_ratio_leaves_out_an_untied_input_embedding(tmp_path, tokenizer, text_file):
    """A decode step streams the blocks and the LM head; an untied input embedding is looked up a row
    a token, so it counts in the parameters but not in the ideal byte ratio."""
    from tests.conftest import tiny_config
    from transformers import AutoModelForCausalLM
    cfg = tiny_config("llama", vocab_size=len(tokenizer))
    cfg.tie_word_embeddings = False
    d = tmp_path / "untied"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    out = tmp_path / "pkg"
    r = CliRunner().invoke(optimize, [str(d), "--target", "a100", "--method", "activation", "--retain", "0.6",
                                      "--calib", str(text_file), "--eval", str(text_file), "--set", "data.seq_len=64",
                                      "--set", "data.calib_windows=2", "--set", "data.eval_windows=1", "--no-heal",
                                      "--quant", "none", "-o", str(out)])
    assert r.exit_code == 0, r.output
    size = json.loads((out / "manifest.json").read_text())["size"]
    lookup = cfg.vocab_size * cfg.hidden_size
    assert size["lookup_params"] == lookup
    assert size["ideal_ratio"] == pytest.approx((size["params_dense"] - lookup) / (size["params_pruned"] - lookup))
    assert size["ideal_ratio"] > size["params_dense"] / size["params_pruned"]
