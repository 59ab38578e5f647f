"""Stage 02 end to end against the local emulator: budgets, faults, the money running out, stops,
kills and resumes. The emulator's ledger (every request a provider billed, keyed by the prompt)
is the referee for "nothing paid for is lost, nothing is paid twice".

The emulator runs in this process (a background thread); runs that are killed or signalled run
in a child process, as a user's would.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from draftsmith.openrouter.apikey import ApiKey
from draftsmith.datasets import DatasetReader, DatasetSpec, stable_id
from draftsmith.emulator import running
from draftsmith.generate.session import GenerationStopped
from draftsmith.paths import Run

from conftest import stage_02_at, wait_until

pytestmark = pytest.mark.emulator

MODEL = "moonshotai/kimi-k2.5"
CONTRACT = {"sample_id", "dataset", "messages", "content", "reasoning", "finish_reason", "native_finish_reason",
            "provider", "model", "generation_id", "usage", "request", "attempts", "latency_s"}
FAST = dict(balance_poll_s=0.2, backoff_base_s=0.02, backoff_cap_s=0.3, request_timeout_s=3.0, stop_grace_s=5.0)


def prompts_file(path: Path, n: int, tag: str, long_every: int = 0) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{tag}-{i}", "messages": [
                {"role": "user", "content": f"[{tag}] Tell me about item {i} in a few words."}]}) + "\n")
    return path


def emu_config(**kw) -> dict:
    cfg = {"backend": "synthetic", "time_scale": 0.0, "synthetic_tokens": 20, "hang_s": 1.0}
    cfg.update(kw)
    return cfg


def generate(emu, root: Path, datasets: list[dict], key=None, **kw):
    logs: list[str] = []
    args = dict(model=MODEL, max_tokens=32, concurrency=8, spend_limit_usd=5.0, log=logs.append,
                native_precision="int4", **FAST)
    args.update(kw)
    r = stage_02_at(emu.base_url, key or emu.key, Run(root, "r"), datasets, **args)
    r.logs = logs
    return r


def saved(root: Path, name: str) -> list[dict]:
    path = root / "r" / "generate" / name / "raw_responses.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def prompt_keys(path: Path, name: str) -> dict[str, str]:
    """sample id -> the emulator ledger's prompt_key of its prompt."""
    return {p.sample_id: stable_id(p.messages) for p in DatasetReader(DatasetSpec(name, str(path)))}


def billed(emu) -> Counter:
    return Counter(x["prompt_key"] for x in emu.ledger_lines() if x["billed"])


def assert_whole_and_unique(rows: list[dict]) -> None:
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a sample was written twice"
    for r in rows:
        assert CONTRACT <= set(r), CONTRACT - set(r)
        assert r["finish_reason"] in ("stop", "length"), r["finish_reason"]
        # no text at all is kept only as a billed full-length answer: max_tokens ran out inside reasoning
        # the provider withheld (the emulator's SiliconFlow drops it; test_client pins the rule)
        assert r["content"] or r["reasoning"] or (r["finish_reason"] == "length" and r["usage"]["completion_tokens"]), \
            "an empty or error body was kept as data"
        assert set(r["usage"]) >= {"prompt_tokens", "completion_tokens", "reasoning_tokens", "cost"}


@pytest.fixture(scope="module")
def shared_emu(tmp_path_factory):
    with running(emu_config(credits=100.0), state_dir=tmp_path_factory.mktemp("emu")) as emu:
        yield emu


