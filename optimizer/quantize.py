"""Quantize: the decoder's weights (and activations) to the precision the target accelerates.

The stage after healing (`job.Job.run`, `--quant`). Every Linear of the decoder blocks gets one
of compressed-tensors' preset schemes (`PRESETS`) through the library itself, so the checkpoint
is in the format stock vLLM loads with no flag; the embedding and the LM head stay 16-bit (vLLM
cannot use a quantized tied embedding). What this module computes is the weights' scales:
symmetric absmax per output channel, round to nearest (`weight_scales`). Activations are
quantized dynamically, per token, at run time: nothing to calibrate for them.

After `quantize` the model runs fake-quantized in PyTorch (compressed-tensors' forward wrapper
quantizes and dequantizes weights and activations on the fly), so the job's evaluation measures
the quantized model, not the 16-bit one. `compress` turns it into the checkpoint's tensors (int8
or fp8 weights and their scales) just before export; the model is not usable after it.
"""

from __future__ import annotations

import time

import torch

# --quant → compressed-tensors preset (quantization/quant_scheme.py) and what it holds
PRESETS = {
    "int8": "W8A8",         # int8 per-channel weights, dynamic per-token int8 activations
    "fp8": "FP8_DYNAMIC",   # fp8 E4M3 per-channel weights, dynamic per-token fp8 activations
}
IGNORE = ["lm_head"]        # kept 16-bit; tied to the embedding in most small models


def quantize(job, model):
    """The quantize stage: `model`'s block Linears to `job.plan.quant`, in place, fake-quantized
    from now on. Leaves the manifest's account in `job.quant_detail`."""
    precision = job.plan.quant
    started = time.time()
    n = apply(model, precision)
    weight_bytes = quantized_bytes(model)
    job.quant_detail = {"precision": precision, "scheme": PRESETS[precision], "format": "compressed-tensors",
                        "weights": "symmetric absmax per output channel, round to nearest",
                        "activations": "dynamic per token", "linears": n, "ignore": IGNORE,
                        "reason": job.plan.quant_reason, **weight_bytes, "wall_s": round(time.time() - started, 1)}
    job.log(f"quantized: {n} Linear layers to {PRESETS[precision]} ({weight_bytes['quantized_params']:,} weights, "
            f"{weight_bytes['weight_bytes'] / 1e6:.0f} MB of weights against {weight_bytes['bf16_bytes'] / 1e6:.0f} MB in bf16)")
    return model


def apply(model, precision: str) -> int:
    """Attach the preset's scheme to every Linear but IGNORE and fill its weight scales.
    Returns how many Linear layers were quantized."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(PRESETS[precision], ["Linear"])},
                                ignore=IGNORE)
    apply_quantization_config(model, config)
    n = 0
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        scale, zero_point = weight_scales(module.weight.detach(), scheme.weights)
        with torch.no_grad():
            module.weight_scale.copy_(scale.to(module.weight_scale.dtype))
            module.weight_zero_point.copy_(zero_point.to(module.weight_zero_point.dtype))
        n += 1
    return n


def weight_scales(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel scales: the row's largest magnitude maps to the format's
    largest value (127.5 steps a side for int8, 448 for fp8 E4M3: the library's rule)."""
    from compressed_tensors.quantization.utils import calculate_qparams
    w = weight.float()
    return calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)


def quantized_bytes(model) -> dict:
    """Weight bytes as the checkpoint holds them: 1 byte a quantized weight (plus a 2-byte scale
    per channel), 2 bytes (bf16) for everything else; against all-bf16."""
    seen, quantized, scales, other = set(), 0, 0, 0
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen or not p.is_floating_point():
                continue
            seen.add(id(p))
            if getattr(module, "quantization_scheme", None) is not None and p is module.weight:
                quantized += p.numel()
            elif p.dim() > 0 and not _is_qparam(module, p):
                other += p.numel()
        if getattr(module, "quantization_scheme", None) is not None:
            scales += module.weight.shape[0]
    return {"quantized_params": quantized, "weight_bytes": quantized + 2 * scales + 2 * other,
            "bf16_bytes": 2 * (quantized + other)}


def _is_qparam(module, p) -> bool:
    return any(p is getattr(module, name, None) for name in ("weight_scale", "weight_zero_point",
                                                              "input_scale", "input_zero_point"))


def is_quantized(model) -> bool:
    return any(getattr(m, "quantization_scheme", None) is not None for m in model.modules())


def compress(model):
    """Replace the fake-quantized weights by the checkpoint's (int8 / fp8 tensors and scales) and
    return the compressor, whose `update_config(directory)` writes the quantization_config."""
    from compressed_tensors.compressors import ModelCompressor
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    return compressor
