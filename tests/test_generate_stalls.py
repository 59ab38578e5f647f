"""Stage 02 never waits forever and counts every bill: through the function notebook 02 calls
(`generate.stage.run` with `api_base: local`, the emulator a child process as a user's is), against
providers that stall behind keep-alive, send bodies that are not UTF-8, or answer from the
response cache. The emulator's ledger is the referee of the money; its stalls last a minute, the
rules under test cut them in a second, so a rule that does not fire fails the test's counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import stage_config
from draftsmith.emulator import read_ledger, running
from draftsmith.generate import stage
from draftsmith.paths import Run

pytestmark = pytest.mark.emulator

FAST = dict(balance_poll_s=0.2, backoff_base_s=0.02, backoff_cap_s=0.2, recovery_patience_s=30.0)
TARGET = "tiny-test"   # built in seconds (the notebook's default, tiny, takes minutes)
STALL_S = 60.0      # how long a stalled provider keeps the connection alive (the emulator's `stall_s`)


def prompts(path: Path, n: int, tag: str) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{tag}-{i}", "messages": [
                {"role": "user", "content": f"[{tag}] Say something short about item {i}."}]}) + "\n")
    return path


def provider(**faults) -> list[dict]:
    return [{"slug": "stally", "name": "Stally", "quantization": "int4", "prompt_price": 0.5,
             "completion_price": 2.0, "faults": faults}]


def run_02(root: Path, name: str, path: Path, emulator: dict, logs: list | None = None, **params):
    """`generate.stage.run` as notebook 02 calls it, against the local emulator (a child process)."""
    emu = {"backend": "synthetic", "synthetic_tokens": 16, "time_scale": 0.0, "generation_delay_s": 0.1,
           "padding_interval_s": 0.05, "stall_s": STALL_S, **emulator}
    params = {"max_tokens": 24, "concurrency": 8, "spend_limit_usd": 5.0, "target_model_path": TARGET, **params}
    cfg = stage_config("02", api_base="local", emulator=emu, datasets=[{"name": "p", "path": str(path)}], **params)
    run = Run(root, name)
    return stage.run(run, cfg, log=(logs if logs is not None else []).append, **FAST), run


def rows(run: Run) -> list[dict]:
    path = run.dir("generate") / "p" / "raw_responses.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def ledger(run: Run) -> list[dict]:
    return read_ledger(run.dir("emulator"))


def assert_clean(saved: list[dict], n: int) -> None:
    assert len(saved) == n and len({r["sample_id"] for r in saved}) == n
    for r in saved:
        assert r["finish_reason"] in ("stop", "length") and r["usage"]["completion_tokens"] > 0
        assert "\ufffd" not in (r["content"] or "") + (r["reasoning"] or ""), "a body with bad bytes was kept"


def test_a_stream_stalled_behind_comments_is_cut_when_no_data_comes_and_the_run_finishes(tmp_path):
    """Comments every 0.05 s keep the socket busy (the read timeout never fires); a stream with no
    data chunk for request_timeout_s is given up, its bill asked, the prompt asked again."""
    r, run = run_02(tmp_path, "r", prompts(tmp_path / "p.jsonl", 40, "sstall"), {"providers": provider(stall=0.2)},
                    stream=True, request_timeout_s=0.5, request_deadline_s=30.0, max_attempts=20)
    assert r.complete, r.message
    assert_clean(rows(run), 40)
    stalls = [x for x in ledger(run) if x["error"] == "stall"]
    kinds = r.session["errors_by_kind"]
    # each stall was cut by the rule (a read timeout only if the loaded box held the comments back)
    assert stalls and kinds.get("stalled", 0) > 0 and kinds["stalled"] + kinds.get("timeout", 0) == len(stalls), kinds
    assert "stream_error" not in kinds and "deadline" not in kinds       # none waited out to the 524
    assert r.session["lost_answers_costed"] >= len(stalls) and r.session["unknown_bills"] == 0
    assert r.spent_usd == pytest.approx(sum(x["cost"] for x in ledger(run)), abs=1e-9)


def test_a_json_body_padded_while_stalled_is_cut_at_its_deadline_shown_as_waiting_on_padding(tmp_path, capsys,
                                                                                              monkeypatch):
    """Whitespace padding is normal while a provider generates, so a JSON request has a total
    deadline, by default request_timeout_s + max_tokens / 10 tokens/s; the progress line counts the
    requests waiting on padding alone longer than request_timeout_s."""
    monkeypatch.setenv("DRAFTSMITH_PROGRESS_INTERVAL", "0.2")
    r, run = run_02(tmp_path, "r", prompts(tmp_path / "p.jsonl", 40, "jstall"), {"providers": provider(stall=0.2)},
                    stream=False, request_timeout_s=1.0, max_tokens=24, max_attempts=20)
    assert r.complete, r.message
    assert r.session["request_deadline_s"] == pytest.approx(1.0 + 24 / 10)
    assert_clean(rows(run), 40)
    stalls = [x for x in ledger(run) if x["error"] == "stall"]
    kinds = r.session["errors_by_kind"]
    # padding keeps the socket busy: the deadline cut them (a read timeout only if the loaded box held it back)
    assert stalls and kinds.get("deadline", 0) > 0 and kinds["deadline"] + kinds.get("timeout", 0) == len(stalls), kinds
    assert "error_in_200" not in kinds                                   # none waited out to the 524
    assert r.session["lost_answers_costed"] >= len(stalls) and r.session["unknown_bills"] == 0
    assert r.spent_usd == pytest.approx(sum(x["cost"] for x in ledger(run)), abs=1e-9)
    out = capsys.readouterr().out
    waiting = [int(x.split("padding=")[1].split(",")[0].split()[0]) for x in out.splitlines() if "padding=" in x]
    assert waiting and max(waiting) > 0, out[-2000:]


@pytest.mark.parametrize("stream", [False, True])
def test_a_billed_body_that_is_not_utf8_is_asked_again_and_its_bill_counted(tmp_path, stream):
    r, run = run_02(tmp_path, "r", prompts(tmp_path / "p.jsonl", 40, f"bytes-{stream}"),
                    {"providers": provider(bad_bytes=0.25)}, stream=stream, request_timeout_s=5.0, max_attempts=20)
    assert r.complete, r.message
    assert_clean(rows(run), 40)
    spoiled = [x for x in ledger(run) if x["error"] == "bad_bytes"]
    assert spoiled and all(x["billed"] and x["cost"] > 0 for x in spoiled)
    assert r.session["errors_by_kind"].get("bad_bytes") == len(spoiled)
    assert r.session["unknown_bills"] == 0
    assert r.spent_usd == pytest.approx(sum(x["cost"] for x in ledger(run)), abs=1e-9)
    man = json.loads((run.dir("generate") / "manifest.json").read_text())
    assert man["spent_usd"] == pytest.approx(sum(x["cost"] for x in ledger(run)), abs=1e-7)


EVERY_FAULT = {"rate_limit": 0.05, "bad_gateway": 0.03, "unavailable": 0.03, "timeout": 0.03, "overloaded": 0.03,
               "error_200": 0.04, "mid_stream": 0.04, "empty_200": 0.04, "hang": 0.04, "cut_after_billing": 0.05,
               "stall": 0.05, "bad_bytes": 0.05}


@pytest.mark.parametrize("stream", [False, True])
def test_spend_equals_the_ledger_in_every_fault_mode(tmp_path, stream):
    emulator = {"providers": provider(**EVERY_FAULT), "hang_s": 1.0,
                "router_faults": {"temporarily_unavailable": 0.03, "no_endpoints": 0.03}}
    r, run = run_02(tmp_path, "r", prompts(tmp_path / "p.jsonl", 60, f"every-{stream}"), emulator, stream=stream,
                    request_timeout_s=0.4, request_deadline_s=2.0, max_attempts=30)
    assert r.complete, r.message
    assert_clean(rows(run), 60)
    lines = ledger(run)
    assert {"stall", "bad_bytes", "hang", "cut_after_billing"} <= {x["error"] for x in lines}
    assert r.session["unknown_bills"] == 0
    assert r.spent_usd == pytest.approx(sum(x["cost"] for x in lines), abs=1e-9)


def test_a_cached_reply_is_not_saved_as_a_new_sample(tmp_path):
    """Two runs over the same prompts on one account (`stage.run_at`, the function `stage.run`
    calls, on one emulator). With the cache on by the key's preset, the `X-OpenRouter-Cache: false`
    we send keeps it off: the second run gets answers of its own. With the cache on whatever the
    request says, every reply of the second run is a copy of the first run's, usage zeroed: none
    is saved, each is counted, its sample set aside for a re-run, and the run says why."""
    path = prompts(tmp_path / "p.jsonl", 12, "cache")
    for mode in ("preset", "always"):
        emu_cfg = {"backend": "synthetic", "target_model_path": TARGET, "synthetic_tokens": 16, "time_scale": 0.0, "providers": provider(),
                   "response_cache": mode}
        with running(emu_cfg, state_dir=tmp_path / mode / "emu") as emu:
            runs = []
            for name in ("first", "second"):
                cfg = stage_config("02", datasets=[{"name": "p", "path": str(path)}], max_tokens=24,
                                   concurrency=4, spend_limit_usd=5.0, max_attempts=2, target_model_path=TARGET)
                logs: list[str] = []
                run = Run(tmp_path / mode, name)
                r = stage.run_at(emu.base_url, emu.key, run, cfg, **FAST, log=logs.append)
                runs.append((r, run, logs))
            lines = emu.ledger_lines()
        (first, run1, _), (second, run2, logs) = runs
        assert first.complete and len(rows(run1)) == 12
        assert "cached" not in first.session["errors_by_kind"]
        hits = [x for x in lines if x["error"] == "cache_hit"]
        assert second.spent_usd + first.spent_usd == pytest.approx(sum(x["cost"] for x in lines), abs=1e-9)
        if mode == "preset":
            assert not hits and second.complete and len(rows(run2)) == 12
            assert "cached" not in second.session["errors_by_kind"]
            continue
        assert len(hits) == 2 * 12 and all(x["cost"] == 0 for x in hits)
        assert rows(run2) == [] and second.session["errors_by_kind"]["cached"] == 2 * 12
        assert second.spent_usd == pytest.approx(0.0, abs=1e-12)
        errors = [json.loads(x) for x in (run2.dir("generate") / "p" / "errors.jsonl").read_text().splitlines()]
        assert len(errors) == 12 and {(e["kind"], e["action"]) for e in errors} == {("cached", "exhausted")}
        assert "response cache" in second.message, second.message