def test_budgets_filled_once_each_and_a_rerun_costs_nothing(shared_emu, tmp_path):
    """Two datasets share 16 slots; background faults; each budget met within max(1%, max_tokens)."""
    a = prompts_file(tmp_path / "a.jsonl", 200, "budget-a")
    b = prompts_file(tmp_path / "b.jsonl", 200, "budget-b")
    datasets = [{"name": "a", "path": str(a), "output_token_budget": 1500},
                {"name": "b", "path": str(b), "output_token_budget": 800}]
    r = generate(shared_emu, tmp_path, datasets, concurrency=16, max_tokens=48)
    assert r.complete and r.reason == "finished", r.message
    keys = {**prompt_keys(a, "a"), **prompt_keys(b, "b")}
    for name, budget in (("a", 1500), ("b", 800)):
        rows = saved(tmp_path, name)
        assert_whole_and_unique(rows)
        tokens = sum(x["usage"]["completion_tokens"] for x in rows)
        assert budget - 48 < tokens <= budget + 48, (name, tokens)
        assert r.datasets[name]["completion_tokens"] == tokens and r.datasets[name]["samples"] == len(rows)
        assert all(x["request"]["max_tokens"] == 48 for x in rows)
    # paid exactly once for every saved sample, for nothing else
    mine = {k for k in keys.values()}
    bills = Counter({k: n for k, n in billed(shared_emu).items() if k in mine})
    saved_keys = [keys[x["sample_id"]] for name in "ab" for x in saved(tmp_path, name)]
    assert sorted(bills.elements()) == sorted(saved_keys)
    ledger_cost = sum(x["cost"] for x in shared_emu.ledger_lines() if x["prompt_key"] in mine)
    assert r.spent_usd == pytest.approx(ledger_cost, rel=1e-6) and r.spent_usd <= 5.0
    man = json.loads((tmp_path / "r" / "generate" / "manifest.json").read_text())
    assert "key" not in json.dumps(man["config"]).lower().replace("key_source", "")
    assert sum(p["samples"] for p in man["providers"].values()) == len(saved_keys)

    again = generate(shared_emu, tmp_path, datasets, concurrency=16, max_tokens=48)
    assert again.reason == "nothing_to_do" and again.complete
    assert sum(n for k, n in billed(shared_emu).items() if k in mine) == len(saved_keys)
    man = json.loads((tmp_path / "r" / "generate" / "manifest.json").read_text())
    assert [s["status"] for s in man["sessions"]] == ["finished", "nothing_to_do"]


STORM = {"rate_limit": 0.25, "bad_gateway": 0.05, "unavailable": 0.05, "timeout": 0.03, "overloaded": 0.03,
         "error_200": 0.06, "mid_stream": 0.08, "empty_200": 0.06, "hang": 0.06}


@pytest.mark.parametrize("stream", [False, True])
def test_a_storm_of_faults_still_completes(tmp_path, stream):
    """429s with Retry-After (from faults and from a provider at capacity), 5xx, errors inside 200
    bodies and streams, empty 200s and hung connections: every prompt ends saved exactly once,
    no error body is kept as data, and the concurrency was cut under the 429s."""
    providers = [{"slug": s, "name": s.title(), "quantization": "int4", "prompt_price": 0.5,
                  "completion_price": 2.0, "capacity": 6, "retry_after_s": 0.3, "faults": STORM}
                 for s in ("alpha", "beta")]
    with running(emu_config(providers=providers, hang_s=2.5, time_scale=0.2,
                            stream_interval_s=0.05), state_dir=tmp_path / "emu") as emu:
        path = prompts_file(tmp_path / "p.jsonl", 50, f"storm-{stream}")
        # the read timeout is well above a response's time (~0.3 s), below a hang's (2.5 s): a
        # timeout that cut off a live non-streamed response would be billed twice (and rightly fail below)
        r = generate(emu, tmp_path, [{"name": "p", "path": str(path)}], concurrency=16, stream=stream,
                     max_attempts=30, request_timeout_s=1.5)
        assert r.complete, r.message
        rows = saved(tmp_path, "p")
        assert_whole_and_unique(rows)
        assert len(rows) == 50
        kinds = r.session["errors_by_kind"]
        # a hung stream is cut by the read timeout or, as early, by the rule of no data chunk for as long
        hung = kinds.get("timeout", 0) + kinds.get("stalled", 0)
        assert kinds.get("http_429", 0) > 0 and hung > 0 and kinds.get("empty", 0) > 0
        assert kinds.get("stream_error" if stream else "error_in_200", 0) > 0
        assert r.session["concurrency_cuts"] >= 1
        # hung and cut answers are billed (OpenRouter bills a request the client gave up on): every
        # such bill was asked of /generation and counted, so the run's spend is the ledger's
        ledger = sum(x["cost"] for x in emu.ledger_lines())
        assert r.spent_usd == pytest.approx(ledger, abs=1e-9)


