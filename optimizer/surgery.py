"""The only code that edits weights and configs.

A method decides *what* to keep (a `Masks`); this module either simulates the removal
(`masked`: hooks zero the removed heads' and channels' outputs, weights untouched) or does it
(`prune`: slices the Linear layers, writes the smaller config, builds a fresh model and loads
the sliced weights strictly, so the config provably describes the tensors). The two must
give the same logits; the tests check that for every family.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from optimizer.adapters import BlockShape, DecoderAdapter
from optimizer.masks import BlockMask, Masks


def check_masks(adapter: DecoderAdapter, config, masks: Masks) -> None:
    """Kept query heads must sit in kept KV groups, the same number in each group."""
    dense = adapter.dense_shape(config)
    group = dense.num_heads // dense.num_kv_heads
    if len(masks.blocks) != config.num_hidden_layers:
        raise ValueError(f"{len(masks.blocks)} block masks for {config.num_hidden_layers} layers")
    for i, b in enumerate(masks.blocks):
        if sorted(set(b.heads)) != b.heads or sorted(set(b.kv_heads)) != b.kv_heads \
                or sorted(set(b.channels)) != b.channels:
            raise ValueError(f"block {i}: kept indices must be ascending and unique")
        per_group = {kv: sum(1 for h in b.heads if h // group == kv) for kv in b.kv_heads}
        if any(h // group not in per_group for h in b.heads):
            raise ValueError(f"block {i}: a kept query head belongs to a removed KV group")
        if len(set(per_group.values())) != 1 or 0 in per_group.values():
            raise ValueError(f"block {i}: kept KV groups must keep equally many query heads, got {per_group}")
        if b.channels and not (0 <= b.channels[0] and b.channels[-1] < dense.intermediate_size):
            raise ValueError(f"block {i}: channel index out of range")


def _unit_mask(n: int, keep: list[int], scale: list[float] | None, repeat: int, like: torch.Tensor) -> torch.Tensor:
    m = torch.zeros(n, dtype=like.dtype, device=like.device)
    m[keep] = 1 if scale is None else torch.tensor(scale, dtype=like.dtype, device=like.device)
    return m.repeat_interleave(repeat)


def unit_scale(values: list[float] | None, repeat: int, like: torch.Tensor) -> torch.Tensor | float:
    """Per-column scales from per-unit ones (each unit spans `repeat` columns); 1 if none."""
    if values is None:
        return 1.0
    return torch.tensor(values, dtype=like.dtype).repeat_interleave(repeat)


@contextlib.contextmanager
def masked(model, adapter: DecoderAdapter, masks: Masks):
    """Within the block, removed heads and channels contribute nothing; weights untouched."""
    with contextlib.ExitStack() as stack:
        for block, bm in zip(adapter.blocks(model), masks.blocks):
            stack.enter_context(block_hooks(block, adapter, model.config, bm))
        yield model


def check_same_logits(pruned, simulated, held_out: torch.Tensor,
                      what: str = "pruned model differs from the masked model") -> float:
    """The internal check after every surgery: the physically smaller model gives the logits the
    dense model gives under `simulated` (a context manager: masks, skipped blocks or experts), to
    1e-3 of the largest logit, on the first 256 held-out tokens (short: the check is seconds).
    Returns the largest difference (the manifest records it)."""
    tokens = held_out[:, :256]
    with torch.inference_mode(), simulated as model:
        ref = model(tokens, use_cache=False).logits
    with torch.inference_mode():
        max_diff = (pruned(tokens, use_cache=False).logits - ref).abs().max().item()
    if max_diff > 1e-3 * max(1.0, ref.abs().max().item()):
        raise RuntimeError(f"internal check failed: {what} by {max_diff}")
    return max_diff


@contextlib.contextmanager
def block_hooks(block, adapter: DecoderAdapter, config, bm: BlockMask):
    """`masked` for one block: hooks scale the inputs of o_proj and down_proj per unit, or,
    where the mask carries refitted columns, compute the projection from the kept inputs."""
    dense = adapter.dense_shape(config)
    d = adapter.head_dim(config)
    o_proj, down = adapter.attention(block).o, adapter.mlp(block).down
    handles = []

    def scale_input(vec):
        return lambda _mod, args: (args[0] * vec.to(args[0].dtype),) + tuple(args[1:])

    def kept_columns_only(keep, columns):
        return lambda mod, args, _out: F.linear(args[0][..., keep], columns.to(args[0].dtype), mod.bias)

    try:
        for lin, units, scale, columns, n, size in (
                (o_proj, bm.heads, bm.head_scale, bm.o_proj_columns, dense.num_heads, d),
                (down, bm.channels, bm.channel_scale, bm.down_columns, dense.intermediate_size, 1)):
            if columns is None:
                handles.append(lin.register_forward_pre_hook(scale_input(_unit_mask(n, units, scale, size, lin.weight))))
            else:
                handles.append(lin.register_forward_hook(kept_columns_only(unit_columns(units, size), columns)))
        yield block
    finally:
        for h in handles:
            h.remove()


def unit_columns(units: list[int], size: int) -> torch.Tensor:
    """Indices of these units' rows (or columns) when each unit spans `size` of them."""
    return (torch.tensor(units)[:, None] * size + torch.arange(size)).flatten()


