"""One sample's attempts, and what its failures cost.

`Sampler.sample` takes one sample to its end: a reply is saved at once (outputs.py) and its
reservation settled at the billed cost; a failure is waited out, retried, recorded or turned into
a stop as its `Action` says (openrouter/client.py). An answer that may have been billed keeps its
reservation until `GET /generation` tells its cost. The session gives its `Sampler` what the
attempts use and makes the stop a sample returns (`Stop`, `NotSaved`): nothing here reads or
writes the session."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable
from collections import Counter
from dataclasses import asdict, dataclass, field

import aiohttp

from ..datasets import Prompt
from ..openrouter import client
from ..openrouter.client import Action, KeepaliveWatch
from ..openrouter.budget import SpendBudget
from ..openrouter.pricing import generation_cost
from ..openrouter.retry import Aimd, backoff_delay
from ..progress import Progress
from .prompt_queue import DatasetQueue


@dataclass
class Counts:
    """What one session counted, each field named as its line in the manifest's `sessions` names it
    (outputs.Manifest): the session and its attempts add to it, the session writes it."""

    samples: int = 0                    # answers saved
    completion_tokens: int = 0          # their output tokens
    cost: float = 0.0                   # what they cost
    attempts: int = 0                   # requests sent
    errors_by_kind: dict[str, int] = field(default_factory=dict)    # failed attempts, by kind
    failed_attempts_cost: float = 0.0   # what billed failures cost
    peak_in_flight: int = 0
    exhausted_samples: int = 0          # out of attempts this session (a re-run tries them again)
    permanent_samples: int = 0          # failed for good (errors.jsonl)
    lost_answers: int = 0               # answers lost after billing could start
    lost_answers_costed: int = 0        # ... of which GET /generation told the cost
    unknown_bills: int = 0              # ... of which the cost stayed unknown (counted at the worst case)
    abandoned_reserved_usd: float = 0.0  # that worst case, summed
    unsaved_answers: int = 0            # answers paid for that the store could not write
    unsaved_cost: float = 0.0

    def entry(self) -> dict:
        """The manifest's fields: dollars rounded to 1e-8, the dict copied."""
        d = asdict(self)
        for k in ("cost", "failed_attempts_cost", "abandoned_reserved_usd", "unsaved_cost"):
            d[k] = round(d[k], 8)
        return d


