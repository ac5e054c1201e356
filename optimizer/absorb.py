"""Exact equivalent transforms of a LLaMA-style block, for SI (sparsity induction).

A per-channel scale s > 0 and shift δ on the input of a Linear, x' = (x − δ)/s, with
W' = W diag(s) and b' = b + W δ, leave W'x' + b' = Wx + b. There are four points in a block
where the transformed input can be produced by the block's own parameters:

  attn  input of q/k/v   scale: the attention norm's weight /= s   shift: see below
  mlp   input of gate/up scale: the MLP norm's weight /= s (LLaMA's post_attention_layernorm,
        Gemma's pre_feedforward_layernorm: adapter.norms); a (1 + w) norm gets (1 + w)/s − 1
  o     input of o_proj  scale and shift: on v_proj's outputs (v' = (v − δ)/s). Softmax
        weights sum to 1, so the attention output moves by exactly the same (x − δ)/s.
        Parametrised per v_proj output channel: every query head reading a KV head sees
        its scale/shift (GQA), so o_proj's input channel (h, d) gets v channel (h // group, d).
  down  input of down_proj   scale only: up_proj rows /= s (act(gate)·up is linear in up, not
        affine in a shift, so no shift here).

An RMSNorm has no bias, so at attn/mlp the shift cannot be produced upstream: before pruning
it cancels exactly (W'(z − δ/s) + b + Wδ = W'z + b with z = y/s), and only matters once W' is
pruned to Ŵ: the transformed-then-pruned layer is Ŵ(z − δ/s) + b + Wδ. `absorb` makes the
Linear see z − δ/s through a forward pre-hook (so the pruners observe the shifted input),
and `Pending.fold()` after pruning turns it into the bias b + Wδ − Ŵδ/s and drops the hook.
The folded model equals the transformed-then-pruned one exactly, with no extra op.

Biases: the shifts put biases on q/k/v (attn), v/o (o) and gate/up (mlp). Families whose
transformers class can hold them get them (LLaMA: attention_bias, mlp_bias; Qwen3:
attention_bias; Qwen2: q/k/v biases are native). Elsewhere (Mistral; Qwen2's o/mlp; Qwen3's
mlp) SI keeps that point's shift at zero and uses its scale only — still a valid, exact
transform, so no family is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

POINTS = ("attn", "o", "mlp", "down")


@dataclass
class Transform:
    """Scale (and optional shift) per absorption point; a missing point is the identity.
    attn/mlp: [hidden]; o: [kv_heads·head_dim] (per v_proj output channel); down: [intermediate]."""
    scale: dict[str, torch.Tensor] = field(default_factory=dict)
    shift: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Layout:
    """Names (relative to the block) of the modules SI touches, and the GQA geometry."""
    attn_norm: str
    mlp_norm: str
    q: str
    k: str
    v: str
    o: str
    gate: str
    up: str
    down: str
    head_dim: int
    group: int  # query heads per KV head
    norm_offset: float = 0.0  # the norms multiply by (norm_offset + w): 1 for Gemma's (1 + w)


def layout(block, adapter) -> Layout:
    names = {id(m): n for n, m in block.named_modules()}
    q, k, v, o = adapter.attention(block)
    gate, up, down = adapter.mlp(block)
    na, nm = adapter.norms(block)
    return Layout(names[id(na)], names[id(nm)], *(names[id(m)] for m in (q, k, v, o, gate, up, down)),
                  head_dim=block.self_attn.head_dim, group=o.in_features // v.out_features,
                  norm_offset=adapter.norm_offset)


def expand_o(t: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Per-v-channel values → per-o_proj-input-channel values (query head h reads KV head h // group)."""
    kv = t.numel() // lay.head_dim
    return t.view(kv, 1, lay.head_dim).expand(kv, lay.group, lay.head_dim).reshape(-1)


def input_transforms(t: Transform, lay: Layout) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """(scale, shift) acting on each Linear's input, in that Linear's input channels."""
    out = {}
    for point, linears in (("attn", (lay.q, lay.k, lay.v)), ("mlp", (lay.gate, lay.up)), ("down", (lay.down,))):
        for name in linears:
            out[name] = (t.scale.get(point), t.shift.get(point))
    s, d = t.scale.get("o"), t.shift.get("o")
    out[lay.o] = (None if s is None else expand_o(s, lay), None if d is None else expand_o(d, lay))
    return out


