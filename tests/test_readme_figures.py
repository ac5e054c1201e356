"""Every figure in the documentation's tables is checked at the place its source names.

The convention (README.md and docs/*.md):

- A table is a run of lines that start with `|`: a header, a `|---|` separator, body rows.
- A row's first cell names the row: its numbers are settings and labels (`retain 0.7`, `c=16`),
  not checked. Every other number in the row, outside its links, is a figure, bold or not, with
  its `×` or `%`. Numbers glued to letters or colons are names (`SmolLM2`, `135M`, `r0.70`,
  `bf16`, `2:4`), and so are version strings with two dots or more (`0.14.0.1`).
- A row names where each of its figures is, in the fragments of its links: a link's fragment is a
  comma-separated list of locators, one per figure, and the row's locators (its links' in the order
  they appear, links without a fragment skipped) are its figures' in order. One link may carry
  them all, `[quant.json](bench/results/quant/X/quant.json#variants.dense-int8.wikitext2,dense.wikitext2)`,
  or, to keep a row short, a reference link `[quant.json][q1]` defined below the table:
  `[q1]: bench/results/quant/X/quant.json#variants.dense-int8.wikitext2,dense.wikitext2`.
  A fragment may start with a common prefix, `#variants.cpu0.70.serving/vs_dense.1.ratio,vs_dense.16.ratio`.
- A locator in a JSON file is a dotted path: keys, and list items by index (`levels.0.ppl`); a key
  that holds dots is written as it is (`variants.cpu0.70.wikitext2`: the longest key that matches).
  In a markdown file it is a cell: `t2.r3.c4` (table 2 of the file, its third body row, fourth
  column, all counted from 1), `t2.r3.c4.n2` for the cell's second number.
- A figure written with d decimals matches when the value there, rounded to d decimals, is written the
  same: `59.92` matches 59.921849686718375, `1.33×` matches 1.3273973614955694, `1,448` matches 1448.2.
  A figure followed by `%` may also be 100 × the value (`92%` matches 0.9197). Signs are ignored.
- Link targets are relative to the markdown file and must be files (not folders). A table whose rows
  have no figures (a list of commands) needs no links.

So a result that changes fails the check at its place, whatever else the file holds.

docs/history.md, the research history, keeps the looser check this test applied to every document
before: a figure is accepted when any number in a file its row (or the table's `Source:` line above
it) links rounds to it. Converting its ~40 tables, most of them historical runs whose figures are
computed across several folders, would cost more than it protects: nothing in the product's
documentation rests on them.

Fast: text files only, no model, no network.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HISTORY = ROOT / "docs" / "history.md"
# The product's documentation: strict. The run folders' own READMEs are lab notes and not checked.
DOCS = [ROOT / "README.md", ROOT / "bench" / "results" / "README.md",
        *sorted(p for p in (ROOT / "docs").glob("*.md") if p != HISTORY)]

LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
REF_LINK = re.compile(r"\[([^\]]*)\]\[([^\]]+)\]")
REF_DEF = re.compile(r"^\[([^\]]+)\]:\s*(\S+)")
# In a cell: a number with thousands separators, or a number or version string.
CELL_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)*")
FILE_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
SEPARATOR = re.compile(r"^\|[\s:|-]+\|\s*$")
CELL_LOCATOR = re.compile(r"^t(\d+)\.r(\d+)\.c(\d+)(?:\.n(\d+))?$")


def tables(text: str):
    """(line number of the header, header, [(line number, row)], sources or None) per table."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        block = lines[start:i]
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        k = j  # the paragraph above the table: a `Source:` line may wrap
        while k > 0 and lines[k - 1].strip() and not lines[k - 1].startswith("|"):
            k -= 1
        paragraph = " ".join(lines[k:j + 1]) if j >= 0 else ""
        sources = [t for _, t in LINK.findall(paragraph)] if paragraph.startswith("Source:") else None
        body = [(start + 1 + k, row) for k, row in enumerate(block) if k > 0 and not SEPARATOR.match(row)]
        yield start + 1, block[0], body, sources


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def figures(text: str) -> list[tuple[str, bool]]:
    """(figure as written, followed by %) for every figure in `text`, links removed."""
    text = REF_LINK.sub(" ", LINK.sub(" ", text)).replace("**", "")
    out = []
    for m in CELL_NUMBER.finditer(text):
        before = text[m.start() - 1] if m.start() else " "
        after = text[m.end()] if m.end() < len(text) else " "
        if re.match(r"[A-Za-z_:]", before) or re.match(r"[A-Za-z_:]", after):
            continue                       # part of a name: SmolLM2, 135M, r0.70, bf16, 2:4
        if m.group().count(".") >= 2:
            continue                       # a version string
        out.append((m.group(), after == "%"))
    return out


