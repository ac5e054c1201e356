"""What the bench scripts share: paths, the WikiText-2 windows, run folders, result files, tables
and the serving figures.

    import benchlib                        # `python bench/x.py` puts bench/ on sys.path
    out = benchlib.run_dir("spine", args.out)   # bench/results/spine/2026-05-01-a4c211c[-dirty]

Results are never overwritten. Every run writes into a folder of its own (`run_dir`): the
date and the commit, `-2`, `-3`... when that folder exists. A JSON result is written once
(`write_result`), or grown (`update_result`): rows and keys may be added to it — by the same
process as it goes, or by several processes given the same `--out` — but a value already in
the file is never replaced; the script stops instead. Markdown tables are views of a run's JSON,
rebuilt from it (`write_markdown`), and so are the plots (`plot_table`, or a script's own).

Only the standard library is imported here: bench/peer_llmcompressor.py imports this module in
the peer's own virtual environment, where the product is not installed. The product's public
API (`optimizer.data`) is imported inside the function that needs it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Sequence

try:
    import fcntl
except ImportError:  # not on Linux: merges from several processes are then not locked
    fcntl = None

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DATA = ROOT.parent / "shared" / "data"
CALIB_FILE = "wikitext2-valid.txt"
TEST_FILE = "wikitext2-raw-test.txt"
SPLITS = {"valid": CALIB_FILE, "test": TEST_FILE}
# What run_info() records: a row or protocol made by another process of the same run may carry
# other values of these (update_result's keep_existing).
RUN_KEYS = ("command", "commit", "dirty")


# --- data ----------------------------------------------------------------------------------------

def data_file(split: str, data_dir: str | Path = DATA) -> Path:
    """The WikiText-2 file of `split` ("valid": calibration and training text, "test": perplexity)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: one of {', '.join(SPLITS)}")
    return Path(data_dir) / SPLITS[split]


def wikitext_windows(tok, split: str, n_windows: int | None, seq_len: int = 2048, data_dir: str | Path = DATA):
    """The first `n_windows` (None: all) non-overlapping windows of `seq_len` tokens of the
    WikiText-2 `split`, a [n, seq_len] tensor: the product's own reading and tokenization."""
    from optimizer import data  # the product's public API; lazily, see the module's docstring
    return data.token_windows(tok, data.read_text_file(data_file(split, data_dir)).text, seq_len, n_windows)


def c4_file() -> Path:
    """exllamav2's c4 sample, the second text no run trains or tunes on; exits in one line where it
    is not installed (check it before the long work)."""
    from optimizer import data
    path = data.builtin_sample("c4.utf8")
    if path is None:
        raise SystemExit("error: exllamav2's c4 sample is not installed (make setup installs it)")
    return path


def c4_windows(tok, n_windows: int | None, seq_len: int = 2048):
    """The first `n_windows` windows of `seq_len` tokens of the c4 sample, as wikitext_windows."""
    from optimizer import data
    return data.token_windows(tok, data.read_text_file(c4_file(), "c4 sample").text, seq_len, n_windows)


# --- the run: its commit, its command, its folder --------------------------------------------------

def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=None)
def git_state() -> tuple[str | None, bool | None]:
    """(HEAD's commit, whether tracked files differ from it), or (None, None) without git."""
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return None, None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return commit, (bool(status) if status is not None else None)


def run_info() -> dict:
    """What every result records of the run that made it: the command line and the commit."""
    commit, dirty = git_state()
    return {"command": " ".join(sys.argv), "commit": commit, "dirty": dirty}