def prune(model, adapter: DecoderAdapter, masks: Masks):
    """A new, physically smaller model holding only what `masks` keeps."""
    config = model.config
    check_masks(adapter, config, masks)
    shape = masks.uniform_shape()
    if shape is None:
        raise ValueError("per-layer shapes need a per-layer export layout; masks are not uniform")
    if not adapter.loadable(config, shape):
        raise ValueError(f"{shape} cannot be saved as a {adapter.family} checkpoint that loads back")
    new_config, sd = adapter.pruned_checkpoint(config, shape, _sliced_state_dict(model, adapter, masks), model)
    return build_model(new_config, sd, model.dtype)


def build_model(config, state_dict: dict, dtype: torch.dtype):
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")] \
        if not getattr(config, "architectures", None) else config.architectures
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(prev)
    tied = getattr(config, "tie_word_embeddings", False)
    if tied:
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"pruned weights do not match the pruned config: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    if tied:
        model.tie_weights()
    return model.eval()


# --- per-layer layout -----------------------------------------------------------------------
# A per-layer `Masks` may keep a different number of query heads, KV groups and channels in
# every block, and may remove a block's attention (no heads, no KV groups) or MLP (no
# channels) entirely. `masked` already simulates all of that; `prune_per_layer` does it, into
# one of our per-layer model classes (exporters/plugin: the family's transformers layers built
# from per-layer configs), which the exporters then write as DeciLM or as a plugin package.

def check_masks_per_layer(adapter: DecoderAdapter, config, masks: Masks) -> None:
    """`check_masks`' rules for every block that keeps attention / MLP; removed parts are allowed."""
    stand_in = []
    for i, b in enumerate(masks.blocks):
        if not b.heads and b.kv_heads:
            raise ValueError(f"block {i}: KV groups kept without any query head")
        stand_in.append(BlockMask(b.heads or [0], b.kv_heads or [0], b.channels or [0]))
    check_masks(adapter, config, Masks(stand_in))


def layer_shapes(masks: Masks) -> list[dict]:
    """Per block: {num_heads, num_kv_heads, intermediate_size} (0 = removed), as config.json holds them."""
    return [{"num_heads": len(b.heads), "num_kv_heads": len(b.kv_heads), "intermediate_size": len(b.channels)}
            for b in masks.blocks]


