"""`<run>/report.html`: the executed stage notebooks of a run rendered as one page, inputs hidden.

Written by `draftsmith run` after the stages it ran (also after a failure, with what exists), so a
person can open one self-contained file (figures embedded) instead of six notebooks. The page is
meant for sharing: it fits any window (wide tables and code blocks scroll in their own box), names
no folder of this machine (paths are written relative to the run folder, the repository or `~`),
and leaves out the log of building a built-in target.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

from .files import write_text_atomic
from .paths import REPO_ROOT, Run
from .targets.tiny import BUILD_LOG

# Appended to the exporter's own styles: nothing may be wider than the page. A wide table or code
# block (a serving command) scrolls sideways in its own box, its lines kept whole; printed text
# wraps, as the exporter already has it.
FIT_THE_PAGE = """<style>
.jp-RenderedHTMLCommon table, .jp-RenderedHTMLCommon pre, .jp-RenderedText pre {
  display: block; max-width: 100%; overflow-x: auto; }
.jp-RenderedHTMLCommon pre, .jp-RenderedHTMLCommon pre code { white-space: pre; word-break: normal; }
.jp-RenderedHTMLCommon table { width: max-content; }
img { max-width: 100%; height: auto; }
</style>
"""


def report_file(run: Run) -> Path:
    return run.root / "report.html"


def write_report(run: Run) -> Path | None:
    import nbformat     # here, not at the top: its import costs a second that every command would pay
    from nbconvert import HTMLExporter

    notebooks = run.executed_notebooks()
    if not notebooks:
        return None
    merged = nbformat.v4.new_notebook()
    merged.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    merged.cells.append(nbformat.v4.new_markdown_cell(
        f"# draftsmith run `{run.name}`\n\nStages: " + ", ".join(p.stem for p in notebooks) +
        ".\n\nEach section is an executed stage notebook with its code hidden; the notebooks "
        f"themselves are in `{notebooks[0].parent}`. Paths are written relative to the run folder (where this "
        "page is), files of the repository relative to its root, and others in the home folder as `~`."))
    for p in notebooks:
        nb = nbformat.read(p, as_version=4)
        merged.cells.append(nbformat.v4.new_markdown_cell(f"---\n\n<a id='{p.stem}'></a>\n*stage {p.stem}*"))
        for c in nb.cells:
            tags = c.get("metadata", {}).get("tags", [])
            if "parameters" in tags or "injected-parameters" in tags:
                continue
            merged.cells.append(_without_build_log(copy.deepcopy(c)))
    exporter = HTMLExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(merged)
    body = _relative_paths(body.replace("</head>", FIT_THE_PAGE + "</head>", 1), run)
    out = report_file(run)
    write_text_atomic(out, body)
    return out


def _without_build_log(cell):
    """The cell without the lines a built-in target's build printed (its training steps are of no
    use to a reader of the run); an output left empty goes."""
    if "outputs" in cell:
        for out in cell.outputs:
            if out.get("output_type") == "stream":
                out["text"] = "".join(x for x in out["text"].splitlines(keepends=True) if not x.startswith(BUILD_LOG))
        cell.outputs = [o for o in cell.outputs if o.get("output_type") != "stream" or o["text"]]
    return cell


def _relative_paths(html: str, run: Run) -> str:
    """`html` with this machine's folders written the way a reader elsewhere can use them: the run
    folder's files relative to it, the repository's relative to its root, the home folder as `~`."""
    prefixes = [(run.root.absolute(), ""), (run.root.resolve(), ""), (REPO_ROOT, ""), (Path.home(), "~/")]
    parts = _EMBEDDED.split(html)  # odd items: embedded figures, whose base64 may spell anything
    for i in range(0, len(parts), 2):
        for folder, short in prefixes:
            if len(folder.parts) > 1:
                at = re.escape(str(folder))
                parts[i] = re.sub(at + r"(?![\w.-])", short.rstrip("/") or ".", re.sub(at + "/", short, parts[i]))
    return "".join(parts)


_EMBEDDED = re.compile(r"(data:[\w/+.-]+;base64,[A-Za-z0-9+/=\s]+)")
