"""Side-by-side report of dense vs pruned serving runs (``run_load`` results).

Input::

    {"meta": {...free-form...},
     "runs": {"dense": {"1": [run_load result per round, ...], "16": [...]},
              "pruned": {...}},
     "ideal_ratio": 1.43 or None,
     "warmup": {"dense": [run_load result per round], ...}}   # optional

The first label in ``runs`` is the baseline. Each (label, concurrency) cell is reduced to its
best round ("best-of-N"): the highest output tokens/s and the lowest of each latency
percentile over the N rounds, which filters out rounds disturbed by noise on the machine.

Requests are never best-of-N: ``summary["requests"]`` adds up the requests sent, succeeded and
failed over every round of every (label, concurrency) cell and of the warm-up runs, and
``requests_line`` states the total, or FAILED with each cell that lost requests.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

__all__ = ["summarize", "markdown_table", "requests_line", "plot", "write_report"]

_LAT_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")
_PCTS = ("p50", "p99")

BEST_OF_N_NOTE = (
    "Best-of-N: each model and concurrency level was run N times (rounds, times --repeat within a "
    "round); the table shows the highest output tokens/s and, separately, the lowest of each latency "
    "percentile across those runs, so one noisy run does not decide the comparison. Ratios compare these best values "
    "with the baseline's; 'of ideal' is the tokens/s ratio divided by the ideal speed-up. 'paired' takes each "
    "measurement with the baseline's measurement of the same index (the same prompts, in the same round): the "
    "median of those N ratios and their range."
)
INTERLEAVED_NOTE = (
    "Interleaved (--interleave): both servers were up at once and measured in turn, so each pair's two "
    "measurements lie next to each other in time."
)


def _num(x: Any) -> float | None:
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _min(values) -> float | None:
    vs = [v for v in (_num(x) for x in values) if v is not None]
    return min(vs) if vs else None


def _max(values) -> float | None:
    vs = [v for v in (_num(x) for x in values) if v is not None]
    return max(vs) if vs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _conc_sort_key(c: str):
    try:
        return (0, float(c), c)
    except ValueError:
        return (1, 0.0, c)


def _counts(rounds: list[dict]) -> dict:
    """Requests over all rounds: sent, completed (= succeeded), failed (num_requests = both)."""
    completed = sum(int(r.get("completed") or 0) for r in rounds)
    failed = sum(int(r.get("failed") or 0) for r in rounds)
    # results written before "sent" existed: every request was sent
    sent = sum(int(r["sent"]) if r.get("sent") is not None
               else int(r.get("completed") or 0) + int(r.get("failed") or 0) for r in rounds)
    return {"sent": sent, "completed": completed, "failed": failed}


def _first_errors(rounds: list[dict], limit: int = 3) -> list[str]:
    errs: list[str] = []
    for r in rounds:
        for e in r.get("errors") or []:
            if e not in errs:
                errs.append(str(e))
    return errs[:limit]


def _requests(results: dict, best: dict[str, dict[str, dict]]) -> dict:
    """Requests sent / succeeded / failed per label and level, per label's warm-up, and in all."""
    levels = {label: {c: {"sent": cell["sent"], "succeeded": cell["completed"], "failed": cell["failed"]}
                      for c, cell in per_conc.items()}
              for label, per_conc in best.items()}
    warmup = {}
    for label, rounds in (results.get("warmup") or {}).items():
        n = _counts(list(rounds or []))
        warmup[str(label)] = {"sent": n["sent"], "succeeded": n["completed"], "failed": n["failed"]}
    cells = [n for per in levels.values() for n in per.values()] + list(warmup.values())
    lost = []
    for label, per in levels.items():
        for c, n in per.items():
            if n["failed"]:
                rounds = (results.get("runs") or {}).get(label, {}).get(c) or []
                lost.append({"label": label, "concurrency": c, **n, "errors": _first_errors(rounds)})
    for label, n in warmup.items():
        if n["failed"]:
            lost.append({"label": label, "concurrency": "warm-up", **n,
                         "errors": _first_errors(results["warmup"][label])})
    return {
        "sent": sum(n["sent"] for n in cells),
        "succeeded": sum(n["succeeded"] for n in cells),
        "failed": sum(n["failed"] for n in cells),
        "all_succeeded": not any(n["failed"] for n in cells),
        "levels": levels,
        "warmup": warmup,
        "lost": lost,  # the cells that lost requests, with their first error messages
    }


