"""Retention → block shapes. `--retain R` keeps a fraction R of the blocks' parameters.

Heads are coarse (SmolLM2 has 9) and channels fine, so for a uniform layout we enumerate
the regular GQA attention shapes (kept KV groups × query heads per group) and give each
the MLP width that fills the rest of the budget, rounded down to a kernel-friendly
multiple. The method then tries the few shapes whose attention share is closest to R on
held-out calibration text and keeps the best.
"""

from __future__ import annotations

from optimizer.adapters import BlockShape, DecoderAdapter


def channel_multiple(intermediate_size: int) -> int:
    # GPU GEMMs tile in 64/128; tiny test models need finer steps.
    return 64 if intermediate_size >= 1024 else 8 if intermediate_size >= 64 else 1


def block_cost(costs: tuple, shape: BlockShape) -> float:
    """Cost of a block from unit costs (head, kv, channel, fixed): parameters or seconds."""
    head, kv, channel, fixed = costs
    return fixed + shape.num_heads * head + shape.num_kv_heads * kv + shape.intermediate_size * channel


def uniform_candidates(adapter: DecoderAdapter, config, retain: float, limit: int = 6,
                       costs: tuple | None = None) -> list[BlockShape]:
    """Regular shapes keeping at most `retain` of the block cost (parameters by default)."""
    costs = costs or adapter.unit_params(config)
    dense = adapter.dense_shape(config)
    if retain >= 1.0:
        return [dense]
    budget = retain * block_cost(costs, dense)
    mult = channel_multiple(dense.intermediate_size)
    group = dense.num_heads // dense.num_kv_heads
    scored = []
    for kv in range(1, dense.num_kv_heads + 1):
        for per_group in range(1, group + 1):
            heads = kv * per_group
            base = block_cost(costs, BlockShape(heads, kv, mult))
            per_channel = block_cost(costs, BlockShape(heads, kv, 2 * mult)) - base
            extra = int((budget - base) // per_channel) if budget >= base else -1
            width = min(mult * (1 + extra), dense.intermediate_size) if extra >= 0 else 0
            if width < max(mult, dense.intermediate_size // 16):
                continue  # attention alone eats the budget; an MLP this thin is not worth it
            shape = BlockShape(heads, kv, width)
            if not adapter.loadable(config, shape):
                continue
            attn_share = heads / dense.num_heads * 0.5 + kv / dense.num_kv_heads * 0.5
            scored.append((abs(attn_share - retain), -width, shape))
    return [s for _, _, s in sorted(scored, key=lambda t: (t[0], t[1]))[:limit]]


def retention(adapter: DecoderAdapter, config, shape: BlockShape, costs: tuple | None = None) -> float:
    costs = costs or adapter.unit_params(config)
    return block_cost(costs, shape) / block_cost(costs, adapter.dense_shape(config))
