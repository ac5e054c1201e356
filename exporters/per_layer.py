"""Write a per-layer model (surgery.prune_per_layer) as a vLLM package, in the format that fits.

  decilm  LLaMA family, one query-head count across attention blocks (KV groups, MLP widths
          and removed blocks free per layer): NVIDIA's DeciLM / nemotron-nas layout, served by
          stock vLLM's DeciLMForCausalLM (`--trust-remote-code` for the config class the
          package carries). See exporters/decilm.py.
  plugin  anything else (query heads per layer, Mistral / Qwen2 / Qwen3): our
          `<family>_per_layer` config with `layer_shapes`, served by our vLLM model classes,
          which the `vllm.general_plugins` entry point of this project registers (`pip install
          -e .`). The package also carries the plugin as a tiny installable project
          (`vllm_plugin/`, installed by the Dockerfile) for machines without this tool.

Both carry `configuration_per_layer.py` / `modeling_per_layer.py` with `auto_map`, so
transformers loads them with `trust_remote_code=True` (or natively once `exporters.plugin`
is imported).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from core.manifest import Manifest
from exporters import decilm
from exporters import vllm as vllm_export
from exporters.plugin import register_transformers

register_transformers()  # this tool's processes load what it writes natively (no remote code)

PLUGIN_DIR = Path(__file__).resolve().parent / "plugin"
REMOTE_CODE = ("configuration_per_layer.py", "modeling_per_layer.py")
PLUGIN_PACKAGE = "per_layer_vllm"  # the shipped copy's import name
PLUGIN_PYPROJECT = """\
# vLLM plugin for this package's per-layer architecture (a copy of llm-deploy-optimizer's
# exporters/plugin). Install it into the environment that runs vLLM:
#     pip install --no-deps ./vllm_plugin
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "llm-deploy-optimizer-per-layer-plugin"
version = "0.1.0"
description = "Per-layer decoder shapes for vLLM and transformers (from llm-deploy-optimizer)."
requires-python = ">=3.10"

[project.entry-points."vllm.general_plugins"]
per_layer_package = "per_layer_vllm:register"

[tool.setuptools]
packages = ["per_layer_vllm"]
"""


def choose(model, llama_layout: bool) -> tuple[str, str]:
    """('decilm' | 'plugin', why) for a model from surgery.prune_per_layer; `llama_layout`: its
    family's blocks are LLaMA's exactly (adapter.llama_layout)."""
    reason = decilm.why_not(model, llama_layout)
    if reason is None:
        return "decilm", "DeciLM (nemotron-nas) layout: stock vLLM serves it with --trust-remote-code"
    return "plugin", f"plugin architecture {model.config.architectures[0]}: {reason}"


def convert(model, fmt: str):
    return decilm.to_decilm(model) if fmt == "decilm" else model


def engine_section(fmt: str, target_kind: str, max_model_len: int, served_model_name: str) -> dict:
    e = vllm_export.engine_section(target_kind, max_model_len, served_model_name)
    if fmt == "decilm":
        e["args"] = e["args"] + ["--trust-remote-code"]
        e["requires"] = ("a vLLM with DeciLMForCausalLM (nemotron_nas.py, reads block_configs); "
                         "--trust-remote-code for the config class in this package")
    else:
        e["requires"] = ("the per-layer vLLM plugin: `pip install -e .` of llm-deploy-optimizer, or "
                         "`pip install --no-deps ./vllm_plugin` from this package (the Dockerfile does)")
        e["plugin"] = {"entry_point_group": "vllm.general_plugins", "package_dir": "vllm_plugin"}
    e["package_format"] = fmt
    return e


def write_package(tmp: Path, out: Path, model, tokenizer, manifest: Manifest, report_md: str, fmt: str,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    """Fill `tmp` like exporters.vllm does, plus the model code and the report's per-layer
    section; rename to `out` when complete."""
    for f in REMOTE_CODE:
        shutil.copy(PLUGIN_DIR / f, tmp / f)
    config_cls, model_cls = type(model.config).__name__, type(model).__name__
    model.config.auto_map = {"AutoConfig": f"configuration_per_layer.{config_cls}",
                             "AutoModelForCausalLM": f"modeling_per_layer.{model_cls}"}
    if fmt == "plugin":
        _write_plugin_project(tmp / "vllm_plugin")
    staged = tmp.with_name(tmp.name + "-staged")
    try:
        vllm_export.write_package(tmp, staged, model, tokenizer, manifest, report_md, dtype=dtype)
        with open(staged / "report.md", "a") as f:  # after the Serving section, where it always was
            f.write(report_section(manifest))
        if fmt == "plugin":
            _install_plugin_in_dockerfile(staged / "Dockerfile")
            (staged / "vllm_plugin").chmod(0o755)  # exporters.vllm sets every top-level entry to 0644
            for d in [p for p in staged.rglob("*") if p.is_dir()]:
                d.chmod(0o755)
        os.replace(staged, out.expanduser().resolve())
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return out


def _write_plugin_project(dest: Path) -> None:
    pkg = dest / PLUGIN_PACKAGE
    pkg.mkdir(parents=True)
    for f in ("__init__.py", "vllm_models.py", *REMOTE_CODE):
        shutil.copy(PLUGIN_DIR / f, pkg / f)
    (dest / "pyproject.toml").write_text(PLUGIN_PYPROJECT)


def _install_plugin_in_dockerfile(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if line.startswith("COPY . /package"))
    lines.insert(i + 1, "RUN pip install --no-cache-dir --no-deps /package/vllm_plugin\n")
    path.write_text("".join(lines))


def report_section(manifest: Manifest) -> str:
    meth, engine = manifest.method, manifest.engine
    lines = ["", "## Per-layer layout", "",
             f"- format: **{meth['format']}** — {meth['format_reason']}",
             f"- engine requirement: {engine.requires}",
             "- retention is met over all blocks to within a run of channels (DDP's budget binarisation; "
             "every MLP width a multiple the kernels take); the shape table above shows the mean block.", "",
             "| layer | query heads | KV heads | MLP channels |", "|---|---|---|---|"]
    for i, s in enumerate(meth["layer_shapes"]):
        lines.append(f"| {i} | {s['num_heads']} | {s['num_kv_heads']} | {s['intermediate_size']} |")
    return "\n".join(lines) + "\n"
