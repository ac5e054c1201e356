"""Validate an exported decoder against the PyTorch model before a package is written.

What optimum checks after an export (output names, shapes, `allclose` against PyTorch), for
the two ways a decoder is used: a prefill step (batch of two, one row left-padded) and a
decode step fed with the graph's own `present` tensors; then greedy generation over 32
tokens, run by the serving code's own loop (runtime/ort_server.py), against PyTorch's.

Along the greedy path every step's logits are compared with PyTorch's as the prefill's are. The
tokens may part only at a step whose logits agree within that tolerance (a near-tie the two
runtimes break either way): that is reported, not failed, and the comparison stops there, since
the two continuations differ. A parting where the logits disagree beyond it is a failure.

The reference is always the transformers model, never the functional decoder
(exporters/decoder.py) the graph was traced from: checking an export against its own source
would pass whatever the tracing got wrong. A model whose transformers forward cannot run
(e.g. per-layer head counts without per-module group sizes) fails validation with that reason.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from exporters.decoder import head_dim, layer_shapes
from runtime.ort_server import OrtDecoder

# |onnx - torch| <= TOLERANCE x max(1, max |torch|) per output. The reference is itself fp32:
# on SmolLM2-135M pruned to 0.5, PyTorch's fp32 logits are up to 8.6e-3 from a float64 run
# (2.8e-4 of their scale 30.3) while onnxruntime's are 5.4e-4 away, so optimum's absolute 1e-4
# would reject correct exports; a wrong mask, RoPE or head layout moves logits by whole units,
# far beyond 1e-3 of their scale. fp16 is compared with the fp32 model: its tolerance is fp16
# rounding through every layer (4.7e-3 of the scale on dense SmolLM2), not an export error.
TOLERANCE = {"float32": 1e-3, "float16": 2e-2,
             # onnxruntime's INT8 graph against the same model fake-quantized in PyTorch: the weights
             # are the same integers, but an activation a float rounding away from a half step rounds
             # to the other uint8 value, and such flips accumulate through the layers
             "int8": 5e-2}
GREEDY_TOKENS = 32
# The perturbation of the INT8 twin's quantizer inputs, relative (2^-20: eight float32 ulps), and
# its seeds: onnxruntime's float32 activations differ from PyTorch's by a few ulps, from the order it
# sums in.
JITTER, JITTER_SEEDS = 2.0 ** -20, (1, 2)


class ValidationError(RuntimeError):
    """The exported graph does not reproduce the model; the message is one readable line."""


class _Reference:
    """PyTorch forward with a cache: __call__(ids, mask, pos, state) -> (logits, state, presents)."""

    def __init__(self, model):
        self.model, self.name = model, "transformers"
        try:
            with torch.inference_mode():
                # with padding, as validation runs it: without a mask transformers may take a
                # grouped-attention path that hides wrong per-module group sizes
                model(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1]]), use_cache=True)
        except Exception as e:  # noqa: BLE001 - whatever it is, there is no independent reference
            raise ValidationError(f"the reference cannot run (transformers forward fails: {_line(e)}), so the "
                                  f"export cannot be checked against anything but itself; not writing it") from None

    @torch.inference_mode()
    def __call__(self, ids, mask, pos, state=None):
        out = self.model(ids, attention_mask=mask, position_ids=pos, past_key_values=state, use_cache=True)
        cache = out.past_key_values
        presents = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]
        return out.logits.float(), cache, presents


def validate(model, onnx_path: Path, dtype: str = "float32", tokenizer=None, seed: int = 0,
             threads: int | None = None, int8=None, static_activations: bool = False) -> dict:
    """Run the checks; raise ValidationError (one line) on the first failure; return the figures.

    threads: onnxruntime threads, by default as many as torch uses (the pipeline's --threads).
    int8: the graph is onnxruntime's INT8 and `model` its PyTorch twin, activations fake-quantized
    per tensor by these hooks (optimizer/quantize.OrtInt8). Its tolerance is TOLERANCE["int8"] of the logits' scale, or twice
    what the twin itself moves when perturbed at the level of float rounding, whichever is larger:
    an activation a rounding error away from a half step lands on the other int8 value, and such
    flips grow through the layers, in PyTorch as in onnxruntime (one flip in a middle layer can move a
    position's logits by a tenth of their scale or more: docs/onnx.md). The perturbed twins
    (`_perturbed_twins`): the twin in float64, and the twin in float32 with every quantizer input
    moved by a few float32 ulps (`JITTER`), as different summation orders move them. Their largest
    distance is taken per position (`_Noise`): such a position gets its own limit without
    loosening the others'. A wrong graph (a padded row, a wrong axis) is off by ten times that.
    static_activations: an INT8 graph whose activation scales are fixed (QDQ). A row no longer
    depends on its batch, so the prefill keeps its left-padded row; the caches are not held to the
    rule above (its limits there are the least robust), but to an exact check that follows
    (`_MatchedRounding`): the graph's operators as written, unfused, with onnxruntime's own int8
    activations read out of a copy of it; the twin takes them where the two round a value
    differently, which must be a near-tie (optimizer/quantize.NEAR_TIE; any other difference fails),
    and prefill and decode logits and caches are then held to the fp32 tolerance. (onnxruntime's
    fused kernels, which the checks above run, round a few values differently again.)
    """
    t0 = time.time()
    threads = threads or torch.get_num_threads()
    tol = TOLERANCE["int8"] if int8 else TOLERANCE[dtype]
    shapes = layer_shapes(model)
    d = head_dim(model.config)
    try:
        ort_dec = OrtDecoder(onnx_path, threads=threads)
    except Exception as e:
        raise ValidationError(f"onnxruntime cannot load the exported graph: {_line(e)}") from None
    names_in = ["input_ids", "attention_mask", "position_ids"] + \
        [f"past_key_values.{i}.{kv}" for i in range(len(shapes)) for kv in ("key", "value")]
    names_out = ["logits"] + [f"present.{i}.{kv}" for i in range(len(shapes)) for kv in ("key", "value")]
    got_in = [i.name for i in ort_dec.session.get_inputs()]
    if got_in != names_in or ort_dec.output_names != names_out:
        raise ValidationError(f"graph names differ from the expected ones: inputs {got_in[:4]}..., "
                              f"outputs {ort_dec.output_names[:3]}...")
    ref = _Reference(model)
    vocab = ort_dec.vocab_size
    rng = np.random.default_rng(seed)
    figures = {"reference": ref.name, "dtype": dtype, "tolerance_of_scale": tol}

    # prefill: two rows of 12 tokens, the second left-padded by 4 (not for a graph whose activations
    # are quantized per tensor at run time: the padded positions' states, which the two runtimes need
    # not agree on, would set the scale every row is rounded with)
    b, s, pad = 2, 12, 0 if int8 and not static_activations else 4
    figures["prefill_left_padding"] = pad
    ids = torch.from_numpy(rng.integers(0, vocab, (b, s)))
    mask = torch.ones(b, s, dtype=torch.long)
    if pad:
        mask[1, :pad] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    r_logits, state, r_pres = ref(ids, mask, pos)
    keep = mask.bool().numpy()
    noise = noise2 = twins = None
    if int8:
        twins = _perturbed_twins(model, ref, int8)
        noise = _Noise([t(ids, mask, pos) for t in twins], r_logits, r_pres, keep, keep)
        figures.update(reference_twin_noise=noise.max, perturbed_twins=len(twins))
    logits, pres = _run(ort_dec, ids, mask, pos, ort_dec.empty_past(b))
    _shapes("prefill", logits, pres, (b, s, vocab), shapes, d, s)
    cache = not (int8 and static_activations)  # a QDQ graph's caches: held exactly by `_as_written` instead
    figures["prefill"] = _compare("prefill", logits[keep], r_logits.numpy()[keep], pres if cache else [],
                                  r_pres, keep, tol, noise and noise.logits[keep], noise and noise.presents)

    # decode: one token per row, fed with the graph's own presents
    nxt = torch.from_numpy(rng.integers(0, vocab, (b, 1)))
    mask2 = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], dim=1)
    pos2 = pos[:, -1:] + 1
    r_logits2, _, r_pres2 = ref(nxt, mask2, pos2, state)
    if int8:
        noise2 = _Noise([t(nxt, mask2, pos2, st) for t, st in zip(twins, noise.states)], r_logits2, r_pres2,
                        np.ones((b, 1), bool), mask2.bool().numpy(), typical=noise)
        figures.update(reference_twin_noise=max(noise.max, noise2.max), tolerance_of_scale=noise.tolerance_of_scale(tol),
                       positions_loosened_by_float_noise=noise.loosened(tol) + noise2.loosened(tol),
                       positions=int(keep.sum()) + b)
    logits2, pres2 = _run(ort_dec, nxt, mask2, pos2, pres)
    _shapes("decode", logits2, pres2, (b, 1, vocab), shapes, d, s + 1)
    figures["decode"] = _compare("decode", logits2, r_logits2.numpy(), pres2 if cache else [], r_pres2,
                                 mask2.bool().numpy(), tol, noise2 and noise2.logits, noise2 and noise2.presents)

    # along the greedy path the INT8 limit is set per step by the perturbed twins run beside it, as above
    figures["greedy"] = _greedy(ort_dec, ref, _prompt(tokenizer, vocab, rng), tol,
                                twins, noise.typical if int8 else 0.0)
    if int8 and static_activations:
        figures["as_written"] = _as_written(_MatchedRounding(onnx_path, ref, threads, int8), (ids, mask, pos),
                                            (nxt, mask2, pos2))
    figures["validate_s"] = round(time.time() - t0, 2)
    return figures


def _run(dec: OrtDecoder, ids, mask, pos, past):
    try:
        return dec.run(ids.numpy(), mask.numpy(), pos.numpy(), past)
    except Exception as e:
        raise ValidationError(f"onnxruntime failed to run the exported graph: {_line(e)}") from None


def _shapes(step, logits, pres, want_logits, shapes, d, total) -> None:
    if logits.shape != want_logits:
        raise ValidationError(f"{step}: logits shape {logits.shape}, expected {want_logits}")
    for i, sh in enumerate(shapes):
        want = (want_logits[0], sh.num_kv_heads, total, d)
        for j, kind in enumerate(("key", "value")):
            if pres[2 * i + j].shape != want:
                raise ValidationError(f"{step}: present.{i}.{kind} shape {pres[2 * i + j].shape}, expected {want}")


class _MatchedRounding:
    """A QDQ graph's operators as written against the PyTorch twin rounding as they did. Each call runs
    a copy of the graph, unfused, with every QuantizeLinear output made an output, and the twin with
    those int8 values (optimizer/quantize.OrtInt8.rounding_from); a value the two round differently
    away from a near-tie fails. Returns the twin's (logits, state, presents) and onnxruntime's
    (logits, presents); the state carries both caches."""

    def __init__(self, onnx_path: Path, ref: _Reference, threads: int, int8):
        import onnx
        from exporters.onnx import qdq_pairs
        self.ref, self.int8, self.counts = ref, int8, {}
        proto = onnx.load(str(onnx_path), load_external_data=False)
        # (block, role) -> the QuantizeLinear output its MatMul reads through a DequantizeLinear
        self.tensor_of = {key: q.output[0] for key, (q, _dq) in qdq_pairs(proto.graph).items()}
        missing = sorted(set(self.int8.scales) - set(self.tensor_of))
        if missing:
            raise ValidationError(f"the graph has no QuantizeLinear for the twin's INT8 Linear {missing[0]} "
                                  f"({len(missing)} missing)")
        self.names = sorted(set(self.tensor_of.values()))
        for t in self.names:
            proto.graph.output.append(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.INT8, None))
        copy = onnx_path.parent / f".rounding-{onnx_path.name}"
        try:
            onnx.save(proto, str(copy))  # its weights stay in the graph's own external data file, if any, by name
            self.dec = OrtDecoder(copy, threads=threads, optimized=False)
        except Exception as e:
            raise ValidationError(f"onnxruntime cannot load the graph with its int8 activations as outputs: "
                                  f"{_line(e)}") from None
        finally:
            copy.unlink(missing_ok=True)
        self.n_pres = len(self.dec.past_names)

    def __call__(self, ids, mask, pos, state=None):
        twin_state, past = state if state is not None else (None, self.dec.empty_past(ids.shape[0]))
        ort_logits, out = _run(self.dec, ids, mask, pos, past)
        past, ints = out[:self.n_pres], dict(zip(self.names, out[self.n_pres:]))
        theirs = {key: torch.from_numpy(ints[t]) for key, t in self.tensor_of.items()}
        with self.int8.rounding_from(theirs, mask[:, -ids.shape[1]:].bool(), self.counts):
            logits, twin_state, presents = self.ref(ids, mask, pos, twin_state)
        if self.counts.get("mismatched"):
            raise ValidationError(f"onnxruntime rounded {self.counts['mismatched']} of {self.counts['values']:,} int8 "
                                  f"activations differently from the PyTorch twin, away from any near-tie")
        return (logits, (twin_state, past), presents), (ort_logits, past)


def _as_written(exact: _MatchedRounding, prefill: tuple, decode: tuple) -> dict:
    """Prefill and decode of the QDQ graph as written against the twin rounding as it did, logits and
    caches within the fp32 tolerance."""
    tol, figures, state = TOLERANCE["float32"], {"tolerance_of_scale": TOLERANCE["float32"]}, None
    for step, (ids, mask, pos) in (("prefill", prefill), ("decode", decode)):
        (r_logits, state, r_pres), (logits, pres) = exact(ids, mask, pos, state)
        keep = mask[:, -ids.shape[1]:].bool().numpy()
        figures[step] = _compare(f"{step}, the graph as written", logits[keep], r_logits.numpy()[keep], pres, r_pres,
                                 mask.bool().numpy(), tol)
    figures.update(activations_compared=exact.counts["values"], near_ties_taken_from_onnxruntime=exact.counts["near_ties"])
    return figures


def _perturbed_twins(model, ref: _Reference, int8) -> list:
    """The INT8 twin in float64, and in float32 with its quantizer inputs jittered (one per seed)."""
    import copy
    return [_Reference(copy.deepcopy(model).double()), *(_Jittered(ref, int8, seed) for seed in JITTER_SEEDS)]


class _Jittered:
    """The reference run with its INT8 quantizer inputs perturbed by JITTER (optimizer/quantize.OrtInt8)."""

    def __init__(self, ref: _Reference, int8, seed: int):
        self.ref, self.int8, self.generator = ref, int8, torch.Generator().manual_seed(seed)

    def __call__(self, *args):
        with self.int8.jittered(JITTER, self.generator):
            return self.ref(*args)


class _Noise:
    """Twice the perturbed twins' largest distance from the float32 reference per position, the
    limits of an INT8 check: `logits` (batch, seq, 1) and `presents` (one (batch, 1, seq, 1) per
    cache tensor), never below twice the distance at 90% of the positions (`typical`: a position
    where the twins happen to agree is no tighter than the rest; the positions beyond it keep their own).
    keep, cache_keep: the positions compared, (batch, seq) and (batch, cache length): padded ones
    take no part in the statistics."""

    def __init__(self, runs: list, r_logits, r_pres, keep: np.ndarray, cache_keep: np.ndarray,
                 typical: "_Noise | None" = None):
        self.states = [state for _, state, _ in runs]
        dist = np.max([(lg.float() - r_logits).abs().amax(-1, keepdim=True).numpy() for lg, _, _ in runs], axis=0)
        pres = [np.max([(run[2][i].float() - p).abs().amax((1, 3), keepdim=True).numpy() for run in runs], axis=0)
                for i, p in enumerate(r_pres)]
        kept = dist[..., 0][keep]
        self.max = float(kept.max())
        self.scale = max(1.0, float(r_logits.abs().max()))
        self.typical = typical.typical if typical else float(np.quantile(kept, 0.9))
        self.logits = 2 * np.maximum(dist, self.typical)
        self.presents = [2 * np.maximum(p, np.quantile(p[:, 0, :, 0][cache_keep[:, -p.shape[2]:]], 0.9))
                         for p in pres]
        self._dist = kept

    def tolerance_of_scale(self, tol: float) -> float:
        """The tolerance at most positions, as a fraction of the logits' scale."""
        return max(tol, 2 * self.typical / self.scale)

    def loosened(self, tol: float) -> int:
        """Positions where the twin's own distance there, not the typical one, sets the logits' limit."""
        return int((2 * self._dist > self.tolerance_of_scale(tol) * self.scale).sum())


def _compare(step, logits, r_logits, pres, r_pres, keep, tol, noise=None, pres_noise=None) -> dict:
    """Max abs differences; fail beyond tolerance (or, given the twin's float noise per position,
    beyond twice that where it is larger). Cache rows at padded positions are not compared."""
    diff = _excess(logits.astype(np.float32), r_logits, tol, noise)
    if diff["excess"] > 0:
        raise ValidationError(f"{step}: logits differ from PyTorch by up to {diff['max_abs']:.3g} "
                              f"(tolerance {diff['limit']:.3g} = {tol:g} x their scale"
                              f"{'' if noise is None else ', or twice the perturbed twins’ distance'})")
    worst = 0.0
    for i, (a, r) in enumerate(zip(pres, r_pres)):
        r = r.float().numpy()
        a = a[:, :, -r.shape[2]:].astype(np.float32)  # a sliding-window cache keeps only the last tokens
        valid = keep[:, None, -r.shape[2]:, None]
        dd = _excess(np.where(valid, a, 0), np.where(valid, r, 0), tol, None if pres_noise is None else pres_noise[i])
        if dd["excess"] > 0:
            raise ValidationError(f"{step}: present.{i // 2}.{('key', 'value')[i % 2]} differs from PyTorch's cache "
                                  f"by up to {dd['max_abs']:.3g} (tolerance {dd['limit']:.3g})")
        worst = max(worst, dd["max_abs"])
    return {"logits_max_abs_diff": diff["max_abs"], "present_max_abs_diff": worst if pres else None,
            "logits_max_abs": float(np.abs(r_logits).max())}


def _excess(a: np.ndarray, r: np.ndarray, tol: float, noise: np.ndarray | None = None) -> dict:
    """noise: a limit per position broadcastable to `a` (_Noise's), where it is larger than tol's."""
    limit = tol * max(1.0, float(np.abs(r).max(initial=0.0)))
    if not np.isfinite(a).all():
        return {"max_abs": float("nan"), "excess": 1.0, "limit": limit}
    d = np.abs(a - r)
    if noise is None:
        return {"max_abs": float(d.max(initial=0.0)), "excess": float(d.max(initial=0.0)) - limit, "limit": limit}
    over = d - np.maximum(limit, noise)
    worst = np.unravel_index(np.argmax(over), over.shape) if over.size else None
    # beyond the limit, the worst offender's difference and limit; within it, the largest difference
    return {"max_abs": float(d.max(initial=0.0)) if over.size == 0 or over[worst] <= 0 else float(d[worst]),
            "excess": float(over.max(initial=-1.0)),
            "limit": limit if worst is None else float(np.maximum(limit, np.broadcast_to(noise, d.shape)[worst]))}


def _prompt(tokenizer, vocab: int, rng) -> list[int]:
    if tokenizer is not None:
        ids = tokenizer("The history of the city begins in", add_special_tokens=True)["input_ids"]
        if ids and max(ids) < vocab:
            return list(ids)
    return rng.integers(0, vocab, 8).tolist()


def _greedy(ort_dec: OrtDecoder, ref: _Reference, prompt: list[int], tol: float,
            twins: list | None = None, typical: float = 0.0) -> dict:
    """Greedy tokens of onnxruntime against PyTorch's, each step's logits within tol of their scale
    (with an INT8 graph's perturbed twins: or twice their largest distance at that step, or `typical`,
    whichever is larger). They may part only at a step whose logits agree that closely."""
    ort_tokens, ort_steps = ort_dec.greedy(prompt, GREEDY_TOKENS)
    n = len(prompt)
    args = (torch.tensor([prompt]), torch.ones(1, n, dtype=torch.long), torch.arange(n)[None])
    logits, state, _ = ref(*args)
    runs = [t(*args) for t in twins or []]
    matched, tie, worst = 0, None, 0.0
    for step in range(GREEDY_TOKENS):
        row = logits[0, -1]
        limit = tol * max(1.0, float(row.abs().max()))
        if runs:
            limit = max(limit, 2 * max(typical, *(float((lg[0, -1].float() - row).abs().max()) for lg, _, _ in runs)))
        diff = float(np.abs(ort_steps[step] - row.numpy()).max())  # nan where onnxruntime's logits are
        worst = max(worst, diff)
        tok = int(row.argmax())
        if not diff <= limit:
            parted = f", and the tokens part there (PyTorch {tok}, onnxruntime {ort_tokens[step]})" \
                if tok != ort_tokens[step] else ""
            raise ValidationError(f"greedy generation: token {step + 1}'s logits differ from PyTorch by up to "
                                  f"{diff:.3g} (tolerance {limit:.3g}){parted}")
        if tok != ort_tokens[step]:
            tie = {"step": step + 1, "logit_margin": float(row[tok] - row[ort_tokens[step]]), "logits_max_abs_diff": diff}
            break
        matched += 1
        if step + 1 < GREEDY_TOKENS:
            n += 1
            args = (torch.tensor([[tok]]), torch.ones(1, n, dtype=torch.long), torch.tensor([[n - 1]]))
            logits, state, _ = ref(*args, state)
            runs = [t(*args, st) for t, (_, st, _) in zip(twins or [], runs)]
    return {"tokens": GREEDY_TOKENS, "matched": matched, "parted_at_near_tie": tie, "prompt_tokens": len(prompt),
            "logits_max_abs_diff": worst}


def _line(e: Exception) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]
