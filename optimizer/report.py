"""The package's report.md, for a person: what was done, why, and what was measured, up to the
plan. The exporter adds its serving section (exporters/vllm.py, exporters/onnx.py)."""

from __future__ import annotations

from core.manifest import Manifest
from optimizer import search


def _perplexity_line(q: dict | None) -> str:
    if not q:
        return "Not measured (no evaluation text)."
    line = (f"Perplexity on {q['eval']} ({q['windows']} windows of {q['seq_len']} tokens): "
            f"dense **{q['dense']:.3f}**, pruned **{q['pruned']:.3f}**")
    if q.get("pruned_unquantized") is not None:
        u = q["pruned_unquantized"]
        line += f" (before quantizing {u:.3f}: quantization {100 * (q['pruned'] / u - 1):+.1f}%)"
    return line + "."


def _zeroshot_lines(m: Manifest) -> list[str]:
    z = m.quality.get("zeroshot")
    if not z:
        return []
    before = (m.heal or {}).get("before", {}).get("zeroshot")
    tasks = z["tasks"]
    last = "pruned, quantized" if m.quantization else "pruned"
    rows = [("dense", z["dense"]), *((("before healing", before),) if before else ()), (last, z["pruned"])]
    lines = ["", f"Zero-shot accuracy ({z['limit']} seeded documents a task, seed {z['seed']}):", "",
             "| | " + " | ".join(tasks) + " | mean |", "|---" * (len(tasks) + 2) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{r['tasks'][t]:.3f}" for t in tasks) + f" | **{r['mean']:.3f}** |"
              for name, r in rows]
    return lines


def _quant_lines(m: Manifest) -> list[str]:
    q = m.quantization
    if not q:
        return []
    size = m.size
    per_value = q.get("bytes_per_value", 2)
    rest, dense = ("fp32", "fp32") if per_value == 4 else ("16-bit", "bf16")
    return [f"- quantization: {q['scheme']} ({q['precision']}: weights {q['weights']}, activations "
            f"{q['activations']}; {_kept_unquantized(q, rest)}), {q['linears']} Linear "
            f"layers; weights {size['weight_bytes_quantized'] / 1e6:.0f} MB against the dense model's "
            f"{per_value * size['params_dense'] / 1e6:.0f} MB in {dense} (ideal speedup from bytes: "
            f"{size['ideal_ratio_quantized']:.2f}x)"] + [
        f"  - kernel shapes: {line}" for line in [*(q.get("cpu_kernel_shape_misses") or []),
                                                    *(q.get("marlin_misses") or [])]]


def _recipe(c: dict) -> str:
    """The heal config's optimizer and memory recipe, in words."""
    opt = {"adamw": "AdamW", "adafactor": "Adafactor"}[c.get("optimizer", "adamw")]
    return f"{opt} at {c['lr']:g}" + (", activations recomputed per block" if c.get("checkpointing") else "")


