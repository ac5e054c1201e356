"""The package's report.md: what was done, why, and what was measured, for a person."""

from __future__ import annotations


def render(m: dict) -> str:
    meth, size, q = m["method"], m["size"], m["quality"].get("perplexity")
    dense, shape = meth["dense_shape"], meth["shape"]
    lines = [
        f"# {m['engine']['served_model_name']}",
        "",
        f"- source: {m['source']['model']} ({m['source']['architecture']})",
        f"- target: {m['target']['display_name']} (`{m['target']['name']}`)",
        f"- method: {meth['name']} ({meth['plan']}, {meth['layout']} layout, seed {meth['seed']})",
        f"- retention of block parameters: requested {meth['retain_requested']:.2f}, "
        f"achieved {meth['retain_achieved']:.3f}",
        f"- parameters: {size['params_dense']:,} → {size['params_pruned']:,} "
        f"(ideal speedup from bytes: {size['ideal_ratio']:.2f}x)",
        f"- calibration: {meth['calibration']['source']}, {meth['calibration']['tokens']:,} tokens",
        "",
        "## Shape per block",
        "",
        "| | query heads | KV heads | MLP channels |",
        "|---|---|---|---|",
        f"| dense | {dense['num_heads']} | {dense['num_kv_heads']} | {dense['intermediate_size']} |",
        f"| pruned | {shape['num_heads']} | {shape['num_kv_heads']} | {shape['intermediate_size']} |",
        "",
        "Candidate shapes tried (held-out calibration loss, lower is better):",
        "",
    ]
    for c in meth["candidates"]:
        s = c["shape"]
        lines.append(f"- {s['num_heads']}/{s['num_kv_heads']} heads, {s['intermediate_size']} channels: "
                     f"retention {c['retain']:.3f}, loss {c['held_out_loss']:.4f}")
    lines += ["", "## Quality", ""]
    if q:
        lines.append(f"Perplexity on {q['eval']} ({q['windows']} windows of {q['seq_len']} tokens): "
                     f"dense **{q['dense']:.3f}**, pruned **{q['pruned']:.3f}**.")
    else:
        lines.append("Not measured (no evaluation text).")
    lines += ["", "## Plan", "", "```", m["plan"]["text"], "```", "",
              "The roofline is a prediction from the target's datasheet numbers; "
              "`bench PACKAGE --baseline MODEL` measures the real ratio on your hardware.", "",
              "## Serving", "",
              f"- engine: {m['engine']['name']} (tested with {m['engine']['tested_with']})",
              f"- `./launch.sh` or `serve .` starts the OpenAI-compatible server with "
              f"`{' '.join(m['engine']['args'])}`",
              "- `Dockerfile` builds the same on an official vLLM image",
              f"- internal check: masked vs physically pruned logits differ by at most "
              f"{m['checks']['masked_vs_pruned_max_abs_logit_diff']:.2e}", ""]
    return "\n".join(lines)
