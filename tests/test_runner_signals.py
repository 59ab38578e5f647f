"""SIGTERM to `draftsmith run` (a `kill`, a scheduler's time-out) stops stage 02 as cleanly as Ctrl-C:
the requests in flight are saved, the session is marked, the local emulator does not outlive the
run, the exit code says which signal it was, and the same command resumes without duplicates."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from conftest import wait_until

import pytest

pytestmark = pytest.mark.notebook

REPO = Path(__file__).resolve().parents[1]


def test_sigterm_stops_stage_02_cleanly_and_the_rerun_resumes(tmp_path):
    out = tmp_path / "outputs"
    cmd = [str(Path(sys.executable).with_name("draftsmith")), "run", "02", "-f", "params/smoke.yaml",
           "-p", "outputs_dir", str(out), "-p", "concurrency", "4", "-p", "stop_grace_s", "60",
           "-p", "emulator", '{"backend": "synthetic", "synthetic_tokens": 24, "time_scale": 1.0, "fault_scale": 0}']
    raw = out / "smoke" / "generate" / "code" / "raw_responses.jsonl"
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_until(lambda: raw.read_text().count("\n") if raw.exists() else 0, lambda lines: lines >= 2,
               what=f"2 lines in {raw}", timeout_s=420, proc=proc)
    emulators = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "draftsmith.emulator" in " ".join(p.cmdline())]
    assert emulators, "the stage runs against a local emulator child"
    proc.send_signal(signal.SIGTERM)  # the runner only, as `kill PID` does
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM in 02_generate" in err and "re-run the same command" in err
    assert "Traceback" not in err
    session = json.loads((out / "smoke" / "generate" / "manifest.json").read_text())["sessions"][-1]
    assert session["status"] not in ("running", "killed", "finished"), session["status"]
    assert session.get("stop_reason") or session.get("message"), session
    ids = [json.loads(x)["sample_id"] for x in raw.read_text().splitlines()]
    assert ids and len(ids) == len(set(ids))
    wait_until(lambda: [p for p in emulators if alive(p)], lambda left: not left,
               what="the local emulator gone with the run (else orphaned)")

    fast = cmd[:-1] + ['{"backend": "synthetic", "synthetic_tokens": 24, "time_scale": 0.0, "fault_scale": 0}']
    again = subprocess.run(fast, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [json.loads(x) for x in raw.read_text().splitlines()]
    assert len({r["sample_id"] for r in rows}) == len(rows) > len(ids)
    assert {r["sample_id"] for r in rows} >= set(ids)


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
