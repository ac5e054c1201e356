"""Write a vLLM serving package: checkpoint + tokenizer + manifest + report + launcher + Dockerfile.

Everything is written into a temporary sibling directory and renamed into place at the
end, so a failure never leaves a half-written package behind.

The package is a plain Hugging Face directory (vLLM serves it as `--model PACKAGE`); the
other files are ignored by engines:
  manifest.json  what `serve` and `bench` read (and nothing else): source, target, method,
                 retention, measured quality, engine requirement and recommended arguments
                 (core/manifest.py)
  report.md      the same for a person, with the planner's reasoning; this module adds its
                 Serving section (`report_section`)
  launch.sh      starts vLLM's OpenAI-compatible server from this directory
  Dockerfile     the same on an official vLLM image (template in docker/)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from core.engines import DEFAULT_VLLM, server_command
from core.manifest import Engine, Manifest

DOCKER_DIR = Path(__file__).resolve().parents[1] / "docker"


def image_version(engine: Engine) -> str:
    """The official vLLM image the package's Dockerfile builds on (2:4 packages name an older one)."""
    return engine.image_version or DEFAULT_VLLM


def recommended_args(target_kind: str, max_model_len: int) -> list[str]:
    # Nothing GPU-specific: vLLM's CPU backend reads --gpu-memory-utilization as a fraction
    # of host memory and refuses to start when it is not free, so the engine default stays.
    return ["--dtype", "bfloat16", "--max-model-len", str(max_model_len)]


def recommended_env(target_kind: str) -> dict[str, str]:
    # vLLM's CPU backend sizes its KV cache from this variable (GiB); a 135M model needs little.
    return {"VLLM_CPU_KVCACHE_SPACE": "2"} if target_kind == "cpu" else {}


def engine_section(target_kind: str, max_model_len: int, served_model_name: str) -> dict:
    """The manifest's `engine` entry: what `serve` runs and what the package needs."""
    return {"name": "vllm", "tested_with": "vllm-cpu 0.32.0",
            "requires": "a vLLM whose LlamaForCausalLM / Qwen3 / Mistral read config.head_dim",
            "served_model_name": served_model_name,
            "args": recommended_args(target_kind, max_model_len),
            "env": recommended_env(target_kind)}


# compressed-tensors' description of a 2:4 model stored in plain dense tensors (methods.md §4).
# Only engines with a 2:4 kernel get it: vLLM 0.19+ refuses any sparsity_config with targets.
def sparse24_quantization_config(global_sparsity: float) -> dict:
    return {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "dense", "version": "0.9.1", "config_groups": {},
        "sparsity_config": {"format": "dense", "sparsity_structure": "2:4",
                            "global_sparsity": round(global_sparsity, 4),
                            "targets": ["Linear"], "ignore": ["lm_head"]}}}


# What `serve` adds when the installed vLLM has no 2:4 kernel but the package carries the
# sparsity_config for one: vLLM then reads no quantization config and serves the zeros densely.
DENSE_FALLBACK_ARGS = ["--hf-overrides", json.dumps({"quantization_config": None})]


# What a quantized Linear writes besides its bias: its integer / fp8 / packed weight and the scales
# the quantization computed (kept fp32: the served model's are then the evaluated model's).
QUANTIZED_TENSORS = {"weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx"}


def _cast_unquantized(model, dtype: torch.dtype) -> None:
    """Every floating tensor to `dtype` but a quantized Linear's weight and scales (`Module.to`
    would cast fp8 weights too: torch counts float8 as floating point)."""
    for module in model.modules():
        quantized = getattr(module, "quantization_scheme", None) is not None
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if t.is_floating_point() and not (quantized and name in QUANTIZED_TENSORS):
                t.data = t.data.to(dtype)


