"""Stage 02: sample responses for every prompt through the API, within token and dollar budgets.

One aiohttp session carries up to `concurrency` requests at once, shared by all datasets: a slot
freed by one dataset goes to whichever dataset still has budget and prompts (round robin), so the
run stays full until the last budget is reached. Prompts are read lazily from the files
(prompt_queue.py), so memory does not grow with the number of prompts.

Each attempt: reserve its worst-case dollars and count the sample against its dataset's tokens in
flight (budget.py), POST it (client.py), then save the response (store.py) or deal with the
failure: wait out throttling (429s, in-flight 402s; the concurrency is lowered and no attempt is
spent), back off and retry a real failure (up to `max_attempts`), record a permanent failure, or
stop the run (the balance or a budget is gone, the key or the routing is refused). An attempt
whose answer was lost after a provider took it may still be billed: its reservation is held until
`GET /generation` says what it cost (pricing.generation_cost), and that cost is counted.

A stop (balance gone, spend limit, a refusal, SIGINT/SIGTERM) starts nothing new, gives the
requests in flight `stop_grace_s` to finish and be saved, asks the cost of what it gave up on,
and closes the files, so a re-run resumes exactly where this one ended. The last line says what
was paid for and not saved, and how many samples were given up.

Routing: stage 01's `providers/routing.json` merged with the `provider` parameter; without it,
the same precision policy (providers.policy_routing) is applied here over the live endpoint list.

A bare OpenAI-compatible server (`api_base` of the user's own vLLM or SGLang, bare_server.py) has
no balance, catalogue, routing or cost: those parts are switched off, with a line saying so, and
each response line records the engine as its `source` and, from vLLM, the sampled `output_ids` and
`prompt_ids`. OpenRouter's lines say `"source": "openrouter"`.

`run_generation(...)` is what notebook 02 calls; it returns a `GenerationResult`.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from . import bare_server, client, providers
from .budget import SpendBudget, TokenBudget
from .datasets import DatasetSpec, Prompt, parse_datasets
from .imports import answered, parse_imports
from .paths import Run, resolve
from .pricing import BalanceReader, CatalogueError, catalogue, fetch_endpoints, generation_cost
from .progress import Progress
from .prompt_queue import ContextCheck, DatasetQueue
from .retry import Aimd, backoff_delay
from .files import repair_tail
from .store import DatasetStore, Manifest

TODO = {"balance": "top up the balance, then re-run", "spend_limit": "raise spend_limit_usd, then re-run",
        "fatal": "fix that, then re-run", "interrupted": "re-run"}
HINTS = {
    "unauthorized": "check api_key_file / OPENROUTER_API_KEY",
    "forbidden": ("a key, workspace or guardrail budget is spent, or the key lacks permission (GET /key shows "
                  "`budgets`); no sample was written off: raise the budget or wait for it to reset"),
    "no_provider": "no endpoint meets the routing: check `model` and `provider` (and providers/routing.json from stage 01)",
    "weight_exceeds_budget": ("one request's worst case alone is more than the budget allows: lower max_tokens "
                              "or raise the budget (retrying cannot help)"),
}


@dataclass
class Options:
    """How the engine behaves (the notebook's stage 02 parameters)."""

    concurrency: int
    spend_limit_usd: float
    balance_floor_usd: float = 0.0
    # Stop for a top-up once money keeps fewer than this share of the slots busy and cannot finish
    # the job anyway (0: spend down to the floor first, however few requests that keeps in flight).
    money_bound_stop_fraction: float = 0.5
    max_attempts: int = 6
    request_timeout_s: float = 600.0     # no byte for this long: a hung connection
    stop_grace_s: float = 30.0
    balance_poll_s: float = 15.0
    fsync_s: float = 5.0
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    recovery_patience_s: float = 120.0   # how long to keep asking /generation the cost of a lost answer
    target_model_path: str | None = None  # its tokenizer measures prompts that may be too long
    trust_remote_code: bool = False       # loading that tokenizer may run its own code (Kimi-K2.5)

    def __post_init__(self):
        for name in ("concurrency", "max_attempts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.request_timeout_s or self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s!r}")
        if not 0 <= self.money_bound_stop_fraction <= 1:
            raise ValueError(f"money_bound_stop_fraction must be between 0 and 1, got {self.money_bound_stop_fraction!r}")


@dataclass
class GenerationResult:
    status: str                 # finished | stopped
    reason: str                 # finished | nothing_to_do | balance | spend_limit | fatal | interrupted
    message: str
    folder: Path
    spent_usd: float
    session: dict
    datasets: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.status == "finished"

    def raise_if_incomplete(self) -> None:
        """Make a stopped run fail its notebook (so `draftsmith run all` does not go on with half the data)."""
        if not self.complete:
            raise GenerationStopped(self.message)


class GenerationStopped(RuntimeError):
    pass


def stage_01_routing(run: Run) -> dict | None:
    """The provider object of stage 01's `providers/routing.json`; None if stage 01 did not run."""
    path = run.root / "providers" / "routing.json"
    if not path.is_file():
        return None
    obj = json.loads(path.read_text(encoding="utf-8"))
    obj = obj.get("provider", obj) if isinstance(obj, dict) else None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object (or one with a 'provider' object)")
    return obj


class Engine:
    def __init__(self, base_url: str, api_key, run: Run, specs: list[DatasetSpec], settings: dict,
                 opts: Options, config: dict, log=print, policy: tuple[str, bool] | None = None):
        """`policy`: (native_precision, allow_unknown) when there is no stage-01 routing and the
        engine must build it from the endpoint list; `settings["provider"]` is then laid over it."""
        self.base = base_url.rstrip("/")
        self.url = self.base + "/chat/completions"
        self._headers = {**api_key.header(), "Content-Type": "application/json", "X-Title": "draftsmith"}
        self.opts, self.config, self.log = opts, config, log
        self.folder = run.dir("generate")
        self.stream = bool(settings.get("stream"))
        self.bodies = client.BodyMaker(settings)
        self.settings_json = json.dumps(settings, ensure_ascii=False, separators=(",", ":"))
        self.model, self.provider, self.max_tokens = settings["model"], settings.get("provider") or {}, settings["max_tokens"]
        self.stop_grace_s = opts.stop_grace_s
        self.settings, self.policy = settings, policy
        self.sent = client.sent_parameters(settings)

        self.manifest = Manifest.open(self.folder / "manifest.json")
        self.datasets: list[DatasetQueue] = []
        self.stage_01_usd = providers.spent(run.root / "providers")
        config["stage_01_spent_usd"] = self.stage_01_usd
        spent = self.manifest.spent_outside_responses + self.stage_01_usd
        for spec in specs:
            store = DatasetStore(self.folder / spec.name, fsync_s=opts.fsync_s)
            for note in store.notes:
                log(f"resume: {note}")
            budget = TokenBudget(spec.output_token_budget, self.max_tokens)
            for duration, n in store.lengths:
                budget.add(n, duration)
            store.lengths = []
            spent += store.totals.cost
            self.datasets.append(DatasetQueue(spec, store, budget))
        self.spend = SpendBudget(opts.spend_limit_usd, opts.balance_floor_usd, spent)
        self.aimd = Aimd(opts.concurrency)
        self.check: ContextCheck | None = None
        self.server: bare_server.BareServer | None = None   # set when api_base is not OpenRouter
        self.source = "openrouter"
        self.progress: Progress | None = None
        self.http: aiohttp.ClientSession | None = None

        self.in_flight = self.peak_in_flight = 0
        self.tasks: set[asyncio.Task] = set()
        self.reason: str | None = None       # why the session ended (None while running)
        self.message = ""
        self.blocked: tuple[str, float] | None = None   # (spend_limit | balance, worst cost) if dollars stopped a start
        self.winding_down: tuple[str, str] | None = None  # (reason, message): stopping for a top-up once in flight ends
        self.errors: dict[str, int] = {}
        self.attempts = self.samples = self.tokens = 0
        self.exhausted_samples = self.permanent_samples = 0
        self.cost = self.failed_attempts_cost = self.abandoned_reserved = 0.0
        self.lost = self.recovered = self.unknown_bills = 0    # answers lost after billing could start
        self.recoveries: set[asyncio.Task] = set()             # asking /generation what one cost
        self._rr = 0
        self.entry = {"started": _now(), "status": "running",      # this session's line in the manifest
                      "samples_at_start": sum(len(d.store.done) for d in self.datasets)}
        self.manifest.sessions.append(self.entry)
        self.timeline = None     # generate/timeline.jsonl, opened at the first point (_point)

    # -- dispatch ---------------------------------------------------------------------------
    def _take(self) -> tuple | None:
        """Claim a slot and the next job for it: round robin over the datasets that can start one,
        its dollars reserved. None if nothing can start now."""
        if self.reason is not None or self.winding_down or self.in_flight >= self.aimd.limit:
            return None
        n = len(self.datasets)
        for i in range(n):
            d = self.datasets[(self._rr + i) % n]
            if not d.budget.can_start():
                continue
            nxt = d.peek(self.check)
            if nxt is None:
                continue
            p, bound = nxt
            worst = self.spend.worst_cost(bound, d.budget.worst)
            if not self.spend.try_reserve(worst):
                self._block(worst)
                self._maybe_wind_down()
                return None
            self.blocked = None
            d.take()
            self._rr = (self._rr + i + 1) % n
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            return d, p, worst, d.budget.start()
        return None

    async def _dispatch(self) -> None:
        """Start a worker per free slot. A worker keeps taking jobs itself when it finishes one, so
        this loop only wakes when a worker runs dry, on the periodic tick, or at a stop."""
        loop = asyncio.get_running_loop()
        while self.reason is None:
            while (job := self._take()) is not None:
                t = loop.create_task(self._worker(job))
                self.tasks.add(t)
                t.add_done_callback(self.tasks.discard)
            if self.in_flight == 0 and self.reason is None:
                if self.winding_down:
                    self.request_stop(*self.winding_down)
                    break
                if not (self.blocked and any(d.budget.can_start() and d.peek(self.check) for d in self.datasets)):
                    self.request_stop("finished")
                    break
                if not self.recoveries:         # else their reservations may yet be freed
                    self.request_stop(self.blocked[0], self._blocked_message())
                    break
            self._wake.clear()
            await self._wake.wait()

    async def _worker(self, job: tuple) -> None:
        while job is not None:
            await self._sample(*job)
            job = self._take()
        self._wake.set()

    def _block(self, worst: float) -> None:
        left = self.spend.balance_left
        by_balance = left is not None and left - self.spend.floor < self.spend.limit - self.spend.spent
        self.blocked = ("balance" if by_balance else "spend_limit", worst)

    async def _reserve(self, worst: float) -> float:
        """Reserve the dollars of a retry, waiting while other requests hold them; 0.0 if the run
        stops first (or must stop: nothing else holds money, and still it does not fit)."""
        while self.reason is None:
            if self.spend.try_reserve(worst):
                return worst
            self._block(worst)
            if self.spend.reserved <= 1e-12 and not self.recoveries:
                self.request_stop(self.blocked[0], self._blocked_message())
                break
            self._money.clear()
            try:
                await asyncio.wait_for(self._money.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        return 0.0

    def _blocked_message(self) -> str:
        why, worst = self.blocked
        top_up = self._top_up_usd(worst)
        if why == "balance":
            floor = f" (balance_floor_usd ${self.spend.floor:.2f})" if self.spend.floor else ""
            return (f"the balance ran out: ${self.spend.balance_left:.4f} left{floor}, less than the next "
                    f"request could cost (${worst:.4f} at max_tokens on the dearest allowed provider)"
                    + (f"; top up about ${top_up:,.2f} to finish" if top_up else ""))
        return (f"spend_limit_usd ${self.spend.limit:.2f} reached: spent ${self.spend.spent:.4f}, and the next "
                f"request could cost ${worst:.4f}, more than the ${self.spend.limit - self.spend.spent:.4f} left"
                + (f"; raise it by about ${top_up:,.2f} to finish" if top_up else ""))

    # -- the money-bound tail -----------------------------------------------------------------
    # Each request is reserved at its worst case (about 3x an average one), so once the money left is
    # less than `concurrency` worst cases, fewer requests fit in flight, and the last of the balance
    # is spent at a trickle. When the money cannot finish the job anyway, that trickle only delays
    # the top-up the job needs: below `money_bound_stop_fraction` of the slots, stop starting
    # requests, let those in flight finish (they are paid for), and stop with what to top up.
    def _money_left(self) -> float:
        left = self.spend.limit - self.spend.spent
        if self.spend.balance_left is not None:
            left = min(left, self.spend.balance_left - self.spend.floor)
        return max(0.0, left)

    def _left_to_finish(self) -> tuple[float, int] | None:
        """(expected dollars, requests) to finish every dataset's budget, in flight included, at the
        run's cost and length per response so far; None if unknown (nothing paid yet, or a dataset
        without a budget that still has prompts)."""
        done = sum(d.budget.done for d in self.datasets)
        samples = sum(d.store.totals.samples for d in self.datasets)
        if done <= 0 or samples <= 0 or self.spend.spent <= 0:
            return None
        left = 0
        for d in self.datasets:
            if d.spec.output_token_budget is None:
                if d.exhausted:
                    continue
                return None
            left += max(0, d.spec.output_token_budget - d.budget.done)
        return left * self.spend.spent / done, math.ceil(left * samples / done)

    def _top_up_usd(self, worst: float) -> float:
        """About what to add to finish with every slot busy to the end: the expected cost of what is
        left, plus a worst case for each slot it will use, less the money left."""
        left = self._left_to_finish()
        if left is None:
            return 0.0
        usd, requests = left
        return max(0.0, usd + min(self.opts.concurrency, requests) * worst - self._money_left())

    def _maybe_wind_down(self) -> None:
        fraction = self.opts.money_bound_stop_fraction
        if self.winding_down or not fraction or self.in_flight >= fraction * min(self.opts.concurrency, self.aimd.limit):
            return
        left = self._left_to_finish()
        if left is None or left[0] <= self._money_left():
            return
        need = left[0]
        why, worst = self.blocked
        top_up = self._top_up_usd(worst)
        money = (f"${self.spend.balance_left - self.spend.floor:.2f} above the balance floor" if why == "balance"
                 else f"${self.spend.limit - self.spend.spent:.2f} below spend_limit_usd")
        action = "top up" if why == "balance" else "raise spend_limit_usd by"
        message = (f"money keeps only {self.in_flight} of {self.opts.concurrency} requests in flight ({money}; each "
                   f"is reserved at its worst case, ${worst:.4f}) and cannot finish the job (about ${need:,.2f} "
                   f"more at the cost per token so far): {action} about ${top_up:,.2f} (what is left, plus a worst "
                   f"case per slot it needs, so every slot stays busy) and re-run stage 02 "
                   f"(money_bound_stop_fraction: 0 spends the rest first)")
        self.winding_down = (why, message)
        self.entry["top_up_usd"] = round(top_up, 2)
        self.log(f"winding down: {message}; starting nothing new, letting the {self.in_flight} requests in flight finish")

    # -- one sample -------------------------------------------------------------------------
    async def _sample(self, d: DatasetQueue, p: Prompt, reserved: float, ticket: int) -> None:
        """One sample to the end: saved, failed for good, out of attempts, or left for a re-run by a
        stop. Only real failures spend attempts; throttling is waited out."""
        msgs_json = client.messages_json(p.messages)
        body = self.bodies.body(msgs_json)
        worst, started = reserved, time.time()
        tokens = None
        failures = throttles = 0
        seen: dict = {}
        try:
            while True:
                self.attempts += 1
                seen = {}
                t0 = time.monotonic()
                res = await client.complete(self.http, self.url, None, body, self.stream, seen=seen)
                if isinstance(res, client.Reply):
                    latency = time.monotonic() - t0
                    self.aimd.observe_latency(latency)
                    self.aimd.on_success()
                    if self.server is not None:
                        res.provider = res.provider or self.source
                    u = res.usage
                    tokens = u["completion_tokens"]
                    if tokens is None:      # no usage came back: count what we got, roughly
                        tokens = max(1, (len(res.content) + len(res.reasoning or "")) // 4)
                    cost = u["cost"] or 0.0
                    self.spend.settle(reserved, cost, u["prompt_tokens"], tokens)
                    reserved = 0.0
                    self._money.set()
                    d.store.write(p.sample_id, self._line(d, p, msgs_json, res, failures + throttles + 1,
                                                          latency, started))
                    d.store.count_reply(u, res.finish_reason, res.provider)
                    self.samples += 1
                    self.tokens += tokens
                    self.cost += cost
                    self.progress.update(tokens)
                    return
                self.errors[res.kind] = self.errors.get(res.kind, 0) + 1
                self._settle_failed(res, reserved)
                reserved = 0.0
                if res.action == "permanent":
                    return self._record_failure(d, p, res, failures + 1, "permanent")
                if res.action == "balance":
                    return self.request_stop("balance", f"the OpenRouter balance ran out ({res.message})")
                if res.action == "fatal":
                    return self.request_stop("fatal", f"{res}: {HINTS.get(res.kind, 'fix that')}")
                if res.action == "throttle":
                    throttles += 1
                    self.aimd.on_throttle()
                    delay = backoff_delay(min(throttles, 8), res.retry_after, self.opts.backoff_base_s,
                                          self.opts.backoff_cap_s)
                else:
                    failures += 1
                    if failures >= self.opts.max_attempts:
                        if self.reason is None:
                            self._record_failure(d, p, res, failures, "exhausted")
                        return
                    delay = backoff_delay(failures, res.retry_after, self.opts.backoff_base_s, self.opts.backoff_cap_s)
                if self.reason is not None:
                    return
                await asyncio.wait((self._stop,), timeout=delay)     # a stop cuts the wait short
                if self.reason is not None:
                    return
                reserved = await self._reserve(worst)
                if not reserved:
                    return
        except asyncio.CancelledError:
            if reserved:        # given up on while in flight: it may still be billed
                self._recover(seen.get("generation_id"), reserved)
                reserved = 0.0
            raise
        finally:
            d.budget.end(ticket, tokens)
            if reserved:
                self.spend.settle(reserved, 0.0)
            self.in_flight -= 1

    # -- money of failed attempts -------------------------------------------------------------
    def _settle_failed(self, res: client.Failure, reserved: float) -> None:
        if res.maybe_billed:
            self._recover(res.generation_id, reserved)
            return
        self.spend.settle(reserved, res.cost)
        self.failed_attempts_cost += res.cost
        self._money.set()

    def _recover(self, generation_id: str | None, reserved: float) -> None:
        """An answer lost after a provider may have taken the request: hold its reservation until
        /generation says what it cost; with no generation id, count it at its worst case."""
        self.lost += 1
        if self.server is not None:   # nothing is billed
            return self.spend.settle(reserved, 0.0)
        if generation_id is None:
            return self._count_unknown(reserved)
        t = asyncio.get_running_loop().create_task(self._ask_cost(generation_id, reserved))
        self.recoveries.add(t)
        t.add_done_callback(self.recoveries.discard)

    async def _ask_cost(self, generation_id: str, reserved: float) -> None:
        cost = None
        try:
            cost = await generation_cost(self.http, self.base, generation_id, self.opts.recovery_patience_s)
        finally:                # also when given up on at the very end: then counted at its worst case
            if cost is None:
                self._count_unknown(reserved)
            else:
                self.spend.settle(reserved, cost)
                self.failed_attempts_cost += cost
                self.recovered += 1
                self._money.set()
            self._wake.set()

    def _count_unknown(self, reserved: float) -> None:
        self.spend.settle(reserved, reserved)
        self.abandoned_reserved += reserved
        self.unknown_bills += 1
        self._money.set()

    def _line(self, d: DatasetQueue, p: Prompt, msgs_json: str, res: client.Reply, attempt: int,
              latency: float, started: float) -> str:
        """The raw_responses.jsonl line; the prompt and the settings are already JSON."""
        rec = json.dumps({
            "sample_id": p.sample_id, "dataset": d.name, "content": res.content, "reasoning": res.reasoning,
            "finish_reason": res.finish_reason, "native_finish_reason": res.native_finish_reason,
            "provider": res.provider, "model": res.model, "generation_id": res.generation_id, "usage": res.usage,
            "attempts": attempt, "latency_s": round(latency, 3), "started_at": round(started, 3),
            "completed_at": round(time.time(), 3), "source": self.source,
            **({"output_ids": res.output_ids, "prompt_ids": res.prompt_ids} if res.output_ids else {})},
            ensure_ascii=False, separators=(",", ":"))
        return f'{rec[:-1]},"messages":{msgs_json},"request":{self.settings_json}}}'

    def _record_failure(self, d: DatasetQueue, p: Prompt, res: client.Failure, attempts: int, action: str) -> None:
        if action == "permanent":
            self.permanent_samples += 1
        else:
            self.exhausted_samples += 1
        d.store.write_error({"sample_id": p.sample_id, "dataset": d.name, "action": action, "kind": res.kind,
                             "status": res.status, "message": res.message, "provider": res.provider,
                             "attempts": attempts, "time": round(time.time(), 3)})

    # -- stopping ---------------------------------------------------------------------------
    def request_stop(self, reason: str, message: str = "") -> None:
        self._money.set()
        if self.reason is None:
            self.reason, self.message = reason, message
            if reason != "finished":
                wait = (f", waiting up to {self.stop_grace_s:.0f}s for the {self.in_flight} requests in flight"
                        if self.in_flight else "")
                self.log(f"stopping: {message or reason}; starting nothing new{wait}")
        if not self._stop.done():
            self._stop.set_result(None)
        self._wake.set()

    def cancel_all(self) -> None:
        """Give up on everything in flight now (a second SIGINT)."""
        self.stop_grace_s = 0
        self.request_stop("interrupted", "interrupted twice")
        for t in list(self.tasks) + list(self.recoveries):
            t.cancel()

    # -- background: balance polling, progress, periodic saves ------------------------------
    async def _poll_balance(self, reader: BalanceReader) -> None:
        while self.reason is None:
            await asyncio.wait((self._stop,), timeout=self.opts.balance_poll_s)
            balance = await reader.read()
            if balance is not None:
                self.spend.set_balance(balance)
                self._wake.set()

    async def _tick(self) -> None:
        last_save = last_t = time.monotonic()
        last_tokens, rate = self.tokens, 0.0
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            rate = 0.7 * rate + 0.3 * (self.tokens - last_tokens) / max(1e-9, now - last_t)
            last_tokens, last_t = self.tokens, now
            self.progress.set(**self._progress_fields(rate))
            self._point()
            self._wake.set()       # the limit may have grown back, or a reservation been freed
            if now - last_save >= 2:
                for d in self.datasets:
                    d.store.sync()
                self._save_manifest()
                last_save = now

    def _point(self) -> None:
        """A line of `timeline.jsonl`, every second of every session: money, slots and tokens now
        (the report's spend-vs-balance and in-flight figures)."""
        if self.timeline is None:
            path = self.folder / "timeline.jsonl"
            repair_tail(path)           # a killed session's torn last line
            self.timeline = open(path, "a", encoding="utf-8")
        left = self.spend.balance_left
        self.timeline.write(json.dumps({
            "t": round(time.time(), 2), "session": len(self.manifest.sessions), "in_flight": self.in_flight,
            "limit": self.aimd.limit, "spent": round(self.spend.spent, 6), "reserved": round(self.spend.reserved, 6),
            "balance": None if left is None else round(left, 6),
            "tokens": {d.name: d.budget.done for d in self.datasets}}) + "\n")
        self.timeline.flush()

    def _progress_fields(self, rate: float) -> dict:
        f = {}
        for d in self.datasets:
            b = d.spec.output_token_budget
            f[d.name] = f"{_short(d.budget.done)}/{_short(b)}" if b else _short(d.budget.done)
        f.update(samples=self.samples, spent=f"${self.spend.spent:.4f}/{self.spend.limit:g}",
                 tok_s=round(rate), in_flight=f"{self.in_flight}/{self.aimd.limit}",
                 err=f"{100 * sum(self.errors.values()) / max(1, self.attempts):.1f}%")
        return f

    # -- the manifest -----------------------------------------------------------------------
    def _dataset_table(self) -> dict:
        out = {}
        for d in self.datasets:
            out[d.name] = {**d.store.totals.as_dict(), "budget": d.spec.output_token_budget, "path": d.spec.path,
                           "failed_for_good": len(d.store.permanent)}
        return out

    def _provider_table(self) -> dict:
        merged: dict[str, dict] = {}
        for d in self.datasets:
            for name, t in d.store.providers.items():
                m = merged.setdefault(name, {"samples": 0, "completion_tokens": 0, "prompt_tokens": 0, "cost": 0.0})
                m["samples"] += t.samples
                m["completion_tokens"] += t.completion_tokens
                m["prompt_tokens"] += t.prompt_tokens
                m["cost"] = round(m["cost"] + t.cost, 8)
        return merged

    def _save_manifest(self, final: bool = False) -> None:
        problems = {d.name: [str(p) for p in d.reader.problems[:20]] +
                    ([f"... {len(d.reader.problems) - 20} more"] if len(d.reader.problems) > 20 else [])
                    for d in self.datasets if d.reader.problems}
        self.entry.update(
            updated=_now(), samples=self.samples, completion_tokens=self.tokens, cost=round(self.cost, 8),
            attempts=self.attempts, errors_by_kind=dict(self.errors),
            failed_attempts_cost=round(self.failed_attempts_cost, 8), reserved_usd=round(self.spend.reserved, 8),
            peak_in_flight=self.peak_in_flight, concurrency_limit=self.aimd.limit, concurrency_cuts=self.aimd.cuts,
            exhausted_samples=self.exhausted_samples, permanent_samples=self.permanent_samples,
            lost_answers=self.lost, lost_answers_costed=self.recovered, unknown_bills=self.unknown_bills,
            abandoned_reserved_usd=round(self.abandoned_reserved, 8),
            skipped_too_long={d.name: d.skipped for d in self.datasets if d.skipped}, malformed_rows=problems)
        if final:
            self.entry.update(ended=_now(), status=self.reason, message=self.message, reserved_usd=0.0)
        self.manifest.write(self.config, self._dataset_table(), self._provider_table(), self.spend.spent)

    # -- the whole session -------------------------------------------------------------------
    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop = loop.create_future()
        self._wake = asyncio.Event()
        self._money = asyncio.Event()      # a reservation was freed
        if not any(d.budget.can_start() and d.peek() for d in self.datasets):
            self.reason = "nothing_to_do"
            self.message = "every dataset is done (budget reached or no prompts left); nothing was requested"
            return self._close()
        budgets = [d.spec.output_token_budget for d in self.datasets]
        self.progress = Progress(total=sum(budgets) if all(budgets) else None, desc="generate", unit="tok")
        self.progress.update(sum(d.budget.done for d in self.datasets))
        _raise_fd_limit(self.opts.concurrency + 256)
        connector = aiohttp.TCPConnector(limit=self.opts.concurrency + 16, limit_per_host=0, ttl_dns_cache=300,
                                         enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.opts.request_timeout_s)
        background: list[asyncio.Task] = []
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self._headers) as session:
                self.http = session
                try:
                    self.server = await bare_server.probe(session, self.base, self.model)
                except ValueError as e:
                    self.reason, self.message = "fatal", str(e)
                    return
                if self.server is not None:
                    await self._bare_main(loop)
                    return
                try:
                    eps = await fetch_endpoints(session, self.base, self.model)
                    if self.policy is not None:
                        self._apply_policy(eps)
                    cat = catalogue(eps, self.model, self.provider, self.sent)
                except (CatalogueError, ValueError) as e:
                    self.reason, self.message = "fatal", str(e)
                    return
                self.spend.set_prices(cat.prompt_price, cat.completion_price, cat.request_price)
                self.check = ContextCheck(cat.context_length, self.max_tokens, self.opts.target_model_path,
                                          self.opts.trust_remote_code)
                reader = BalanceReader(session, self.base)
                self.spend.set_balance(await reader.read())
                background = [loop.create_task(self._poll_balance(reader)), loop.create_task(self._tick())]
                self._save_manifest()
                await self._dispatch()
                await self._drain()
                if self.recoveries:
                    patience = self.opts.recovery_patience_s if self.stop_grace_s else 0.0
                    self.log(f"asking GET /generation what {len(self.recoveries)} lost answers cost "
                             f"(up to {patience:.0f}s)")
                    _, pending = await asyncio.wait(set(self.recoveries), timeout=patience + 1.0)
                    for t in pending:
                        t.cancel()
                    if pending:
                        await asyncio.wait(pending)
        finally:
            for t in background:
                t.cancel()
            if self.reason is None:
                self.reason, self.message = "interrupted", self.message or "interrupted"
            self._close()

    async def _bare_main(self, loop) -> None:
        """A bare OpenAI-compatible server: no prices, balance or routing (every reservation is $0),
        the requests without OpenRouter's fields; the rest as with OpenRouter."""
        self.log(self.server.notice(self.base, self.settings))
        self.source = self.server.engine
        self.settings = self.server.settings(self.settings)
        self.bodies = client.BodyMaker(self.settings)
        self.settings_json = json.dumps(self.settings, ensure_ascii=False, separators=(",", ":"))
        self.config.update(request=self.settings, server=self.server.engine, routing_source=None)
        self.check = ContextCheck(self.server.max_model_len, self.max_tokens, self.opts.target_model_path,
                                  self.opts.trust_remote_code)
        background = loop.create_task(self._tick())
        try:
            self._save_manifest()
            await self._dispatch()
            await self._drain()
        finally:
            background.cancel()

    async def _drain(self) -> None:
        """Let the requests in flight finish, for `stop_grace_s` at most; give up on the rest."""
        if not self.tasks:
            return
        _, pending = await asyncio.wait(set(self.tasks), timeout=self.stop_grace_s)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
            self.log(f"gave up on {len(pending)} requests still in flight after {self.stop_grace_s:.0f}s")

    def _apply_policy(self, eps: list[dict]) -> None:
        """No stage-01 routing: route only where the precision policy allows (the `provider`
        parameter laid over it), and say so."""
        native, allow_unknown = self.policy
        obj, excluded = providers.policy_routing(eps, native, allow_unknown, self.sent)
        self.provider = {**obj, **self.provider}
        self.settings["provider"] = self.provider
        self.bodies = client.BodyMaker(self.settings)
        self.settings_json = json.dumps(self.settings, ensure_ascii=False, separators=(",", ":"))
        self.config["request"] = self.settings
        self.config["routing_source"] = "stage 02 precision policy (no providers/routing.json)"
        gone = "; ".join(f"{x['tag']}: {x['reason']}" for x in excluded) or "none"
        self.log(f"no providers/routing.json from stage 01: applied the precision policy (native {native}) "
                 f"here. Allowed: {', '.join(obj['only'])}. Excluded: {gone}. The fidelity probe did not run: "
                 f"run stage 01 first to also exclude endpoints that answer unlike the first party.")

    def _close(self) -> None:
        for d in self.datasets:
            d.store.close()
        if self.progress is not None:
            self.progress.set(**self._progress_fields(0.0))
            self.progress.close()
        self._save_manifest(final=True)
        if self.progress is not None:       # the session ran: its last point
            self._point()
            self.timeline.close()
        for d in self.datasets:
            if d.reader.problems:
                self.log(d.reader.summary())

    def result(self) -> GenerationResult:
        done = self.reason in ("finished", "nothing_to_do")
        parts = []
        for d in self.datasets:
            t, b = d.store.totals, d.spec.output_token_budget
            ran_out = done and b and d.exhausted and t.completion_tokens < b
            parts.append(f"{d.name}: {t.samples} samples, {t.completion_tokens:,} tokens" + (f" of {b:,}" if b else "")
                         + (" (its prompts ran out below the budget)" if ran_out else "")
                         + (f", {len(d.store.permanent)} failed for good" if d.store.permanent else ""))
        summary = "; ".join(parts)
        stage_01 = ", stage 01 included" if self.stage_01_usd else ""
        spent = (f"spent ${self.cost + self.failed_attempts_cost + self.abandoned_reserved:.4f} this session, "
                 f"${self.spend.spent:.4f} in this run{stage_01} (limit ${self.spend.limit:.2f})")
        lost = self.failed_attempts_cost + self.abandoned_reserved
        if lost > 0:
            unknown = (f", of which ${self.abandoned_reserved:.4f} is counted at its worst case for "
                       f"{self.unknown_bills} requests whose bill could not be read" if self.unknown_bills else "")
            paid = f"Paid for and not saved this session: ${lost:.4f} (failed attempts that were billed{unknown})"
        else:
            paid = "Nothing paid for was lost"
        if done:
            head = self.message + ": " if self.reason == "nothing_to_do" else "finished: "
            msg = f"{head}{summary}; {spent}. {paid}."
            if self.exhausted_samples:
                msg += (f" {self.exhausted_samples} samples were GIVEN UP after {self.opts.max_attempts} failed "
                        f"attempts each (errors.jsonl); a re-run tries them again.")
        else:
            msg = (f"stopped: {self.message}. Done so far: {summary}; {spent}. {paid}; every saved response is "
                   f"kept: {TODO.get(self.reason, 're-run')} and it resumes where it stopped.")
            if self.exhausted_samples:
                msg += f" {self.exhausted_samples} samples were given up this session (a re-run tries them again)."
        return GenerationResult("finished" if done else "stopped", self.reason, msg, self.folder,
                                self.spend.spent, dict(self.entry), self._dataset_table())


def _raise_fd_limit(need: int) -> None:
    """One socket per request in flight: make sure the process may open that many files."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < need:
            print(f"warning: the open-file limit ({hard}) is below concurrency + 256 = {need}; "
                  f"raise it (ulimit -n) or lower concurrency")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _short(n: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


# --- the entry point ---------------------------------------------------------------------------

def run_generation(base_url: str, api_key, run: Run, datasets: list[dict], model: str, max_tokens: int,
                   concurrency: int, spend_limit_usd: float, temperature: float | None = None,
                   top_p: float | None = None, seed: int | None = None, provider: dict | None = None,
                   reasoning: dict | None = None, stream: bool = False, native_precision: str | None = None,
                   allow_unknown_quantization: bool = False, imports: list[dict] | None = None, log=print,
                   **options) -> GenerationResult:
    """Generate responses for `datasets` into `run.dir("generate")`, resuming whatever is there.
    `options`: the other fields of `Options` (balance_floor_usd, max_attempts, request_timeout_s, ...).
    Without stage 01's routing.json, `native_precision` is required: the engine then applies the
    precision policy itself. Prompts answered by an import file (`imports`, see imports.py) are not
    asked for: they are never paid for twice.

    Runs its own event loop (in a thread when one is already running, as in Jupyter). SIGINT and
    SIGTERM stop it cleanly; a second SIGINT gives up on the requests in flight at once."""
    datasets = [{**d, "path": str(resolve(d["path"]))} if isinstance(d, dict) and isinstance(d.get("path"), str)
                else d for d in datasets]
    specs = parse_datasets(datasets)
    for spec in specs:
        if not Path(spec.path).is_file():
            raise FileNotFoundError(f"datasets: file of dataset {spec.name!r} not found: {spec.path}")
    opts = Options(concurrency, spend_limit_usd, **options)
    base_routing = stage_01_routing(run)
    policy = None
    if base_routing is None:
        if not native_precision:
            raise ValueError(f"no {run.root / 'providers' / 'routing.json'} (stage 01 has not run for run "
                             f"{run.name!r}) and no native_precision: run stage 01 first, or set native_precision so "
                             f"that stage 02 applies the precision policy itself")
        policy = (native_precision, allow_unknown_quantization)
    settings = client.request_settings(model, max_tokens, temperature, top_p, seed,
                                       {**(base_routing or {}), **(provider or {})}, reasoning, stream)
    config = {"base_url": base_url, "key_source": api_key.source, "datasets": datasets, "request": settings,
              "routing_source": "providers/routing.json" if base_routing is not None else None,
              **{k: v for k, v in vars(opts).items() if k != "target_model_path"}}
    engine = Engine(base_url, api_key, run, specs, settings, opts, config, log, policy)
    import_specs = parse_imports(imports or [], [s.name for s in specs])
    for d in engine.datasets:
        d.answered = answered(import_specs, d.name)
        if d.answered:
            log(f"{d.name}: prompts that an import file answers are skipped (stage 03 reads that file)")
    _run_with_signals(engine)
    return engine.result()


def _run_with_signals(engine: Engine) -> None:
    """Run the engine's event loop; SIGINT/SIGTERM ask it to stop (a second one: at once)."""
    state = {"loop": None, "signals": 0}

    def stop(loop) -> None:
        if state["signals"] == 1:
            loop.call_soon_threadsafe(engine.request_stop, "interrupted", f"{state['name']} received")
        else:
            loop.call_soon_threadsafe(engine.cancel_all)

    def on_signal(signum, frame=None) -> None:
        state["signals"] += 1
        state["name"] = signal.Signals(signum).name
        if state["loop"] is not None:
            stop(state["loop"])

    async def body() -> None:
        state["loop"] = asyncio.get_running_loop()
        if state["signals"]:            # a signal came before the loop did
            stop(state["loop"])
        await engine.main()

    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, on_signal)
    try:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(body())         # a script, or papermill's kernel cell without a loop
            return
        # Jupyter already runs a loop in this thread: run ours in another, wait here (signals land here).
        errors: list[BaseException] = []

        def target() -> None:
            try:
                asyncio.run(body())
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)

        th = threading.Thread(target=target, name="draftsmith-generate", daemon=True)
        th.start()
        while th.is_alive():
            th.join(0.2)
        if errors:
            raise errors[0]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