def transform_tensors(params: dict[str, torch.Tensor], t: Transform, lay: Layout
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The block's parameters after transform `t` (differentiable in t), and the input shift
    σ = δ/s each hooked Linear (q/k/v, gate/up) must subtract from what it receives.
    `params` maps block-relative names to tensors; missing biases are treated as zero but
    created only where a shift needs them (the caller must have made room, see enable_biases)."""
    p = dict(params)
    shifts = {}

    def bias(name, rows):  # an absent bias is zero
        return p.get(f"{name}.bias", torch.zeros(rows, dtype=p[f"{name}.weight"].dtype,
                                                 device=p[f"{name}.weight"].device))

    for point, norm, linears in (("attn", lay.attn_norm, (lay.q, lay.k, lay.v)), ("mlp", lay.mlp_norm, (lay.gate, lay.up))):
        s, d = t.scale.get(point), t.shift.get(point)
        if s is not None:  # (offset + w) / s, written back as a weight of the same norm
            p[f"{norm}.weight"] = (p[f"{norm}.weight"] + lay.norm_offset) / s - lay.norm_offset
        for name in linears:
            w = p[f"{name}.weight"]
            if d is not None:  # b' = b + W δ with the untransformed W
                p[f"{name}.bias"] = bias(name, w.shape[0]) + w @ d
                shifts[name] = d if s is None else d / s
            if s is not None:
                p[f"{name}.weight"] = w * s[None, :]

    s, d = t.scale.get("o"), t.shift.get("o")
    if d is not None:  # v' = (v − δ)/s: bias first, then the row scale below divides it too
        p[f"{lay.v}.bias"] = bias(lay.v, p[f"{lay.v}.weight"].shape[0]) - d
        p[f"{lay.o}.bias"] = bias(lay.o, p[f"{lay.o}.weight"].shape[0]) + p[f"{lay.o}.weight"] @ expand_o(d, lay)
    if s is not None:
        p[f"{lay.v}.weight"] = p[f"{lay.v}.weight"] / s[:, None]
        if f"{lay.v}.bias" in p:
            p[f"{lay.v}.bias"] = p[f"{lay.v}.bias"] / s
        p[f"{lay.o}.weight"] = p[f"{lay.o}.weight"] * expand_o(s, lay)[None, :]

    s = t.scale.get("down")
    if s is not None:
        p[f"{lay.up}.weight"] = p[f"{lay.up}.weight"] / s[:, None]
        if f"{lay.up}.bias" in p:
            p[f"{lay.up}.bias"] = p[f"{lay.up}.bias"] / s
        p[f"{lay.down}.weight"] = p[f"{lay.down}.weight"] * s[None, :]
    return p, shifts


def fold_shift(weight: torch.Tensor, bias: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Bias that makes `weight @ z + bias` equal `weight @ (z − shift) + old bias`."""
    return bias - weight @ shift


def block_params(block, lay: Layout) -> dict[str, torch.Tensor]:
    """The tensors transform_tensors reads (norm weights, the seven Linears' weights and biases)."""
    keep = {f"{lay.attn_norm}.weight", f"{lay.mlp_norm}.weight"}
    for name in (lay.q, lay.k, lay.v, lay.o, lay.gate, lay.up, lay.down):
        keep |= {f"{name}.weight", f"{name}.bias"}
    return {n: p for n, p in block.named_parameters() if n in keep}


class Pending:
    """Shift hooks of one absorbed block; fold() after the block is pruned makes them biases."""

    def __init__(self, block, shifts: dict[str, torch.Tensor]):
        self.items = []
        for name, sigma in shifts.items():
            lin = block.get_submodule(name)
            sigma = sigma.detach().to(lin.weight.dtype)
            h = lin.register_forward_pre_hook(lambda m, a, sg=sigma: (a[0] - sg.to(a[0].device), *a[1:]))
            self.items.append((lin, sigma, h))

    @torch.no_grad()
    def fold(self) -> None:
        for lin, sigma, h in self.items:
            h.remove()
            lin.bias.copy_(fold_shift(lin.weight, lin.bias, sigma.to(lin.weight.device)))
        self.items = []


@torch.no_grad()
def absorb(block, adapter, t: Transform) -> Pending:
    """Write transform `t` into the block's parameters. The block computes the same function;
    its q/k/v and gate/up see their shifted inputs through hooks until Pending.fold()."""
    lay = layout(block, adapter)
    params = block_params(block, lay)
    dtype = torch.promote_types(params[f"{lay.q}.weight"].dtype, torch.float32)  # bf16 weights: do the algebra in fp32
    compute = {n: p.detach().to(dtype) for n, p in params.items()}
    cast = lambda d: {k: v.detach().to(dtype) for k, v in d.items()}  # noqa: E731
    new, shifts = transform_tensors(compute, Transform(cast(t.scale), cast(t.shift)), lay)
    for name, value in new.items():
        if name not in params:
            raise RuntimeError(f"{name}: the block has no parameter for this shift; call enable_biases first")
        params[name].copy_(value)
    return Pending(block, shifts)


# --- which shifts a family can hold -----------------------------------------------------

def _config_field(config, flag: str) -> bool:
    return any(flag in getattr(c, "__annotations__", {}) for c in type(config).__mro__)


def shift_support(model, adapter) -> dict[str, bool]:
    """Which points may carry a shift: their Linears already have biases, or the family's
    config class has the flag that gives them biases."""
    block = adapter.blocks(model)[0]
    q, k, v, o = adapter.attention(block)
    gate, up, _ = adapter.mlp(block)
    has = lambda *ms: all(m.bias is not None for m in ms)  # noqa: E731
    attn_flag = _config_field(model.config, "attention_bias")
    mlp_flag = _config_field(model.config, "mlp_bias")
    return {"attn": has(q, k, v) or attn_flag, "o": has(v, o) or attn_flag, "mlp": has(gate, up) or mlp_flag}


@torch.no_grad()
def enable_biases(model, adapter, points: dict[str, bool]) -> None:
    """Give every block zero biases where the enabled shifts need them, and set the config
    flag so save_pretrained/from_pretrained rebuild the same modules. Zero biases change nothing."""
    # Families with native biases (Qwen2's q/k/v) need nothing; the flags give a whole group a bias.
    attn = (points.get("attn") or points.get("o")) and _config_field(model.config, "attention_bias")
    mlp = points.get("mlp") and _config_field(model.config, "mlp_bias")
    for block in adapter.blocks(model):
        for lin in (*(adapter.attention(block) if attn else ()), *(adapter.mlp(block) if mlp else ())):
            if lin.bias is None:
                w = lin.weight
                lin.bias = nn.Parameter(torch.zeros(w.shape[0], dtype=w.dtype, device=w.device),
                                        requires_grad=w.requires_grad)
    if attn:
        model.config.attention_bias = True
    if mlp:
        model.config.mlp_bias = True
