"""report.html is meant for sharing: `write_report` (what `draftsmith run` calls after its stages)
shows each stage's results and errors, leaves out what the stage printed while working (its log,
in logs/) and the built-in target's build log, and writes this machine's folders as relative or
`~` paths. (tests/test_report_browser.py opens a real report in Chromium.)"""

from pathlib import Path

import nbformat

from draftsmith.paths import REPO_ROOT, Run
from draftsmith.report import write_report
from draftsmith.targets.tiny import BUILD_LOG

import pytest

pytestmark = pytest.mark.unit


def executed(run: Run, outputs: list) -> None:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("start_emulator()")
    cell.outputs = outputs
    nb.cells.append(cell)
    folder = run.root / "notebooks"
    folder.mkdir(parents=True)
    nbformat.write(nb, folder / "01_providers.ipynb")


def test_the_report_leaves_out_the_target_build_log_and_names_no_folder_of_this_machine(tmp_path):
    run = Run(tmp_path / "outputs", "demo")
    build = "".join(BUILD_LOG + line + "\n" for line in (
        "building target 'tiny': 13.0M params, 260 steps of 16x128 tokens",
        "  step 20/260 loss 7.1 (9s, checkpoint saved)", "target 'tiny' built in 151s"))
    cache = Path.home() / ".cache" / "draftsmith" / "targets" / "tiny-0123456789"
    executed(run, [
        nbformat.v4.new_output("stream", name="stdout", text=build),  # a cell that printed only the build
        nbformat.v4.new_output("stream", name="stdout", text=build + f"emulator ready: target {cache}\n"
                               f"routing written to {run.root / 'providers' / 'routing.json'}\n"
                               f"prompts from {REPO_ROOT / 'data' / 'demo' / 'code.jsonl'}\n"),
    ])
    html = write_report(run).read_text(encoding="utf-8")
    assert BUILD_LOG.strip() not in html and "built in 151s" not in html
    assert "emulator ready: target ~/.cache/draftsmith/targets/tiny-0123456789" in html
    assert "routing written to providers/routing.json" in html
    assert "prompts from data/demo/code.jsonl" in html
    assert str(tmp_path) not in html and str(REPO_ROOT) + "/" not in html and str(Path.home()) + "/" not in html
    assert html.count('class="jp-RenderedText') == 1  # the output that held only the build log is gone


def test_the_stages_own_call_shows_its_results_and_errors_and_leaves_what_it_printed_to_the_log(tmp_path):
    run = Run(tmp_path / "outputs", "demo")
    nb = nbformat.v4.new_notebook()
    work = nbformat.v4.new_code_cell("summary = stage.run(run, parameters.stage_config('01', globals()))\nsummary")
    work.outputs = [nbformat.v4.new_output("stream", name="stdout", text="[pilot] 6/8 req (75%) in 15s\n"),
                    nbformat.v4.new_output("execute_result", data={"text/plain": "the plan fits 100%"},
                                           execution_count=1)]
    shown = nbformat.v4.new_code_cell("print(tokens.summary(report))")
    shown.outputs = [nbformat.v4.new_output("stream", name="stdout", text="262 of 350 samples kept\n")]
    failed = nbformat.v4.new_code_cell("report = stage.run(run, parameters.stage_config('02', globals()))")
    failed.outputs = [nbformat.v4.new_output("stream", name="stdout", text="[generate] 1,322/28,000 tok\n"),
                      nbformat.v4.new_output("error", ename="ValueError", evalue="datasets: file not found",
                                             traceback=["ValueError: datasets: file not found"])]
    nb.cells += [work, shown, failed]
    (run.root / "notebooks").mkdir(parents=True)
    nbformat.write(nb, run.root / "notebooks" / "01_providers.ipynb")
    html = write_report(run).read_text(encoding="utf-8")
    assert "[pilot]" not in html and "[generate]" not in html        # the stage's log: logs/01_providers.log
    assert "the plan fits 100%" in html and "262 of 350 samples kept" in html
    assert "datasets: file not found" in html
