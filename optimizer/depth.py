"""The depth kind of job (`--method depth`): remove whole decoder blocks.

method   each block's influence on the residual stream over the calibration windows (ShortGPT's
         block influence: 1 − cos(block input, block output), the token mean); the
         L − round(retain · L) blocks that change it least go, the first and last never
surgery  a copy of the model that holds only the kept blocks (config.num_hidden_layers and the
         per-layer `layer_types` sliced), checked against the dense model run with the removed
         blocks skipped
export   the structured kind's exporters: a stock vLLM package (fewer layers, same names), or ONNX

Why a kind of its own: at the same parameters, narrowing every block (the structured kind) kept the
perplexity closer and removing blocks more of the zero-shot ability, and a package with fewer
layers runs fewer kernels a step (bench/results/heal-select/2026-12-04-depth/).
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
from tqdm import tqdm

from core.manifest import Manifest
from optimizer import plan as planner
from optimizer.config import refuse_width_settings
from optimizer.errors import UserError
from optimizer.job import MAX_MODEL_LEN, Decision, Job
from optimizer.surgery import check_same_logits


def blocks_to_keep(num_layers: int, retain: float) -> int:
    """The blocks a --retain keeps: the nearest whole number, at least the first and the last."""
    return max(2, min(num_layers, round(retain * num_layers)))


def check(cfg, adapter, config) -> None:
    """What --method depth does not do, refused in one line before any work (`config`: the model's)."""
    refuse_width_settings(cfg, "--method depth removes whole blocks and keeps the others whole")
    retain = cfg.retain
    if config.num_hidden_layers < 3:
        raise UserError(f"--method depth removes whole blocks between the first and the last; this model has "
                        f"{config.num_hidden_layers}")
    if blocks_to_keep(config.num_hidden_layers, retain) == config.num_hidden_layers:
        raise UserError(f"--retain {retain} keeps all {config.num_hidden_layers} blocks (each is "
                        f"{1 / config.num_hidden_layers:.3f} of them): lower --retain or use --method structured")
    if getattr(config, "use_sliding_window", False):
        raise UserError(f"{adapter.family}: a sliding-window split by layer count (max_window_layers) is not "
                        f"rewritten for fewer layers: use --method structured")


def block_influence(job) -> "BlockInfluence":
    """Each block's influence, read over the calibration windows."""
    stats = BlockInfluence(job.adapter.blocks(job.model))
    try:
        for w in tqdm(job.calib.train[: job.cfg.data.calib_windows], desc="block influence", unit="win"):
            stats.add_batch(job.model, w)
    finally:
        stats.close()
    return stats


def block_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """A decoder block's input hidden states, as a forward hook with kwargs sees them."""
    return args[0] if args else kwargs["hidden_states"]


class BlockInfluence:
    """Statistics: per block, the running token mean of 1 − cos(input, output) of the residual
    stream (`add_batch` per window). Decision: `keep(n)`, the n blocks that change it most."""

    def __init__(self, blocks: torch.nn.ModuleList):
        self.sums = torch.zeros(len(blocks), dtype=torch.float64)
        self.tokens = 0
        self.handles = [b.register_forward_hook(self._hook(i), with_kwargs=True) for i, b in enumerate(blocks)]

    def _hook(self, i: int):
        def hook(module, args, kwargs, out):
            x = block_input(args, kwargs)
            y = out[0] if isinstance(out, tuple) else out
            cos = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1)
            self.sums[i] += float((1 - cos).sum())
        return hook

    @torch.inference_mode()
    def add_batch(self, model, window: torch.Tensor) -> None:
        model(window[None], use_cache=False)
        self.tokens += window.numel()

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def influence(self) -> list[float]:
        return (self.sums / max(self.tokens, 1)).tolist()

    def keep(self, n: int) -> list[int]:
        """The first, the last, and the n − 2 blocks between them of highest influence, in order."""
        inner = sorted(range(1, len(self.sums) - 1), key=lambda i: -self.sums[i])[: n - 2]
        return sorted([0, *inner, len(self.sums) - 1])


@contextlib.contextmanager
def skipped(model, adapter, removed: list[int]):
    """The model with the `removed` blocks passing their input through unchanged (the reference
    the pruned model is checked against)."""
    def identity(module, args, kwargs, out):
        x = block_input(args, kwargs)
        return (x, *out[1:]) if isinstance(out, tuple) else x
    blocks = adapter.blocks(model)
    handles = [blocks[i].register_forward_hook(identity, with_kwargs=True) for i in removed]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


def remove_blocks(model, adapter, keep: list[int]):
    """A copy of `model` with only the `keep` blocks, renumbered, and its config to match. One deep
    copy of the model holding only those blocks, so that they share the copy's config."""
    blocks = adapter.blocks(model)
    model.model.layers = torch.nn.ModuleList(blocks[i] for i in keep)
    try:
        pruned = copy.deepcopy(model)
    finally:
        model.model.layers = blocks
    for j, block in enumerate(adapter.blocks(pruned)):
        for m in block.modules():  # attention's index into the KV cache
            if hasattr(m, "layer_idx"):
                m.layer_idx = j
    config = pruned.config
    if getattr(config, "layer_types", None):  # each kept block keeps its attention kind (sliding or full)
        config.layer_types = [config.layer_types[i] for i in keep]
    config.num_hidden_layers = len(keep)
    return pruned


