"""`draftsmith compare RUN_A RUN_B ...` on run folders as stage 06 and the run summary leave them:
each run's headline, the results side by side, a difference beyond noise marked and one within it not."""

import pytest

from draftsmith import cli, summary
from draftsmith.evaluate import results
from draftsmith.paths import Run

pytestmark = pytest.mark.unit


def stage_06_report(code: float, code_se: float, chat: float = 1.9) -> dict:
    """A stage 06 report measured in vLLM at T = 0: the final drafter at `code` (its SE `code_se`) and
    `chat` on the held-out prompts, ngram 1.8 on both, 4 prompts each."""
    def m(kind, by_set, final=None):
        out = {"kind": kind, "lossless": True, "k": 3, "per_dataset": {
            ds: {"acceptance_length": v, "acceptance_length_se": se, "prompts": 4, "drafts": 30}
            for ds, (v, se) in by_set.items()}}
        overall = sum(v for v, _ in by_set.values()) / len(by_set)
        out.update(acceptance_length=overall, acceptance_length_se=0.03, prompts=8)
        if final is not None:
            out["final"] = final
        return out

    return {"draft_tokens": 3, "temperatures": {}, "engine": {"version": "0.32.0", "temperatures": {"0": {
        "temperature": 0.0, "methods": {
            "none": m("none", {"code": (1.0, 0.0), "chat": (1.0, 0.0)}),
            "ngram": m("ngram", {"code": (1.8, 0.04), "chat": (1.8, 0.04)}),
            "eagle3": m("eagle3", {"code": (code, code_se), "chat": (chat, 0.05)}, final=True)}}}}}


def a_run(root, name: str, report: dict) -> Run:
    """A run folder with stage 06's results.csv and a summary.json holding its headline."""
    run = Run(root, name)
    results.write_csv(run, report)
    summary.write(run, summary.Summary(name, summary.Verdict.OK, [], results.run_headline(report)))
    return run


def test_compare_prints_each_headline_and_the_results_side_by_side_marking_only_differences_beyond_noise(tmp_path, capsys):
    a = a_run(tmp_path, "seed0", stage_06_report(1.50, 0.05))
    b = a_run(tmp_path, "seed1", stage_06_report(1.90, 0.05, chat=1.93))   # code +0.40: beyond; chat +0.03: noise;
    # all held-out prompts together (the headline's row): 1.70 -> 1.92 (+-0.03 each): beyond
    assert cli.main(["compare", str(a.root), str(b.root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("compare 2 runs: 2 differences beyond noise (marked *: more than 2 standard errors of the "
                      "difference)")
    assert out[1].startswith("  seed0  headline: final drafter 1.70 ± 0.03") and "held-out prompts" in out[1]
    assert out[2].startswith("  seed1  headline: final drafter 1.92 ± 0.03")
    code = next(x for x in out if "held-out code" in x and "eagle3" in x)
    chat = next(x for x in out if "held-out chat" in x and "eagle3" in x)
    assert "1.50 ± 0.05" in code and "1.90 ± 0.05" in code and code.rstrip().endswith("+0.40 *")
    assert chat.rstrip().endswith("+0.03")
    everything = next(x for x in out if "held-out, all" in x and "eagle3" in x)
    assert everything.rstrip().endswith("+0.22 *")
    ngram = next(x for x in out if "held-out code" in x and "ngram" in x)
    assert ngram.rstrip().endswith("+0.00")


def test_compare_names_the_run_folder_or_file_it_cannot_read(tmp_path, capsys):
    a = a_run(tmp_path, "seed0", stage_06_report(1.5, 0.05))
    assert cli.main(["compare", str(a.root), str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"draftsmith: compare: {tmp_path / 'nope'}: no such run folder"
    (tmp_path / "old").mkdir()
    assert cli.main(["compare", str(a.root), str(tmp_path / "old")]) == 2
    assert f"{tmp_path / 'old' / 'eval' / 'results.csv'}: no results" in capsys.readouterr().err
    assert cli.main(["compare", str(a.root)]) == 2
    assert "give at least two run folders" in capsys.readouterr().err