def _sliced_state_dict(model, adapter: DecoderAdapter, masks: Masks) -> dict:
    """The dense state dict with every block sliced to its mask and gate scales folded, as
    `prune` slices (same helpers); removed attention / MLP parts lose their weights and norms."""
    config = model.config
    d = adapter.head_dim(config)
    sd = model.state_dict()
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    modules = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}

    def name(lin, attr="weight"):
        return names[id(getattr(lin, attr))]

    def drop(prefix):
        for k in [k for k in sd if k.startswith(prefix + ".")]:
            del sd[k]

    for block, bm in zip(adapter.blocks(model), masks.blocks):
        q, k, v, o = adapter.attention(block)
        gate, up, down = adapter.mlp(block)
        blk = modules[id(block)]
        if bm.heads:
            q_rows, kv_rows = unit_columns(bm.heads, d), unit_columns(bm.kv_heads, d)
            for lin, rows in ((q, q_rows), (k, kv_rows), (v, kv_rows)):
                sd[name(lin)] = lin.weight.data[rows].clone()
                if lin.bias is not None:
                    sd[name(lin, "bias")] = lin.bias.data[rows].clone()
            sd[name(o)] = (o.weight.data[:, q_rows] * unit_scale(bm.head_scale, d, o.weight)
                           if bm.o_proj_columns is None else bm.o_proj_columns.to(o.weight.dtype).clone())
        else:  # all four families name these modules the same way (see the model classes)
            if o.bias is not None:
                raise ValueError(f"{blk}: o_proj has a bias, so removing the whole attention block is not exact")
            drop(modules[id(q)].rsplit(".", 1)[0])
            drop(f"{blk}.input_layernorm")
        if bm.channels:
            chans = torch.tensor(bm.channels)
            for lin in (gate, up):
                sd[name(lin)] = lin.weight.data[chans].clone()
                if lin.bias is not None:
                    sd[name(lin, "bias")] = lin.bias.data[chans].clone()
            sd[name(down)] = (down.weight.data[:, chans] * unit_scale(bm.channel_scale, 1, down.weight)
                              if bm.down_columns is None else bm.down_columns.to(down.weight.dtype).clone())
        else:
            if down.bias is not None:
                raise ValueError(f"{blk}: down_proj has a bias, so removing the whole MLP is not exact")
            drop(modules[id(gate)].rsplit(".", 1)[0])
            drop(f"{blk}.post_attention_layernorm")
    return sd


def per_layer_config(adapter: DecoderAdapter, config, masks: Masks):
    """The family's config as our `<family>_per_layer` config holding every block's shape."""
    from exporters.plugin.configuration_per_layer import PER_LAYER_CONFIGS
    model_type = f"{config.model_type}_per_layer"
    if model_type not in PER_LAYER_CONFIGS:
        raise ValueError(f"no per-layer model class for model type '{config.model_type}'")
    shapes = layer_shapes(masks)
    refusal = adapter.per_layer_refusal(config, shapes)
    if refusal:
        raise ValueError(refusal)
    d = {k: v for k, v in config.to_dict().items()
         if k not in ("model_type", "architectures", "auto_map", "transformers_version", "quantization_config")}
    cls = PER_LAYER_CONFIGS[model_type]
    arch = "PerLayer" + type(config).__name__.replace("Config", "ForCausalLM")
    return cls.from_dict({**d, "head_dim": adapter.head_dim(config), "layer_shapes": shapes,
                          "architectures": [arch]})


def prune_per_layer(model, adapter: DecoderAdapter, masks: Masks):
    """A new, physically smaller model with each block's own shape (our per-layer model class).

    Same slicing and scale folding as `prune`; the weights are loaded strictly into a fresh
    model built from the per-layer config, so the config provably describes the tensors.
    """
    from exporters.plugin import register_transformers
    register_transformers()  # build_model creates the model through AutoModelForCausalLM
    check_masks_per_layer(adapter, model.config, masks)
    new_config = per_layer_config(adapter, model.config, masks)
    return build_model(new_config, _sliced_state_dict(model, adapter, masks), model.dtype)
