"""The rehearsal of the real job (bench/rehearsal.py) at smoke scale, through the same path as
`make rehearsal`: params/kimi-k2.5.yaml pointed at a local emulator, stages 01, 02 (stopped at
the balance floor), a top-up, 02 again, 03, and the table.

This runs four stage notebooks through papermill (about a minute on two idle cores): it is the
only test of the rehearsal's code, which otherwise runs only as the full benchmark.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.notebook

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import rehearsal  # noqa: E402


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("rehearsal")
    lines = []
    r = rehearsal.rehearse(volume=0.002, time_scale=0.0, run_name="smoke", outputs_dir=out, log=lines.append)
    return r, out / "smoke", lines


def test_stage_01_says_the_balance_does_not_cover_the_plan(result):
    r, _, lines = result
    plan = r["plan"]
    assert plan["planned_usd"] > r["initial_balance_usd"] and "does NOT cover" in plan["sentence"]
    assert 0 < plan["tokens_that_fit"] < plan["output_tokens"] == 6 * r["budget_per_dataset"]
    assert any("stage 01 says" in line and f"{plan['tokens_that_fit']:,}" in line for line in lines)


def test_plan_verdict_says_what_the_money_buys():
    import pandas as pd

    from draftsmith.providers.stage import plan_verdict

    plan = pd.DataFrame({"cost_mix": [80.0, 60.0], "output_tokens": [10_000_000, 10_000_000],
                         "output_tokens_that_fit": [7_142_857, 7_142_857]})
    assert plan_verdict(plan, 100.0, 150.0) == (
        "The balance ($100.00) does NOT cover the plan: $140.00 at the expected mix for 20,000,000 output tokens; "
        "it buys 14,285,714 of them (71%). Stage 02 will stop when it runs out: top up about $40.00 (and re-run "
        "stage 02) to finish.")
    assert "raise spend_limit_usd by about $90.00" in plan_verdict(plan, None, 50.0)
    plan["output_tokens_that_fit"] = plan["output_tokens"]
    assert plan_verdict(plan, 500.0, 200.0).startswith("spend_limit_usd ($200.00) covers the plan: $140.00")


def test_stage_02_stops_at_the_floor_then_finishes_every_budget_after_the_top_up(result):
    r, run, _ = result
    assert "balance ran out" in r["stop_message"] or "keeps only" in r["stop_message"], r["stop_message"]
    assert r["top_up_usd"] > 0
    assert r["account_credits_usd"] == pytest.approx(r["initial_balance_usd"] + r["top_up_usd"])
    for name, tokens in r["tokens"].items():
        assert tokens >= r["budgets"][name], name
        assert r["overshoot"][name] <= r["overshoot_limit"], name
    assert r["spent_usd_run"] == pytest.approx(r["ledger_usd"], abs=0.005)   # to the cent
    assert r["duplicated"] == 0 and r["lost"] == 0
    assert r["paid_twice"] == r["paid_twice_after_wire_fault"] + r["paid_twice_in_flight_at_stop"]
    assert [s["label"] for s in r["sessions"]] == ["02 #1", "02 #2"]
    assert {"generate/figures/timeline.png", "generate/figures/overview.png",
            "providers/figures/cost_vs_balance.png"} <= set(r["figures"])
    timeline = (run / "generate" / "timeline.jsonl").read_text().splitlines()
    assert {json.loads(line)["session"] for line in timeline} == {1, 2}


def test_stage_03_validates_every_response(result):
    r, _, _ = result
    s3 = r["stage03"]
    assert s3["samples"] == r["samples_saved"]
    assert s3["flagged"] == 0 and not s3["flagged_providers"] and not s3["issues"]
    assert s3["billed"] == s3["rebuilt"]


def test_the_table_stands_next_to_the_reference_run(result):
    r, run, _ = result
    table = (run / "rehearsal" / "table.md").read_text()
    assert table == rehearsal.render(r) + "\n"
    for ref in ("33 min", "$86", "0 in 1637", "0.04%"):
        assert ref in table
    assert "sk-or-v1" not in table and "sk-or-v1" not in (run / "rehearsal" / "params.yaml").read_text()
