"""Expert removal for MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE): simulate it or do it.

`keep` holds one list per MoE layer (in `adapter.moe_layers(config)` order; dense layers of
Qwen MoE models have no entry): the ascending indices of the routed experts the layer keeps.
`scales` optionally holds, per MoE layer, one factor per kept expert that multiplies that
expert's output in the weighted expert sum (a learned DDP gate lands here).

- `masked_experts`: hooks, weights untouched. A forward hook on the router sets the removed
  experts' logits to -inf and redoes the family's softmax / top-k / renormalisation from them
  (`adapter.route`), so a removed expert can never be chosen and the probabilities are those
  of a router that only has the kept rows; a forward pre-hook on the fused experts module
  multiplies each token's top-k weights by the chosen expert's scale, which is the expert's
  output times its scale (whatever kernel the experts module dispatches to).
- `prune_experts`: slices the router rows and both 3-D expert tensors, folds the scales into
  the kept experts' `down_proj` slices (the experts have no biases, so this is exact), writes
  the config with fewer experts, builds a fresh model and loads the weights strictly.
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

from optimizer.adapters.mixtral import MoEAdapter, MoEParts
from optimizer.errors import UserError
from optimizer.surgery import build_model


def as_moe_adapter(adapter) -> MoEAdapter:
    if not isinstance(adapter, MoEAdapter):
        raise UserError(f"{adapter.family}: not an MoE model; expert removal needs Mixtral, Qwen2-MoE or Qwen3-MoE")
    return adapter


def moe_parts(model, adapter: MoEAdapter) -> list[MoEParts]:
    """The MoE blocks, one per MoE layer, in `keep` order."""
    blocks = adapter.blocks(model)
    return [adapter.moe(blocks[i]) for i in adapter.moe_layers(model.config)]


def check_keep(adapter: MoEAdapter, config, keep: Sequence[Sequence[int]], scales=None) -> None:
    """One ascending, unique, in-range list per MoE layer, each with at least top-k experts."""
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


def experts_to_keep(adapter: MoEAdapter, config, retain: float) -> int:
    """Routed experts per MoE layer that `--retain` keeps: floor(retain · E), so the routed experts'
    parameters never exceed the budget; at least top-k, or a one-line refusal."""
    n, k = adapter.num_experts(config), adapter.experts_per_token(config)
    keep = math.floor(retain * n + 1e-9)
    if keep < k:
        raise UserError(f"--retain {retain} keeps {keep} of {n} experts per MoE layer, fewer than the {k} every "
                        f"token is routed to (num_experts_per_tok); use --retain {math.ceil(k / n * 100) / 100:g} "
                        f"or more")
    return keep


def uniform_count(keep: Sequence[Sequence[int]]) -> int:
    counts = {len(k) for k in keep}
    if len(counts) != 1:
        raise UserError(f"MoE layers keep different numbers of experts ({sorted(len(k) for k in keep)}); "
                        f"only a uniform count exports to a stock config, per-layer expert counts need "
                        f"the vLLM plugin model, which is not built")
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
                   scales: Sequence[torch.Tensor | Sequence[float] | None] | None = None):
    """Within the block, removed experts are never routed to and kept ones are scaled.

    Per-layer counts may differ here (a simulation); `prune_experts` needs them equal.
    """
    adapter = as_moe_adapter(adapter)
    config = model.config
    check_keep(adapter, config, keep, scales)
    n = adapter.num_experts(config)
    handles = []
    try:
        for i, (parts, kept) in enumerate(zip(moe_parts(model, adapter), keep)):
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


def prune_experts(model, adapter, keep: Sequence[Sequence[int]],
                  scales: Sequence[torch.Tensor | Sequence[float] | None] | None = None):
    """A new model with only the kept experts (same count in every MoE layer), scales folded."""
    adapter = as_moe_adapter(adapter)
    config = model.config
    check_keep(adapter, config, keep, scales)
    n_keep = uniform_count(keep)
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    sd = model.state_dict()
    for i, (parts, kept) in enumerate(zip(moe_parts(model, adapter), keep)):
        idx = torch.tensor([int(e) for e in kept], dtype=torch.long)
        router, ex = parts.router.weight, parts.experts
        sd[names[id(router)]] = router.data[idx].clone()
        sd[names[id(ex.gate_up_proj)]] = ex.gate_up_proj.data[idx].clone()
        down = ex.down_proj.data[idx].clone()
        if scales is not None and scales[i] is not None:
            down *= torch.as_tensor(scales[i], dtype=down.dtype).view(-1, 1, 1)
        sd[names[id(ex.down_proj)]] = down
    new_config = adapter.pruned_moe_config(config, n_keep)
    return build_model(new_config, sd, model.dtype)