def matches(figure: str, percent: bool, value: float) -> bool:
    plain = figure.replace(",", "")
    decimals = len(plain.split(".")[1]) if "." in plain else 0
    return (f"{abs(value):.{decimals}f}" == plain
            or (percent and f"{abs(value) * 100:.{decimals}f}" == plain))


# --- the strict check: each figure at its locator ----------------------------------------------------

def reference_definitions(text: str) -> dict[str, str]:
    return {m.group(1).lower(): m.group(2) for line in text.splitlines() if (m := REF_DEF.match(line))}


def row_links(row: str, refs: dict[str, str]) -> list[str]:
    """The row's link targets in the order they appear, inline and reference links alike."""
    found = [(m.start(), m.group(2)) for m in LINK.finditer(row)]
    found += [(m.start(), refs.get(m.group(2).lower(), f"<undefined reference {m.group(2)}>"))
              for m in REF_LINK.finditer(row)]
    return [target for _, target in sorted(found)]


def locators(fragment: str) -> list[str]:
    """`a.b/c,d` -> [a.b.c, a.b.d]; `x,y` -> [x, y]."""
    prefix, sep, rest = fragment.partition("/")
    if not sep:
        return [p.strip() for p in fragment.split(",") if p.strip()]
    return [f"{prefix}.{p.strip()}" for p in rest.split(",") if p.strip()]


def json_place(data, locator: str):
    """(container, key) of the value at a dotted path: keys, and list items by index; a key holding
    dots matches the longest run of parts it spells."""
    parts = locator.split(".")
    node, i = data, 0
    while True:
        if isinstance(node, list):
            if not parts[i].isdigit() or int(parts[i]) >= len(node):
                raise KeyError(".".join(parts[:i + 1]))
            key, j = int(parts[i]), i + 1
        elif isinstance(node, dict):
            j = next((j for j in range(len(parts), i, -1) if ".".join(parts[i:j]) in node), None)
            if j is None:
                raise KeyError(".".join(parts[:i + 1]))
            key = ".".join(parts[i:j])
        else:
            raise KeyError(".".join(parts[:i + 1]))
        if j == len(parts):
            return node, key
        node, i = node[key], j


def json_value(data, locator: str):
    """The value at a dotted path (json_place)."""
    node, key = json_place(data, locator)
    return node[key]


def cell_value(text: str, locator: str) -> str:
    """The number written in a markdown file's table cell (`t2.r3.c4[.n2]`), as written."""
    m = CELL_LOCATOR.match(locator)
    if not m:
        raise KeyError(f"{locator} (a markdown locator is tT.rR.cC[.nN])")
    t, r, c, n = (int(g) if g else 1 for g in m.groups())
    found = list(tables(text))
    if t > len(found) or r > len(found[t - 1][2]) or c > len(cells(found[t - 1][2][r - 1][1])):
        raise KeyError(locator)
    numbers = [f for f, _ in figures(cells(found[t - 1][2][r - 1][1])[c - 1])]
    if n > len(numbers):
        raise KeyError(f"{locator} (the cell holds {len(numbers)} numbers)")
    return numbers[n - 1]


