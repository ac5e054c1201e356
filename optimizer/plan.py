"""Choose the method from the target profile and the serving engine, and predict the gain.

The rule that matters: 2:4 sparsity only pays where the GPU has sparse tensor cores *and*
the engine version that will serve the package has a kernel for them. Everywhere else the
only way to be faster is to be smaller, so the choice is structured pruning.

The prediction is a roofline: each phase takes max(FLOPs / peak, bytes / bandwidth) on the
target. Prefill is compute-bound, decode at small batch is bandwidth-bound, so the two
speedups differ; both count the embeddings and LM head, which pruning leaves whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.engines import DEFAULT_VLLM, installed_vllm_version  # noqa: F401  (the planner's default engine version)
from core.errors import UserError
from optimizer import registry
from optimizer.adapters import BlockShape, DecoderAdapter
from optimizer.profiles import QUANT_NAMES, Profile, _parse_version
from optimizer.quantize import HEAD_PRECISIONS

# auto / structured → the planner's structured method: the one-shot activation method, then
# heal (auto on a target with a measured per-block cost may remove whole blocks instead:
# prefers_fewer_blocks). DDP's learned gates beat one-shot unhealed (bench/results/ddp/), but its 80 steps alone
# take longer than the 15 minutes the default job may take here, and the same minutes spent
# healing the one-shot student's weights buy more (bench/results/heal/); DDP on request.
STRUCTURED = "activation"
# Whole blocks removed (optimizer/depth.py): fewer layers instead of narrower ones.
DEPTH = "depth"
# --method auto removes whole blocks where the target's fixed cost per block makes them this much
# faster at batch 16 than narrower blocks of the same parameters (plan.prefers_fewer_blocks), and
# only from this --retain up: at 0.5 the default heal left 15 of 30 blocks of SmolLM2 with a worse
# held-out KL than narrower blocks, at 0.7 and 0.8 with a better one (heal-select/2026-12-05-mixed).
FEWER_BLOCKS_GAIN = 1.1
FEWER_BLOCKS_MIN_RETAIN = 0.7
SEMI_STRUCTURED = "sparsegpt"   # auto's choice where a 2:4 kernel serves the package
is_sparse = registry.is_sparse


@dataclass
class Plan:
    """What `resolve` decided, once: nothing after it changes a plan (`freeze`)."""
    target: Profile
    engine: str
    engine_version: str
    method: str
    reasons: list[str] = field(default_factory=list)
    prediction: dict = field(default_factory=dict)
    sparsity: str | None = None      # "2:4", "0.5", ... for the semi-structured family
    sparse_kernel: bool = False      # the engine will run this sparsity with a sparse kernel
    quant: str = "none"              # the weights' precision: none | int8 | fp8 | w4a16 (optimizer/quantize.py)
    quant_reason: str = ""
    quant_head: bool = False         # the LM head quantized too (quant_head; W8A8 only)
    kind: str = ""                   # the kind of job that runs it (optimizer/registry.py KINDS)
    format: str = "vllm"             # the package's: vllm | onnx (onnxruntime serves it; `engine` is the roofline's)

    def freeze(self) -> "Plan":
        """The plan as resolved: its fields can no longer be set, its reasons no longer appended to."""
        self.reasons = tuple(self.reasons)
        object.__setattr__(self, "_frozen", True)
        return self

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(f"the plan is resolved once (plan.resolve); '{name}' cannot change after it")
        object.__setattr__(self, name, value)

    def text(self, prediction: dict | None = None) -> str:
        """The plan in words; `prediction`: another roofline than the plan's (the achieved shape's)."""
        lines = [f"target: {self.target.display_name} ({self.target.name})",
                 f"engine: {self.engine} {self.engine_version}" if self.format == "vllm" else
                 f"engine: onnxruntime (an ONNX package; the roofline is the target profile's, made for "
                 f"{self.engine} {self.engine_version}: --measure times it on the cpu target)",
                 f"method: {self.method}" + (f" ({self.sparsity} sparsity)" if self.sparsity else "")]
        lines += [f"  why: {r}" for r in self.reasons]
        if self.quant_reason:
            lines.append(f"quantization: {QUANT_NAMES[self.quant]}" + (", the LM head too (untied; the embedding "
                                                                      "is not quantized)" if self.quant_head else ""))
            lines.append(f"  why: {self.quant_reason}")
        p = prediction if prediction is not None else self.prediction
        if p:
            precision = QUANT_NAMES[p.get("precision", "none")] + " against dense bf16"
            lines.append(f"roofline on {self.target.name} ({precision}, prompt {p['prompt_tokens']}, "
                         f"context {p['context_tokens']}): prefill {p['prefill_speedup']:.2f}x, "
                         f"decode {p['decode_speedup_b1']:.2f}x at batch 1, "
                         f"{p['decode_speedup_b16']:.2f}x at batch 16 "
                         f"(weight bytes {p['weight_bytes_ratio']:.2f}x smaller"
                         + (f"; the blocks are {p['block_bytes_share']:.0%} of the bytes a dense step reads, "
                            f"the LM head the rest" if "block_bytes_share" in p else "") + ")")
            if "experts" in p:
                e = p["experts"]
                narrowed = e.get("width_kept", e.get("width_dense")) != e.get("width_dense")
                flops = (f"each narrowed to {e['width_kept']} of {e['width_dense']} channels because --retain is "
                         f"below top-k / experts, so a token costs fewer FLOPs" if narrowed
                         else "so the FLOPs a token costs do not change")
                lines.append(f"  experts: {e['kept']} of {e['dense']} per MoE layer, top-{e['top_k']} kept, {flops}; "
                             f"a batch of 16 reads {e['touched_b16'][0]:.1f} → "
                             f"{e['touched_b16'][1]:.1f} experts a layer (uniform routing assumed)")
        return "\n".join(lines)


# vLLM's compressed-tensors loader quantizes a ParallelLMHead from this version on (PR #37291)
QUANT_HEAD_MIN_VLLM = "0.20.0"


def _refuse_quant_head(plan: Plan, adapter: DecoderAdapter) -> None:
    """quant_head needs a W8A8 precision and, for a vLLM package, a model class whose vLLM
    implementation has a head of its own and a vLLM whose loader quantizes it."""
    if plan.quant not in HEAD_PRECISIONS:
        raise UserError(f"quant_head quantizes the LM head in W8A8, but {plan.quant_reason.removesuffix(' (--quant auto)')}")
    if plan.format == "onnx":  # onnxruntime's INT8 MatMul of an untied head: the exporter's check runs it
        return
    if not adapter.vllm_head_module:
        raise UserError(f"quant_head: vLLM computes {adapter.family}'s logits from its embedding (no LM head of its "
                        f"own to quantize); drop quant_head")
    version = _parse_version(plan.engine_version)
    if version is not None and version < _parse_version(QUANT_HEAD_MIN_VLLM):
        raise UserError(f"quant_head: vLLM {plan.engine_version} loads no quantized LM head (from "
                        f"{QUANT_HEAD_MIN_VLLM} on); drop quant_head or name a newer --engine-version")


def prefers_fewer_blocks(narrower: dict, fewer: dict, retain: float) -> bool:
    """Whether `--method auto` takes whole blocks (--method depth) over the narrower layout, on a target
    with a measured fixed cost per block (the caller's test): at --retain FEWER_BLOCKS_MIN_RETAIN and up,
    where the roofline predicts fewer blocks FEWER_BLOCKS_GAIN times as fast at batch 16 (same
    parameters either way; the smaller KV cache counts too). On SmolLM2 at 0.7 and 0.8 whole blocks
    healed to a lower held-out KL and no less zero-shot, at a higher perplexity on WikiText-2 and c4 at 0.7
    (bench/results/heal-select/2026-12-05-mixed/)."""
    return (retain >= FEWER_BLOCKS_MIN_RETAIN
            and fewer["decode_speedup_b16"] >= FEWER_BLOCKS_GAIN * narrower["decode_speedup_b16"])


def fewer_blocks_reason(target: Profile, narrower: dict, fewer: dict, kept: int, layers: int,
                        chosen: bool = False) -> str:
    """The plan's line where the target has a fixed cost per block (Profile.block_overhead_ms): what
    keeping `kept` of `layers` whole blocks (`fewer`, --method depth) is predicted to give beside the
    narrower blocks of the structured layout (`narrower`), at batch 16, where the fixed cost weighs
    most; `chosen`: --method auto took it."""
    cost = (f"on {target.short_name} every block kept costs {target.block_overhead_s(1) * 1e3:.2f} ms a decode "
            f"step at batch 1 and {target.block_overhead_s(16) * 1e3:.2f} ms at batch 16 beyond its matmuls "
            f"(attention, norms, the framework), and narrower blocks keep that cost")
    if chosen:
        return (f"{cost} → {kept} of {layers} whole blocks (depth): predicted {fewer['decode_speedup_b16']:.2f}x at "
                f"batch 16 against {narrower['decode_speedup_b16']:.2f}x for narrower blocks, at a higher "
                f"perplexity (--method structured keeps every block, narrower; docs/quantize.md)")
    return (f"{cost}: {kept} of {layers} whole blocks instead (--method depth) is predicted "
            f"{fewer['decode_speedup_b16']:.2f}x at batch 16 against {narrower['decode_speedup_b16']:.2f}x, at a "
            f"higher perplexity (docs/quantize.md)")


def quant_prediction(plan: Plan) -> dict:
    """The roofline's quantization arguments for `plan`: its precision and whether the engine has its kernel."""
    return {"quant": plan.quant, "head": plan.quant_head,
            "quant_kernel": plan.quant == "none" or plan.target.has_quant_kernel(plan.engine, plan.engine_version, plan.quant)}


def choose_quant(plan: Plan, quant: str, not_quantized: str | None = None) -> None:
    """--quant: `auto` (the default) takes the precision the target's tensor cores and the
    engine's kernels accelerate (profiles.Profile.choose_quant), or 16-bit weights where this kind
    of package is `not_quantized` (the reason); a named precision is taken as asked, with a
    warning in the reason where the engine has no kernel for it on this target."""
    if quant == "none":
        return
    auto, why = plan.target.choose_quant(plan.engine, plan.engine_version)
    if quant == "auto":
        plan.quant, plan.quant_reason = ("none", f"{not_quantized} (--quant auto)") if not_quantized else (auto, why)
        return
    plan.quant = quant
    if plan.target.has_quant_kernel(plan.engine, plan.engine_version, quant):
        plan.quant_reason = (f"--quant {quant} requested; {why}" if quant == auto else
                             f"--quant {quant} requested; auto would take {QUANT_NAMES[auto]}: {why}")
    else:
        plan.quant_reason = (f"--quant {quant} requested, but {plan.engine} {plan.engine_version} has no "
                             f"{QUANT_NAMES[quant]} kernel on {plan.target.short_name}: expect no speedup ({why})")


def choose(target: Profile, method: str, engine: str = "vllm", engine_version: str | None = None,
           sparsity: str = "2:4") -> Plan:
    if method not in registry.choices():
        raise UserError(f"unknown method '{method}'; choose from: {', '.join(registry.choices())}")
    version = engine_version or installed_vllm_version() or DEFAULT_VLLM
    has_kernel = target.has_sparse24_kernel(engine, version)
    if method in ("auto", "structured"):
        chosen = SEMI_STRUCTURED if method == "auto" and has_kernel else STRUCTURED
    elif method == "semi-structured":
        chosen = SEMI_STRUCTURED
    else:
        chosen = method
    plan = Plan(target, engine, version, chosen)
    plan.reasons.append(target.sparse24_reason(engine, version))
    if is_sparse(chosen):
        plan.sparsity = "2:4" if method == "auto" else sparsity
        plan.sparse_kernel = has_kernel and plan.sparsity == "2:4"
        if method == "auto":
            plan.reasons.append("2:4 kernel → semi-structured 2:4: same shapes, half the weights zero, "
                                "served by the sparse tensor cores")
        elif plan.sparse_kernel:
            plan.reasons.append(f"{method} requested; the engine runs 2:4 with its sparse kernel")
        else:
            why = ("no 2:4 kernel here" if plan.sparsity == "2:4"
                   else f"no engine has a kernel for {plan.sparsity} sparsity")
            plan.reasons.append(f"{method} requested, but {why}: the package serves dense-format weights "
                                f"and no speedup is to be expected (use --method structured to be faster)")
    elif method in registry.METHODS and registry.spec(method).kind == registry.STRUCTURED:
        plan.reasons.append(f"{method} requested")
    elif method == DEPTH:
        plan.reasons.append("depth requested: whole blocks removed, the rest untouched (the family's own config "
                            "with fewer layers)")
    elif has_kernel:
        plan.reasons.append("structured requested: smaller on every GPU, no sparse kernel needed")
    else:
        plan.reasons.append("no 2:4 kernel → structured: removing heads and channels makes the "
                            "model smaller, which is faster on any GPU and engine")
    return plan


def resolve(cfg, target: Profile, adapter, hf_config, fewer_blocks: bool = True, chosen_by: str | None = None) -> Plan:
    """The plan, resolved once from the config, the target's profile and the model's config: the
    method and the kind of job that runs it, the precision, the reasons and the roofline prediction.
    Every refusal is made here, before any compute: the kind's own (`refuse` of its class in
    optimizer/registry.py) and the package format's. Returns it frozen. `fewer_blocks`: whether
    `auto` may take whole blocks instead of narrower ones (the search scores both itself); `chosen_by`:
    who pinned the precision, where it was not the user (the search), for the reasons' wording."""
    from optimizer.adapters import MoEAdapter, onnx_families
    plan = choose(target, cfg.method, engine_version=cfg.engine_version, sparsity=cfg.sparsity)
    moe = isinstance(adapter, MoEAdapter)
    if moe:
        for_experts(plan, cfg.method, adapter.family)
    plan.kind = registry.EXPERTS if moe else registry.spec(plan.method).kind
    plan.format = cfg.format
    kind = registry.kind_class(plan.kind)
    kind.refuse(cfg, plan, adapter, hf_config)
    choose_quant(plan, cfg.quant, not_quantized=_not_quantized(cfg, plan, moe))
    if cfg.quant_head:
        _refuse_quant_head(plan, adapter)
    plan.quant_head = bool(cfg.quant_head)
    if plan.quant == "w4a16" and target.kind != "cpu":  # the cpu target refuses shapes its kernel cannot take
        plan.quant_reason += _marlin_note(hf_config.hidden_size)
    if cfg.format == "onnx" and plan.quant == "int8":  # not vLLM's kernel table: onnxruntime's own INT8
        form = ("dynamic INT8 (MatMulInteger" if cfg.onnx.int8 == "dynamic" else
                "static INT8 in QDQ form (QuantizeLinear / DequantizeLinear pairs")
        plan.quant_reason = (f"--quant int8 requested: onnxruntime's {form}, run by onnxruntime on the CPU)"
                             + (", whatever kernels the target's GPU has" if target.kind != "cpu" else "")
                             if cfg.quant == "int8" else
                             f"the cpu target's INT8 kernels (VNNI / AMX) through onnxruntime's {form}, its CPU "
                             f"provider's integer kernels)")
    if chosen_by:  # a search's candidate: not the user's request
        plan.quant_reason = plan.quant_reason.replace(f"--quant {cfg.quant} requested", chosen_by)
    if cfg.onnx.int8 != "dynamic" and plan.quant != "int8":
        raise UserError(f"onnx.int8={cfg.onnx.int8} needs INT8 weights, but "
                        f"{plan.quant_reason.removesuffix(' (--quant auto)')}")
    if cfg.format == "onnx" and not adapter.onnx_export:
        raise UserError(f"{adapter.family}: ONNX export covers the LLaMA-shaped families "
                        f"({', '.join(onnx_families())}); use --format vllm")
    plan.prediction = kind.predict(cfg, plan, adapter, hf_config)
    if plan.kind == registry.STRUCTURED and fewer_blocks:
        _fewer_blocks_instead(cfg, plan, adapter, hf_config)
    return plan.freeze()


def _fewer_blocks_instead(cfg, plan: Plan, adapter, hf_config) -> None:
    """A target where every kept block costs time beyond its matmuls (measured under vLLM): the
    same parameters in fewer, whole blocks, where `auto` finds that faster (prefers_fewer_blocks).
    Not for onnxruntime, nor where --method depth would be refused (which includes a --retain
    keeping every block)."""
    depth = registry.kind_class(registry.DEPTH)
    if not (plan.target.block_overhead_ms and cfg.format == "vllm" and depth.accepts(cfg, adapter, hf_config)):
        return
    whole = depth.predict(cfg, plan, adapter, hf_config)
    chosen = cfg.method == "auto" and prefers_fewer_blocks(plan.prediction, whole, cfg.retain)
    plan.reasons.append(fewer_blocks_reason(plan.target, plan.prediction, whole, depth.blocks_kept(cfg, hf_config),
                                            hf_config.num_hidden_layers, chosen=chosen))
    if chosen:
        plan.method, plan.kind, plan.prediction = DEPTH, registry.DEPTH, whole


def _marlin_note(hidden: int) -> str:
    """W4A16 on a GPU: vLLM's Marlin kernel wants every input width a multiple of 128, which the
    hidden size (the input of q/k/v and gate/up) decides before any pruning."""
    if hidden % 128 == 0:
        return (" (groups of the largest of 128 / 64 / 32 every pruned input width takes; vLLM's Marlin kernel "
                "wants each a multiple of 128: the quantize stage names those that are not)")
    return (f" (the hidden size {hidden} is not a multiple of 128, which vLLM's Marlin kernel wants of every input "
            f"width: q/k/v and gate/up need another of its 4-bit kernels, or vLLM refuses to load them; not run on "
            f"a GPU here)")


def _not_quantized(cfg, plan: Plan, moe: bool = False) -> str | None:
    """Why this kind of package keeps 16-bit weights whatever the target accelerates, or None."""
    if moe:
        return "MoE packages are not quantized yet"
    if cfg.format != "vllm" and plan.target.kind != "cpu":
        return ("ONNX packages for a GPU keep fp32 weights (onnxruntime's INT8 kernels are its CPU provider's; "
                "--quant int8 to ask)")
    if cfg.format != "vllm" and cfg.onnx.dtype != "float32":
        return "a float16 ONNX package is not quantized (INT8 is quantized from the float32 graph)"
    if plan.sparsity:
        return "2:4 packages keep 16-bit weights (vLLM's 2:4 kernels are unquantized)"
    return None


def for_experts(plan: Plan, method: str, family: str) -> None:
    """An MoE model: whole routed experts go (moe_surgery), the same number in every MoE layer,
    then, below top-k / E, expert channels;
    `activation` / `structured` / `auto` take the one-shot REAP-style importance, `ddp` DDP's
    expert gates. Semi-structured methods are not written for fused 3-D expert tensors."""
    if plan.sparsity and method != "auto":
        raise UserError(f"{family}: MoE models are pruned by removing whole experts (and expert channels); --method {method} "
                        f"(semi-structured) is not written for them: use --method structured or ddp")
    if method == DEPTH:
        raise UserError(f"{family}: MoE models are pruned by removing whole experts; --method depth is written for "
                        f"dense blocks: use --method structured or ddp")
    plan.sparsity, plan.sparse_kernel = None, False
    plan.method = "ddp" if method == "ddp" else "reap"
    del plan.reasons[1:]  # the 2:4 kernel's line stays; the heads-and-channels reasoning does not apply
    how = ("DDP's learned expert gates" if plan.method == "ddp" else
           "the one-shot REAP-style importance (router-weighted expert output norms on the calibration text)")
    plan.reasons.append(f"MoE model → routed experts removed, the same number in every MoE layer (a stock "
                        f"config every engine loads), chosen by {how}, down to top-k at most; a --retain below "
                        f"top-k / experts narrows the kept experts' channels instead; attention, shared experts "
                        f"and dense layers stay whole")


def experts_touched(n_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts a batch of `batch` tokens reaches in one MoE layer, routing uniform."""
    return n_experts * (1 - (1 - top_k / n_experts) ** batch)


def roofline_experts(target: Profile, adapter, config, n_keep: int, params: int, prompt_tokens: int = 512,
                     context_tokens: int = 512, bytes_per_value: int = 2, width: int | None = None) -> dict:
    """The roofline of an MoE package with `n_keep` of E routed experts per MoE layer (each
    `width` channels wide; default the dense width), against the dense MoE (`params`: its
    parameter count). Every token still runs top-k experts, so removing experts leaves the FLOPs
    alone but for the router's removed rows; what falls is the bytes a decode step streams, the experts the batch touches:
    E·(1 − (1 − k/E)^B) a layer with routing assumed uniform. At batch 1 that is k either way
    (no gain) unless the experts are narrowed; at a large batch every expert is read and the
    ratio tends to the weight-bytes ratio."""
    peak = target.peak_bf16_dense_tflops * 1e12
    bw = target.memory_bandwidth_gbps * 1e9
    n, k, layers = adapter.num_experts(config), adapter.experts_per_token(config), len(adapter.moe_layers(config))
    full = adapter.expert_intermediate(config)
    width = full if width is None else width
    lookup = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    always = params - lookup - layers * n * 3 * config.hidden_size * full  # attention, shared, dense, routers, head
    d = adapter.head_dim(config)
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * d
    attn_width = config.num_hidden_layers * config.num_attention_heads * d

    def times(experts: int, channels: int):
        ffn = 3 * config.hidden_size * channels   # one routed expert's weights
        always_here = always - layers * (n - experts) * config.hidden_size  # the router keeps a row per expert
        active = always_here + layers * k * ffn
        weight_bytes = (always_here + layers * experts * ffn) * bytes_per_value
        L = prompt_tokens
        read_prefill = (always_here + layers * experts_touched(experts, k, L) * ffn) * bytes_per_value
        prefill = max((2 * active * L + 2 * L * L * attn_width) / peak, read_prefill / bw)

        def decode(batch):
            flops = batch * (2 * active + 4 * context_tokens * attn_width) / peak
            moved = ((always_here + layers * experts_touched(experts, k, batch) * ffn) * bytes_per_value
                     + batch * context_tokens * kv * bytes_per_value)
            return max(flops, moved / bw) + config.num_hidden_layers * target.block_overhead_s(batch)
        return prefill, decode(1), decode(16), weight_bytes, active

    dense, pruned = times(n, full), times(n_keep, width)
    return {"prompt_tokens": prompt_tokens, "context_tokens": context_tokens, "precision": "none",
            "prefill_speedup": dense[0] / pruned[0], "decode_speedup_b1": dense[1] / pruned[1],
            "decode_speedup_b16": dense[2] / pruned[2], "weight_bytes_ratio": dense[3] / pruned[3],
            "dense_decode_ms_b1": dense[1] * 1e3, "pruned_decode_ms_b1": pruned[1] * 1e3,
            "experts": {"dense": n, "kept": n_keep, "top_k": k, "moe_layers": layers,
                        "width_dense": full, "width_kept": width,
                        "touched_b16": [experts_touched(n, k, 16), experts_touched(n_keep, k, 16)],
                        "active_params": dense[4], "active_params_pruned": pruned[4], "routing": "uniform"}}


def unit_latency_costs(target: Profile, adapter: DecoderAdapter, config, batch: int = 16,
                       context_tokens: int = 512, bytes_per_value: int = 2) -> tuple[float, float, float, float]:
    """Predicted seconds per decode step that one head / KV group / channel costs on `target`.

    Additive roofline terms (bytes / bandwidth + FLOPs / peak) at a serving-like operating
    point: a KV group also streams its KV cache, a query head also does its attention math.
    Same order as DecoderAdapter.unit_params, so DDP's budget can use either.
    """
    peak = target.peak_bf16_dense_tflops * 1e12
    bw = target.memory_bandwidth_gbps * 1e9
    head_p, kv_p, chan_p, fixed_p = adapter.unit_params(config)
    d = adapter.head_dim(config)

    def t(params, extra_bytes=0.0, extra_flops=0.0):
        return (params * bytes_per_value + extra_bytes) / bw + (2 * batch * params + extra_flops) / peak
    return (t(head_p, extra_flops=batch * 4 * context_tokens * d),
            t(kv_p, extra_bytes=batch * context_tokens * 2 * d * bytes_per_value),
            t(chan_p), t(fixed_p))


def _model_cost(adapter: DecoderAdapter, config, shape: BlockShape, layers: int | None = None) -> tuple[int, int, int, int]:
    """(parameters read per token, KV values per token, attention width heads*head_dim, embedding)
    of `layers` blocks (default: the config's) of this shape."""
    layers = config.num_hidden_layers if layers is None else layers
    embed = config.vocab_size * config.hidden_size
    head = embed  # tied or not, the LM head matmul reads a vocab x hidden matrix
    blocks = layers * adapter.block_params(config, shape)
    d = adapter.head_dim(config)
    kv = 2 * layers * shape.num_kv_heads * d
    return blocks + head, kv, layers * shape.num_heads * d, embed


# Bytes a block weight takes per precision (scales included: one 2-byte scale per output channel is
# negligible, one per group of 64 input columns is 2/64 byte a weight), and the peak its matmuls run
# at where the engine has a kernel for it (activations quantized too: int8 / fp8 tensor cores).
QUANT_BYTES = {"none": 2.0, "int8": 1.0, "fp8": 1.0, "w4a16": 0.5 + 2 / 64}


def _quant_peak(target: Profile, quant: str) -> float:
    tops = {"int8": target.peak_int8_dense_tops, "fp8": target.peak_fp8_dense_tflops}.get(quant)
    return (tops or target.peak_bf16_dense_tflops) * 1e12


def _step_times(target: Profile, blocks: int, embed: int, kv: int, attn_width: int, block_peak: float,
                block_bytes: float, bytes_per_value: int, prompt_tokens: int, context_tokens: int,
                layers: int, head_quantized: bool = False) -> tuple:
    """(prefill s, decode s at batch 1, at batch 16, weight bytes) on `target`: `blocks` block
    weights, each `block_bytes` and multiplied at `block_peak` FLOP/s; the LM head (`embed`
    values; `head_quantized`: as the blocks' weights), attention and the KV cache in 16-bit at the
    bf16 peak. Each phase is max(FLOPs / peak, bytes / bandwidth); a decode step adds the target's
    fixed cost per block (Profile.block_overhead_s, 0 where not measured) for each of the `layers` blocks."""
    peak = target.peak_bf16_dense_tflops * 1e12
    bw = target.memory_bandwidth_gbps * 1e9
    head_bytes, head_peak = (block_bytes, block_peak) if head_quantized else (bytes_per_value, peak)
    weight_bytes = blocks * block_bytes + embed * head_bytes  # the LM head; an input embedding is looked up
    L = prompt_tokens
    prefill = max(2 * blocks * L / block_peak + 2 * embed * L / head_peak + 2 * L * L * attn_width / peak,
                  weight_bytes / bw)

    def decode(batch):
        flops = (batch * 2 * blocks / block_peak + batch * 2 * embed / head_peak
                 + batch * 4 * context_tokens * attn_width / peak)
        moved = weight_bytes + batch * context_tokens * kv * bytes_per_value
        return max(flops, moved / bw) + layers * target.block_overhead_s(batch)
    return prefill, decode(1), decode(16), weight_bytes


def _speedups(dense: tuple, pruned: tuple, prompt_tokens: int, context_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "context_tokens": context_tokens,
            "prefill_speedup": dense[0] / pruned[0], "decode_speedup_b1": dense[1] / pruned[1],
            "decode_speedup_b16": dense[2] / pruned[2], "weight_bytes_ratio": dense[3] / pruned[3],
            "dense_decode_ms_b1": dense[1] * 1e3, "pruned_decode_ms_b1": pruned[1] * 1e3}


def roofline(target: Profile, adapter: DecoderAdapter, config, shape: BlockShape,
             prompt_tokens: int = 512, context_tokens: int = 512, bytes_per_value: int = 2,
             quant: str = "none", quant_kernel: bool = True, layers: int | None = None, head: bool = False) -> dict:
    """Prefill and decode speedups of the pruned (and `quant`-quantized) model, `layers` blocks
    (default: all) of `shape`, over the dense bf16 one. Quantized, the block weights stream QUANT_BYTES each and, with the engine's kernel for
    `quant` (`quant_kernel`), W8A8's block matmuls run at the int8 / fp8 peak; without a kernel
    the quantized package is predicted as the 16-bit one. The embedding and LM head stay 16-bit
    (`head`: the LM head as the blocks); the bytes a step streams are the blocks' and the LM head's
    (an untied input embedding is only looked up: a row a token)."""
    q = quant if quant_kernel else "none"

    def times(s: BlockShape, quantized: bool, n_layers: int | None = None):
        matmul_params, kv, attn_width, embed = _model_cost(adapter, config, s, n_layers)
        blocks = matmul_params - embed                      # _model_cost counted the LM head in
        block_peak, block_bytes = ((_quant_peak(target, q), QUANT_BYTES[q]) if quantized
                                   else (target.peak_bf16_dense_tflops * 1e12, bytes_per_value))
        return _step_times(target, blocks, embed, kv, attn_width, block_peak, block_bytes, bytes_per_value,
                           prompt_tokens, context_tokens,
                           config.num_hidden_layers if n_layers is None else n_layers,
                           head_quantized=quantized and head), blocks * block_bytes

    dense, dense_block_bytes = times(adapter.dense_shape(config), False)
    pruned, _ = times(shape, q != "none", layers)
    return {**_speedups(dense, pruned, prompt_tokens, context_tokens), "precision": q,
            **({"head_quantized": True} if head and q != "none" else {}),
            # what pruning can reach: a large vocabulary's head is bytes no block pruning removes
            "block_bytes_share": dense_block_bytes / dense[3]}


def roofline_sparse(target: Profile, adapter: DecoderAdapter, config, kernel: bool,
                    prompt_tokens: int = 512, context_tokens: int = 512, bytes_per_value: int = 2) -> dict:
    """The same roofline for a 2:4 package: without a kernel nothing changes (1.00x); with one,
    the blocks' matmuls run at the sparse peak and stream compressed weights (half the values
    plus 2 bits of position metadata per kept value: 0.5625 of the dense bytes in bf16)."""
    peak = target.peak_bf16_dense_tflops * 1e12
    sparse_peak = (target.peak_bf16_sparse24_tflops or target.peak_bf16_dense_tflops) * 1e12
    blocks, kv, attn_width, embed = _model_cost(adapter, config, adapter.dense_shape(config))
    blocks -= embed                                          # _model_cost counted the LM head in
    byte_factor = (0.5 + 0.5 * 2 / 8 / bytes_per_value) if kernel else 1.0
    layers = config.num_hidden_layers
    dense = _step_times(target, blocks, embed, kv, attn_width, peak, bytes_per_value, bytes_per_value,
                        prompt_tokens, context_tokens, layers)
    sparse = _step_times(target, blocks, embed, kv, attn_width, sparse_peak if kernel else peak,
                         byte_factor * bytes_per_value, bytes_per_value, prompt_tokens, context_tokens, layers)
    return {**_speedups(dense, sparse, prompt_tokens, context_tokens), "sparse_kernel": kernel}
