"""One sample's attempts, and what its failures cost.

An attempt is POSTed (openrouter/client.py); a reply is saved at once (outputs.py) and its reservation settled
at the billed cost. A failure is waited out (throttling: no attempt spent, the concurrency is
lowered), retried after a back-off (a real failure, up to `max_attempts`), recorded (permanent, or
out of attempts) or turned into a stop (the balance, the key, the model or the routing). A
retryable availability error (the router cannot serve the model just now) is waited out like a
throttle; the engine's `outage` clock (outage.py) stops the run when nothing but such errors came
back for longer than `outage_limit_s`, and a sample that alone meets them for that long starts
spending attempts (a prompt no provider can serve is not an outage). An answer lost
after a provider took the request may still be billed: its reservation is held until
`GET /generation` says what it cost (pricing.generation_cost); without a generation id it is
counted at its worst case.
"""

from __future__ import annotations

import asyncio
import json
import time

from ..openrouter import client
from ..datasets import Prompt
from ..openrouter.pricing import generation_cost
from ..openrouter.retry import backoff_delay
from .prompt_queue import DatasetQueue

HINTS = {
    "unauthorized": "check api_key_file / OPENROUTER_API_KEY",
    "forbidden": ("a key, workspace or guardrail budget is spent, or the key lacks permission (GET /key shows "
                  "`budgets`); no sample was written off: raise the budget or wait for it to reset"),
    "no_provider": "no endpoint meets the routing: check `model` and `provider` (and the routing stage 01 wrote)",
    "model_not_found": "OpenRouter does not know the model {model!r}: check `model` (no sample was written off)",
    "wrong_endpoint": "the model {model!r} is not served at this endpoint: check `model` and `api_base`",
    "constraint_filtered": ("the routing constraints filtered every endpoint of {model!r}: loosen `provider` "
                            "(quantizations, max_price, require_parameters) or the routing stage 01 wrote"),
    "weight_exceeds_budget": ("one request's worst case alone is more than the budget allows: lower max_tokens "
                              "or raise the budget (retrying cannot help)"),
}