def test_samples_out_of_attempts_go_to_errors_and_a_rerun_retries_them(tmp_path):
    one = [{"slug": "flaky", "name": "Flaky", "quantization": "int4", "prompt_price": 0.5, "completion_price": 2.0,
            "faults": {"error_200": 0.6}}]
    path = prompts_file(tmp_path / "p.jsonl", 40, "exhaust")
    ds = [{"name": "p", "path": str(path)}]
    with running(emu_config(providers=one), state_dir=tmp_path / "emu") as emu:
        r = generate(emu, tmp_path, ds, max_attempts=2)
    assert r.complete and r.session["exhausted_samples"] > 0
    n = r.session["exhausted_samples"]
    assert r.message.endswith(f"{n} samples were GIVEN UP after 2 failed attempts each (errors.jsonl); "
                              "a re-run tries them again."), r.message
    err = [json.loads(x) for x in (tmp_path / "r/generate/p/errors.jsonl").read_text().splitlines()]
    assert {e["action"] for e in err} == {"exhausted"} and {e["kind"] for e in err} == {"error_in_200"}
    assert len(saved(tmp_path, "p")) == 40 - len(err)
    with running(emu_config(providers=one, fault_scale=0.0), state_dir=tmp_path / "emu") as emu:
        r = generate(emu, tmp_path, ds, max_attempts=2)
        assert r.complete and r.session["samples"] == len(err)
        rows = saved(tmp_path, "p")
        assert_whole_and_unique(rows)
        assert len(rows) == 40 and max(billed(emu).values()) == 1


def test_balance_runs_out_then_top_up_finishes(tmp_path):
    with running(emu_config(credits=0.01, fault_scale=0.0), state_dir=tmp_path / "emu") as emu:
        path = prompts_file(tmp_path / "p.jsonl", 300, "balance")
        ds = [{"name": "p", "path": str(path)}]
        r = generate(emu, tmp_path, ds, concurrency=16)
        assert r.reason == "balance" and not r.complete
        for words in ("balance", "spent $", "Done so far", "re-run", "resumes"):
            assert words in r.message, (words, r.message)
        with pytest.raises(GenerationStopped, match="balance"):
            r.raise_if_incomplete()
        rows = saved(tmp_path, "p")
        assert_whole_and_unique(rows)
        keys = prompt_keys(path, "p")
        assert 0 < len(rows) < 300
        assert sorted(billed(emu).elements()) == sorted(keys[x["sample_id"]] for x in rows)  # nothing paid is lost
        assert sum(x["cost"] for x in emu.ledger_lines()) <= 0.01

        emu.top_up(1.0)
        r2 = generate(emu, tmp_path, ds, concurrency=16)
        assert r2.complete, r2.message
        rows = saved(tmp_path, "p")
        assert_whole_and_unique(rows)
        assert len(rows) == 300 and max(billed(emu).values()) == 1


def test_bad_key_or_unroutable_provider_stops_with_the_reason(shared_emu, tmp_path):
    path = prompts_file(tmp_path / "p.jsonl", 20, "fatal")
    ds = [{"name": "p", "path": str(path)}]
    r = generate(shared_emu, tmp_path / "k", ds, key=ApiKey("sk-or-v1-wrong", "test"))
    assert r.reason == "fatal" and "api_key_file" in r.message
    r = generate(shared_emu, tmp_path / "p", ds, provider={"only": ["nobody"]})
    assert r.reason == "fatal" and "provider" in r.message and "no endpoint" in r.message
    assert not saved(tmp_path / "p", "p")


def test_a_session_runs_fewer_garbage_collections_and_gives_the_collector_back_as_it_was(shared_emu, tmp_path):
    """While stage 02 runs, what was alive at its start is frozen and young collections are rarer
    (session.fewer_collections); after it, the process's collector is as it was, even when the
    session ends on a stop."""
    import gc

    from draftsmith.generate.session import GC_GEN0_THRESHOLD

    path = prompts_file(tmp_path / "p.jsonl", 20, "gc")
    before = gc.get_threshold(), gc.get_freeze_count()
    during = []
    r = generate(shared_emu, tmp_path, [{"name": "p", "path": str(path)}], key=ApiKey("sk-or-v1-wrong", "test"),
                 log=lambda m: during.append((m, gc.get_threshold(), gc.get_freeze_count())))
    assert r.reason == "fatal"
    stop = [d for d in during if d[0].startswith("stopping:")]
    assert stop and stop[0][1][0] == max(before[0][0], GC_GEN0_THRESHOLD) and stop[0][2] > before[1], during
    assert (gc.get_threshold(), gc.get_freeze_count()) == before


