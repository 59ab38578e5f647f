"""Stage 02 under an operator's mistakes, through the CLI as a user runs it: a second terminal on
the same run, a disk that fills up or is too small for the plan, a re-run with other settings.
The emulator's ledger (every request billed, keyed by its prompt) says what was paid."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from draftsmith.datasets import DatasetReader, DatasetSpec, stable_id
from draftsmith.emulator import KEY_ENV, emulator_process, read_ledger
from draftsmith.emulator.config import load_config

from conftest import wait_until

pytestmark = pytest.mark.notebook

REPO = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("draftsmith"))
MODEL = "moonshotai/kimi-k2.5"


def paced(tokens_per_s: float, **kw) -> dict:
    """A synthetic emulator whose one provider answers 24 tokens at `tokens_per_s`, no faults."""
    return {"backend": "synthetic", "synthetic_tokens": 24, "time_scale": 1.0, "fault_scale": 0.0, "credits": 5.0,
            "providers": [{"slug": "slow", "name": "Slow", "quantization": "int4", "prompt_price": 0.5,
                           "completion_price": 2.0, "latency_s": {"median": 0.2, "sigma": 0.2},
                           "tokens_per_s": {"median": tokens_per_s, "sigma": 0.2}, "capacity": 1000}], **kw}


def stage_02(out: Path, *params: tuple[str, object]) -> list[str]:
    cmd = [CLI, "run", "02", "-f", "params/smoke.yaml", "-p", "outputs_dir", str(out)]
    for k, v in params:
        cmd += ["-p", k, v if isinstance(v, str) else json.dumps(v)]
    return cmd


def run_cli(cmd: list[str], timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def responses(out: Path, dataset: str) -> list[dict]:
    path = out / "smoke" / "generate" / dataset / "raw_responses.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def saved_count(out: Path) -> int:
    return sum(len(responses(out, d)) for d in ("code", "chat"))


def bills(state: Path) -> Counter:
    return Counter(x["prompt_key"] for x in read_ledger(state) if x["billed"])


@contextmanager
def tmpfs(path: Path, size: str):
    """A small filesystem of its own at `path` (root only: the test is skipped elsewhere)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(folder: Path) -> None:
    """Write a file in `folder` until its filesystem is full."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass


def test_a_second_run_02_on_the_same_run_refuses_naming_the_holder_and_nothing_is_paid_twice(tmp_path, api_key_file):
    """Against an http API (the emulator as its own process, as OpenRouter would be): the second
    `draftsmith run 02` stops before asking anything, naming the pid and host of the one writing."""
    key_path, key = api_key_file
    out, state = tmp_path / "outputs", tmp_path / "emu"
    cfg = load_config({**paced(3.0, credits=50.0), "model": MODEL}).model_dump_json()
    with emulator_process(state, cfg, {**os.environ, KEY_ENV: key}) as (_, base_url):
        cmd = stage_02(out, ("api_base", base_url), ("api_key_file", str(key_path)))
        first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)
        try:
            wait_until(lambda: saved_count(out), lambda n: n >= 1, what="the first run's first saved answer",
                       timeout_s=300, proc=first, interval_s=0.2)
            log = out / "smoke" / "logs" / "02_generate.log"
            logged = log.read_text()
            second = run_cli(cmd)
            assert log.read_text().startswith(logged), "the refused run emptied the first run's log"
            assert first.poll() is None, "the first run ended before the second tried: the test proves nothing"
            first_processes = {p.pid for p in psutil.Process(first.pid).children(recursive=True)}
            billed_during = sum(bills(state).values())
        finally:
            first.send_signal(signal.SIGTERM)
            first.communicate(timeout=120)
    assert second.returncode == 1, second.stderr[-3000:]
    m = re.search(r"is being generated by pid (\d+) on host (\S+)", second.stderr)
    assert m, second.stderr[-3000:]
    assert m.group(2) == socket.gethostname()
    assert "Traceback" not in second.stderr
    assert int(m.group(1)) in first_processes, "the holder named is not the first run's notebook kernel"
    assert billed_during >= 1
    paid = bills(state)
    prompts = Counter(stable_id(p.messages) for d in ("code", "chat")      # one prompt may be in both files
                      for p in DatasetReader(DatasetSpec(d, str(REPO / "data" / "demo" / f"{d}.jsonl"))))
    assert paid and all(n <= prompts[k] for k, n in paid.items()), "a prompt was paid for twice"
    sessions = json.loads((out / "smoke" / "generate" / "manifest.json").read_text())["sessions"]
    assert len(sessions) == 1, "the refused run left a session in the manifest"
    # what was billed is what the first run saved, and the answers it gave up on in flight when stopped
    assert saved_count(out) <= sum(paid.values()) <= saved_count(out) + sessions[0]["lost_answers"]


def test_a_disk_that_fills_up_stops_stage_02_with_what_was_paid_and_not_saved(tmp_path):
    """The run's generate/ folder on a small filesystem that another process fills mid-run: stage 02
    stops starting requests, exits 1 with one line that says what was paid for and not saved; the
    files hold only whole lines, and once space is freed the same command resumes without duplicates."""
    out = tmp_path / "outputs"
    emulator = ("emulator", paced(4.0))
    with tmpfs(out / "smoke" / "generate", "1m") as gen:
        cmd = stage_02(out, emulator)
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            wait_until(lambda: saved_count(out), lambda n: n >= 2, what="two saved answers", timeout_s=300,
                       proc=proc, interval_s=0.2)
            fill(gen)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 1, err[-3000:]
        line = next(x for x in err.splitlines() if "failed in cell" in x)
        assert "No space left on device" in line and "Paid for and not saved this session: $" in line, line
        assert "Traceback" not in err
        ledger = read_ledger(out / "smoke" / "emulator")
        saved = saved_count(out)          # every line whole (json.loads above would fail on a torn one)
        billed = [x for x in ledger if x["billed"]]
        assert len(billed) > saved, "nothing came back unsaved: the disk filled too late to test anything"
        unsaved = float(re.search(r"Paid for and not saved this session: \$([0-9.]+)", line).group(1))
        saved_cost = sum(r["usage"]["cost"] for d in ("code", "chat") for r in responses(out, d))
        # what was billed and not saved is in the figure (answers lost in flight at their worst case)
        assert unsaved >= sum(x["cost"] for x in billed) - saved_cost - 1e-4
        (gen / "filler").unlink()
        again = run_cli(stage_02(out, ("emulator", paced(400.0))))
        assert again.returncode == 0, again.stderr[-3000:]
        ids = [r["sample_id"] for d in ("code", "chat") for r in responses(out, d)]
        assert len(ids) == len(set(ids)) > saved


def test_a_disk_too_small_for_the_plan_is_refused_before_anything_is_asked(tmp_path):
    out = tmp_path / "outputs"
    with tmpfs(out / "smoke" / "generate", "64k"):
        r = run_cli(stage_02(out, ("emulator", paced(400.0))))
    assert r.returncode == 1, r.stderr[-3000:]
    line = next(x for x in r.stderr.splitlines() if "failed in cell" in x)
    assert "not enough free space" in line and "MB free" in line, line
    assert not [x for x in read_ledger(out / "smoke" / "emulator") if x["billed"]], "something was asked"


@pytest.mark.timeout(3600)  # three runs of stage 02: up to ten minutes each on a loaded 2-core box
def test_a_rerun_with_another_max_tokens_is_refused_naming_the_difference(tmp_path):
    out = tmp_path / "outputs"
    emulator = ("emulator", paced(400.0))
    first = run_cli(stage_02(out, emulator))
    assert first.returncode == 0, first.stderr[-3000:]
    ledger = out / "smoke" / "emulator"
    paid = len(read_ledger(ledger))
    changed = run_cli(stage_02(out, emulator, ("max_tokens", 16)))
    assert changed.returncode == 1, changed.stderr[-3000:]
    line = next(x for x in changed.stderr.splitlines() if "failed in cell" in x)
    assert "max_tokens: 48 -> 16" in line and "allow_changed_settings" in line, line
    assert len(read_ledger(ledger)) == paid, "the refused run asked for something"
    assert all(r["request"]["max_tokens"] == 48 for d in ("code", "chat") for r in responses(out, d))
    # saying so continues the run (its budgets are met already: nothing is asked) and records the change
    allowed = run_cli(stage_02(out, emulator, ("max_tokens", 16), ("allow_changed_settings", True)))
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    man = json.loads((out / "smoke" / "generate" / "manifest.json").read_text())
    assert man["sessions"][-1]["settings_changed"] == ["max_tokens: 48 -> 16 (datasets code, chat)"]
    assert man["settings"]["code"]["max_tokens"] == man["settings"]["chat"]["max_tokens"] == 16


@pytest.mark.unit
def test_each_changed_setting_is_named_and_a_template_that_cannot_be_read_is_not_compared(tmp_path):
    from draftsmith.generate.stage import chat_template_id, changes, data_settings

    sent = {"model": MODEL, "max_tokens": 48, "temperature": 1.0, "top_p": 1.0, "provider": {"only": ["a/int4"]}}
    old = data_settings(sent, ("int4", False), "tiny-test")
    assert changes(old, data_settings(sent, ("int4", False), "tiny-test")) == []
    new = data_settings({**sent, "temperature": 0.6, "reasoning": {"enabled": True}}, None, "tiny")
    assert changes(old, new) == [
        "temperature: 1.0 -> 0.6", 'reasoning: {} -> {"enabled": true}',
        'precision_policy: {"allow_unknown_quantization": false, "native_precision": "int4"} -> null',
        "chat_template: tiny-test -> tiny"]
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, text in ((a, "{{ messages }}"), (b, "{{ messages }}")):
        folder.mkdir()
        (folder / "chat_template.jinja").write_text(text)
    assert chat_template_id(str(a)) == chat_template_id(str(b)) != chat_template_id("tiny")   # same template, other path
    (tmp_path / "none").mkdir()
    assert changes(data_settings(sent, None, str(a)), data_settings(sent, None, str(tmp_path / "none"))) == []
