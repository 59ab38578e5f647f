"""generate/outputs.py: whole lines only, completed ids remembered, nothing written twice, manifest sessions."""

import json

import pytest

from draftsmith.generate import outputs as store
from draftsmith.files import repair_tail
from draftsmith.paths import Run
from draftsmith.generate.outputs import DatasetStore, Manifest

pytestmark = pytest.mark.unit


def line(sid, tokens=10, cost=0.001, provider="P", finish="stop"):
    return json.dumps({"sample_id": sid, "dataset": "d", "content": "x", "finish_reason": finish, "provider": provider,
                       "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "reasoning_tokens": 0, "cost": cost},
                       "started_at": 100.0, "completed_at": 102.5})


def test_torn_last_line_is_cut_and_ids_reloaded(tmp_path):
    d = tmp_path / "ds"
    s = DatasetStore(d)
    s.write("a", line("a"))
    s.write("b", line("b", tokens=20, provider="Q", finish="length"))
    s.close()
    with open(d / "raw_responses.jsonl", "a") as f:
        f.write(line("c")[:25])                       # a kill in the middle of a write
    s = DatasetStore(d)
    assert s.done == {"a", "b"} and any("torn" in n for n in s.notes)
    assert (d / "raw_responses.jsonl").read_text().endswith("\n")
    assert s.totals.samples == 2 and s.totals.completion_tokens == 30 and s.totals.length_finishes == 1
    assert set(s.providers) == {"P", "Q"} and s.lengths == [(2.5, 10), (2.5, 20)]
    s.write("c", line("c"))
    s.close()
    ids = [json.loads(x)["sample_id"] for x in (d / "raw_responses.jsonl").read_text().splitlines()]
    assert ids == ["a", "b", "c"]


def test_whole_line_missing_only_its_newline_is_kept(tmp_path):
    p = tmp_path / "raw_responses.jsonl"
    p.write_text(line("a") + "\n" + line("b"))
    assert "completed" in repair_tail(p)
    assert [json.loads(x)["sample_id"] for x in p.read_text().splitlines()] == ["a", "b"]
    assert repair_tail(p) is None


def test_torn_only_line_leaves_an_empty_file(tmp_path):
    p = tmp_path / "raw_responses.jsonl"
    p.write_text('{"sample_id": "a", "cont')
    repair_tail(p)
    assert p.read_text() == ""


def test_a_sample_is_never_written_twice(tmp_path):
    s = DatasetStore(tmp_path)
    s.write("a", line("a"))
    with pytest.raises(RuntimeError, match="already"):
        s.write("a", line("a"))
    s.close()


def test_damaged_middle_line_is_reported_with_file_and_line(tmp_path):
    p = tmp_path / "raw_responses.jsonl"
    p.write_text(line("a") + "\n{oops\n" + line("b") + "\n")
    with pytest.raises(ValueError, match=r"raw_responses.jsonl:2: not valid JSON"):
        DatasetStore(tmp_path)


def test_repeated_id_in_file_is_noted_and_counted_once(tmp_path):
    (tmp_path / "raw_responses.jsonl").write_text(line("a") + "\n" + line("a") + "\n")
    s = DatasetStore(tmp_path)
    assert s.done == {"a"} and s.totals.samples == 1 and any("repeats" in n for n in s.notes)
    s.close()


def test_permanent_failures_are_skipped_exhausted_ones_retried(tmp_path):
    s = DatasetStore(tmp_path)
    s.write_error({"sample_id": "x", "action": "permanent", "kind": "bad_request"})
    s.write_error({"sample_id": "y", "action": "exhausted", "kind": "http_429"})
    s.close()
    s = DatasetStore(tmp_path)
    assert set(s.permanent) == {"x"} and s.failed_for_good("x", "h-any") and not s.failed_for_good("y", "h-any")
    s.close()


def test_a_failure_for_good_holds_only_for_the_words_it_failed_in(tmp_path):
    s = DatasetStore(tmp_path)
    s.write_error({"sample_id": "x", "prompt_hash": "h1", "action": "permanent", "kind": "too_long"})
    assert s.failed_for_good("x", "h1") and not s.failed_for_good("x", "h2")
    s.close()
    s = DatasetStore(tmp_path)
    assert s.failed_for_good("x", "h1") and not s.failed_for_good("x", "h2")   # reworded: asked again
    s.write("x", json.dumps({"sample_id": "x", "prompt_hash": "h2"}))
    assert not s.failed_for_good("x", "h2") and not s.permanent
    s.close()


def test_manifest_marks_a_killed_session_and_counts_its_reservations(tmp_path):
    path = tmp_path / "manifest.json"
    m = Manifest.open(path)
    m.sessions.append({"status": "running", "reserved_usd": 0.25, "failed_attempts_cost": 0.01,
                       "errors_by_kind": {"http_429": 3}})
    m.write({"x": 1}, {}, {}, 1.0)
    m = Manifest.open(path)
    assert m.sessions[0]["status"] == "killed"
    assert m.spent_outside_responses == pytest.approx(0.26)
    m.sessions.append({"status": "finished", "errors_by_kind": {"http_429": 1, "timeout": 2}})
    m.write({"x": 1}, {}, {}, 2.0)
    data = json.loads(path.read_text())
    assert data["errors_by_kind"] == {"http_429": 4, "timeout": 2} and len(data["sessions"]) == 2
    assert not (tmp_path / "manifest.json.tmp").exists()


