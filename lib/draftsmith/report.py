"""`<run>/report.html`: the executed stage notebooks of a run rendered as one page, inputs hidden.

Written by `draftsmith run` after the stages it ran (also after a failure, with what exists), so a
person can open one self-contained file (figures embedded) instead of six notebooks.
"""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat

from .files import write_text_atomic
from .paths import Run
from .runner import executed_notebooks


def report_file(run: Run) -> Path:
    return run.root / "report.html"


def write_report(run: Run) -> Path | None:
    from nbconvert import HTMLExporter

    notebooks = executed_notebooks(run)
    if not notebooks:
        return None
    merged = nbformat.v4.new_notebook()
    merged.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    merged.cells.append(nbformat.v4.new_markdown_cell(
        f"# draftsmith run `{run.name}`\n\nStages: " + ", ".join(p.stem for p in notebooks) +
        ".\n\nEach section is an executed stage notebook with its code hidden; the notebooks "
        f"themselves are in `{notebooks[0].parent}`."))
    for p in notebooks:
        nb = nbformat.read(p, as_version=4)
        merged.cells.append(nbformat.v4.new_markdown_cell(f"---\n\n<a id='{p.stem}'></a>\n*stage {p.stem}*"))
        for c in nb.cells:
            tags = c.get("metadata", {}).get("tags", [])
            if "parameters" in tags or "injected-parameters" in tags:
                continue
            merged.cells.append(copy.deepcopy(c))
    exporter = HTMLExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(merged)
    out = report_file(run)
    write_text_atomic(out, body)
    return out
