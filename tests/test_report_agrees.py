"""Stage 06's report agrees with itself: the figures its prose (figures.explain_engine, figures.explain)
states are the figures of the tables beside it (results.tables, figures.decoder_table), read from the
same rows, and the cross-check column says "not comparable" where the two n-gram matchers differ by
design. `prose_disagreements` is also run on a real executed notebook (tests/test_evaluate.py)."""

import re

import pandas as pd

from draftsmith.evaluate import figures, results

import pytest

pytestmark = pytest.mark.unit


def _two(x) -> str:
    return f"{x:.2f}"


def prose_disagreements(prose: str, table: pd.DataFrame, method_column: str = "method") -> list[str]:
    """Each figure the prose gives for the drafter ("drafter **1.72 ± 0.05**") and for the baseline
    ("ngram 1.62 ± 0.04", "prompt lookup 1.40") that is not the table's row for it as shown (two
    decimals); an empty list when they agree. A paragraph per temperature is matched to the table's
    rows in order."""
    problems = []
    drafter = table[table[method_column].str.startswith("eagle3") & table[method_column].str.endswith(
        "(final)")] if table[method_column].str.endswith("(final)").any() else \
        table[table[method_column] == "eagle3"]
    base = table[table[method_column].isin(["ngram", "prompt lookup"])]
    paragraphs = [p for p in prose.split("\n\n") if "drafter **" in p]
    if not paragraphs:
        return ["the prose states no drafter figure"]
    for i, p in enumerate(paragraphs):
        said = re.search(r"drafter \*\*([0-9.]+)(?: ± ([0-9.]+))?\*\*, (ngram|prompt lookup) ([0-9.]+)(?: ± ([0-9.]+))?", p)
        if not said:
            problems.append(f"paragraph {i + 1}: no 'drafter **X**, ngram Y' figure: {p[:80]}")
            continue
        d, d_se, _, b, b_se = said.groups()
        row, brow = drafter.iloc[i], base.iloc[i]
        if d != _two(row["acceptance length"]):
            problems.append(f"paragraph {i + 1}: drafter {d} in the prose, {_two(row['acceptance length'])} in the table")
        se_col = next(c for c in table.columns if c.startswith("±"))
        if d_se is not None and d_se != _two(row[se_col]):
            problems.append(f"paragraph {i + 1}: drafter ± {d_se} in the prose, {_two(row[se_col])} in the table")
        if b != _two(brow["acceptance length"]):
            problems.append(f"paragraph {i + 1}: baseline {b} in the prose, {_two(brow['acceptance length'])} in the table")
        if b_se is not None and b_se != _two(brow[se_col]):
            problems.append(f"paragraph {i + 1}: baseline ± {b_se} in the prose, {_two(brow[se_col])} in the table")
    return problems


def _method(kind, overall, per_set, se, final=None, fraction=None, prompts=8, ours=False):
    s = {"kind": kind, "lossless": True, "k": 3, "acceptance_length": overall, "acceptance_length_se": se,
         "prompts": prompts, "drafts": 60, "tokens_per_s": 20.0 if not ours else None,
         "per_dataset": {ds: {"acceptance_length": v, "acceptance_length_se": se * 1.4, "prompts": prompts // 2,
                              "drafts": 30} for ds, v in per_set.items()}}
    if not ours:
        s["in_flight"] = 8 if kind != "none" else 16
    if final is not None:
        s["final"] = final
    if fraction is not None:
        s["fraction"] = fraction
    if ours:   # what our decoder's summary adds
        part = {"acceptance_length": overall, "rounds": 10}
        s.update(rounds=20, novel_text=part, repeating_text={**part, "rounds": 10}, position_acceptance=[0.5, 0.2, 0.1],
                 position1_ceiling=1.0)
    return s