def _heal_lines(m: Manifest) -> list[str]:
    h = m.heal
    if not h:
        return []
    q = m.perplexity
    b, a = h["before"], h["after"]
    lines = ["", "## Healing", ""]
    if h.get("skipped_by_probe"):
        lines += [f"Not distilled: a probe of the learning rate on {h['data']} lowered no held-out KL "
                  f"({h['wall_s']:.0f} s)."]
    else:
        lines += [f"Distilled from the dense model on {h['data']}: {h['tokens']:,} tokens in {h['steps']} steps "
                  f"({h['wall_s']:.0f} s, peak {h['peak_rss_gib']:.1f} GiB resident; {_recipe(h['config'])}"
                  + (f"; {h['processes']} processes, {h['batch'] // h['processes']} sequence(s) each a step"
                     if h.get("processes", 1) > 1 else "")
                  + (", stopped by the time cap" if h["stopped_by_time"] else "") + ")."]
    lines.append(f"KL to the dense model on the held-out calibration window: {b['held_out_kd']:.4f} before, "
                 f"{a['held_out_kd']:.4f} after.")
    if h.get("probe"):
        lines.append(f"Peak learning rate {h['config']['lr']:.1e}, chosen by healing {h['probe'][0]['steps']} steps "
                     "at each probed rate from the unhealed weights (held-out KL after each: "
                     + ", ".join(f"{p['held_out_kd']:.4f} at {p['lr']:.1e}" for p in h["probe"])
                     + f"); the probe's peak: {h['peak_rule']}.")
    if h.get("skipped_by_probe"):
        lines.append("**No probed rate lowered that KL, so nothing was healed: the package keeps the unhealed "
                     "weights** (`--set heal.lr=RATE` heals at a rate of your choice).")
    elif h.get("kept_unhealed"):
        lines.append("**Healing made that KL worse, so the package keeps the unhealed weights** (try another "
                     "`heal.lr` or other `heal.data`).")
    if q and "perplexity" in b and not h.get("kept_unhealed"):
        healed = q.get("pruned_unquantized", q["pruned"])  # the package's, where nothing was quantized
        lines.append(f"Perplexity on the evaluation text: {b['perplexity']:.3f} before healing, "
                     f"{healed:.3f} after (dense {q['dense']:.3f})"
                     + (f"; {q['pruned']:.3f} quantized." if "pruned_unquantized" in q else "."))
    if h.get("zeros_held"):
        lines.append(f"The zeros of {h['zeros_held']} weight matrices were held through training.")
    if h.get("chat"):
        lines += ["", "Greedy answers (PyTorch), dense beside healed:", "",
                  "| instruction | dense | healed |", "|---|---|---|"]
        cell = lambda t: t.replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines += [f"| {cell(c['prompt'])} | {cell(c['dense'])} | {cell(c['healed'])} |" for c in h["chat"]]
    return lines


def _shape_lines(meth: dict) -> list[str]:
    """Heads and channels removed: the block shape, and the shapes tried."""
    dense, shape = meth["dense_shape"], meth["shape"]
    lines = ["## Shape per block", "",
             "| | query heads | KV heads | MLP channels |", "|---|---|---|---|",
             f"| dense | {dense['num_heads']} | {dense['num_kv_heads']} | {dense['intermediate_size']} |",
             f"| pruned | {shape['num_heads']} | {shape['num_kv_heads']} | {shape['intermediate_size']} |",
             "", "Candidate shapes tried (held-out calibration loss, lower is better):", ""]
    for c in meth["candidates"]:
        if "alpha" in c:  # the per-layer layout's widths (structured.choose_per_layer)
            lines.append(f"- per-layer MLP widths {min(c['widths'])}-{max(c['widths'])}, {c['alpha']:.0%} of the way "
                         f"from uniform to the global ranking: loss {c['held_out_loss']:.4f}")
            continue
        s = c["shape"]
        lines.append(f"- {s['num_heads']}/{s['num_kv_heads']} heads, {s['intermediate_size']} channels: "
                     f"retention {c['retain']:.3f}, loss {c['held_out_loss']:.4f}")
    return lines


def _blocks_lines(meth: dict) -> list[str]:
    """Whole blocks removed (--method depth): which, and each block's influence."""
    b = meth["blocks"]
    return ["## Blocks", "",
            f"{len(b['kept'])} of {b['dense']} blocks kept, each whole; removed: "
            f"{', '.join(map(str, b['removed']))} ({b['criterion']}, lowest first go; the first and last stay).", "",
            "| block | " + " | ".join(str(i) for i in range(b["dense"])) + " |",
            "|---" * (b["dense"] + 1) + "|",
            "| influence | " + " | ".join(f"{x:.3f}" for x in b["influence"]) + " |",
            "| kept | " + " | ".join("yes" if i in b["kept"] else "—" for i in range(b["dense"])) + " |"]


