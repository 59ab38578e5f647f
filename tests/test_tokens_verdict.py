"""Stage 03's summary ends with one verdict on its flags: whether the data as kept is fit to train
on, why, and what to do when it is not. Runs stage 03 (`tokens.stage.run`, what notebook 03 calls) on
the synthetic providers of test_tokens_stage.py."""

from test_tokens_stage import SPECS, stage_03, synthetic_rows, synthetic_run, write_raw  # noqa: F401 (fixture)

from draftsmith import tokens
from draftsmith.paths import Run

import pytest

pytestmark = pytest.mark.unit


def verdict_line(report: dict) -> str:
    [line] = [x for x in tokens.summary(report).splitlines() if x.startswith("verdict:")]
    return line


def test_providers_that_change_the_text_are_kept_only_with_a_warning_and_the_fix(synthetic_run, tiny_target):
    report = stage_03(synthetic_run, SPECS, tiny_target)
    assert report["totals"]["flagged"] > 0 and report["totals"]["excluded"] == 0
    line = verdict_line(report)
    assert line.startswith("verdict: NOT fit to train on as kept: Drop (dropped_reasoning), Strip "
                           "(stripped_whitespace), Trunc (truncated_reasoning) returned text unlike the target's, "
                           "and their 72 samples are kept because exclude_flagged is off; re-run stage 03 with "
                           "-p exclude_flagged true"), line


def test_with_exclude_flagged_the_verdict_says_what_was_left_out(synthetic_run, tiny_target):
    report = stage_03(synthetic_run, SPECS, tiny_target, exclude_flagged=True)
    assert verdict_line(report) == ("verdict: fit to train on: exclude_flagged leaves the "
                                 f"{report['totals']['flagged']} flagged samples and every sample of a flagged "
                                 "provider out (120 excluded, 24 kept)")


def test_providers_flagged_only_for_their_billing_are_fit_to_train_on(tmp_path, tiny_target, target_tokenizer):
    run = Run(tmp_path, "r")
    rows = [r for r in synthetic_rows(target_tokenizer, "code", 12) if r["provider"] in ("Clean", "OtherTok", "Split")]
    write_raw(run, "code", rows)
    report = stage_03(run, SPECS[:1], tiny_target)
    assert set(report["flagged_providers"]) == {"OtherTok", "Split"}
    assert verdict_line(report) == ("verdict: fit to train on as kept: the flagged providers differ from the target "
                                 "only in how they count tokens (non_canonical_split, other_tokenizer); the text is "
                                 "the target's, and the training ids are rebuilt from it with the target's own "
                                 "template")
