"""Calibration and evaluation text → fixed-length token windows.

Without --calib the product still calibrates on real text it can reach offline: the
calibration corpus shipped inside the `exllamav2` wheel (Wikipedia, C4, code...), and if
that package is absent, text the model generates itself. The report names the source.
The built-in corpus is split in two disjoint halves so the default evaluation never sees
calibration text.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import UserError


@dataclass(frozen=True)
class Text:
    text: str
    description: str
    builtin: bool = False  # the packaged Wikipedia sample (builtin_text)


def read_text_file(path: str | Path, what: str = "text file") -> Text:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} {path}: no such file")
    raw = p.read_bytes()
    if b"\x00" in raw[:1 << 20]:
        raise UserError(f"{what} {path}: not a text file (binary content)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{what} {path}: not UTF-8 text") from None
    if not text.strip():
        raise UserError(f"{what} {path}: the file is empty")
    return Text(text, f"file {p.resolve()}")


def builtin_sample(name: str) -> Path | None:
    """A text sample shipped in the `exllamav2` wheel's standard_cal_data (wiki.utf8, c4.utf8,
    code.utf8, ...), or None where that package is absent."""
    spec = importlib.util.find_spec("exllamav2")  # find_spec: importing it would build CUDA code
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "conversion" / "standard_cal_data" / name
    return path if path.is_file() else None


def builtin_text(part: str) -> Text | None:
    """The first ('calib') or second ('eval') half of the packaged Wikipedia sample."""
    path = builtin_sample("wiki.utf8")
    if path is None:
        return None
    text = path.read_text(encoding="utf-8")
    cut = text.rfind("\n", 0, len(text) // 2) + 1
    half = text[:cut] if part == "calib" else text[cut:]
    label = "first" if part == "calib" else "second"
    return Text(half, f"built-in corpus: {label} half of exllamav2 standard_cal_data/wiki.utf8", builtin=True)


# exllamav2's other samples (children's stories, technical prose, code, several languages): the
# default heal reads all but their last 10%, held out: the heal's settings were chosen on it
# (docs/history.md). c4.utf8 is not among them: it is an evaluation text.
HEAL_SAMPLES = ("tiny.utf8", "technical.utf8", "code.utf8", "multilingual.utf8")


def split_sample(text: str, share: float = 0.9) -> tuple[str, str]:
    """A sample's first `share` (to a line end) and the rest."""
    cut = text.rfind("\n", 0, int(len(text) * share)) + 1
    return text[:cut], text[cut:]


@functools.cache  # read once a process: the overlap check and the heal text both use them
def builtin_heal_samples() -> dict[str, str]:
    """HEAL_SAMPLES' first 90% each, by name (not to be modified); empty where the `exllamav2`
    wheel is absent."""
    paths = {name: builtin_sample(name) for name in HEAL_SAMPLES}
    if None in paths.values():
        return {}
    return {name: split_sample(path.read_text(encoding="utf-8"))[0] for name, path in paths.items()}


def self_generated_text(model, tokenizer, n_tokens: int, seed: int) -> Text:
    """Sample text from the model itself, from a handful of neutral prompts."""
    prompts = ["The history of", "In mathematics,", "The city is known for", "Scientists have found",
               "The following program", "Once upon a time"]
    g = torch.Generator().manual_seed(seed)
    pieces, total = [], 0
    i = 0
    while total < n_tokens:
        ids = tokenizer(prompts[i % len(prompts)], return_tensors="pt").input_ids
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
        out = model.generate(ids, do_sample=True, top_p=0.95, temperature=1.0,
                             max_new_tokens=min(512, n_tokens - total + 16), pad_token_id=tokenizer.eos_token_id)
        pieces.append(tokenizer.decode(out[0], skip_special_tokens=True))
        total += out.shape[1]
        i += 1
    return Text("\n\n".join(pieces), f"self-generated: {total} tokens sampled from the model (seed {seed})")


def token_windows(tokenizer, text: str, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of seq_len tokens, in order; the ragged tail is dropped."""
    ids = tokenizer(text, return_attention_mask=False, verbose=False)["input_ids"]
    n = len(ids) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise UserError(f"the text has {len(ids)} tokens, fewer than one window of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
