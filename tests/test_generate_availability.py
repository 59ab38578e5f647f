"""Stage 02 against OpenRouter's availability errors (the August 2026 contract), end to end through
the emulator: retryable ones are waited out without spending attempts, a router-wide outage is
ridden out or, past `outage_limit_s`, stops the run cleanly for a re-run; a model the router no
longer knows stops the run at once; 402s are told apart by `limit_source`. The emulator's ledger
is the referee for "nothing paid for is lost, nothing is paid twice".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.emulator import running
from test_generate_e2e import MODEL, assert_whole_and_unique, billed, emu_config, generate, prompt_keys, \
    prompts_file, saved

pytestmark = pytest.mark.emulator


# a loaded 2-core box may take seconds to answer: a read timeout here would be a real failure
PATIENT = dict(request_timeout_s=60.0)
# two endpoints without provider quirks or faults: every failure here is the router's
PLAIN = [{"slug": s, "name": s.title(), "quantization": "int4", "prompt_price": 0.5, "completion_price": 2.0}
         for s in ("alpha", "beta")]


def two_datasets(tmp_path: Path, n: int, tag: str) -> tuple[list[dict], dict[str, str]]:
    ds, keys = [], {}
    for name in ("a", "b"):
        path = prompts_file(tmp_path / f"{name}.jsonl", n, f"{tag}-{name}")
        ds.append({"name": name, "path": str(path)})
        keys |= prompt_keys(path, name)
    return ds, keys


def errors_written(tmp_path: Path) -> list[dict]:
    out = []
    for name in ("a", "b"):
        path = tmp_path / "r" / "generate" / name / "errors.jsonl"
        out += [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return out


def all_saved(tmp_path: Path) -> list[dict]:
    return saved(tmp_path, "a") + saved(tmp_path, "b")


def test_retryable_404_and_503_are_waited_out_and_every_prompt_is_answered_in_one_run(tmp_path):
    # one attempt per sample: a retryable error that spent it would write the sample off
    cfg = emu_config(router_faults={"temporarily_unavailable": 0.15, "no_endpoints": 0.1}, fault_scale=0.0,
                     providers=PLAIN)
    ds, keys = two_datasets(tmp_path, 60, "blip")
    with running(cfg, state_dir=tmp_path / "emu") as emu:
        r = generate(emu, tmp_path, ds, max_attempts=1, **PATIENT)
        assert r.complete, r.message
        kinds = r.session["errors_by_kind"]
        assert kinds.get("http_404", 0) > 0 and kinds.get("http_503", 0) > 0, kinds
        rows = all_saved(tmp_path)
        assert_whole_and_unique(rows)
        assert len(rows) == 120 and not errors_written(tmp_path)
        assert sorted(billed(emu).elements()) == sorted(keys.values())


def test_an_outage_shorter_than_the_limit_is_ridden_out(tmp_path):
    cfg = emu_config(router_faults={"outage_after": 30, "outage_s": 1.0}, fault_scale=0.0, providers=PLAIN)
    ds, keys = two_datasets(tmp_path, 60, "short")
    with running(cfg, state_dir=tmp_path / "emu") as emu:
        r = generate(emu, tmp_path, ds, max_attempts=2, outage_limit_s=20.0, **PATIENT)
        assert r.complete, r.message
        assert r.session["errors_by_kind"].get("http_503", 0) > 8     # the outage was met, many times over
        assert len(all_saved(tmp_path)) == 120 and not errors_written(tmp_path)
        assert sorted(billed(emu).elements()) == sorted(keys.values())


def test_a_longer_outage_stops_cleanly_and_the_rerun_finishes_with_nothing_lost_or_paid_twice(tmp_path):
    ds, keys = two_datasets(tmp_path, 60, "long")
    down = emu_config(router_faults={"outage_after": 30, "outage_s": 600.0}, fault_scale=0.0, providers=PLAIN)
    with running(down, state_dir=tmp_path / "emu") as emu:
        r = generate(emu, tmp_path, ds, max_attempts=2, outage_limit_s=1.0, **PATIENT)
        assert (r.status, r.reason) == ("stopped", "unavailable"), r.message
        assert "retryable availability errors" in r.message and "outage_limit_s" in r.message
        first = all_saved(tmp_path)
        assert 0 < len(first) < 120 and not errors_written(tmp_path)     # nothing written off
    with running(emu_config(fault_scale=0.0, providers=PLAIN), state_dir=tmp_path / "emu") as emu:
        r = generate(emu, tmp_path, ds, max_attempts=2, outage_limit_s=1.0, **PATIENT)
        assert r.complete, r.message
        assert r.session["samples"] == 120 - len(first)
        rows = all_saved(tmp_path)
        assert_whole_and_unique(rows)
        assert len(rows) == 120
        # every prompt billed exactly once over both runs, and the run's spend is the ledger's
        assert sorted(billed(emu).elements()) == sorted(keys.values())
        assert r.spent_usd == pytest.approx(sum(x["cost"] for x in emu.ledger_lines()), abs=1e-9)


def test_model_not_found_stops_at_once_naming_the_model_and_writes_nothing_off(tmp_path):
    """The router stops knowing the model mid-run (400 `model_not_found`, not retryable): the run
    stops with the slug in its message, asking no more than the requests already in flight, and
    no sample goes to errors.jsonl; once the model is served again the re-run answers every prompt."""
    ds, keys = two_datasets(tmp_path, 60, "gone")
    gone = emu_config(router_faults={"outage_after": 20, "outage_s": 600.0, "outage_code": "model_not_found"},
                      fault_scale=0.0, providers=PLAIN)
    with running(gone, state_dir=tmp_path / "emu") as emu:
        r = generate(emu, tmp_path, ds, concurrency=8, **PATIENT)
        assert (r.status, r.reason) == ("stopped", "fatal"), r.message
        assert "model_not_found" in r.message and MODEL in r.message
        refused = r.session["errors_by_kind"]["model_not_found"]
        assert 1 <= refused <= 8                    # the requests in flight at the stop, never a retry
        assert not errors_written(tmp_path)
        first = all_saved(tmp_path)
    with running(emu_config(fault_scale=0.0, providers=PLAIN), state_dir=tmp_path / "emu") as emu:
        r = generate(emu, tmp_path, ds, concurrency=8, **PATIENT)
        assert r.complete, r.message
        assert r.session["samples"] == 120 - len(first) and len(all_saved(tmp_path)) == 120
        assert sorted(billed(emu).elements()) == sorted(keys.values())


def test_an_in_flight_402_throttles_and_a_credits_402_stops(tmp_path):
    """Both 402s read "can only afford"; only `limit_source` tells the in-flight budget (wait) from
    the balance (stop). The balance is hidden from the key, so the API's 402 is what the run meets."""
    slow = [{"slug": "slow", "name": "Slow", "quantization": "int4", "prompt_price": 0.5, "completion_price": 2.0,
             "latency_s": {"median": 0.3, "sigma": 0.0}}]      # requests overlap: 32 in flight want ~$0.003
    hidden = dict(fault_scale=0.0, key_capped=False, credits_need_management_key=True)
    path = prompts_file(tmp_path / "p.jsonl", 50, "inflight")
    with running(emu_config(credits=1.0, in_flight_budget=0.002, providers=slow, time_scale=1.0, **hidden),
                 state_dir=tmp_path / "emu") as emu:
        r = generate(emu, tmp_path, [{"name": "p", "path": str(path)}], concurrency=32, max_attempts=1, **PATIENT)
        assert r.complete, r.message
        assert r.session["errors_by_kind"].get("in_flight_budget", 0) > 0 and r.session["concurrency_cuts"] >= 1
        assert len(saved(tmp_path, "p")) == 50
    poor = tmp_path / "poor"
    path = prompts_file(tmp_path / "q.jsonl", 300, "afford")
    plain = [{k: v for k, v in slow[0].items() if k != "latency_s"}]     # no provider quirks: every answer is data
    with running(emu_config(credits=0.01, in_flight_budget=None, providers=plain, **hidden),
                 state_dir=poor / "emu") as emu:
        r = generate(emu, poor, [{"name": "q", "path": str(path)}], concurrency=16, **PATIENT)
        assert r.reason == "balance" and "can only afford" in r.message, r.message
        rows = saved(poor, "q")
        assert_whole_and_unique(rows)
        keys = prompt_keys(path, "q")
        assert sorted(billed(emu).elements()) == sorted(keys[x["sample_id"]] for x in rows)


@pytest.mark.notebook
def test_the_notebook_parameter_stops_stage_02_in_an_outage_and_says_so(tmp_path, api_key_file):
    """`draftsmith run 02 -p outage_limit_s 1` against an emulator whose router is down: the stage
    fails with the outage message, nothing is written off, and the manifest says why it stopped."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "outputs"
    emulator = json.dumps({"backend": "synthetic", "synthetic_tokens": 24,
                           "router_faults": {"outage_after": 5, "outage_s": 600}})
    cmd = [str(Path(sys.executable).with_name("draftsmith")), "run", "02", "-f", "params/smoke.yaml",
           "-p", "outputs_dir", str(out), "-p", "api_key_file", str(api_key_file[0]), "-p", "emulator", emulator,
           "-p", "outage_limit_s", "1", "-p", "stop_grace_s", "5"]
    p = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "outage_limit_s = 1s" in p.stderr, p.stderr[-3000:]
    generate = out / "smoke" / "generate"
    manifest = json.loads((generate / "manifest.json").read_text())
    assert manifest["sessions"][-1]["status"] == "unavailable"
    assert not list(generate.glob("*/errors.jsonl")) or all(not f.read_text() for f in generate.glob("*/errors.jsonl"))