def _best(rounds: list[dict]) -> dict:
    """Best-of-N reduction of a list of run_load results."""
    rounds = list(rounds or [])
    cell: dict[str, Any] = {
        "rounds": len(rounds),
        "output_tokens_per_s": _max(r.get("output_tokens_per_s") for r in rounds),
        "requests_per_s": _max(r.get("requests_per_s") for r in rounds),
        **_counts(rounds),
    }
    for key in _LAT_KEYS:
        cell[key] = {
            p: _min((r.get(key) or {}).get(p) for r in rounds) for p in _PCTS
        }
    return cell


def _paired(runs: list[dict], base_runs: list[dict]) -> dict | None:
    """Tokens/s ratio of each measurement to the baseline's of the same index: median, min, max."""
    if not runs or not base_runs or len(runs) != len(base_runs):
        return None  # nothing to pair by index
    pairs = sorted(p for p in (_ratio(_num(a.get("output_tokens_per_s")), _num(b.get("output_tokens_per_s")))
                               for a, b in zip(runs, base_runs)) if p is not None)
    if not pairs:
        return None
    return {"median": statistics.median(pairs), "min": pairs[0], "max": pairs[-1], "n": len(pairs)}


def summarize(results: dict) -> dict:
    """Best-of-N per label and concurrency, plus ratios against the baseline (first) label.

    Returns a JSON-serialisable dict::

        {"baseline": "dense", "labels": [...], "concurrencies": ["1", "16"],
         "ideal_ratio": 1.43 | None, "meta": {...},
         "best": {label: {conc: {"rounds", "output_tokens_per_s", "requests_per_s",
                                 "sent", "completed", "failed", "ttft_ms": {"p50","p99"},
                                 "tpot_ms": {...}, "e2e_ms": {...}}}},
         "ratios": {label: {conc: {"tokens_per_s", "ttft_p50", "tpot_p50", "e2e_p50",
                                   "fraction_of_ideal", "paired": {"median", "min", "max", "n"} | None}}},
         "requests": {"sent", "succeeded", "failed", "all_succeeded",
                      "levels": {label: {conc: {"sent", "succeeded", "failed"}}},
                      "warmup": {label: {"sent", "succeeded", "failed"}},
                      "lost": [{"label", "concurrency", "sent", "succeeded", "failed", "errors"}]}}

    Counts in ``best`` and ``requests`` are sums over the rounds, not a best-of-N.

    ``tokens_per_s`` ratio > 1 means faster than the baseline; latency ratios < 1 mean lower
    latency than the baseline.
    """
    runs = results.get("runs") or {}
    labels = [str(k) for k in runs]
    if not labels:
        raise ValueError("results has no runs")
    baseline = labels[0]
    ideal = _num(results.get("ideal_ratio"))
    concs: set[str] = set()
    best: dict[str, dict[str, dict]] = {}
    for label, per_conc in runs.items():
        best[str(label)] = {
            str(c): _best(rounds) for c, rounds in sorted(
                (per_conc or {}).items(), key=lambda kv: _conc_sort_key(str(kv[0])))
        }
        concs.update(best[str(label)])
    concurrencies = sorted(concs, key=_conc_sort_key)

    ratios: dict[str, dict[str, dict]] = {}
    for label in labels:
        ratios[label] = {}
        for c in concurrencies:
            cell = best[label].get(c)
            base = best[baseline].get(c)
            if cell is None:
                continue
            if base is None:
                r = {"tokens_per_s": None, "ttft_p50": None, "tpot_p50": None, "e2e_p50": None}
            else:
                r = {
                    "tokens_per_s": _ratio(cell["output_tokens_per_s"], base["output_tokens_per_s"]),
                    "ttft_p50": _ratio(cell["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
                    "tpot_p50": _ratio(cell["tpot_ms"]["p50"], base["tpot_ms"]["p50"]),
                    "e2e_p50": _ratio(cell["e2e_ms"]["p50"], base["e2e_ms"]["p50"]),
                }
            r["fraction_of_ideal"] = (
                _ratio(r["tokens_per_s"], ideal) if (ideal and label != baseline) else None
            )
            r["paired"] = None if label == baseline else _paired((runs.get(label) or {}).get(c),
                                                                 (runs.get(baseline) or {}).get(c))
            ratios[label][c] = r

    return {
        "baseline": baseline,
        "labels": labels,
        "concurrencies": concurrencies,
        "ideal_ratio": ideal,
        "meta": results.get("meta") or {},
        "best": best,
        "ratios": ratios,
        "requests": _requests(results, best),
        "predicted": _predicted_vs_measured(results.get("predicted"), ratios, labels),
    }


def _predicted_vs_measured(predicted: dict | None, ratios: dict, labels: list[str]) -> dict | None:
    """The plan's roofline decode speedup beside the measured one (the baseline's TPOT p50 over the
    package's, the decode steps alone) and the tokens/s ratio, at the levels the prediction has."""
    if not predicted or len(labels) < 2:
        return None
    measured = ratios.get(labels[1], {})
    levels = {}
    for c, pred in predicted["decode"].items():
        r = measured.get(c)
        if r is None:
            continue
        levels[c] = {"predicted_decode": pred, "measured_decode": _ratio(1.0, r.get("tpot_p50")),
                     "measured_tokens_per_s": r.get("tokens_per_s")}
    return {**{k: v for k, v in predicted.items() if k != "decode"}, "levels": levels} if levels else None


# --------------------------------------------------------------------------------------------
# markdown


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def markdown_table(summary: dict) -> str:
    """One row per (concurrency, label): throughput, latencies (ms), ratios vs the baseline."""
    base = summary["baseline"]
    ideal = summary.get("ideal_ratio")
    ideal_hdr = f"of ideal ({ideal:.2f}×)" if ideal else "of ideal"
    header = [
        "concurrency", "model", "output tok/s",
        "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "E2E p99",
        f"tok/s vs {base}", ideal_hdr, "paired: median (range)", "failed",
    ]
    align = ["---:", ":---"] + ["---:"] * (len(header) - 2)
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(align) + "|",
    ]
    for c in summary["concurrencies"]:
        for label in summary["labels"]:
            cell = summary["best"].get(label, {}).get(c)
            if cell is None:
                continue
            r = summary["ratios"].get(label, {}).get(c, {})
            row = [
                str(c),
                label,
                _f(cell["output_tokens_per_s"]),
                _f(cell["ttft_ms"]["p50"]),
                _f(cell["ttft_ms"]["p99"]),
                _f(cell["tpot_ms"]["p50"]),
                _f(cell["tpot_ms"]["p99"]),
                _f(cell["e2e_ms"]["p50"]),
                _f(cell["e2e_ms"]["p99"]),
                _f(r.get("tokens_per_s"), "{:.2f}×"),
                _f(None if r.get("fraction_of_ideal") is None else 100 * r["fraction_of_ideal"],
                   "{:.0f}%"),
                _paired_text(r.get("paired")),
                f"{cell['failed']}/{cell['completed'] + cell['failed']}",
            ]
            lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("Latencies in ms. TTFT: time to first token; TPOT: time per output token after "
                 "the first; E2E: whole request. failed: failed / requested, over all rounds.")
    if "requests" in summary:
        lines += ["", requests_line(summary)]
    return "\n".join(lines) + "\n"


def _paired_text(p: dict | None) -> str:
    return "—" if not p else f"{p['median']:.2f}× ({p['min']:.2f}–{p['max']:.2f}, {p['n']})"


def requests_line(summary: dict) -> str:
    """One line: every request succeeded, or FAILED with the cells that lost requests."""
    req = summary["requests"]
    warm = sum(n["succeeded"] + n["failed"] for n in req["warmup"].values())  # = sent if none lost
    warm_txt = f" (including {warm} warm-up)" if warm else ""
    if req["all_succeeded"]:
        return (f"Requests: {req['succeeded']} of {req['sent']} sent{warm_txt} succeeded, "
                f"none lost.")
    cells = "; ".join(
        f"{x['label']} {'warm-up' if x['concurrency'] == 'warm-up' else 'c=' + str(x['concurrency'])}: "
        f"{x['failed']} of {x['succeeded'] + x['failed']} failed"
        + (f" ({x['errors'][0]})" if x["errors"] else "")
        for x in req["lost"]
    )
    return (f"FAILED: {req['failed']} of {req['succeeded'] + req['failed']} requests{warm_txt} lost — "
            f"{cells}.")


# --------------------------------------------------------------------------------------------
# plot


def _title(summary: dict) -> str:
    meta = summary.get("meta") or {}
    parts = []
    for key in ("model", "models", "hardware", "device", "engine"):
        v = meta.get(key)
        if v:
            if isinstance(v, dict):
                v = ", ".join(f"{k}: {vv}" for k, vv in v.items())
            elif isinstance(v, (list, tuple)):
                v = ", ".join(map(str, v))
            parts.append(str(v))
    labels = summary["labels"]
    head = " vs ".join(labels) + " — serving benchmark"
    return head + ("\n" + " | ".join(parts) if parts else "")


def plot(summary: dict, path) -> None:
    """PNG: output tokens/s vs concurrency (log2 x) per label, and TPOT p50 vs concurrency."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    concs = [c for c in summary["concurrencies"]]
    xs_all = []
    for c in concs:
        try:
            xs_all.append(float(c))
        except ValueError:
            pass
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5), dpi=110)
    markers = ["o", "s", "^", "D", "v", "P", "X"]
    base = summary["baseline"]
    for i, label in enumerate(summary["labels"]):
        pts = []
        for c in concs:
            cell = summary["best"].get(label, {}).get(c)
            if cell is None:
                continue
            try:
                x = float(c)
            except ValueError:
                continue
            pts.append((x, cell["output_tokens_per_s"], cell["tpot_ms"]["p50"], c))
        m = markers[i % len(markers)]
        p1 = [(x, y, c) for x, y, _, c in pts if y is not None]
        p2 = [(x, t) for x, _, t, _ in pts if t is not None]
        if p1:
            ax1.plot([p[0] for p in p1], [p[1] for p in p1], marker=m, linewidth=2,
                     label=label + (" (baseline)" if label == base else ""))
            if label != base:
                for x, y, c in p1:
                    r = summary["ratios"].get(label, {}).get(c, {}).get("tokens_per_s")
                    if r is not None:
                        ax1.annotate(f"{r:.2f}×", (x, y), textcoords="offset points",
                                     xytext=(0, 8), ha="center", fontsize=9)
        if p2:
            ax2.plot([p[0] for p in p2], [p[1] for p in p2], marker=m, linewidth=2,
                     label=label + (" (baseline)" if label == base else ""))
    ideal = summary.get("ideal_ratio")
    if ideal:
        pts = []
        for c in concs:
            cell = summary["best"].get(base, {}).get(c)
            try:
                x = float(c)
            except ValueError:
                continue
            if cell and cell["output_tokens_per_s"] is not None:
                pts.append((x, cell["output_tokens_per_s"] * ideal))
        if pts:
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="--", color="gray",
                     linewidth=1.5, label=f"ideal ({ideal:.2f}× {base})")

    for ax, ylabel, title in (
        (ax1, "output tokens/s (higher is better)", "Throughput"),
        (ax2, "TPOT p50, ms (lower is better)", "Time per output token"),
    ):
        ax.set_xscale("log", base=2)
        if xs_all:
            ax.set_xticks(xs_all)
            ax.set_xticklabels([f"{x:g}" for x in xs_all])
            ax.minorticks_off()
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    # headroom for the ratio annotations
    lo, hi = ax1.get_ylim()
    ax1.set_ylim(0, hi * 1.08)
    fig.suptitle(_title(summary), fontsize=12)
    fig.tight_layout()
    fig.savefig(str(path), format="png")
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# files


def _meta_lines(meta: dict) -> list[str]:
    out = []
    for k, v in meta.items():
        if isinstance(v, (dict, list)):
            v = json.dumps(v)
        out.append(f"- **{k}**: {v}")
    return out


def _predicted_lines(p: dict | None, meta: dict) -> list[str]:
    if not p:
        return []
    if (p.get("kind") == "cpu") != (p.get("host") == "cpu"):
        return [f"- **the plan's roofline** is for {p['target']} ({p.get('kind')}); this machine served the models on "
                f"its {p.get('host')}: not set side by side (bench.json has both)"]
    cells = "; ".join(f"c={c}: {v['predicted_decode']:.2f}× predicted, {_f(v['measured_decode'], '{:.2f}')}× measured "
                      f"(tok/s {_f(v['measured_tokens_per_s'], '{:.2f}')}×)" for c, v in p["levels"].items())
    return [f"- **decode speedup, predicted by the plan's roofline for {p['target']} / measured here** "
            f"(TPOT p50 ratio; the roofline at a {p.get('prompt_tokens')}-token prompt and context, measured at "
            f"{meta.get('prompt_tokens')} + {meta.get('output_tokens')}): {cells}"]


def write_report(results: dict, out_dir) -> dict:
    """Write bench.json (results + summary), bench.md and bench.png into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(results)
    with open(out / "bench.json", "w") as f:
        json.dump({**results, "summary": summary}, f, indent=2, default=str)
    md = ["# Serving benchmark: " + " vs ".join(summary["labels"]), ""]
    md += _meta_lines(summary.get("meta") or {})
    if summary.get("ideal_ratio"):
        md.append(f"- **ideal tokens/s ratio**: {summary['ideal_ratio']:.2f}×")
    md += _predicted_lines(summary.get("predicted"), summary.get("meta") or {})
    notes = [BEST_OF_N_NOTE] + ([INTERLEAVED_NOTE] if (summary.get("meta") or {}).get("interleave") else [])
    md += ["", markdown_table(summary), " ".join(notes), "", "![benchmark](bench.png)", ""]
    (out / "bench.md").write_text("\n".join(md))
    plot(summary, out / "bench.png")
    return summary