def test_too_long_prompts_skipped_and_malformed_rows_reported(tiny_target, tmp_path):
    providers = [{"slug": "small", "name": "Small", "quantization": "int4", "prompt_price": 0.5,
                  "completion_price": 2.0, "context_length": 400}]
    with running(emu_config(providers=providers, fault_scale=0.0), state_dir=tmp_path / "emu") as emu:
        path = tmp_path / "p.jsonl"
        rows = [{"id": "ok-1", "messages": [{"role": "user", "content": "short"}]},
                {"id": "long", "messages": [{"role": "user", "content": "word " * 2000}]},
                {"id": "bad", "messages": "not a list"},
                {"id": "ok-2", "messages": [{"role": "user", "content": "also short"}]}]
        path.write_text("\n".join(json.dumps(x) for x in rows) + "\n{torn\n")
        ds = [{"name": "p", "path": str(path)}]
        r = generate(emu, tmp_path / "tok", ds, target_model_path=str(tiny_target))
        assert r.complete
        assert {x["sample_id"] for x in saved(tmp_path / "tok", "p")} == {"ok-1", "ok-2"}
        err = [json.loads(x) for x in (tmp_path / "tok/r/generate/p/errors.jsonl").read_text().splitlines()]
        assert [(e["sample_id"], e["kind"]) for e in err] == [("long", "too_long")]
        assert "does not fit the context" in err[0]["message"]
        malformed = r.session["malformed_rows"]["p"]
        assert any(f"{path}:3:" in m for m in malformed) and any(f"{path}:5:" in m for m in malformed)
        assert any(f"{path}:3:" in line for line in r.logs)
        # without a tokenizer the API's 400 says it: a permanent failure, not retried by a re-run
        r = generate(emu, tmp_path / "api", ds)
        err = [json.loads(x) for x in (tmp_path / "api/r/generate/p/errors.jsonl").read_text().splitlines()]
        assert [(e["sample_id"], e["action"], e["kind"]) for e in err] == [("long", "permanent", "bad_request")]
        again = generate(emu, tmp_path / "api", ds)
        assert again.reason == "nothing_to_do"


# --- stops from outside: SIGTERM, and kill -9 ------------------------------------------------

CHILD = """
import asyncio, json, sys
from draftsmith.openrouter.apikey import ApiKey
from draftsmith.config import GenerateConfig, split
from draftsmith.generate.stage import run_at
from draftsmith.paths import Run
a = json.loads(sys.argv[1])
def go():
    settings, knobs = split(GenerateConfig, a["fast"])
    cfg = GenerateConfig(datasets=a["datasets"], model=a["model"], max_tokens=32, concurrency=a["concurrency"],
                         spend_limit_usd=5.0, native_precision="int4", target_model_path=None, **settings)
    r = run_at(a["base"], ApiKey(a["key"], "test"), Run(a["root"], "r"), cfg, **knobs)
    print("RESULT", r.reason, flush=True)
async def like_jupyter():      # a cell runs inside the kernel's event loop
    go()
asyncio.run(like_jupyter()) if a["in_loop"] else go()
"""