class Cited:
    """A cited file, read once."""

    _cache: dict[Path, "Cited"] = {}

    def __init__(self, path: Path):
        self.path = path
        self.text = path.read_text(encoding="utf-8", errors="replace")
        self.data = json.loads(self.text) if path.suffix == ".json" else None

    @classmethod
    def get(cls, path: Path) -> "Cited":
        if path not in cls._cache:
            cls._cache[path] = cls(path)
        return cls._cache[path]

    def value(self, locator: str) -> float:
        if self.data is not None:
            v = json_value(self.data, locator)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise KeyError(f"{locator} (holds {json.dumps(v)[:60]}, not a number)")
            return float(v)
        return float(cell_value(self.text, locator).replace(",", ""))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def problems(doc: Path) -> list[str]:
    """Every violation of the convention in one markdown file, as 'file:line: what'."""
    text = doc.read_text(encoding="utf-8")
    refs = reference_definitions(text)
    out = []
    for _, _, body, _ in tables(text):
        for line_no, row in body:
            where = f"{_rel(doc)}:{line_no}"
            found = [f for cell in cells(row)[1:] for f in figures(cell)]
            places = []  # (file, locator)
            broken = False
            for target in row_links(row, refs):
                if target.startswith("<undefined"):
                    out.append(f"{where}: {target[1:-1]}")
                    broken = True
                    continue
                file, _, fragment = target.partition("#")
                if re.match(r"[a-z]+://", file):
                    continue
                path = (doc.parent / file).resolve()
                if not path.is_file():
                    out.append(f"{where}: cited file {file} does not exist (or is a folder)")
                    broken = True
                    continue
                places += [(path, loc) for loc in locators(fragment)]
            if broken or (not found and not places):
                continue
            if len(places) != len(found):
                out.append(f"{where}: {len(found)} figures ({', '.join(f for f, _ in found)}) "
                           f"but {len(places)} locators in the row's links")
                continue
            for (figure, percent), (path, loc) in zip(found, places):
                try:
                    value = Cited.get(path).value(loc)
                except (KeyError, ValueError) as e:
                    out.append(f"{where}: {figure}: {_rel(path)} has no value at {e.args[0] if e.args else loc}")
                    continue
                if not matches(figure, percent, value):
                    out.append(f"{where}: {figure}{'%' if percent else ''} is {value!r} at {_rel(path)}#{loc}")
    return out


# --- the loose check of docs/history.md: any number of a cited file --------------------------------

def loose_problems(doc: Path) -> list[str]:
    """The history's check: each figure (the first cell's numbers are labels here too) is some number,
    rounded as written, of a file the row or the table's `Source:` line links."""
    text = doc.read_text(encoding="utf-8")
    out = []
    for header_line, _, body, table_sources in tables(text):
        for line_no, row in body:
            cited = [t for _, t in LINK.findall(row)] or table_sources
            where = f"{_rel(doc)}:{line_no}"
            if not cited:
                out.append(f"{where}: no `Source:` line above the table (line {header_line}) and no link in the row")
                continue
            files = []
            for target in cited:
                path = (doc.parent / target.split("#")[0]).resolve()
                if not path.is_file():
                    out.append(f"{where}: cited file {target} does not exist (or is a folder)")
                else:
                    files.append(Cited.get(path).text)
            numbers = {float(m.group()) for t in files for m in FILE_NUMBER.finditer(t)}
            versions = "\n".join(files)
            for figure, percent in figures(" | ".join(cells(row)[1:])):
                if files and not any(matches(figure, percent, v) for v in numbers):
                    out.append(f"{where}: {figure}{'%' if percent else ''} is not in the cited files")
            for version in re.findall(r"(?<![\w.])\d+(?:\.\d+){2,}(?![\w.])", LINK.sub(" ", row)):
                if files and version not in versions:
                    out.append(f"{where}: {version} is not in the cited files")
    return out


# --- the documents ---------------------------------------------------------------------------------

@pytest.mark.parametrize("doc", DOCS, ids=lambda p: _rel(p))
def test_every_table_figure_is_at_its_cited_place(doc):
    assert doc.is_file(), f"{doc} is missing"
    found = problems(doc)
    assert not found, "\n".join(found)


def test_the_history_figures_are_in_their_cited_files():
    found = loose_problems(HISTORY)
    assert not found, "\n".join(found)


def test_the_readme_has_its_summary_table():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    refs = reference_definitions(text)
    summary = [body for _, _, body, _ in tables(text) if len(body) >= 5]
    assert summary and all("#" in t for _, row in summary[0] for t in row_links(row, refs))
    assert len(text.splitlines()) <= 260, "the README is for users; details go to docs/"


@pytest.mark.parametrize("doc", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: _rel(p))
def test_no_line_over_300_characters(doc):
    long = [i + 1 for i, line in enumerate(doc.read_text(encoding="utf-8").splitlines()) if len(line) > 300]
    assert not long, f"{_rel(doc)}: lines {long} are over 300 characters"


