"""The notebooks stay thin in words: no markdown cell over 120 words (longer explanations live in
docs/ and are named), every docs page a notebook names exists, every section of
docs/reading-the-report.md it names is a heading there, and the committed notebooks carry no
outputs."""

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
MAX_WORDS = 120
READING = "docs/reading-the-report.md"


def markdown_cells(nb: Path) -> list[tuple[int, str]]:
    cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    return [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "markdown"]


def headings(page: Path) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+)$", page.read_text(encoding="utf-8"), re.M)}


def word_problems(notebooks: list[Path]) -> list[str]:
    return [f"{nb.name} cell {i}: {n} words (at most {MAX_WORDS}; move the rest to docs/)"
            for nb in notebooks for i, text in markdown_cells(nb) if (n := len(text.split())) > MAX_WORDS]


def reference_problems(notebooks: list[Path], root: Path) -> list[str]:
    out = []
    for nb in notebooks:
        for i, text in markdown_cells(nb):
            for page in re.findall(r"docs/[\w.-]+\.md", text):
                if not (root / page).is_file():
                    out.append(f"{nb.name} cell {i}: names {page}, which does not exist")
            for section in re.findall(re.escape(READING) + r"`? \(([^)]+)\)", text):
                if (root / READING).is_file() and section not in headings(root / READING):
                    out.append(f"{nb.name} cell {i}: names section {section!r} of {READING}, which has no such heading")
    return out


def test_no_markdown_cell_of_a_notebook_runs_over_120_words():
    assert NOTEBOOKS
    assert word_problems(NOTEBOOKS) == []


def test_every_docs_page_and_section_a_notebook_names_exists():
    assert any(READING in text for nb in NOTEBOOKS for _, text in markdown_cells(nb))
    assert reference_problems(NOTEBOOKS, REPO) == []


def test_the_committed_notebooks_carry_no_outputs():
    for nb in NOTEBOOKS:
        for i, c in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
            if c["cell_type"] == "code":
                assert c["outputs"] == [] and c["execution_count"] is None, f"{nb.name} cell {i} has outputs"


def test_the_checks_name_a_long_cell_a_missing_page_and_a_missing_section(tmp_path):
    """The checks above, on a made-up notebook with one of each mistake."""
    (tmp_path / "docs").mkdir()
    (tmp_path / READING).write_text("# Reading\n\n## The figures\n")
    nb = tmp_path / "toy.ipynb"
    cells = [{"cell_type": "markdown", "metadata": {}, "source": ["word " * 121]},
             {"cell_type": "markdown", "metadata": {},
              "source": [f"See `{READING}` (The figures) and `docs/gone.md`."]},
             {"cell_type": "markdown", "metadata": {}, "source": [f"See `{READING}` (The tables)."]}]
    nb.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert word_problems([nb]) == ["toy.ipynb cell 0: 121 words (at most 120; move the rest to docs/)"]
    assert reference_problems([nb], tmp_path) == [
        "toy.ipynb cell 1: names docs/gone.md, which does not exist",
        f"toy.ipynb cell 2: names section 'The tables' of {READING}, which has no such heading",
    ]
