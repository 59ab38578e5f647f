"""`<run>/report.html`: the executed stage notebooks of a run rendered as one page, inputs hidden.

Written by `draftsmith run` after the stages it ran (also after a failure, with what exists), so a
person can open one self-contained file (figures embedded) instead of six notebooks. It opens with
the run summary (`draftsmith.summary`: each stage's verdict and figures, each linking to its stage's
section, and a link to each stage's log); each section starts with its stage's verdict and log. The page is
meant for sharing: it fits any window (wide tables and code blocks scroll in their own box), names
no folder of this machine (paths are written relative to the run folder, the repository or `~`),
and leaves out the log of building a built-in target.
"""

from __future__ import annotations

import copy
import re
from html import escape
from pathlib import Path

from .files import write_text_atomic
from .paths import REPO_ROOT, Run
from .summary import Summary, meta_line, stage_time
from .targets.tiny import BUILD_LOG

# Appended to the exporter's own styles: nothing may be wider than the page. A wide table or code
# block (a serving command a user copies) scrolls sideways in its own box, its lines kept whole;
# printed text wraps between words, never inside one (the exporter's break-all), and a word wider
# than the box (a path) scrolls rather than being cut at the box's edge.
FIT_THE_PAGE = """<style>
.jp-RenderedHTMLCommon table, .jp-RenderedHTMLCommon pre, .jp-RenderedText pre, .jp-OutputArea-output pre {
  display: block; max-width: 100%; overflow-x: auto; }
.jp-RenderedHTMLCommon pre, .jp-RenderedHTMLCommon pre code { white-space: pre; word-break: normal; }
.jp-RenderedText pre, .jp-OutputArea-output pre {
  white-space: pre-wrap; word-break: normal; overflow-wrap: normal; word-wrap: normal; }
.jp-OutputArea-output { max-width: 100%; min-width: 0; }
.jp-RenderedHTMLCommon td, .jp-RenderedHTMLCommon th { word-break: normal; overflow-wrap: normal; }
.jp-RenderedHTMLCommon table { width: max-content; }
img { max-width: 100%; height: auto; }
.ds-summary table { display: table; width: auto; max-width: 100%; }
.ds-summary td, .ds-summary th { white-space: normal; vertical-align: top; text-align: left; }
.ds-summary td:nth-child(3) { white-space: nowrap; }
.ds-headline { font-size: 1.15em; font-weight: bold; padding: 0.4em 0; }
.ds-meta { color: #57606a; font-size: 0.9em; }
.ds-summary .ok { color: #1a7f37; font-weight: bold; }
.ds-summary .warning { color: #9a6700; font-weight: bold; }
.ds-summary .failed { color: #cf222e; font-weight: bold; }
</style>
"""


def report_file(run: Run) -> Path:
    return run.root / "report.html"


def write_report(run: Run, summary: Summary | None = None) -> Path | None:
    """Render the run's executed notebooks as `<run>/report.html`, `summary` (the run's, see
    `draftsmith.summary.build`) at its top; None when no stage has run."""
    import nbformat     # here, not at the top: its import costs a second that every command would pay
    from nbconvert import HTMLExporter

    skipped = {n.title for n in summary.not_run} if summary else set()   # an earlier run's, not this chain's
    notebooks = [p for p in run.executed_notebooks() if p.stem.split("@")[0] not in skipped]
    if not notebooks:
        return None
    merged = nbformat.v4.new_notebook()
    merged.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    if summary is not None and summary.headline is not None:   # the page's first line
        merged.cells.append(nbformat.v4.new_markdown_cell(
            f"<div class='ds-summary ds-headline'>{escape(summary.headline.text())}</div>"))
    merged.cells.append(nbformat.v4.new_markdown_cell(f"# draftsmith run `{run.name}`"))
    if summary is not None and summary.meta is not None:
        merged.cells.append(nbformat.v4.new_markdown_cell(
            f"<div class='ds-summary ds-meta'>{escape(meta_line(summary.meta))}</div>"))
    if summary is not None:
        merged.cells.append(nbformat.v4.new_markdown_cell(summary_html(summary)))
    merged.cells.append(nbformat.v4.new_markdown_cell(
        "Each section below is an executed stage notebook with its code hidden; the notebooks "
        f"themselves are in `{notebooks[0].parent}`, what each stage printed in `logs/`. Paths are written "
        "relative to the run folder (where this page is), files of the repository relative to its root, and "
        "others in the home folder as `~`."))
    verdicts = {s.title: s.verdict for s in summary.stages} if summary else {}
    for p in notebooks:
        nb = nbformat.read(p, as_version=4)
        v = verdicts.get(p.stem.split("@")[0])
        said = f" · <span class='{v.value}'>{v.value}</span>" if v else ""
        merged.cells.append(nbformat.v4.new_markdown_cell(
            f"---\n\n<a id='{p.stem}'></a>\n<div class='ds-summary'><em>stage {p.stem}</em>{said} · "
            f"<a href='logs/{p.stem}.log'>log</a></div>"))
        for c in nb.cells:
            tags = c.get("metadata", {}).get("tags", [])
            if "parameters" in tags or "injected-parameters" in tags:
                continue
            merged.cells.append(_results_only(copy.deepcopy(c)))
    exporter = HTMLExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(merged)
    body = _relative_paths(body.replace("</head>", FIT_THE_PAGE + "</head>", 1), run)
    out = report_file(run)
    write_text_atomic(out, body)
    return out


def summary_html(summary: Summary) -> str:
    """The summary as the top of the page: the run's verdict, one row per stage (its verdict, time,
    figures each linking to the stage's section, its log), one per stage that did not run and why, then
    why each stage that is not ok is not."""
    rows = []
    for s in summary.stages:
        figures = "<br>".join(f"<a href='#{escape(f.section)}'>{escape(f.text)}</a>" for f in s.figures)
        rows.append(f"<tr><td><a href='#{escape(s.section)}'>{escape(s.title)}"
                    f"</a></td><td class='{s.verdict.value}'>{s.verdict.value}</td><td>{escape(stage_time(s))}</td>"
                    f"<td>{figures}</td><td><a href='{escape(s.log)}'>log</a></td></tr>")
    rows += [f"<tr><td>{escape(n.title)}</td><td class='failed'>not run</td><td>-</td><td>{escape(n.reason)}</td>"
             f"<td></td></tr>" for n in summary.not_run]
    notes = "".join(f"<li><span class='{s.verdict.value}'>{escape(s.title)}</span>: {escape(n.text)}</li>"
                    for s in summary.stages for n in s.notes)
    return (f"<div class='ds-summary'>\n<p><strong>Run summary: <span class='{summary.verdict.value}'>"
            f"{summary.verdict.value}</span></strong> (also in <a href='summary.json'>summary.json</a>)</p>\n"
            "<table><thead><tr><th>stage</th><th>verdict</th><th>time</th><th>what decides it</th><th></th></tr>"
            f"</thead><tbody>{''.join(rows)}</tbody></table>\n" + (f"<ul>{notes}</ul>\n" if notes else "") + "</div>")


def _results_only(cell):
    """The cell as the report shows it: the stage's own call (`stage.run(`) without what it printed
    while working (that is its log, in logs/), its results and errors kept; any other cell without
    the lines a built-in target's build printed. An output left empty goes."""
    if "outputs" in cell:
        work = cell.get("cell_type") == "code" and "stage.run(" in cell.source
        for out in cell.outputs:
            if out.get("output_type") == "stream":
                out["text"] = "" if work else "".join(
                    x for x in out["text"].splitlines(keepends=True) if not x.startswith(BUILD_LOG))
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