def child(emu, root: Path, datasets, concurrency=16, in_loop=False) -> subprocess.Popen:
    arg = json.dumps({"base": emu.base_url, "key": emu.key.reveal(), "root": str(root), "datasets": datasets,
                      "model": MODEL, "concurrency": concurrency, "fast": FAST, "in_loop": in_loop})
    env = {**os.environ, "DRAFTSMITH_PROGRESS": "off"}
    return subprocess.Popen([sys.executable, "-c", CHILD, arg], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_lines(path: Path, n: int, proc: subprocess.Popen) -> None:
    """Until the running child `proc` has written `n` lines to `path`."""
    wait_until(lambda: path.read_bytes().count(b"\n") if path.exists() else 0, lambda lines: lines >= n,
               what=f"{n} lines in {path}", timeout_s=120, proc=proc)


def wait_idle(emu) -> None:
    """Until the emulator has finished (and billed) every request of the dead client: none in flight
    and none of its connections left open (a request still in a socket's buffer is served later)."""
    port = urlsplit(emu.base_url).port

    def busy() -> tuple[int, int]:
        served = [c for c in psutil.Process().net_connections("tcp")
                  if c.laddr and c.laddr.port == port and c.status != psutil.CONN_LISTEN]
        return emu.emulator.accounts.in_flight, len(served)
    wait_until(busy, lambda b: b == (0, 0), what="the emulator idle after the kill (requests in flight, "
               "connections open)")


PACED = {"time_scale": 1.0, "synthetic_tokens": 20, "fault_scale": 0.0, "credits": 100.0,
         "providers": [{"slug": "slow", "name": "Slow", "quantization": "int4", "prompt_price": 0.5,
                        "completion_price": 2.0, "latency_s": {"median": 0.2, "sigma": 0.3},
                        "tokens_per_s": {"median": 60.0, "sigma": 0.3}, "capacity": 1000}]}


@pytest.mark.crash
@pytest.mark.parametrize("sig,in_loop", [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGINT, True)])
def test_a_signal_stops_cleanly_and_a_rerun_finishes(tmp_path, sig, in_loop):
    """SIGTERM to a script; SIGINT (a notebook's interrupt) while called from inside a running event
    loop, as in Jupyter, where the engine runs its loop in a thread."""
    with running(emu_config(**PACED), state_dir=tmp_path / "emu") as emu:
        path = prompts_file(tmp_path / "p.jsonl", 120, f"signal-{sig.name}")
        ds = [{"name": "p", "path": str(path)}]
        raw = tmp_path / "r" / "generate" / "p" / "raw_responses.jsonl"
        proc = child(emu, tmp_path, ds, in_loop=in_loop)
        wait_lines(raw, 10, proc)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "RESULT interrupted" in out, out
        man = json.loads((tmp_path / "r" / "generate" / "manifest.json").read_text())
        assert man["sessions"][-1]["status"] == "interrupted" and sig.name in man["sessions"][-1]["message"]
        assert raw.read_bytes().endswith(b"\n")
        first = saved(tmp_path, "p")
        assert 10 <= len(first) < 120
        r = generate(emu, tmp_path, ds, concurrency=16)
        assert r.complete
        rows = saved(tmp_path, "p")
        assert_whole_and_unique(rows)
        assert len(rows) == 120 and rows[:len(first)] == first


@pytest.mark.crash
def test_kill_9_at_random_moments_then_resume_pays_twice_only_for_in_flight(tmp_path):
    """Three kill -9s at random moments, then a run to completion: every sample id exactly once,
    and the only prompts the ledger billed twice were in flight (billed, not yet saved) at a kill."""
    rng = random.Random(4)
    with running(emu_config(**PACED), state_dir=tmp_path / "emu") as emu:
        path = prompts_file(tmp_path / "p.jsonl", 160, "kill")
        ds = [{"name": "p", "path": str(path)}]
        keys = prompt_keys(path, "p")
        raw = tmp_path / "r" / "generate" / "p" / "raw_responses.jsonl"
        in_flight_at_kill: set[str] = set()
        for k in range(3):
            before = len(saved(tmp_path, "p"))
            proc = child(emu, tmp_path, ds)
            wait_lines(raw, before + 5, proc)
            time.sleep(rng.uniform(0.0, 0.8))
            proc.kill()
            proc.wait()
            wait_idle(emu)
            with open(raw, "rb") as f:
                whole = f.read().rsplit(b"\n", 1)[0]      # a torn tail is not saved: the next run cuts it
            saved_now = {keys[json.loads(x)["sample_id"]] for x in whole.splitlines() if x.strip()}
            in_flight_at_kill |= set(billed(emu)) - saved_now
        assert in_flight_at_kill, "no kill hit a request in flight: the test proved nothing"
        r = generate(emu, tmp_path, ds, concurrency=16)
        assert r.complete, r.message
        rows = saved(tmp_path, "p")
        assert_whole_and_unique(rows)
        assert len(rows) == 160
        twice = {k for k, n in billed(emu).items() if n > 1}
        assert twice <= in_flight_at_kill, twice - in_flight_at_kill
        man = json.loads((tmp_path / "r" / "generate" / "manifest.json").read_text())
        assert [s["status"] for s in man["sessions"]] == ["killed"] * 3 + ["finished"]