def report() -> dict:
    """A stage 06 report measured in vLLM at T = 0 with our decoder beside it: vLLM's drafter 1.72
    against ngram 1.55, our decoder's 1.72 against its prompt lookup 1.80 (different matchers)."""
    engine = {"none": _method("none", 1.0, {"code": 1.0, "chat": 1.0}, 0.0),
              "ngram": _method("ngram", 1.55, {"code": 1.78, "chat": 1.5}, 0.04),
              "eagle3 50%": _method("eagle3", 1.5, {"code": 1.6, "chat": 1.4}, 0.05, final=False, fraction=0.5),
              "eagle3": _method("eagle3", 1.72, {"code": 1.76, "chat": 1.7}, 0.05, final=True, fraction=1.0)}
    ours = {"none": _method("none", 1.0, {"code": 1.0, "chat": 1.0}, 0.0, ours=True),
            "prompt lookup": _method("prompt_lookup", 1.80, {"code": 1.9, "chat": 1.7}, 0.04, ours=True),
            "eagle3 50%": _method("eagle3", 1.5, {"code": 1.6, "chat": 1.4}, 0.05, final=False, fraction=0.5, ours=True),
            "eagle3": _method("eagle3", 1.72, {"code": 1.76, "chat": 1.7}, 0.05, final=True, fraction=1.0, ours=True)}
    return {"draft_tokens": 3, "temperatures": {"0": {"temperature": 0.0, "methods": ours}},
            "engine": {"version": "0.32.0", "concurrency": [32], "temperatures": {"0": {
                "temperature": 0.0, "methods": engine,
                "vs_ours": {"prompts": 8, "same_no_drafter_output": 8,
                            "methods": {"eagle3": {"same_output": 8, "same_accepted_per_step": 8},
                                        "eagle3 50%": {"same_output": 8, "same_accepted_per_step": 8}}}}}}}


def test_the_prose_states_the_figures_of_the_tables_beside_it_and_the_check_fails_when_they_differ():
    r = report()
    table = results.tables(r)["greedy (T = 0) · held-out, all · vLLM 0.32.0"]
    prose = figures.explain_engine(r)
    assert "drafter **1.72 ± 0.05**, ngram 1.55 ± 0.04 (the drafter is above ngram beyond noise)" in prose
    assert prose_disagreements(prose, table) == []
    decoder_prose, decoder = figures.explain(r), figures.decoder_table(r)
    assert "drafter **1.72 ± 0.05**, prompt lookup 1.80 ± 0.04 (within noise of prompt lookup: neither wins; our " \
           "n-gram matcher, not vLLM's ngram)" in decoder_prose
    assert prose_disagreements(decoder_prose, decoder.rename(columns={"±": "± se"})) == []
    # the check fails where the prose says another figure than the table
    assert prose_disagreements(prose.replace("**1.72 ± 0.05**", "**1.73 ± 0.05**"), table) == [
        "paragraph 1: drafter 1.73 in the prose, 1.72 in the table"]
    assert prose_disagreements(prose.replace("ngram 1.55", "ngram 1.60"), table) == [
        "paragraph 1: baseline 1.60 in the prose, 1.55 in the table"]


def test_ngram_against_our_prompt_lookup_is_not_comparable_and_speed_stands_beside_its_load_only():
    t = results.tables(report())["greedy (T = 0) · held-out code · vLLM 0.32.0"]
    check = dict(zip(t["method"], t["our decoder agrees (by how much)"]))
    assert check["ngram"] == "not comparable (another n-gram matcher), +0.120"
    assert check["eagle3 (final)"] == "yes, +0.000"
    assert "requests in flight" in t.columns and not any("÷" in c or "ratio" in c for c in t.columns)
    assert dict(zip(t["method"], t["requests in flight"])) == {"none": 16, "ngram": 8, "eagle3 50%": 8, "eagle3 (final)": 8}
    prose = figures.explain_engine(report())
    assert "none 20 (up to 16 in flight)" in prose and "not compared" in prose and "x)" not in prose


def test_a_long_serving_command_is_shown_one_option_a_line_and_is_the_same_command_to_a_shell():
    import shlex

    from draftsmith.tables import SHELL_WIDTH, shell_lines

    command = ("python -m sglang.launch_server --model-path ~/.cache/draftsmith/targets/tiny-4dd9ea "
               "--speculative-algorithm EAGLE3 --speculative-draft-model-path drafter/eagle3 "
               "--speculative-config '{\"method\": \"eagle3\", \"num_speculative_tokens\": 3}' --port 30000")
    shown = shell_lines(command)
    assert all(len(line) <= SHELL_WIDTH for line in shown.splitlines())
    assert shlex.split(shown.replace("\\\n", " ")) == shlex.split(command)
    assert shell_lines("vllm serve x --port 8000") == "vllm serve x --port 8000"


def test_the_readme_table_shows_each_figure_with_its_noise_and_bolds_only_a_win_beyond_it():
    table = results.readme_table(results.results(report())).splitlines()
    row = {line.split("|")[2].strip(): line for line in table[2:]}
    assert row["held-out, all (8)"] == "| greedy | held-out, all (8) | **1.72 ± 0.05** | 1.55 ± 0.04 | 1.00 |"
    assert row["held-out code (4)"] == "| greedy | held-out code (4) | 1.76 ± 0.07 | 1.78 ± 0.06 | 1.00 |"   # noise