def test_a_changed_cited_value_fails_the_readme(tmp_path):
    """The README and every file it cites, copied; one cited value changed in the copy: the check names it."""
    readme = ROOT / "README.md"
    text = readme.read_text(encoding="utf-8")
    refs = reference_definitions(text)
    copied = tmp_path / "README.md"
    shutil.copy(readme, copied)
    first = None
    for _, _, body, _ in tables(text):
        for _, row in body:
            for target in row_links(row, refs):
                file, _, fragment = target.partition("#")
                src = (readme.parent / file).resolve()
                dst = tmp_path / src.relative_to(ROOT)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, dst)
                if fragment and first is None and src.suffix == ".json":
                    first = (dst, locators(fragment)[0])
    Cited._cache.clear()
    assert problems(copied) == []
    path, loc = first
    data = json.loads(path.read_text())
    parent, key = json_place(data, loc)
    parent[key] = parent[key] * 1.01 + 0.5
    path.write_text(json.dumps(data))
    Cited._cache.clear()
    found = problems(copied)
    Cited._cache.clear()
    assert len(found) == 1 and f"#{loc}" in found[0], found


# The checker itself: each rule fails when broken.

def _doc(tmp_path: Path, body: str) -> Path:
    (tmp_path / "r.json").write_text(json.dumps({"ppl": 59.921849686718375, "other": 20.51,
                                                 "variants": {"cpu0.70": {"ratio": 1.3273973614955694, "f": 0.9197}},
                                                 "levels": [{"wall": 1448.2}]}))
    (tmp_path / "v.md").write_text("| model | PPL | ratio |\n|---|---|---|\n| peer 0.14.0.1 | 64.108 | 1.03 (paired 0.97) |\n")
    doc = tmp_path / "doc.md"
    doc.write_text(body)
    return doc


def test_checker_accepts_figures_at_their_locators(tmp_path):
    doc = _doc(tmp_path, "| a | b | file |\n|---|---:|---|\n"
                         "| r0.70 at 2:4 | **59.92**, 1.33× (92%), 1,448 | [r](r.json#ppl,variants.cpu0.70.ratio,"
                         "variants.cpu0.70.f,levels.0.wall) |\n"
                         "| peer | 64.108, 0.14.0.1, SmolLM2-135M; 0.97 | [v][p] |\n\n[p]: v.md#t1.r1.c2,t1.r1.c3.n2\n"
                         "| prefix | 1.33× / 92% | [r](r.json#variants.cpu0.70/ratio,f) |\n")
    assert problems(doc) == []


def test_checker_rejects_a_figure_another_number_of_the_file_would_match(tmp_path):
    # 20.51 is in the file, but not where the row says it is
    doc = _doc(tmp_path, "| a | b |\n|---|---:|\n| x | 20.51 [r](r.json#ppl) |\n")
    found = problems(doc)
    assert len(found) == 1 and "20.51 is 59.92" in found[0]


def test_checker_rejects_missing_places_and_counts(tmp_path):
    doc = _doc(tmp_path, "| a | b |\n|---|---|\n| x | 1.33× [gone](gone.json#ppl) |\n| y | 2 [r](r.json) |\n"
                         "| z | 59.92 [r](r.json#nope) |\n| w | 59.92 [r][undefined] |\n| v | 64.108 [v](v.md#t1.r2.c2) |\n")
    found = problems(doc)
    assert len(found) == 5, found
    assert "gone.json does not exist" in found[0]
    assert "1 figures (2) but 0 locators" in found[1]
    assert "no value at nope" in found[2]
    assert "undefined reference" in found[3]
    assert "no value at t1.r2.c2" in found[4]


def test_checker_wants_more_decimals_matched_exactly(tmp_path):
    doc = _doc(tmp_path, "| a | b |\n|---|---|\n| x | 59.9219 [r](r.json#ppl) |\n| y | 59.9 [r](r.json#ppl) |\n"
                         "| z | 59.922 [r](r.json#ppl) |\n")
    found = problems(doc)
    assert len(found) == 1 and "59.9219" in found[0]


def test_loose_check_of_the_history(tmp_path):
    doc = _doc(tmp_path, "Source: [r](r.json)\n\n| a | b |\n|---|---:|\n| r0.70 | **59.92** 1.33× (92%) |\n"
                         "| peer | 64.108, 0.14.0.1 [v](v.md) |\n| x | 59.93 |\n")
    found = loose_problems(doc)
    assert len(found) == 1 and "59.93 is not in" in found[0]
