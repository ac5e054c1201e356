"""Quantize: the decoder's weights (and activations) to the precision the target accelerates.

The stage after healing (`job.Job.run`, `--quant`). Every Linear of the decoder blocks gets one
of compressed-tensors' preset schemes (`PRESETS`) through the library itself, so the checkpoint
is in the format stock vLLM loads with no flag; the embedding and the LM head stay 16-bit (vLLM
cannot use a quantized tied embedding). What this module computes is the weights' scales:
symmetric absmax per output channel, round to nearest (`weight_scales`), after a SmoothQuant-
style migration of activation outliers into the weights (`smooth`: exact in floating point, an
absorbed per-channel scale at the four points of a block where the block's own parameters can
produce it, `optimizer/absorb.py`). Activations are quantized dynamically, per token, at run
time.

After `quantize` the model runs fake-quantized in PyTorch (compressed-tensors' forward wrapper
quantizes and dequantizes weights and activations on the fly), so the job's evaluation measures
the quantized model, not the 16-bit one. The vLLM exporter (`exporters/vllm.write_package`)
compresses it into the checkpoint's tensors (int8 or fp8 weights and their scales).
"""

from __future__ import annotations

import time

import torch

from optimizer.absorb import Transform, absorb, layout

# --quant → compressed-tensors preset (quantization/quant_scheme.py) and what it holds
PRESETS = {
    "int8": "W8A8",         # int8 per-channel weights, dynamic per-token int8 activations
    "fp8": "FP8_DYNAMIC",   # fp8 E4M3 per-channel weights, dynamic per-token fp8 activations
}
IGNORE = ["lm_head"]        # kept 16-bit; tied to the embedding in most small models
SMOOTH_ALPHA = 0.5          # SmoothQuant's migration strength (its paper's default; not tuned here)
SMOOTH_WINDOWS = 4          # calibration windows whose activation maxima the migration uses


def quantize(job, model):
    """The quantize stage: `model`'s block Linears to `job.plan.quant`, in place, fake-quantized
    from now on. Leaves the manifest's account in `job.quant_detail`."""
    precision = job.plan.quant
    started = time.time()
    windows = job.calib.train[:min(SMOOTH_WINDOWS, job.cfg.data.calib_windows)]
    smooth(model, job.adapter, windows, SMOOTH_ALPHA)
    n = apply(model, precision)
    weight_bytes = quantized_bytes(model)
    job.quant_detail = {"precision": precision, "scheme": PRESETS[precision], "format": "compressed-tensors",
                        "weights": "symmetric absmax per output channel, round to nearest",
                        "smoothing": {"alpha": SMOOTH_ALPHA, "tokens": windows.numel(),
                                      "points": "q/k/v, o, gate/up and down inputs"},
                        "activations": "dynamic per token", "linears": n, "ignore": IGNORE,
                        "reason": job.plan.quant_reason, **weight_bytes, "wall_s": round(time.time() - started, 1)}
    job.log(f"quantized: {n} Linear layers to {PRESETS[precision]} ({weight_bytes['quantized_params']:,} weights, "
            f"{weight_bytes['weight_bytes'] / 1e6:.0f} MB of weights against {weight_bytes['bf16_bytes'] / 1e6:.0f} MB in bf16)")
    return model


@torch.no_grad()
def smooth(model, adapter, windows: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> None:
    """Migrate activation outliers into the weights (SmoothQuant): at each input point of a block,
    per channel j, s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha) over the Linears reading it;
    the inputs are divided by s (absorbed upstream: norm weights, v_proj and up_proj rows) and the
    weights' columns multiplied by it. The model computes the same function; per-token int8
    activations then lose less to the few channels that dominate each token's range."""
    blocks = list(adapter.blocks(model))
    lays = [layout(b, adapter) for b in blocks]
    maxima, hooks = {}, []

    def record(key):
        def hook(module, args):
            m = args[0].detach().abs().flatten(0, -2).amax(dim=0).float()
            maxima[key] = m if key not in maxima else torch.maximum(maxima[key], m)
        return hook

    for i, (b, lay) in enumerate(zip(blocks, lays)):
        for point, name in (("attn", lay.q), ("mlp", lay.gate), ("o", lay.o), ("down", lay.down)):
            hooks.append(b.get_submodule(name).register_forward_pre_hook(record((i, point))))
    try:
        for w in windows:
            model(w[None])
    finally:
        for h in hooks:
            h.remove()
    for i, (b, lay) in enumerate(zip(blocks, lays)):
        col = lambda name: b.get_submodule(name).weight.detach().abs().amax(dim=0).float()  # noqa: E731
        w_max = {"attn": torch.stack([col(lay.q), col(lay.k), col(lay.v)]).amax(0),
                 "mlp": torch.stack([col(lay.gate), col(lay.up)]).amax(0),
                 "o": col(lay.o), "down": col(lay.down)}
        x_max = {p: maxima[(i, p)] for p in w_max}
        for p in ("o",):  # o_proj's input channel (h, d) reads v channel (h // group, d): one scale per v channel
            kv = x_max[p].numel() // (lay.group * lay.head_dim)
            x_max[p] = x_max[p].view(kv, lay.group, lay.head_dim).amax(1).reshape(-1)
            w_max[p] = w_max[p].view(kv, lay.group, lay.head_dim).amax(1).reshape(-1)
        scale = {}
        for p in w_max:
            s = x_max[p].clamp(min=1e-5) ** alpha / w_max[p].clamp(min=1e-5) ** (1 - alpha)
            scale[p] = torch.where((x_max[p] > 0) & (w_max[p] > 0), s, torch.ones_like(s)).clamp(1e-4, 1e4)
        absorb(b, adapter, Transform(scale=scale))


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
