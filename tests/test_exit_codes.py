"""The exit code follows the verdict, as an unattended caller sees it: `draftsmith run 01,02,03,04
-f params/smoke.yaml` keeps stage 03's flagged providers (exclude_flagged off), so stage 03's verdict
is failed: the chain ends there (stage 04 does not start), the process exits 3, and the last lines
and summary.json say which stage did not run and why. `--keep-going` runs it anyway and still exits
3; `--strict` ends the chain at a warning too (stage 01's plan not covered by the spend limit).
Then stage 05 on that run with one shard cut in half and one deleted: exit 2 before anything runs
(and with --check), both named with the command that repairs them; that command re-captures only
their samples, and stage 05 trains.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith import summary
from draftsmith.paths import Run
from draftsmith.hidden import outputs as hidden_outputs
from draftsmith.runner import VerdictFailed

from conftest import copy_run

pytestmark = pytest.mark.notebook

REPO = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("draftsmith"))


def draftsmith(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, "run", *args], cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """`draftsmith run 01,02,03,04 -f params/smoke.yaml`, as a user types it (into a temporary outputs_dir)."""
    out = tmp_path_factory.mktemp("exit") / "outputs"
    proc = draftsmith("01,02,03,04", "-f", "params/smoke.yaml", "-p", "outputs_dir", str(out))
    return out, Run(out, "smoke"), proc


def test_a_failed_verdict_ends_the_chain_there_and_exits_3(stopped):
    out, run, proc = stopped
    saved = summary.read(run)
    verdicts = {s["title"]: s["verdict"] for s in saved["stages"]}
    assert verdicts.get("03_validate_tokens") == "failed", (verdicts, proc.stderr[-3000:])  # smoke keeps flagged providers
    assert proc.returncode == VerdictFailed.EXIT_CODE == 3, proc.stderr[-3000:]
    # stage 04 did not start: no executed notebook, no log, no features
    assert list(verdicts) == ["01_providers", "02_generate", "03_validate_tokens"]
    assert not (run.root / "notebooks" / "04_hidden_states.ipynb").exists()
    assert not (run.root / "logs" / "04_hidden_states.log").exists()
    assert not (run.root / "hidden" / "index.json").exists()
    assert saved["not_run"] == [{"title": "04_hidden_states", "after": "03_validate_tokens", "cause": "failed",
                                 "reason": "03_validate_tokens failed; the chain stops at a failed stage "
                                           "(--keep-going runs on)"}]
    # the last lines printed are the summary, which names the stage not run and why, and what failed
    printed = proc.stderr.splitlines()
    last = summary.lines(summary.build(run, [summary.NotRun("04_hidden_states", "03_validate_tokens",
                                                            summary.StopCause.FAILED)]))
    assert printed[-len(last):] == last
    assert last[0] == "run smoke: failed (03_validate_tokens failed); not run: 04_hidden_states"
    assert any(x.startswith("  04_hidden_states    not run  03_validate_tokens failed") for x in last)
    assert any(x.startswith("  ! 03_validate_tokens: not fit to train on as kept") for x in last)
    html = (run.root / "report.html").read_text()
    assert "not run" in html and "04_hidden_states" in html


@pytest.fixture(scope="module")
def kept_going(stopped):
    out, run, _ = stopped
    # smaller shards than smoke.yaml's: several, so that a broken one has whole ones beside it
    return out, run, draftsmith("03,04", "-f", "params/smoke.yaml", "-p", "outputs_dir", str(out), "-p", "shard_mb",
                                "0.25", "--keep-going")


def test_keep_going_runs_the_later_stages_and_still_exits_3(kept_going):
    out, run, proc = kept_going
    assert proc.returncode == 3, proc.stderr[-3000:]
    saved = summary.read(run)
    assert [s["title"] for s in saved["stages"]][-2:] == ["03_validate_tokens", "04_hidden_states"]
    assert saved["not_run"] == [] and (run.root / "hidden" / "index.json").is_file()
    assert proc.stderr.splitlines()[-len(summary.lines(summary.build(run))):] == summary.lines(summary.build(run))


def test_a_warning_exits_0_and_with_strict_ends_the_chain_with_3(tmp_path):
    # a spend limit below stage 01's plan: its verdict is warning ("the plan fits n%")
    common = ["-f", "params/smoke.yaml", "-p", "outputs_dir", str(tmp_path / "outputs"), "-p", "spend_limit_usd",
              "0.003", "-p", "logprob_prompts", "0"]   # (the logprob probe alone could cost more than that)
    proc = draftsmith("01", *common)
    run = Run(tmp_path / "outputs", "smoke")
    assert summary.read(run)["stages"][0]["verdict"] == "warning", proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = draftsmith("01,02", *common, "--strict")
    assert proc.returncode == 3, proc.stderr[-3000:]
    saved = summary.read(run)
    assert [s["title"] for s in saved["stages"]] == ["01_providers"]
    assert [(n["title"], n["cause"]) for n in saved["not_run"]] == [("02_generate", "warning")]
    assert not (run.root / "generate" / "manifest.json").exists()
    assert "  02_generate   not run  01_providers warning, and --strict stops at a warning" in proc.stderr


def test_the_exit_codes_are_documented_beside_2_and_130():
    readme = (REPO / "README.md").read_text()
    para = next(p for p in readme.split("\n\n") if "exit 130" in p)
    assert "exit code 2" in para and "exit code is 3" in para and "--keep-going" in para and "--strict" in para
    from draftsmith import cli

    assert "exits 3" in cli.__doc__ and "130" in cli.__doc__


def test_a_broken_shard_is_named_before_training_with_the_command_that_repairs_it(kept_going, tmp_path):
    out, run, _ = kept_going
    out = tmp_path / "outputs"
    copy_run(run.root, out / "smoke")
    hidden = out / "smoke" / "hidden"
    shards = [e["file"] for e in (hidden_outputs.HiddenShards(hidden).index["shards"])]
    assert len(shards) >= 3, shards
    cut, gone = hidden / shards[0], hidden / shards[-1]
    whole = {f: os.stat(hidden / f) for f in shards[1:-1]}
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    gone.unlink()
    common = ["-f", "params/smoke.yaml", "-p", "outputs_dir", str(out)]
    for extra in ([], ["--check"]):
        proc = draftsmith("05", *common, *extra)
        assert proc.returncode == 2, proc.stderr[-3000:]
        err = proc.stderr
        assert "2 shard(s) listed in" in err and f"{cut}: cut short" in err and f"{gone}: missing" in err
        assert "Traceback" not in err and not (out / "smoke" / "drafter").exists()
        assert not (out / "smoke" / "notebooks" / "05_train_drafter.ipynb").exists()
    repair = re.search(r"repair: (draftsmith run 04 .*?)   \(", err).group(1)
    assert repair == f"draftsmith run 04 -f params/smoke.yaml -p outputs_dir {out}"
    proc = draftsmith(*repair.split()[2:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (out / "smoke" / "logs" / "04_hidden_states.log").read_text()
    assert f"{cut.name}: cut short" in log
    assert hidden_outputs.broken_shards(hidden) == []
    for f, st in whole.items():   # the whole shards were kept as they were
        assert (os.stat(hidden / f).st_ino, os.stat(hidden / f).st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    proc = draftsmith("05", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary.read(Run(out, "smoke"))["stages"][-1]["title"] == "05_train_drafter"