def write_package(tmp: Path, out: Path, model, tokenizer, manifest: Manifest, report_md: str,
                  dtype: torch.dtype = torch.bfloat16, config_extra: dict | None = None,
                  finish_checkpoint=None) -> Path:
    """Fill `tmp` and rename it to `out`. The caller removes `tmp` if this raises.

    `config_extra` is merged into config.json as written (e.g. a compressed-tensors
    `quantization_config`), where transformers' config object would reinterpret it.
    `finish_checkpoint(tmp)` then rewrites the checkpoint as the source family's (the adapter's:
    Phi-3's fused projections). `report_md` is the report up to its plan; the Serving section
    is added here.
    """
    compressor = None
    if any(getattr(m, "quantization_scheme", None) is not None for m in model.modules()):
        # --quant (optimizer/quantize.py): the weights become the checkpoint's int8 / fp8 tensors
        # and scales, and compressed-tensors writes the quantization_config vLLM reads
        from compressed_tensors.compressors import ModelCompressor
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
    _cast_unquantized(model, dtype)
    model.config.dtype = dtype
    model.save_pretrained(tmp, safe_serialization=True)
    if compressor is not None:
        compressor.update_config(str(tmp))
    if config_extra:
        cfg_path = tmp / "config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **config_extra}, indent=2) + "\n")
    if finish_checkpoint is not None:
        finish_checkpoint(tmp)
    tokenizer.save_pretrained(tmp)
    manifest.write(tmp)
    (tmp / "report.md").write_text(f"{report_md}\n\n{report_section(manifest)}")
    _write_launcher(tmp, manifest.engine)
    _write_dockerfile(tmp, manifest.target.kind, manifest.engine)
    for f in tmp.iterdir():
        f.chmod(0o755 if f.name == "launch.sh" else 0o644)
    os.replace(tmp, out.expanduser().resolve())
    return out


def internal_check(m: Manifest) -> str | None:
    """The report's line on the job's own check of the physically pruned model: against what,
    and how far apart (checks.masked_vs_pruned_max_abs_logit_diff); None where there is none."""
    diff = m.checks.get("masked_vs_pruned_max_abs_logit_diff")
    if diff is None:
        return None
    reference = ("masked (removed experts' router logits at -inf)" if "experts" in m.method else
                 "the dense model skipping the removed blocks" if "blocks" in m.method else "masked")
    return f"{reference} vs physically pruned logits differ by at most {diff:.2e}"


def report_section(m: Manifest) -> str:
    """The Serving section of a vLLM package's report.md."""
    eng, check = m.engine, internal_check(m)
    needs = f"; needs {eng.requires}" if eng.requires is not None else ""
    return "\n".join(["## Serving", "",
                      f"- engine: {eng.name} (tested with {eng.tested_with}){needs}",
                      f"- `./launch.sh` or `serve .` starts the OpenAI-compatible server with `{' '.join(eng.args)}`",
                      f"- `Dockerfile` builds the same on the official vLLM image v{image_version(eng)}",
                      *([f"- internal check: {check}"] if check else []), ""])


def _write_launcher(tmp: Path, engine: Engine) -> None:
    env = "".join(f'export {k}="${{{k}:-{v}}}"\n' for k, v in engine.env.items())
    cmd = " ".join(server_command('"$HERE"', engine.served_model_name, engine.args,
                                  python='"${PYTHON:-python3}"'))
    text = ("#!/usr/bin/env sh\n"
            "# Serve this package with vLLM's OpenAI-compatible server. Extra arguments go to vLLM,\n"
            "# e.g. ./launch.sh --port 8000 --tensor-parallel-size 2\n"
            "set -e\n"
            'HERE="$(cd "$(dirname "$0")" && pwd)"\n'
            f"{env}exec {cmd} \"$@\"\n")
    path = tmp / "launch.sh"
    path.write_text(text)
    path.chmod(0o755)


def _write_dockerfile(tmp: Path, target_kind: str, engine: Engine) -> None:
    template = DOCKER_DIR / ("vllm-cpu.Dockerfile" if target_kind == "cpu" else "vllm-gpu.Dockerfile")
    entry = server_command("/package", engine.served_model_name, engine.args, python="python3")
    env = "".join(f"ENV {k}={v}\n" for k, v in engine.env.items())
    text = (template.read_text().replace("{{ENTRYPOINT}}", json.dumps(entry)).replace("{{ENV}}", env)
            .replace("{{VLLM_VERSION}}", "v" + image_version(engine)))
    (tmp / "Dockerfile").write_text(text)