def cpu_name() -> str | None:
    """The CPU's model name from /proc/cpuinfo (figures are compared on one CPU only); None elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return None


def run_name() -> str:
    """`YYYY-MM-DD-<short commit>[-dirty]`; the date and time when git cannot say."""
    commit, dirty = git_state()
    now = _dt.datetime.now()
    if not commit:
        return now.strftime("%Y-%m-%d-%H%M%S")
    return f"{now:%Y-%m-%d}-{commit[:7]}" + ("-dirty" if dirty else "")


def run_dir(bench_name: str, out: str | Path | None = None, root: str | Path = RESULTS,
            label: str | None = None) -> Path:
    """The folder a run writes its results into.

    With `out` (a script's --out), that folder as is, created if missing: to resume a run, or
    for several processes adding rows to one run. Otherwise a new folder
    `<root>/<bench_name>/<run_name()>[-<label>]`, `-2`, `-3`... appended when that one exists: a
    rerun never writes into an earlier run's folder. `label` names what the run was (a setting)."""
    if out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        return path
    parent = Path(root) / bench_name
    parent.mkdir(parents=True, exist_ok=True)
    name = run_name() + (f"-{label}" if label else "")
    for k in range(1, 10_000):
        path = parent / (name if k == 1 else f"{name}-{k}")
        try:
            path.mkdir()  # atomic: two processes starting together get two folders
            return path
        except FileExistsError:
            continue
    raise SystemExit(f"error: {parent}: no free run folder named {name}-N")


# --- result files ----------------------------------------------------------------------------------

def _plain(data):
    """`data` as JSON gives it back (tuples as lists, keys as strings): what the file will hold."""
    return json.loads(json.dumps(data))


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _write_atomic(path: Path, text: str, exclusive: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(path)
    tmp.write_text(text)
    try:
        if not exclusive:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)  # atomic, and fails if the file exists
        except FileExistsError:
            raise _exists(path) from None
        except OSError:  # a file system without hard links
            if path.exists():
                raise _exists(path) from None
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _exists(path: Path) -> SystemExit:
    return SystemExit(f"error: {path} exists; results are never overwritten: write this run to a new "
                      "folder (the scripts' default --out)")


def new_file(path: str | Path) -> Path:
    """`path`, or SystemExit if it exists: check before a long run what it will write at the end."""
    path = Path(path)
    if path.exists():
        raise _exists(path)
    return path


def write_result(path: str | Path, data: dict) -> Path:
    """Write the JSON `data` to `path` once: SystemExit if the file exists. Atomic."""
    path = Path(path)
    _write_atomic(path, json.dumps(data, indent=2) + "\n", exclusive=True)
    return path


def show_and_write_result(path: str | Path, data: dict) -> Path:
    """A one-row script's ending: print the result, write it once (write_result), say where."""
    print(json.dumps(data, indent=1))
    path = write_result(path, data)
    print(f"wrote {path}")
    return path


def read_result(path: str | Path, default=None):
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else default


class ReplacedValue(SystemExit):
    """update_result was asked to change a value already in the file."""


def _merge(old, new, where: str, keep: frozenset, path: Path):
    if where in keep:
        return old
    if isinstance(old, dict) and isinstance(new, dict):
        merged = dict(old)
        for k, v in new.items():
            merged[k] = _merge(old[k], v, f"{where}.{k}" if where else k, keep, path) if k in old else v
        return merged
    if isinstance(old, list) and isinstance(new, list):
        common = [_merge(o, n, f"{where}[{i}]", keep, path) for i, (o, n) in enumerate(zip(old, new))]
        return common + (old[len(new):] if len(old) > len(new) else new[len(old):])
    if json.dumps(old) != json.dumps(new):  # as text: an unchanged NaN is the same value
        def short(x):
            s = json.dumps(x)
            return s if len(s) <= 200 else s[:200] + "..."
        raise ReplacedValue(f"error: {path}: {where or 'the file'} is already {short(old)}; this run would replace "
                            f"it with {short(new)}. Results are never replaced: write this run to a new folder "
                            "(the scripts' default --out)")
    return old


@contextlib.contextmanager
def _locked(folder: Path):
    """Hold an exclusive lock on `folder` (processes adding to one file take turns)."""
    if fcntl is None:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def update_result(path: str | Path, data: dict, keep_existing: Iterable[str] = ()) -> dict:
    """Merge `data` into the JSON file at `path` (created if missing) and return what the file
    now holds. Add-only: keys and rows not in the file are added, dicts are merged key by key,
    lists item by item (the longer one's tail is kept), keys only the file has stay. A value
    the file already holds may only be written again unchanged: a different one is a
    SystemExit (ReplacedValue) and the file is left as it was. `keep_existing`: dotted key
    paths ("protocol.command", "si_fast_update") where the file's value, when it has one, is
    kept silently over `data`'s. Atomic (temp file, os.replace), locked against other
    processes merging into the same folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = _plain(data)
    with _locked(path.parent):
        old = read_result(path)
        merged = new if old is None else _merge(old, new, "", frozenset(keep_existing), path)
        if merged != old:
            _write_atomic(path, json.dumps(merged, indent=2) + "\n", exclusive=False)
    return merged


def check_update(path: str | Path, data: dict, keep_existing: Iterable[str] = ()) -> None:
    """SystemExit (ReplacedValue) now if update_result(path, data, keep_existing) would be
    refused: check before a long run that what it will add fits the file. Writes nothing."""
    path = Path(path)
    old = read_result(path)
    if old is not None:
        _merge(old, _plain(data), "", frozenset(keep_existing), path)


def write_markdown(path: str | Path, text: str) -> Path:
    """Write a markdown view of a run's JSON (rebuilt from it, so it may replace the previous
    view in the same run folder as rows are added). Atomic."""
    path = Path(path)
    _write_atomic(path, text, exclusive=False)
    return path


# --- tables ---------------------------------------------------------------------------------------

_ALIGN = {"l": "---", "r": "---:", "c": ":---:"}


def markdown_table(header: Sequence, rows: Iterable[Sequence], align: str | Sequence[str] | None = None) -> str:
    """A markdown table (no trailing newline). `align`: one letter per column, "l" (the
    default for every column), "r" or "c". Cells are written with str(); None as "—"."""
    n = len(header)
    align = list(align) if align is not None else ["l"] * n
    if len(align) != n or any(a not in _ALIGN for a in align):
        raise ValueError(f"align {''.join(align)!r}: one of l, r, c for each of the {n} columns")

    def row(cells) -> str:
        cells = list(cells)
        if len(cells) != n:
            raise ValueError(f"a row of {len(cells)} cells in a table of {n} columns: {cells}")
        return "| " + " | ".join("—" if c is None else str(c) for c in cells) + " |"

    return "\n".join([row(header), "|" + "|".join(_ALIGN[a] for a in align) + "|", *map(row, rows)])


def table_columns(markdown: str) -> tuple[list[str], dict[str, list[float | None]]]:
    """The first table of a markdown view: its row labels (first cells) and, per column whose cells
    hold numbers, the first number of each cell (None where a cell has none: "—", text)."""
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        return [], {}
    block = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        block.append([c.strip() for c in line.strip().strip("|").split("|")])
    header, body = block[0], [row for row in block[2:] if len(row) == len(block[0])]
    labels = [re.sub(r"\*\*|`", "", row[0]) for row in body]
    columns = {}
    for k, name in enumerate(header[1:], start=1):
        values = []
        for row in body:
            m = re.search(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", row[k].replace(",", ""))
            values.append(float(m.group()) if m else None)
        if any(v is not None for v in values):
            columns[name] = values
    return labels, columns


def plot_table(markdown: str, path: str | Path, title: str) -> Path | None:
    """A run's plot: every numeric column of its markdown view's first table, one panel a column
    (their scales differ), a bar a row. A view of the table, rebuilt with it; None without a table
    or without matplotlib (the peer's environment)."""
    labels, columns = table_columns(markdown)
    if not columns:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    n = len(columns)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 0.35 * len(labels) + 1.6), sharey=True, squeeze=False)
    for ax, (name, values) in zip(axes[0], columns.items()):
        ax.barh(range(len(labels)), [v if v is not None else 0 for v in values], color="#4c72b0")
        ax.set_title(name, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.invert_yaxis()
    axes[0][0].set_yticks(range(len(labels)), [label[:40] for label in labels])
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    tmp = _tmp(path).with_suffix(".png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


# --- serving figures --------------------------------------------------------------------------------

def serving_figures(summary: dict, ideal_ratio: float | None = None, weight_bytes: dict | None = None) -> dict:
    """A result's serving figures from a `bench` run's summary (serve/report.py summarize(): its
    "best", "ratios" and "concurrencies"), the pruned label against the baseline.

    Per concurrency (string keys, as in the summary): dense and pruned output tok/s, their
    ratio, the ratio's fraction of `ideal_ratio` (default: the summary's own ideal) and the p50
    time per output token of each. With `weight_bytes` ({"dense": B, "pruned": B}, the weights a
    decode step streams) and concurrency 1 measured, also "decode_step_model": the per-step
    engine overhead from the two step times and the two sizes (t = overhead + bytes / bandwidth,
    two equations, two unknowns), when the pruned step is the faster."""
    best, ratios = summary["best"], summary["ratios"]
    ideal = ideal_ratio if ideal_ratio is not None else summary.get("ideal_ratio")
    fig = {}
    for c in summary["concurrencies"]:
        ratio = ratios["pruned"][c]["tokens_per_s"]
        fig[c] = {"dense_tok_s": best["dense"][c]["output_tokens_per_s"],
                  "pruned_tok_s": best["pruned"][c]["output_tokens_per_s"],
                  "ratio": ratio, "fraction_of_ideal": ratio / ideal if ratio is not None and ideal else None,
                  "paired": ratios["pruned"][c].get("paired"),  # median and range of the per-measurement ratios
                  "tpot_p50_ms": {"dense": best["dense"][c]["tpot_ms"]["p50"],
                                  "pruned": best["pruned"][c]["tpot_ms"]["p50"]}}
    if weight_bytes and "1" in fig:
        t_d, t_p = fig["1"]["tpot_p50_ms"]["dense"], fig["1"]["tpot_p50_ms"]["pruned"]
        b_d, b_p = weight_bytes["dense"], weight_bytes["pruned"]
        if t_d and t_p and t_d > t_p and b_d != b_p:
            ms_per_byte = (t_d - t_p) / (b_d - b_p)
            overhead = t_d - b_d * ms_per_byte
            fig["decode_step_model"] = {"overhead_ms": overhead, "weights_ms_dense": b_d * ms_per_byte,
                                        "overhead_share_dense": overhead / t_d,
                                        "effective_GBps": 1e-6 / ms_per_byte}
    return fig