class Depth:
    edits_in_place = False  # surgery builds a new model; job.model stays the dense teacher

    # --- planning (plan.resolve): what this kind refuses, and its prediction ----------------------
    @staticmethod
    def refuse(cfg, plan, adapter, hf_config) -> None:
        check(cfg, adapter, hf_config)

    @staticmethod
    def accepts(cfg, adapter, hf_config) -> bool:
        """Whether --method depth would run on this model with these settings (`check` passes)."""
        try:
            check(cfg, adapter, hf_config)
        except UserError:
            return False
        return True

    @staticmethod
    def blocks_kept(cfg, hf_config) -> int:
        return blocks_to_keep(hf_config.num_hidden_layers, cfg.retain)

    @staticmethod
    def predict(cfg, plan, adapter, hf_config) -> dict:
        """The roofline of --retain's share of the blocks, each at full width."""
        return planner.roofline(plan.target, adapter, hf_config, adapter.dense_shape(hf_config),
                                layers=Depth.blocks_kept(cfg, hf_config), **planner.quant_prediction(plan))

    @staticmethod
    def searcher(job: Job, retains: list[float]):
        """For the search (optimizer/search.py): the block influence read once, then a function of a
        retain that returns the model with that share of its blocks."""
        if not retains:
            return None
        influence = block_influence(job)

        def build(retain: float):
            return remove_blocks(job.model, job.adapter,
                                 influence.keep(blocks_to_keep(job.model.config.num_hidden_layers, retain)))
        return build

    def method(self, job: Job) -> Decision:
        model, adapter, config = job.model, job.adapter, job.model.config
        n = blocks_to_keep(config.num_hidden_layers, job.cfg.retain)
        windows = job.calib.train[: job.cfg.data.calib_windows]
        started = time.time()
        stats = block_influence(job)
        keep = stats.keep(n)
        wall_s = round(time.time() - started, 1)
        removed = [i for i in range(config.num_hidden_layers) if i not in keep]
        job.log(f"blocks: {n} of {config.num_hidden_layers} kept; removed {removed} (least block influence "
                f"on {windows.numel():,} calibration tokens)")
        detail = {"calibration": {"source": job.calib.text.description, "tokens": windows.numel()}, "wall_s": wall_s,
                  "blocks": {"dense": config.num_hidden_layers, "kept": keep, "removed": removed,
                             "influence": [round(x, 5) for x in stats.influence()],
                             "criterion": "block influence (1 - cos of the residual stream across the block)"}}
        return Decision(None, detail, {"keep": keep, "removed": removed})

    def surgery(self, job: Job, decision: Decision):
        model, adapter = job.model, job.adapter
        pruned = remove_blocks(model, adapter, decision.extra["keep"])
        # the check reads 256 tokens, fewer than a sliding window spans: the tests check layer_types
        decision.extra["max_diff"] = check_same_logits(
            pruned, skipped(model, adapter, decision.extra["removed"]), job.calib.held_out,
            "the model without the removed blocks differs from the dense model skipping them")
        return pruned

    def describe(self, job: Job, decision: Decision, pruned) -> dict:
        from optimizer.structured import exporter, size_section
        cfg, model, adapter, target = job.cfg, job.model, job.adapter, job.target
        config, blocks = model.config, decision.detail["blocks"]
        dense_shape = adapter.dense_shape(config)
        kept = len(blocks["kept"])
        prediction = planner.roofline(target, adapter, config, dense_shape, layers=kept,
                                      **planner.quant_prediction(job.plan))
        block = adapter.block_params(config, dense_shape)
        method = {"name": "depth", "plan": job.plan.method, "layout": "uniform", "budget": "params",
                  "retain_requested": cfg.retain, "retain_achieved": kept / blocks["dense"],
                  "retain_budget_achieved": kept / blocks["dense"],
                  "dense_shape": dense_shape.__dict__, "shape": dense_shape.__dict__, "candidates": [],
                  "seed": cfg.seed, **decision.detail}
        size = size_section(model, pruned, blocks["dense"] * block, kept * block)
        engine = exporter(cfg.format).engine_section(target.kind, MAX_MODEL_LEN, job.out.name)
        return {"format": cfg.format, "method": method, "size": size, "engine": engine, "prediction": prediction,
                "checks": {"masked_vs_pruned_max_abs_logit_diff": decision.extra["max_diff"]}}

    def export(self, job: Job, pruned, manifest: Manifest, quantized=None) -> None:
        from optimizer.structured import Structured
        Structured().export(job, pruned, manifest, quantized)  # the uniform layout's exporters, as they are