def _speeds(measured: dict | None) -> str:
    if not measured:
        return "Speeds are the target's roofline"
    base = measured["dense_tokens_per_s"]
    return (f"Speeds are the target's roofline, and for the candidates within the budget measured ({measured['engine']} "
            f"on {measured['cpu']}, {measured['threads']} threads: decode after a {measured['prompt_tokens']}-token "
            f"prompt, the median of {measured['rounds']} interleaved rounds, scatter {measured['scatter']:.0%}; the dense graph "
            + ", ".join(f"{r} tok/s at batch {b}" for b, r in base.items()) + "); the choice reads the measured ones")


def _search_lines(m: Manifest) -> list[str]:
    """The search's candidates (manifest "frontier"), the budget and why this package."""
    f = m.frontier
    if not f:
        return []
    checked = f.get("chosen_checked")
    return ["", "## Search", "",
            f"Budget: {f['budget']['text']}. Held-out text: {f['held_out']}. " + _speeds(f.get("measured")) + "; "
            "\"expected\" is the measured ratio, for a pruned candidate with the share healing is predicted to win "
            "back" + (f" ({f['heal_recovery_predicted']:.0%} of the excess)" if f.get("heal_recovery_predicted") else "")
            + ". `frontier.png` plots them.", "", search.table(f["candidates"]), "", f"Chosen: {f['why']}."
            + (f" Re-checked as shipped (healed, quantized): {checked['ppl_ratio']:.3f}× dense on the held-out text."
               if checked else "")]


def _head(m: Manifest) -> list[str]:
    return [f"# {m.engine.served_model_name}", "",
            f"- source: {m.source.model} ({m.source.architecture})",
            f"- target: {m.target.display_name} (`{m.target.name}`)"]


def render(m: Manifest) -> str:
    """report.md of a structured or depth package, up to its plan."""
    meth, size, q = m.method, m.size, m.perplexity
    lines = [
        *_head(m),
        f"- method: {meth['name']} ({meth['plan']}, {meth['layout']} layout, seed {meth['seed']})",
        f"- retention of block parameters: requested {meth['retain_requested']:.2f}, "
        f"achieved {meth['retain_achieved']:.3f}",
        f"- parameters: {size['params_dense']:,} → {size['params_pruned']:,} "
        f"(ideal speedup from bytes: {size['ideal_ratio']:.2f}x)",
        (f"- calibration: {meth['calibration']['source']}, {meth['calibration']['tokens']:,} tokens"
         if meth["calibration"]["tokens"] else "- calibration: none needed (nothing removed)"),
        *([(f"- refit: the kept o_proj / down_proj columns were refitted by least squares on "
            f"{meth['refit']['tokens']:,} calibration tokens (ridge {meth['refit']['damp']:g})")
           if meth["refit"]["applied"] else
           ("- refit: tried and not applied (it raised the held-out calibration loss "
            f"{meth['refit']['held_out_loss_before']:.4f} → {meth['refit']['held_out_loss_after']:.4f})")]
          if "refit" in meth else []),
        *_quant_lines(m),
        "",
        *(_blocks_lines(meth) if "blocks" in meth else _shape_lines(meth) if size["params_pruned"] < size["params_dense"]
          else ["Nothing was removed: every block keeps its dense shape."]),
    ]
    lines += ["", "## Quality", "", _perplexity_line(q), *_zeroshot_lines(m), *_heal_lines(m), *_search_lines(m)]
    lines += ["", "## Plan", "", "```", m.plan.text, "```", "",
              "The roofline is a prediction from the target's datasheet numbers; "
              "`bench PACKAGE --baseline MODEL` measures the real ratio on your hardware."]
    return "\n".join(lines)