ISSUE_STORM = {"rate_limit": 0.25, "bad_gateway": 0.025, "unavailable": 0.025, "error_200": 0.04, "mid_stream": 0.04,
               "empty_200": 0.03, "hang": 0.01}


def test_the_429_storm_answers_every_prompt_in_one_run(tmp_path):
    """The storm OpenRouter produces when upstream providers are saturated: 25% 429 with
    Retry-After, 5% 5xx, 4% errors in 200 bodies, 4% mid-stream errors, 3% empty 200s, 1% hung
    connections, and a per-provider in-flight cap; 800 prompts at 300 in flight. Throttling
    spends no attempts, so no prompt is given up, and every bill (hangs included) is counted."""
    # one provider: with two, OpenRouter (and the emulator) falls back on a 429 and the client sees fewer
    providers = [{"slug": "alpha", "name": "Alpha", "quantization": "int4", "prompt_price": 0.5,
                  "completion_price": 2.0, "capacity": 150, "retry_after_s": 0.2, "faults": ISSUE_STORM}]
    with running(emu_config(providers=providers, hang_s=6.0, synthetic_tokens=8), state_dir=tmp_path / "emu") as emu:
        path = prompts_file(tmp_path / "p.jsonl", 800, "issue-storm")
        # the read timeout leaves a loaded 2-core box time to answer, and is still below a hang
        r = generate(emu, tmp_path, [{"name": "p", "path": str(path)}], concurrency=300, request_timeout_s=4.0,
                     max_tokens=16)
        assert r.complete and r.session["exhausted_samples"] == 0, r.message
        rows = saved(tmp_path, "p")
        assert_whole_and_unique(rows)
        assert len(rows) == 800
        kinds = r.session["errors_by_kind"]
        assert kinds.get("http_429", 0) > 200 and kinds.get("timeout", 0) > 0
        assert "GIVEN UP" not in r.message
        assert r.spent_usd == pytest.approx(sum(x["cost"] for x in emu.ledger_lines()), abs=1e-9)


def test_money_bound_tail_stops_for_a_top_up_and_the_top_up_finishes(tmp_path):
    """Once the money left cannot finish the budgets and keeps fewer than half the slots busy, stage 02
    starts nothing new, lets what is in flight finish (nothing paid is lost), stops with how much to
    top up; topping up that much finishes every budget. With the fraction at 0 it spends down until not
    one more request fits. (Which of the two leaves more unspent is not fixed: the stop for a top-up
    leaves what its last few requests were reserved beyond their cost, at most a few worst cases.)"""
    def job(fraction, name):
        with running(emu_config(credits=0.01, fault_scale=0.0), state_dir=tmp_path / f"emu-{name}") as emu:
            path = prompts_file(tmp_path / f"{name}.jsonl", 400, "tail")
            ds = [{"name": "p", "path": str(path), "output_token_budget": 6000}]
            r = generate(emu, tmp_path / name, ds, concurrency=16, money_bound_stop_fraction=fraction)
            assert r.reason == "balance" and not r.complete, r.message
            rows = saved(tmp_path / name, "p")
            assert_whole_and_unique(rows)
            keys = prompt_keys(path, "p")
            assert sorted(billed(emu).elements()) == sorted(keys[x["sample_id"]] for x in rows)  # nothing paid is lost
            spent = sum(x["cost"] for x in emu.ledger_lines())
            if fraction:
                assert "keeps only" in r.message and "top up about $" in r.message, r.message
                assert any("winding down" in line for line in r.logs), r.logs
                top_up = r.session["top_up_usd"]
                assert top_up > 0
                emu.top_up(top_up)
                r2 = generate(emu, tmp_path / name, ds, concurrency=16, money_bound_stop_fraction=fraction)
                assert r2.complete, r2.message
                # met as every budget is: the last start stops once the next response would overshoot
                assert 6000 - 32 < sum(x["usage"]["completion_tokens"] for x in saved(tmp_path / name, "p")) <= 6000 + 60
                assert max(billed(emu).values()) == 1
            return spent, r.message

    _, early = job(0.5, "half")
    in_flight = int(re.search(r"keeps only (\d+) of 16 requests", early)[1])
    assert in_flight < 0.5 * 16, early
    late, message = job(0.0, "none")
    assert "ran out" in message and "keeps only" not in message, message
    worst = float(re.search(r"the next request could cost \(\$([0-9.]+)", message)[1])
    assert 0.01 - late < worst + 0.00005, (late, message)     # down to the floor: not one more fits