async def sample(eng, d: DatasetQueue, p: Prompt, reserved: float, ticket: int) -> None:
    """One sample to the end: saved, failed for good, out of attempts, or left for a re-run by a
    stop. Only real failures spend attempts; throttling is waited out."""
    msgs_json = client.messages_json(p.messages)
    body = eng.bodies.body(msgs_json)
    worst, started = reserved, time.time()
    tokens = None
    failures = throttles = 0
    unavailable_since = None     # this sample has met only retryable availability errors since then
    seen: dict = {}
    try:
        while True:
            eng.counts.attempts += 1
            seen = {}
            t0 = time.monotonic()
            res = await client.complete(eng.http, eng.url, None, body, eng.stream, seen=seen)
            if isinstance(res, client.Reply):
                latency = time.monotonic() - t0
                eng.aimd.observe_latency(latency)
                eng.aimd.on_success()
                eng.outage.answered()
                if eng.server is not None:
                    res.provider = res.provider or eng.source
                u = res.usage
                tokens = u["completion_tokens"]
                if tokens is None:      # no usage came back: count what we got, roughly
                    tokens = max(1, (len(res.content) + len(res.reasoning or "")) // 4)
                cost = u["cost"] or 0.0
                eng.spend.settle(reserved, cost, u["prompt_tokens"], tokens)
                reserved = 0.0
                eng.money_freed.set()
                try:
                    d.store.write(p.sample_id, _response_line(eng, d, p, msgs_json, res, failures + throttles + 1,
                                                          latency, started))
                except OSError as e:        # paid for, not saved (a full disk): the session stops
                    tokens = None
                    return eng.write_failed(e, d.store.raw_path, cost)
                d.store.count_reply(u, res.finish_reason, res.provider)
                eng.counts.samples += 1
                eng.counts.completion_tokens += tokens
                eng.counts.cost += cost
                eng.progress.update(tokens)
                return
            eng.counts.errors_by_kind[res.kind] = eng.counts.errors_by_kind.get(res.kind, 0) + 1
            _settle_failed(eng, res, reserved)
            reserved = 0.0
            if res.action == "permanent":
                return _record_failure(eng, d, p, res, failures + 1, "permanent")
            if res.action == "balance":
                return eng.request_stop("balance", f"the OpenRouter balance ran out ({res.message})")
            if res.action == "fatal":
                hint = HINTS.get(res.kind, "fix that").format(model=eng.model)
                return eng.request_stop("fatal", f"{res}: {hint}")
            if res.action == "unavailable":
                now = time.monotonic()
                if eng.outage.unavailable(now, res.kind):
                    return eng.request_stop("unavailable", eng.outage.message(now))
                unavailable_since = unavailable_since or now
                if now - unavailable_since <= eng.outage.limit_s:
                    res.action = "throttle"       # waited out, as a throttle
                else:
                    res.action = "retry"          # only this prompt keeps failing: spend attempts
            else:
                unavailable_since = None
            if res.action == "throttle":
                throttles += 1
                eng.aimd.on_throttle()
                delay = backoff_delay(min(throttles, 8), res.retry_after, eng.opts.backoff_base_s,
                                      eng.opts.backoff_cap_s)
            else:
                failures += 1
                if failures >= eng.opts.max_attempts:
                    if eng.reason is None:
                        _record_failure(eng, d, p, res, failures, "exhausted")
                    return
                delay = backoff_delay(failures, res.retry_after, eng.opts.backoff_base_s, eng.opts.backoff_cap_s)
            if eng.reason is not None:
                return
            await asyncio.wait((eng.stopped,), timeout=delay)     # a stop cuts the wait short
            if eng.reason is not None:
                return
            reserved = await eng.reserve(worst)
            if not reserved:
                return
    except asyncio.CancelledError:
        if reserved:        # given up on while in flight: it may still be billed
            _recover(eng, seen.get("generation_id"), reserved)
            reserved = 0.0
        raise
    finally:
        d.budget.end(ticket, tokens)
        if reserved:
            eng.spend.settle(reserved, 0.0)
        eng.in_flight -= 1


def _settle_failed(eng, res: client.Failure, reserved: float) -> None:
    if res.maybe_billed:
        _recover(eng, res.generation_id, reserved)
        return
    eng.spend.settle(reserved, res.cost)
    eng.counts.failed_attempts_cost += res.cost
    eng.money_freed.set()


def _recover(eng, generation_id: str | None, reserved: float) -> None:
    """An answer lost after a provider may have taken the request: hold its reservation until
    /generation says what it cost; with no generation id, count it at its worst case."""
    eng.counts.lost_answers += 1
    if eng.server is not None:   # nothing is billed
        return eng.spend.settle(reserved, 0.0)
    if generation_id is None:
        return _count_unknown(eng, reserved)
    t = asyncio.get_running_loop().create_task(_ask_cost(eng, generation_id, reserved))
    eng.recoveries.add(t)
    t.add_done_callback(eng.recoveries.discard)


async def _ask_cost(eng, generation_id: str, reserved: float) -> None:
    cost = None
    try:
        cost = await generation_cost(eng.http, eng.base, generation_id, eng.opts.recovery_patience_s)
    finally:                # also when given up on at the very end: then counted at its worst case
        if cost is None:
            _count_unknown(eng, reserved)
        else:
            eng.spend.settle(reserved, cost)
            eng.counts.failed_attempts_cost += cost
            eng.counts.lost_answers_costed += 1
            eng.money_freed.set()
        eng.wake.set()


def _count_unknown(eng, reserved: float) -> None:
    eng.spend.settle(reserved, reserved)
    eng.counts.abandoned_reserved_usd += reserved
    eng.counts.unknown_bills += 1
    eng.money_freed.set()


_LINE = json.JSONEncoder(ensure_ascii=False, check_circular=False, separators=(",", ":"))   # one, not one per line


def _response_line(eng, d: DatasetQueue, p: Prompt, msgs_json: str, res: client.Reply, attempt: int,
          latency: float, started: float) -> str:
    """The raw_responses.jsonl line; the prompt and the settings are already JSON."""
    rec = _LINE.encode({
        "sample_id": p.sample_id, "dataset": d.name, "content": res.content, "reasoning": res.reasoning,
        "finish_reason": res.finish_reason, "native_finish_reason": res.native_finish_reason,
        "provider": res.provider, "model": res.model, "generation_id": res.generation_id, "usage": res.usage,
        "attempts": attempt, "latency_s": round(latency, 3), "started_at": round(started, 3),
        "completed_at": round(time.time(), 3), "source": eng.source,
        **({"output_ids": res.output_ids, "prompt_ids": res.prompt_ids} if res.output_ids else {})})
    return f'{rec[:-1]},"messages":{msgs_json},"request":{eng.settings_json}}}'


def _record_failure(eng, d: DatasetQueue, p: Prompt, res: client.Failure, attempts: int, action: str) -> None:
    if action == "permanent":
        eng.counts.permanent_samples += 1
    else:
        eng.counts.exhausted_samples += 1
    d.store.write_error({"sample_id": p.sample_id, "dataset": d.name, "action": action, "kind": res.kind,
                         "status": res.status, "message": res.message, "provider": res.provider,
                         "attempts": attempts, "time": round(time.time(), 3)})
