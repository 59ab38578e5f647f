"""Stage 02 against the emulator playing OpenRouter's documented contract (not a stub of ours):
answers billed and then lost on the wire, a key budget running out (403), one request heavier
than the whole budget (402 weight_exceeds_budget), endpoints that do not take `seed`. The
emulator's ledger is the referee for what was paid."""

from __future__ import annotations

import pytest

from draftsmith.emulator import running
from test_generate_e2e import assert_whole_and_unique, emu_config, generate, prompts_file, saved


def ledger_cost(emu) -> float:
    return sum(x["cost"] for x in emu.ledger_lines() if x["billed"])


@pytest.mark.parametrize("stream", [False, True])
def test_answers_billed_then_lost_are_counted_and_the_spend_equals_the_ledger(tmp_path, stream):
    faults = {"cut_after_billing": 0.25, "hang": 0.05}
    # hangs outlast the read timeout; every other answer comes well within it (a client time-out of an
    # answer still on its way has no generation id to ask about, and is counted at its worst case)
    with running(emu_config(credits=100.0, faults=faults, hang_s=6.0), state_dir=tmp_path / "emu") as emu:
        path = prompts_file(tmp_path / "p.jsonl", 60, f"lost{stream}")
        r = generate(emu, tmp_path, [{"name": "p", "path": str(path)}], stream=stream, request_timeout_s=3.0,
                     max_attempts=10)
        assert r.complete, r.message
        rows = saved(tmp_path, "p")
        assert_whole_and_unique(rows)
        assert len(rows) == 60
        lost = [x for x in emu.ledger_lines() if x["billed"] and x["error"] in ("cut_after_billing", "hang")]
        assert lost, "no answer was lost: raise the fault rates"
        assert r.session["unknown_bills"] == 0, r.session
        assert round(r.spent_usd, 2) == round(ledger_cost(emu), 2)
        assert r.spent_usd == pytest.approx(ledger_cost(emu), abs=1e-6)
        assert "Paid for and not saved this session" in r.message, r.message


def test_spend_limit_holds_when_every_answer_can_be_lost(tmp_path):
    with running(emu_config(credits=100.0, faults={"cut_after_billing": 0.6}), state_dir=tmp_path / "emu") as emu:
        path = prompts_file(tmp_path / "p.jsonl", 400, "limit")
        limit = 0.003
        r = generate(emu, tmp_path, [{"name": "p", "path": str(path)}], spend_limit_usd=limit, max_attempts=20)
        assert r.reason == "spend_limit", r.message
        worst = max(x["cost"] for x in emu.ledger_lines() if x["billed"]) * 4   # generous: one request's worst case
        assert ledger_cost(emu) <= limit + worst
        assert r.spent_usd == pytest.approx(ledger_cost(emu), abs=1e-6)


def errors_written(root) -> str:
    path = root / "r" / "generate" / "p" / "errors.jsonl"
    return path.read_text().strip() if path.exists() else ""


def test_a_key_budget_running_out_stops_the_run_and_writes_no_sample_off(tmp_path):
    """The key's budget shows in /key, so the run stops at it (or at the 403 past it) -- never by
    writing the remaining samples off."""
    with running(emu_config(credits=100.0, fault_scale=0.0, key_budget_usd=0.002), state_dir=tmp_path / "emu") as emu:
        path = prompts_file(tmp_path / "p.jsonl", 300, "budget")
        r = generate(emu, tmp_path, [{"name": "p", "path": str(path)}], concurrency=4)
        assert r.reason in ("balance", "fatal") and not r.complete, r.message
        assert not errors_written(tmp_path), "a sample was written off"
        assert 0 < len(saved(tmp_path, "p")) < 300
        assert r.spent_usd == pytest.approx(ledger_cost(emu), abs=1e-6) and r.spent_usd <= 0.002 + 1e-9


def test_one_request_heavier_than_the_whole_budget_stops_at_once(tmp_path):
    with running(emu_config(credits=100.0, fault_scale=0.0, key_budget_usd=0.00001), state_dir=tmp_path / "emu") as emu:
        path = prompts_file(tmp_path / "p.jsonl", 30, "weight")
        r = generate(emu, tmp_path, [{"name": "p", "path": str(path)}], max_tokens=4000, max_attempts=3,
                     spend_limit_usd=5.0)
        assert r.reason in ("fatal", "balance") and not r.complete, r.message
        assert "max_tokens" in r.message, r.message
        assert len(emu.ledger_lines()) == 0 or not any(x["billed"] for x in emu.ledger_lines())
        assert not saved(tmp_path, "p")


def test_endpoints_without_seed_are_not_used_and_none_at_all_stops_before_sending(tmp_path):
    no_seed = ["max_tokens", "temperature", "top_p", "stop", "reasoning", "include_reasoning"]
    eps = [{"slug": "a", "name": "A", "quantization": "int4", "prompt_price": 0.5, "completion_price": 2.0,
            "supported_parameters": no_seed},
           {"slug": "b", "name": "B", "quantization": "int4", "prompt_price": 0.6, "completion_price": 2.2}]
    with running(emu_config(credits=10.0, fault_scale=0.0, providers=eps), state_dir=tmp_path / "emu") as emu:
        path = prompts_file(tmp_path / "p.jsonl", 20, "seed")
        r = generate(emu, tmp_path, [{"name": "p", "path": str(path)}], seed=0)
        assert r.complete, r.message
        assert {x["provider_name"] for x in emu.ledger_lines() if x["billed"]} == {"B"}
    with running(emu_config(credits=10.0, fault_scale=0.0, providers=eps[:1]), state_dir=tmp_path / "emu2") as emu:
        r = generate(emu, tmp_path / "two", [{"name": "p", "path": str(path)}], seed=0)
        assert r.reason == "fatal" and "seed" in r.message, r.message
        assert not emu.ledger_lines()