def test_a_balance_for_a_tenth_of_the_slots_is_spent_down_to_the_floor(tmp_path):
    """A session whose money never filled its slots has no slow tail for the stop for a top-up to
    cut: an account holding a tenth of what 40 slots reserve at their worst case is spent at the
    concurrency it allows until not one more request fits, and stops with the balance stop."""
    from draftsmith.openrouter.budget import SpendBudget, prompt_tokens_bound

    one = [{"slug": "alpha", "name": "Alpha", "quantization": "int4", "prompt_price": 0.5, "completion_price": 2.0}]
    path = prompts_file(tmp_path / "p.jsonl", 400, "small-balance")
    prices = SpendBudget(1.0)
    prices.set_prices(0.5e-6, 2.0e-6)       # the provider's $/M tokens, per token
    worst = max(prices.worst_cost(prompt_tokens_bound(p.messages), 32) for p in DatasetReader(DatasetSpec("p", str(path))))
    credits = 0.1 * 40 * worst
    with running(emu_config(credits=credits, fault_scale=0.0, providers=one), state_dir=tmp_path / "emu") as emu:
        r = generate(emu, tmp_path, [{"name": "p", "path": str(path), "output_token_budget": 6000}], concurrency=40)
        assert r.reason == "balance" and "ran out" in r.message and "keeps only" not in r.message, r.message
        assert not any("winding down" in line for line in r.logs), r.logs
        spent = sum(x["cost"] for x in emu.ledger_lines())
        assert credits - spent < worst, (credits, spent, worst)     # down to the floor: not one more fits
        keys = prompt_keys(path, "p")
        rows = saved(tmp_path, "p")
        assert sorted(billed(emu).elements()) == sorted(keys[x["sample_id"]] for x in rows)  # nothing paid is lost


@pytest.mark.crash
def test_an_interrupt_asks_the_cost_of_lost_answers_for_seconds_and_counts_the_rest_at_their_worst(tmp_path):
    """The stop button (SIGINT) while answers lost to hung streams wait for /generation to know their
    cost (here it would take minutes): the session ends within seconds, those bills counted at
    their worst case in the manifest, so the next session's limit still holds them."""
    cfg = {**PACED, "fault_scale": 1.0, "generation_delay_s": 600.0, "hang_s": 4.0,
           "providers": [{**PACED["providers"][0], "faults": {"hang": 0.2}}]}
    with running(emu_config(**cfg), state_dir=tmp_path / "emu") as emu:
        path = prompts_file(tmp_path / "p.jsonl", 300, "lost-on-stop")
        raw = tmp_path / "r" / "generate" / "p" / "raw_responses.jsonl"
        arg = json.dumps({"base": emu.base_url, "key": emu.key.reveal(), "root": str(tmp_path), "model": MODEL,
                          "datasets": [{"name": "p", "path": str(path)}], "concurrency": 16,
                          "fast": {**FAST, "stream": True, "max_attempts": 30, "request_timeout_s": 1.0},
                          "in_loop": True})
        proc = subprocess.Popen([sys.executable, "-c", CHILD, arg], env={**os.environ, "DRAFTSMITH_PROGRESS": "off"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_lines(raw, 10, proc)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)      # recovery_patience_s is 120 s: not waited out
        assert proc.returncode == 0 and "RESULT interrupted" in out, out
        session = json.loads((tmp_path / "r" / "generate" / "manifest.json").read_text())["sessions"][-1]
        assert "lost answers cost (up to 5s)" in out, (out, session)
        assert session["lost_answers"] > session["lost_answers_costed"]
        assert session["unknown_bills"] >= 1 and session["abandoned_reserved_usd"] > 0