def render_experts(m: Manifest) -> str:
    """report.md of an MoE package, up to its plan: experts removed, what that saves and what it does not."""
    meth, size, q = m.method, m.size, m.perplexity
    e, p = meth["experts"], m.plan.prediction
    lines = [
        *_head(m),
        f"- method: {meth['name']} (routed experts removed, the same number in each of "
        f"{len(e['moe_layers'])} MoE layers; seed {meth['seed']})",
        f"- experts: {e['kept']} of {e['dense']} kept per MoE layer, top-{e['top_k']} routing unchanged"
        + (f", each narrowed to {e['width_kept']} of {e['width_dense']} channels"
           if e.get("width_kept", e.get("width_dense")) != e.get("width_dense") else "")
        + (f"; --retain {meth['retain_requested']:.2f} is the share of routed-expert parameters kept, whole "
           f"experts first down to top-k, then channels" if "width_dense" in e else
           f"; --retain {meth['retain_requested']:.2f} is the share of routed experts kept")
        + f" (achieved {meth['retain_achieved']:.3f}); attention, shared experts and dense layers are whole",
        f"- parameters: {size['params_dense']:,} → {size['params_pruned']:,}; active per token "
        f"{size['active_params_dense']:,} → {size['active_params_pruned']:,} (ideal speedup from bytes once a "
        f"batch reads every expert: {size['ideal_ratio']:.2f}x)",
        f"- calibration: {meth['calibration']['source']}, {meth['calibration']['tokens']:,} tokens",
        "",
        "## Experts kept",
        "",
        "| MoE layer | kept experts |", "|---|---|",
        *(f"| {i} | {', '.join(map(str, k))} |" for i, k in zip(e["moe_layers"], e["keep"])),
        "",
        "## Speed",
        "",
        f"Removing experts does not change the work a token does (it still runs {e['top_k']} experts; "
        f"narrowing them does). It lowers the bytes a step reads once a batch reaches more experts than are left: the roofline "
        f"predicts {p['decode_speedup_b1']:.2f}x at batch 1 and {p['decode_speedup_b16']:.2f}x at batch 16.",
        "", "## Quality", "", _perplexity_line(q), *_zeroshot_lines(m), *_heal_lines(m),
        "", "## Plan", "", "```", m.plan.text, "```"]
    return "\n".join(lines)


def render_sparse(m: Manifest) -> str:
    """report.md of a semi-structured package, up to its plan: the pattern, and whether any engine will use it."""
    meth, q = m.method, m.perplexity
    sparse = m.engine.sparse24 or {}
    if sparse.get("config_written"):
        speed = (f"The config carries compressed-tensors' `sparsity_config` (2:4, dense storage), so vLLM "
                 f"{' or '.join(sparse['kernel_versions'])} on {m.target.display_name} runs the blocks' "
                 f"matmuls on its 2:4 sparse kernel. Other vLLM versions refuse that config; `serve` then "
                 f"adds `{' '.join(sparse['dense_fallback_args'])}` and serves the weights densely.")
    else:
        speed = (f"**No speedup is to be expected**: {m.plan.reasons[0]}. The package stores "
                 f"{meth['sparsity']} zeros in an ordinary dense checkpoint, which every engine loads and runs "
                 f"as dense matmuls. For a faster model on this target use `--method structured`.")
    lines = [
        *_head(m),
        f"- method: {meth['name']}, sparsity {meth['sparsity']} in every Linear of the blocks "
        f"(embeddings and LM head dense), seed {meth['seed']}",
        f"- zeros: {meth['zero_fraction']:.3f} of {meth['pruned_linear_params']:,} block weights; "
        f"every Linear checked against the pattern",
        f"- calibration: {meth['calibration']['source']}, {meth['calibration']['tokens']:,} tokens, "
        f"block by block ({meth['wall_s']:.0f} s)",
        "",
        "## Speed", "", speed, "",
        "## Quality", "", _perplexity_line(q), *_zeroshot_lines(m), *_heal_lines(m),
    ]
    lines += ["", "## Plan", "", "```", m.plan.text, "```"]
    return "\n".join(lines)


def _kept_unquantized(q: dict, rest: str) -> str:
    """What the quantization section leaves in `rest` precision: the head and the embedding, or with
    quant_head the embedding alone (the head untied from it)."""
    if "lm_head" not in q.get("ignore", ["lm_head"]):
        return f"the LM head too, untied; {''.join(f'{name} and ' for name in q['ignore'])}the embedding {rest}"
    return f"{', '.join(q['ignore'])} and the embedding {rest}"
