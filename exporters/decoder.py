"""A LLaMA-style decoder as plain tensor code whose sizes come from each layer's weights.

Why not trace the transformers model itself: its attention modules take their head counts
from the config, which holds one global value, while a pruned model may keep a different
number of query heads, KV heads and MLP channels in every layer. Here every layer reads its
own sizes from its tensors (q rows / head_dim = query heads, k rows / head_dim = KV heads,
gate rows = MLP width), so any per-layer layout exports; and the code uses only basic tensor
ops (no cache objects, no mask helpers), so the TorchScript tracer turns it into standard
ONNX ops that every onnxruntime build runs.

Covered: RMSNorm, default RoPE (others are refused: their frequencies depend on settings
this code does not model), grouped-query attention, q/k/v/o biases (Qwen2, and Qwen2 saved
as LLaMA), Qwen3's per-head q/k RMSNorm, Mistral's sliding window, SiLU-gated MLP (with
biases if present), tied or untied LM head. Numerics follow transformers' eager path: norms
and softmax in fp32, everything else in the export dtype.

Inputs / outputs follow the ONNX ecosystem's decoder names (optimum, onnxruntime-genai):
input_ids [B, S], attention_mask [B, P+S] (1 = real token, 0 = padding), position_ids [B, S],
past_key_values.{i}.key|value [B, kv_heads_i, P, head_dim] → logits [B, S, vocab],
present.{i}.key|value [B, kv_heads_i, P+S, head_dim]. Causality is by cache index, so left
padding works as in transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.errors import UserError


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's sizes, as read from its weights."""
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    sliding_window: int | None = None


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_theta(config) -> float:
    """The RoPE base; any RoPE other than the default one is refused with a clear message."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise UserError(f"ONNX export supports the default RoPE only; this model uses rope_type '{kind}'")
    if (params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0) != 1.0:
        raise UserError("ONNX export supports full-width RoPE only (partial_rotary_factor != 1)")
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None)
    if theta is None:
        raise UserError("the model config names no rope_theta")
    return float(theta)


def sliding_windows(config) -> list[int | None]:
    """Per-layer attention window (None = full), as transformers applies it per family."""
    n, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    if getattr(config, "use_sliding_window", None) is False:
        return [None] * n
    return [window] * n  # Mistral: one window on every layer when set


def layer_shapes(model) -> list[LayerShape]:
    config, d = model.config, head_dim(model.config)
    windows = sliding_windows(config)
    shapes = []
    for i, block in enumerate(model.model.layers):
        a, m = block.self_attn, block.mlp
        q_rows, k_rows = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
        if q_rows % d or k_rows % d or a.v_proj.weight.shape[0] != k_rows or a.o_proj.weight.shape[1] != q_rows:
            raise UserError(f"layer {i}: projection sizes q {q_rows}, k {k_rows} do not split into heads of {d}")
        heads, kv = q_rows // d, k_rows // d
        if heads % kv:
            raise UserError(f"layer {i}: {heads} query heads do not split evenly over {kv} KV heads")
        width = m.gate_proj.weight.shape[0]
        if m.up_proj.weight.shape[0] != width or m.down_proj.weight.shape[1] != width:
            raise UserError(f"layer {i}: gate/up/down widths disagree")
        shapes.append(LayerShape(heads, kv, width, windows[i]))
    return shapes


def _check_supported(model) -> None:
    config = model.config
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UserError(f"ONNX export supports SiLU-gated MLPs only; this model uses '{act}'")
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
        raise UserError(f"{type(model).__name__}: not a LLaMA-style decoder (model.model.layers)")


def _t(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # .to() returns the same tensor when the dtype already matches: fp32 export shares storage.
    return None if x is None else x.detach().to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", _t(weight, dtype))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Linear(nn.Module):
    def __init__(self, lin: nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", _t(lin.weight, dtype))
        self.register_buffer("bias", _t(lin.bias, dtype))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Layer(nn.Module):
    def __init__(self, block, shape: LayerShape, d: int, eps: float, dtype: torch.dtype):
        super().__init__()
        a, m = block.self_attn, block.mlp
        self.shape, self.d, self.scale = shape, d, d ** -0.5
        self.input_norm = RMSNorm(block.input_layernorm.weight, eps, dtype)
        self.post_norm = RMSNorm(block.post_attention_layernorm.weight, eps, dtype)
        self.q, self.k, self.v, self.o = (Linear(x, dtype) for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
        self.q_norm = RMSNorm(a.q_norm.weight, a.q_norm.variance_epsilon, dtype) if hasattr(a, "q_norm") else None
        self.k_norm = RMSNorm(a.k_norm.weight, a.k_norm.variance_epsilon, dtype) if hasattr(a, "k_norm") else None
        self.gate, self.up, self.down = (Linear(x, dtype) for x in (m.gate_proj, m.up_proj, m.down_proj))

    def forward(self, x, cos, sin, allowed, past_k, past_v):
        b, s = x.shape[0], x.shape[1]
        kv, rep, d = self.shape.num_kv_heads, self.shape.num_heads // self.shape.num_kv_heads, self.d
        h = self.input_norm(x)
        q = self.q(h).reshape(b, s, kv * rep, d)
        k = self.k(h).reshape(b, s, kv, d)
        v = self.v(h).reshape(b, s, kv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # [B, heads, S, d]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)  # [B, kv, T, d]: present
        # GQA without copying K/V: query heads grouped as [kv, rep] (head h uses KV head h // rep)
        # and K/V broadcast over the group axis by MatMul.
        qg = q.reshape(b, kv, rep, s, d)
        scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * self.scale   # [B, kv, rep, S, T]
        scores = scores.float()
        scores = torch.where(allowed, scores, torch.tensor(torch.finfo(torch.float32).min))
        probs = torch.softmax(scores, dim=-1).to(x.dtype)
        out = torch.matmul(probs, v.unsqueeze(2))                                  # [B, kv, rep, S, d]
        out = out.permute(0, 3, 1, 2, 4).reshape(b, s, kv * rep * d)
        x = x + self.o(out)
        h = self.post_norm(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x, k, v


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Decoder(nn.Module):
    """forward(input_ids, attention_mask, position_ids, *past) -> (logits, *presents)."""

    def __init__(self, model, dtype: torch.dtype = torch.float32):
        super().__init__()
        _check_supported(model)
        config = model.config
        self.shapes = layer_shapes(model)
        self.d = head_dim(config)
        self.dtype = dtype
        eps = config.rms_norm_eps
        inner = model.model
        self.register_buffer("embed", _t(inner.embed_tokens.weight, dtype))
        self.layers = nn.ModuleList(Layer(b, s, self.d, eps, dtype) for b, s in zip(inner.layers, self.shapes))
        self.norm = RMSNorm(inner.norm.weight, eps, dtype)
        head = model.get_output_embeddings()
        self.tied = head.weight is inner.embed_tokens.weight
        self.head = None if self.tied else Linear(head, dtype)
        theta = rope_theta(config)
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.d, 2, dtype=torch.int64).float() / self.d))
        self.register_buffer("inv_freq", inv_freq)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, input_ids, attention_mask, position_ids, *past):
        x = F.embedding(input_ids, self.embed)
        freqs = position_ids.unsqueeze(-1).float() * self.inv_freq            # [B, S, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(self.dtype).unsqueeze(1), emb.sin().to(self.dtype).unsqueeze(1)
        masks = self._masks(input_ids, attention_mask)
        presents = []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, masks[layer.shape.sliding_window], past[2 * i], past[2 * i + 1])
            presents += [k, v]
        x = self.norm(x)
        logits = self.head(x) if self.head is not None else self._tied_logits(x)
        return (logits, *presents)

    def _tied_logits(self, x):
        """x E^T computed as (E x^T)^T, so the graph multiplies by the embedding tensor itself.

        With F.linear the exporter folds E^T into a second, transposed copy of the table (113 MB
        more for SmolLM2's 49152 x 576); transposing the activations instead costs little.
        """
        flat = x.reshape(-1, x.shape[-1])
        return torch.matmul(self.embed, flat.t()).t().reshape(x.shape[:-1] + (self.embed.shape[0],))

    def _masks(self, input_ids, attention_mask) -> dict:
        """[B, 1, 1, S, T] booleans per distinct window: causal by cache index, padding, window."""
        kv_idx = torch.cumsum(torch.ones_like(attention_mask[0]), 0) - 1          # 0..T-1
        back = torch.cumsum(torch.ones_like(input_ids[0]).flip(0), 0).flip(0)     # S..1
        q_idx = kv_idx[-1:] + 1 - back                                            # T-S..T-1
        dist = q_idx.unsqueeze(1) - kv_idx.unsqueeze(0)                           # [S, T]
        pad = attention_mask.bool()[:, None, None, None, :]
        out = {}
        for w in {s.sliding_window for s in self.shapes}:
            ok = dist >= 0 if w is None else (dist >= 0) & (dist < w)
            out[w] = ok[None, None, None] & pad
        return out

    def input_names(self) -> list[str]:
        return ["input_ids", "attention_mask", "position_ids"] + \
            [f"past_key_values.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]

    def output_names(self) -> list[str]:
        return ["logits"] + [f"present.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")]

    def empty_past(self, batch: int) -> list[torch.Tensor]:
        return [torch.zeros(batch, s.num_kv_heads, 0, self.d, dtype=self.dtype)
                for s in self.shapes for _ in range(2)]