def test_readers_find_what_the_writers_wrote_and_leave_out_a_torn_tail(tmp_path):
    run = Run(tmp_path, "r")
    s = store.open_dataset(run, "code")
    s.write("a", line("a"))
    s.write_error({"sample_id": "x", "action": "permanent", "kind": "bad_request"})
    s.close()
    with open(store.responses_file(run, "code"), "a") as f:
        f.write(line("b")[:30])                       # stage 02 killed mid-line, or still writing
    assert [r["sample_id"] for _, r in store.read_responses(run, "code")] == ["a"]
    assert [e["sample_id"] for _, e in store.read_errors(run, "code")] == ["x"]
    assert list(store.read_responses(run, "chat")) == [] and store.saved_datasets(run) == ["code"]
    tl = store.open_timeline(run)
    tl.append({"t": 1.0, "session": 1})
    tl.close()
    with open(run.root / "generate" / "timeline.jsonl", "a") as f:
        f.write('{"t": 2.')                           # a killed session's last point
    tl = store.open_timeline(run)
    tl.append({"t": 3.0, "session": 2})
    tl.close()
    assert [p["t"] for p in store.read_timeline(run)] == [1.0, 3.0]


def test_damage_inside_a_file_is_named_by_file_and_line(tmp_path):
    run = Run(tmp_path, "r")
    path = store.responses_file(run, "code")
    path.parent.mkdir(parents=True)
    path.write_text(line("a") + "\n{oops\n" + line("b") + "\n")
    with pytest.raises(ValueError, match=r"code/raw_responses.jsonl:2: not valid JSON"):
        list(store.read_responses(run, "code"))


def test_manifest_is_read_back_whole_and_a_damaged_one_is_named(tmp_path):
    run = Run(tmp_path, "r")
    assert store.read_manifest(run) == {}
    m = store.open_manifest(run)
    m.sessions.append({"status": "finished"})
    m.write({"x": 1}, {"code": {"samples": 1}}, {}, 0.5)
    got = store.read_manifest(run)
    assert got["config"] == {"x": 1} and got["spent_usd"] == 0.5 and got["sessions"] == [{"status": "finished"}]
    (run.root / "generate" / "manifest.json").write_text('{"config": ')
    with pytest.raises(ValueError, match=r"manifest.json: not valid JSON"):
        store.read_manifest(run)


HOLD = """
import sys, time
from draftsmith.generate import outputs as store
from draftsmith.paths import Run
with store.writer_lock(Run(sys.argv[1], "r")):
    print("held", flush=True)
    time.sleep(600)
"""


def test_the_writer_lock_names_its_holder_and_dies_with_it(tmp_path):
    import os
    import signal
    import socket
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(store.RunBusy, match=f"pid {child.pid} on host {socket.gethostname()}"):
            with store.writer_lock(Run(tmp_path, "r")):
                pass
    finally:
        os.kill(child.pid, signal.SIGKILL)      # no clean exit: nothing is left to clean up by hand
        child.wait()
    run = Run(tmp_path, "r")
    with store.writer_lock(run):
        with store.writer_lock(run):            # the same process may take it again (notebook, then library)
            pass


PARTIAL = """
import resource, signal, sys
from draftsmith.generate.outputs import DatasetStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # past the size limit a write fails (EFBIG) instead
s = DatasetStore(sys.argv[1], fsync_s=1e9)
resource.setrlimit(resource.RLIMIT_FSIZE, (250, resource.RLIM_INFINITY))
for i in range(5):
    try:
        s.write(f"s{i}", '{"sample_id": "s%d", "pad": "%s"}' % (i, "x" * 70))
    except OSError as e:
        print("refused", i, e.errno, flush=True)
        break
"""


def test_a_line_the_disk_takes_only_in_part_is_cut_off_again(tmp_path):
    """A file-size limit stands in for a full disk: the OS takes part of the third line, then refuses."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", PARTIAL, str(tmp_path / "d")], capture_output=True, text=True, timeout=60)
    assert r.stdout.startswith("refused 2"), r.stdout + r.stderr
    text = (tmp_path / "d" / store.RESPONSES).read_text()
    assert text.endswith("\n") and [json.loads(x)["sample_id"] for x in text.splitlines()] == ["s0", "s1"]
    assert DatasetStore(tmp_path / "d").done == {"s0", "s1"}


def test_room_is_refused_naming_what_the_plan_needs_and_what_is_free(tmp_path):
    import shutil

    free = shutil.disk_usage(tmp_path).free
    assert store.room_problem(tmp_path, 1000) is None
    problem = store.room_problem(tmp_path, free * 2)
    assert "not enough free space" in problem and str(tmp_path) in problem and "free" in problem
    assert store.expected_bytes(prompt_bytes=200, responses=10, tokens=1000) > 10 * 200 + 1000


def test_answers_set_aside_count_in_spend_not_in_what_is_passed_on(tmp_path):
    (tmp_path / store.SUPERSEDED).write_text(
        json.dumps({**json.loads(line("old", cost=0.25)), "set_aside": {"reason": "reworded", "time": 1.0}}) + "\n")
    s = DatasetStore(tmp_path)
    s.write("a", line("a", cost=0.5))
    s.close()
    s = DatasetStore(tmp_path)
    assert s.done == {"a"} and s.totals.samples == 1 and s.totals.cost == 0.5
    assert s.set_aside.samples == 1 and s.set_aside.cost == 0.25
    s.close()
