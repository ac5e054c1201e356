"""Every figure in the documentation's tables is found in the result file its table cites.

The convention (README.md, docs/*.md, bench/results/README.md):

- A table is a run of lines that start with `|`: a header, a `|---|` separator, body rows.
- Its sources are the links on a line starting `Source:` directly above it (blank lines
  between are allowed), e.g. `Source: [spine.json](bench/results/spine/spine.json)`.
- A body row that has links of its own (usually in a last "file" column) is checked against
  those instead. A table with no `Source:` line needs links in every body row.
- Link targets are relative to the markdown file and must be files (not folders).
- A figure is every number written in a body row outside the links, bold or not, with its
  `×` or `%`; the header row is labels and is not checked. Numbers glued to letters are
  names, not figures (`SmolLM2`, `135M`, `r0.70`, `bf16`), and so are version strings with
  two dots or more (`0.14.0.1`), which must appear literally in a cited file.
- A figure written with d decimals is found when some number in a cited file's text (JSON or
  markdown alike), rounded to d decimals, is written the same way: `59.92` matches
  59.921849686718375, `318.2` matches 318.158, `1.33×` matches 1.3273973614955694. A figure
  followed by `%` may also be 100 × a number (`92%` matches 0.9197). Signs are ignored.

Fast: text files only, no model, no network.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# bench/results/*/README.md (the lab notebooks) are not checked: their tables' ratios are
# computed against baselines of other folders and are not in the files they link.
DOCS = [ROOT / "README.md", ROOT / "bench" / "results" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
# In a cell: a number, or a version string; a figure's suffix tells % apart.
CELL_NUMBER = re.compile(r"\d+(?:\.\d+)*")
FILE_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
SEPARATOR = re.compile(r"^\|[\s:|-]+\|\s*$")


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
        sources = [t for _, t in LINK.findall(lines[j])] if j >= 0 and lines[j].startswith("Source:") else None
        body = [(start + 1 + k, row) for k, row in enumerate(block) if k > 0 and not SEPARATOR.match(row)]
        yield start + 1, block[0], body, sources


def figures(row: str) -> list[tuple[str, bool]]:
    """(figure as written, followed by %) for every figure in a table row, links removed."""
    text = LINK.sub(" ", row).replace("**", "")
    out = []
    for m in CELL_NUMBER.finditer(text):
        before = text[m.start() - 1] if m.start() else " "
        after = text[m.end()] if m.end() < len(text) else " "
        if re.match(r"[A-Za-z_]", before) or re.match(r"[A-Za-z_]", after):
            continue                       # part of a name: SmolLM2, 135M, r0.70, bf16
        out.append((m.group(), after == "%"))
    return out


class Source:
    """A cited file: its text, and every number in it formatted at 0–6 decimals."""

    _cache: dict[Path, "Source"] = {}

    def __init__(self, path: Path):
        self.path = path
        self.text = path.read_text(encoding="utf-8", errors="replace")
        self.values = [abs(float(m.group())) for m in FILE_NUMBER.finditer(self.text)]
        self._formatted: dict[tuple[int, bool], set[str]] = {}

    @classmethod
    def get(cls, path: Path) -> "Source":
        if path not in cls._cache:
            cls._cache[path] = cls(path)
        return cls._cache[path]

    def formatted(self, decimals: int, percent: bool) -> set[str]:
        key = (decimals, percent)
        if key not in self._formatted:
            scale = 100.0 if percent else 1.0
            self._formatted[key] = {f"{v * scale:.{decimals}f}" for v in self.values}
        return self._formatted[key]

    def has(self, figure: str, percent: bool) -> bool:
        if figure.count(".") >= 2:                                   # a version string
            return re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d])", self.text) is not None
        decimals = len(figure.split(".")[1]) if "." in figure else 0
        return (figure in self.formatted(decimals, False)
                or (percent and figure in self.formatted(decimals, True)))


def problems(doc: Path) -> list[str]:
    """Every violation of the convention in one markdown file, as 'file:line: what'."""
    rel = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
    out = []
    for header_line, _, body, table_sources in tables(doc.read_text(encoding="utf-8")):
        if not body:
            continue
        for line_no, row in body:
            row_sources = [t for _, t in LINK.findall(row)]
            cited = row_sources or table_sources
            where = f"{rel}:{line_no}"
            if not cited:
                out.append(f"{where}: no `Source:` line above the table (line {header_line}) and no link in the row")
                continue
            files = []
            for target in cited:
                path = (doc.parent / target.split("#")[0]).resolve()
                if not path.is_file():
                    out.append(f"{where}: cited file {target} does not exist (or is a folder)")
                else:
                    files.append(Source.get(path))
            if not files:
                continue
            for figure, percent in figures(row):
                if not any(f.has(figure, percent) for f in files):
                    names = ", ".join(str(f.path.relative_to(ROOT)) if f.path.is_relative_to(ROOT) else str(f.path)
                                      for f in files)
                    out.append(f"{where}: {figure}{'%' if percent else ''} is not in {names}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_figure_is_in_its_cited_file(doc):
    assert doc.is_file(), f"{doc} is missing"
    found = problems(doc)
    assert not found, "\n".join(found)


def test_the_readme_has_its_summary_table():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert any(sources or all(LINK.search(row) for _, row in body) for _, _, body, sources in tables(text))
    assert len(text.splitlines()) <= 260, "the README is for users; details go to docs/"


# The checker itself: each rule fails when broken.

def _doc(tmp_path: Path, body: str) -> Path:
    (tmp_path / "r.json").write_text('{"ppl": 59.921849686718375, "ratio": 1.3273973614955694, "f": 0.9197}')
    (tmp_path / "v.md").write_text("llm-compressor 0.14.0.1, PPL 64.108")
    doc = tmp_path / "doc.md"
    doc.write_text(body)
    return doc


def test_checker_accepts_rounded_ratio_and_percent_figures(tmp_path):
    doc = _doc(tmp_path, "Source: [r](r.json)\n\n| a | b |\n|---|---:|\n| r0.70 | **59.92** 1.33× (92%) |\n"
                         "| peer | 64.108, 0.14.0.1, SmolLM2-135M [v](v.md) |\n")
    assert problems(doc) == []


def test_checker_rejects_a_figure_not_in_the_file(tmp_path):
    doc = _doc(tmp_path, "Source: [r](r.json)\n\n| a | b |\n|---|---:|\n| x | 59.93 |\n")
    found = problems(doc)
    assert len(found) == 1 and "59.93 is not in" in found[0]


def test_checker_rejects_a_missing_file_and_a_table_without_source(tmp_path):
    doc = _doc(tmp_path, "Source: [gone](gone.json)\n\n| a |\n|---|\n| 1 |\n\ntext\n\n| a |\n|---|\n| 2 |\n")
    found = problems(doc)
    assert len(found) == 2
    assert "gone.json does not exist" in found[0]
    assert "no `Source:` line" in found[1]


def test_checker_wants_more_decimals_matched_exactly(tmp_path):
    doc = _doc(tmp_path, "Source: [r](r.json)\n\n| a |\n|---|\n| 59.9219 |\n| 59.9 |\n| 59.922 |\n")
    found = problems(doc)
    assert len(found) == 1 and "59.9219" in found[0]