class Outage:
    """When OpenRouter itself is down. Each retryable `error.availability` answer is waited out; one
    that comes while no response has arrived for longer than `limit_s` since the first of them stops
    the run cleanly (a re-run resumes). Any response resets the clock."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.since: float | None = None   # first retryable availability error since the last response
        self.kinds: Counter[str] = Counter()

    def answered(self) -> None:
        self.since = None
        self.kinds.clear()

    def unavailable(self, now: float, kind: str) -> bool:
        """Count one retryable availability error; True once they have lasted longer than the limit."""
        if self.since is None:
            self.since = now
        self.kinds[kind] += 1
        return now - self.since > self.limit_s

    def message(self, now: float) -> str:
        seen = ", ".join(f"{n} {k}" for k, n in self.kinds.most_common())
        return (f"OpenRouter answered only retryable availability errors for {now - self.since:.0f}s "
                f"(more than outage_limit_s = {self.limit_s:g}s; {seen}): it looks down, so the run stopped "
                f"cleanly with nothing written off; re-run stage 02 later and it resumes")


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


@dataclass(frozen=True)
class Wire:
    """How this session's attempts are sent and recorded: the HTTP session and endpoint, the body
    maker, and the settings and source written with every saved line. A bare server bills nothing."""
    http: aiohttp.ClientSession
    base: str
    bodies: client.BodyMaker
    stream: bool
    settings_json: str
    source: str
    billed: bool
    model: str
    deadline_s: float | None = None         # a request not over by then is given up (client.request_deadline)
    progress_s: float | None = None         # a stream with no data chunk for this long is given up
    watch: KeepaliveWatch | None = None     # counts the requests waiting on keep-alive alone

    @functools.cached_property
    def url(self) -> str:
        return self.base + "/chat/completions"


@dataclass(frozen=True)
class Stop:
    """The sample ended the session: the session starts nothing new (`reason` as in the manifest)."""
    reason: str
    message: str


@dataclass(frozen=True)
class NotSaved:
    """An answer (or a failure record) the store could not write; `cost` when it was a paid answer."""
    error: OSError
    path: object = None
    cost: float | None = None


@dataclass
class Sampler:
    """One session's attempts, given what they use: the wire, the money (`spend`), the counts, the
    concurrency controller and the outage clock, the retry settings (`max_attempts`, the back-off
    and how long a lost answer's bill is asked), and from the session
    the stop it waits on, the event it sets when money is freed or a bill is learnt, the set of
    bills still being asked, and `reserve` (the dollars of a retry, 0.0 if the session stops)."""
    wire: Wire
    spend: SpendBudget
    counts: Counts
    aimd: Aimd
    outage: Outage
    progress: Progress
    max_attempts: int
    backoff_base_s: float
    backoff_cap_s: float
    recovery_patience_s: float
    stopped: asyncio.Future
    freed: asyncio.Event
    wake: asyncio.Event
    recoveries: set
    reserve: Callable[[float], Awaitable[float]]

    async def sample(self, d: DatasetQueue, p: Prompt, reserved: float, ticket: int) -> Stop | NotSaved | None:
        """One sample to the end: saved, failed for good, out of attempts, or left for a re-run by a
        stop (returned, with what stops the session). Only real failures spend attempts (up to
        `max_attempts`, each after a back-off), a reply from the response cache and a request given
        up for lack of progress included; throttling is waited out and lowers the concurrency.
        A retryable availability error is waited out like a throttle; the `outage` clock stops the
        run when nothing but such errors came back for longer than `outage_limit_s`, and a sample
        that alone meets them for that long starts spending attempts (a prompt no provider can
        serve is not an outage)."""
        w, counts = self.wire, self.counts
        msgs_json = client.messages_json(p.messages)
        body = w.bodies.body(msgs_json)
        worst, started = reserved, time.time()
        tokens = None
        failures = throttles = 0
        unavailable_since = None     # this sample has met only retryable availability errors since then
        seen: dict = {}
        try:
            while True:
                counts.attempts += 1
                seen = {}
                t0 = time.monotonic()
                res = await client.complete(w.http, w.url, None, body, w.stream, seen=seen,
                                            progress_s=w.progress_s if w.stream else None,
                                            deadline_s=w.deadline_s, watch=w.watch)
                if isinstance(res, client.Reply):
                    latency = time.monotonic() - t0
                    self.aimd.observe_latency(latency)
                    self.aimd.on_success()
                    self.outage.answered()
                    if not w.billed:
                        res.provider = res.provider or w.source
                    u = res.usage
                    tokens = u["completion_tokens"]
                    if tokens is None:      # no usage came back: count what we got, roughly
                        tokens = max(1, (len(res.content) + len(res.reasoning or "")) // 4)
                    cost = u["cost"] or 0.0
                    self.spend.settle(reserved, cost, u["prompt_tokens"], tokens)
                    reserved = 0.0
                    self.freed.set()
                    try:
                        d.store.write(p.sample_id, _response_line(w, d, p, msgs_json, res, failures + throttles + 1,
                                                                  latency, started))
                    except OSError as e:        # paid for, not saved (a full disk): the session stops
                        tokens = None
                        return NotSaved(e, d.store.raw_path, cost)
                    d.store.count_reply(u, res.finish_reason, res.provider)
                    counts.samples += 1
                    counts.completion_tokens += tokens
                    counts.cost += cost
                    self.progress.update(tokens)
                    return None
                counts.errors_by_kind[res.kind] = counts.errors_by_kind.get(res.kind, 0) + 1
                self._settle_failed(res, reserved)
                reserved = 0.0
                action = res.action
                if action is Action.PERMANENT:
                    return self._record_failure(d, p, res, failures + 1, "permanent")
                if action is Action.BALANCE:
                    return Stop("balance", f"the OpenRouter balance ran out ({res.message})")
                if action is Action.FATAL:
                    return Stop("fatal", f"{res}: {HINTS.get(res.kind, 'fix that').format(model=w.model)}")
                if action is Action.UNAVAILABLE:
                    now = time.monotonic()
                    if self.outage.unavailable(now, res.kind):
                        return Stop("unavailable", self.outage.message(now))
                    unavailable_since = unavailable_since or now
                    # waited out as a throttle; once past the limit only this prompt keeps failing: spend attempts
                    action = Action.THROTTLE if now - unavailable_since <= self.outage.limit_s else Action.RETRY
                else:
                    unavailable_since = None
                if action is Action.THROTTLE:
                    throttles += 1
                    self.aimd.on_throttle()
                    delay = backoff_delay(min(throttles, 8), res.retry_after, self.backoff_base_s, self.backoff_cap_s)
                else:
                    failures += 1
                    if failures >= self.max_attempts:
                        return None if self.stopped.done() else self._record_failure(d, p, res, failures, "exhausted")
                    delay = backoff_delay(failures, res.retry_after, self.backoff_base_s, self.backoff_cap_s)
                if self.stopped.done():
                    return None
                await asyncio.wait((self.stopped,), timeout=delay)     # a stop cuts the wait short
                if self.stopped.done():
                    return None
                reserved = await self.reserve(worst)
                if not reserved:
                    return None
        except asyncio.CancelledError:
            if reserved:        # given up on while in flight: it may still be billed
                self._recover(seen.get("generation_id"), reserved)
                reserved = 0.0
            raise
        finally:
            d.budget.end(ticket, tokens)
            if reserved:
                self.spend.settle(reserved, 0.0)

    def _settle_failed(self, res: client.Failure, reserved: float) -> None:
        if res.maybe_billed:
            self._recover(res.generation_id, reserved)
            return
        self.spend.settle(reserved, res.cost)
        self.counts.failed_attempts_cost += res.cost
        self.freed.set()

    def _recover(self, generation_id: str | None, reserved: float) -> None:
        """An answer lost after a provider may have taken the request: hold its reservation until
        /generation says what it cost; with no generation id, count it at its worst case."""
        self.counts.lost_answers += 1
        if not self.wire.billed:
            return self.spend.settle(reserved, 0.0)
        if generation_id is None:
            return self._count_unknown(reserved)
        t = asyncio.get_running_loop().create_task(self._ask_cost(generation_id, reserved))
        self.recoveries.add(t)
        t.add_done_callback(self.recoveries.discard)

    async def _ask_cost(self, generation_id: str, reserved: float) -> None:
        cost = None
        try:
            cost = await generation_cost(self.wire.http, self.wire.base, generation_id, self.recovery_patience_s)
        finally:                # also when given up on at the very end: then counted at its worst case
            if cost is None:
                self._count_unknown(reserved)
            else:
                self.spend.settle(reserved, cost)
                self.counts.failed_attempts_cost += cost
                self.counts.lost_answers_costed += 1
                self.freed.set()
            self.wake.set()

    def _count_unknown(self, reserved: float) -> None:
        self.spend.settle(reserved, reserved)
        self.counts.abandoned_reserved_usd += reserved
        self.counts.unknown_bills += 1
        self.freed.set()

    def _record_failure(self, d: DatasetQueue, p: Prompt, res: client.Failure, attempts: int,
                        action: str) -> NotSaved | None:
        if action == "permanent":
            self.counts.permanent_samples += 1
        else:
            self.counts.exhausted_samples += 1
        try:
            d.store.write_error({"sample_id": p.sample_id, "prompt_hash": p.prompt_hash, "dataset": d.name,
                                 "action": action, "kind": res.kind,
                                 "status": res.status, "message": res.message, "provider": res.provider,
                                 "attempts": attempts, "time": round(time.time(), 3)})
        except OSError as e:
            return NotSaved(e, d.store.err_path)
        return None


_LINE = json.JSONEncoder(ensure_ascii=False, check_circular=False, separators=(",", ":"))   # one, not one per line


def _response_line(w: Wire, d: DatasetQueue, p: Prompt, msgs_json: str, res: client.Reply, attempt: int,
                   latency: float, started: float) -> str:
    """The raw_responses.jsonl line; the prompt and the settings are already JSON. `source` is
    "openrouter" or a bare server's engine; vLLM's sampled `output_ids` and `prompt_ids` come along."""
    rec = _LINE.encode({
        "sample_id": p.sample_id, "prompt_hash": p.prompt_hash, "dataset": d.name, "content": res.content,
        "reasoning": res.reasoning,
        "finish_reason": res.finish_reason, "native_finish_reason": res.native_finish_reason,
        "provider": res.provider, "model": res.model, "generation_id": res.generation_id, "usage": res.usage,
        "attempts": attempt, "latency_s": round(latency, 3), "started_at": round(started, 3),
        "completed_at": round(time.time(), 3), "source": w.source,
        **({"output_ids": res.output_ids, "prompt_ids": res.prompt_ids} if res.output_ids else {})})
    return f'{rec[:-1]},"messages":{msgs_json},"request":{w.settings_json}}}'
