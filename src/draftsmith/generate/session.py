"""A session of stage 02 (one start or resume of a run): one aiohttp client carries up to
`concurrency` requests at once, shared by all datasets.

A slot freed by one dataset goes to whichever dataset still has budget and prompts (round robin),
so the run stays full until the last budget is reached; each start reserves its worst-case dollars
first (openrouter/budget.py). A stop (money, a refusal, SIGINT/SIGTERM, a write error) starts
nothing new, lets the requests in flight finish for a grace period and closes the files, so a
re-run resumes exactly where this one ended. The session also keeps its own books: the progress
line, a timeline point every second, the manifest every two seconds, and the closing `result()`.

Against a bare OpenAI-compatible server (the user's own vLLM or SGLang: `GET /key` answers 404,
`BareServer`) the balance, catalogue, routing and cost are off, with a line saying so; the
server's `GET /models` must list `model`, its `owned_by` names the samples' source and its
`max_model_len` bounds the prompts; vLLM is asked for the ids it sampled (`return_token_ids`),
saved with each response for stage 03."""

from __future__ import annotations

import asyncio
import gc
import json
import time
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from ..openrouter import client
from . import outputs
from ..openrouter.budget import SpendBudget, TokenBudget
from ..openrouter.client import KeepaliveWatch, request_deadline
from ..config import GenerateConfig
from ..datasets import DatasetSpec
from ..paths import Run
from ..openrouter.pricing import BalanceReader, CatalogueError, catalogue, fetch_endpoints, policy_routing
from ..progress import Progress
from ..providers import outputs as stage_01
from ..openrouter.retry import Aimd
from . import attempts
from .prompt_queue import ContextCheck, DatasetQueue

GC_GEN0_THRESHOLD = 20_000  # objects allocated between young collections while a session runs (Python: 700)
STOPPED_PATIENCE_S = 5.0     # after an interrupt or a write error: how long to ask what lost answers cost
WRITE_ERROR_GRACE_S = 5.0    # after a write error: how long the requests in flight may come back


@dataclass(frozen=True)
class Tuning:
    """The session's clocks that no stage config declares: tests and benchmarks turn them
    (`stage.run_at(..., **knobs)`)."""

    balance_poll_s: float = 15.0
    fsync_s: float = 5.0
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    recovery_patience_s: float = 120.0   # how long to keep asking /generation the cost of a lost answer


@dataclass
class GenerationResult:
    """What stage 02 answers; `raise_if_incomplete` makes a stopped run fail its notebook."""

    status: str                 # finished | stopped
    reason: str                 # finished | nothing_to_do | balance | spend_limit | fatal | unavailable | interrupted
    #                             | write_error (the store could not write) | no_room (the disk cannot hold the plan)
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


class Session:
    """One session (a start or a resume): the slots, the money (`spend`) and the counts (`counts`,
    `attempts.Counts`). Only the session sets its own attributes: a sample's attempts (attempts.Sampler)
    are given what they use, add to `counts`, settle `spend` and return a stop for the session to
    make."""

    def __init__(self, base_url: str, api_key, run: Run, specs: list[DatasetSpec], settings: dict,
                 cfg: GenerateConfig, tuning: Tuning, config: dict, log=print,
                 policy: tuple[str, bool] | None = None):
        """`cfg`: notebook 02's settings, read here as they are; `settings`: the request settings
        built from them (`client.request_settings`). `policy`: (native_precision, allow_unknown) when there is no stage-01 routing and the
        session must build it from the endpoint list; `settings["provider"]` is then laid over it."""
        self.base = base_url.rstrip("/")
        self._headers = {**api_key.header(), "Content-Type": "application/json", "X-Title": "draftsmith",
                         **client.NO_CACHE}
        self.cfg, self.tuning, self.config, self.log = cfg, tuning, config, log
        self.folder = run.dir("generate")
        self.model, self.provider, self.max_tokens = settings["model"], settings.get("provider") or {}, settings["max_tokens"]
        self.stop_grace_s = cfg.stop_grace_s
        # every request has a deadline (by default from `max_tokens` and the slowest credible rate), and
        # a stream one more rule (no data chunk for `request_timeout_s`): keep-alive never holds a
        # slot past them, so neither the end of a run nor a stop waits longer on a stalled request
        self.deadline_s = request_deadline(self.max_tokens, cfg.request_timeout_s, cfg.request_deadline_s)
        self.watch = KeepaliveWatch()       # the requests waiting on keep-alive alone (the progress line)
        self.settings, self.policy = settings, policy
        self.sent = client.sent_parameters(settings)

        self.manifest = outputs.open_manifest(run)
        self.datasets: list[DatasetQueue] = []
        self.stage_01_usd = stage_01.spent(run)
        self.routing_name = str(stage_01.routing_file(run).relative_to(run.root))   # named in messages
        config["stage_01_spent_usd"] = self.stage_01_usd
        spent = self.manifest.spent_outside_responses + self.stage_01_usd
        for spec in specs:
            saved = outputs.open_dataset(run, spec.name, tuning.fsync_s)
            for note in saved.notes:
                log(f"resume: {note}")
            budget = TokenBudget(spec.output_token_budget, self.max_tokens)
            for duration, n in saved.lengths:
                budget.add(n, duration)
            saved.lengths = []
            spent += saved.totals.cost + saved.set_aside.cost    # answers set aside were paid for too
            self.datasets.append(DatasetQueue(spec, saved, budget))
        self.spend = SpendBudget(cfg.spend_limit_usd, cfg.balance_floor_usd, spent)
        self.aimd = Aimd(cfg.concurrency)
        self.outage = attempts.Outage(cfg.outage_limit_s)
        self.check: ContextCheck | None = None
        self.server: BareServer | None = None   # set when api_base is not OpenRouter
        self.sampler: attempts.Sampler | None = None         # once the session is open
        self.progress: Progress | None = None
        self.http: aiohttp.ClientSession | None = None

        self.in_flight = 0
        self.counts = attempts.Counts()
        self.tasks: set[asyncio.Task] = set()
        self.reason: str | None = None       # why the session ended (None while running)
        self.message = ""
        self.balance_reader: BalanceReader | None = None     # None: a bare server, no balance
        self.blocked: tuple[str, float] | None = None   # (spend_limit | balance, worst cost) if dollars stopped a start
        self.winding_down: tuple[str, str] | None = None  # (reason, message): stopping for a top-up once in flight ends
        self.write_error: str | None = None                    # what the store could not write
        self.was_full = False        # every slot was busy at some moment (`_wind_down`)
        self.recoveries: set[asyncio.Task] = set()             # asking /generation what one cost
        self.wake = asyncio.Event()             # a slot, a reservation or the limit may have freed up
        self.money_freed = asyncio.Event()      # a reservation was freed
        self.stopped: asyncio.Future | None = None    # done once the session stops (made by `main`'s loop)
        self._rr = 0
        self.entry = {"started": now(), "status": "running",      # this session's line in the manifest
                      "samples_at_start": sum(len(d.store.done) for d in self.datasets),
                      "request_deadline_s": round(self.deadline_s, 3)}
        self.manifest.sessions.append(self.entry)
        self.timeline = outputs.open_timeline(run)    # a point every second (`_point`)

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
                self.blocked = (self.spend.binding, worst)
                self._maybe_wind_down()
                return None
            self.blocked = None
            d.take()
            self._rr = (self._rr + i + 1) % n
            self.in_flight += 1
            self.counts.peak_in_flight = max(self.counts.peak_in_flight, self.in_flight)
            self.was_full = self.was_full or self.in_flight >= min(self.cfg.concurrency, self.aimd.limit)
            return d, p, worst, d.budget.start()
        return None

    async def _dispatch(self) -> None:
        """Start a worker per free slot. A worker keeps taking jobs itself when it finishes one, so
        this loop only wakes when a worker runs dry, on the periodic tick, or at a stop."""
        loop = asyncio.get_running_loop()
        while self.reason is None:
            try:
                while (job := self._take()) is not None:
                    t = loop.create_task(self._worker(job))
                    self.tasks.add(t)
                    t.add_done_callback(self.tasks.discard)
            except OSError as e:        # setting aside a prompt too long for the context (errors.jsonl)
                self.write_failed(e)
                break
            if self.in_flight == 0 and self.reason is None:
                if self.winding_down:
                    self.request_stop(*self.winding_down)
                    break
                if not (self.blocked and any(d.budget.can_start() and d.peek(self.check) for d in self.datasets)):
                    self.request_stop("finished")
                    break
                if not self.recoveries:         # else their reservations may yet be freed
                    if await self._balance_reread_fits():
                        continue
                    self._stop_blocked()
                    break
            self.wake.clear()
            await self.wake.wait()

    async def _worker(self, job: tuple) -> None:
        while job is not None:
            try:
                end = await self.sampler.sample(*job)
            except OSError as e:        # a write that sample() does not itself turn into NotSaved
                end = attempts.NotSaved(e)
            finally:
                self.in_flight -= 1
            if isinstance(end, attempts.Stop):
                self.request_stop(end.reason, end.message)
            elif isinstance(end, attempts.NotSaved):
                self.write_failed(end.error, end.path, end.cost)
            job = self._take()
        self.wake.set()

    def write_failed(self, e: OSError, path=None, cost: float | None = None) -> None:
        """The store could not write (a full disk): count an answer paid for and not saved (`cost`,
        when it was one), stop starting requests, give those in flight a few seconds to come back
        and be saved, and give up on them at the next failure."""
        if cost is not None:
            self.counts.unsaved_answers += 1
            self.counts.unsaved_cost += cost
        if self.write_error:
            return self.cancel_all()
        self.write_error = f"writing {path or e.filename or self.folder} failed: {e.strerror or e}"
        self.stop_grace_s = min(self.stop_grace_s, WRITE_ERROR_GRACE_S)
        self.request_stop("write_error", self.write_error)

    async def reserve(self, worst: float) -> float:
        """Reserve the dollars of a retry, waiting while other requests hold them; 0.0 if the run
        stops first (or must stop: nothing else holds money, and still it does not fit)."""
        while self.reason is None:
            if self.spend.try_reserve(worst):
                return worst
            self.blocked = (self.spend.binding, worst)
            if self.spend.reserved <= 1e-12 and not self.recoveries:
                if await self._balance_reread_fits():
                    continue
                self._stop_blocked()
                break
            self.money_freed.clear()
            try:
                await asyncio.wait_for(self.money_freed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        return 0.0

    async def _balance_reread_fits(self) -> bool:
        """Before the balance stops the run, with nothing in flight: read it again, and say whether
        the blocked start now fits. Until a poll, the balance left counts from the spend when the
        last poll was sent, so a bill the server had counted before answering it is counted twice
        (`SpendBudget.set_balance`); with nothing in flight the balance read now is the whole truth."""
        if (self.blocked is None or self.blocked[0] != "balance" or self.balance_reader is None
                or self.spend.spent == self.spend.spent_at_poll):
            return False
        if not await self._read_balance(self.balance_reader):
            return False
        return self.spend.headroom() >= self.blocked[1]

    # -- stopping ---------------------------------------------------------------------------
    def _stop_blocked(self) -> None:
        """Money refused a start and nothing can free any: stop, saying about what to add."""
        message, top_up = self._blocked_message(*self.blocked)
        if top_up:
            self.entry["top_up_usd"] = top_up     # what to add, for whoever re-runs it (bench/rehearsal.py)
        self.request_stop(self.blocked[0], message)

    def _maybe_wind_down(self) -> None:
        """In the money-bound tail (`_wind_down`): start nothing new, stop once in flight ends."""
        if self.winding_down:
            return
        stop = self._wind_down(*self.blocked)
        if stop is None:
            return
        message, top_up = stop
        self.winding_down = (self.blocked[0], message)
        self.entry["top_up_usd"] = top_up
        self.log(f"winding down: {message}; starting nothing new, letting the {self.in_flight} requests in flight finish")

    def request_stop(self, reason: str, message: str = "") -> None:
        """Start nothing new; the requests in flight get `stop_grace_s` (at most the deadline) to
        finish and be saved, then the session asks the cost of what it gave up on. After an
        interrupt or a write error that asking is cut to `STOPPED_PATIENCE_S` (what it does not
        learn is counted at its worst case), so a stop button frees the cell in seconds."""
        self.money_freed.set()
        if self.reason is None:
            self.reason, self.message = reason, message
            if reason != "finished":
                wait = (f", waiting up to {self.stop_grace_s:.0f}s for the {self.in_flight} requests in flight"
                        if self.in_flight else "")
                self.log(f"stopping: {message or reason}; starting nothing new{wait}")
        if not self.stopped.done():
            self.stopped.set_result(None)
        self.wake.set()

    def cancel_all(self) -> None:
        """Give up on everything in flight now (a second SIGINT, a second write error)."""
        self.stop_grace_s = 0
        self.request_stop("interrupted", "interrupted twice")
        for t in list(self.tasks) + list(self.recoveries):
            if t is not asyncio.current_task():
                t.cancel()

    # -- background: balance polling, progress, periodic saves ------------------------------
    async def _read_balance(self, reader: BalanceReader) -> bool:
        """Reads the balance into the spend budget, counted from the spend when it was asked
        (`SpendBudget.set_balance`); False when there was none to read (the last one stays)."""
        spent = self.spend.spent
        balance = await reader.read()
        if balance is not None:
            self.spend.set_balance(balance, spent)
        return balance is not None

    async def _poll_balance(self, reader: BalanceReader) -> None:
        while self.reason is None:
            await asyncio.wait((self.stopped,), timeout=self.tuning.balance_poll_s)
            if await self._read_balance(reader):
                self.wake.set()

    # -- the whole session -------------------------------------------------------------------
    async def main(self) -> None:
        with fewer_collections():
            await self._main()

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        self.stopped = loop.create_future()
        if not any(d.budget.can_start() and d.peek() for d in self.datasets):
            self.reason = "nothing_to_do"
            self.message = "every dataset is done (budget reached or no prompts left); nothing was requested"
            return self._close()
        problem = outputs.room_problem(self.folder, self._expected_bytes())
        if problem:
            self.reason, self.message = "no_room", problem
            return self._close()
        budgets = [d.spec.output_token_budget for d in self.datasets]
        self.progress = Progress(total=sum(budgets) if all(budgets) else None, desc="generate", unit="tok")
        self.progress.update(sum(d.budget.done for d in self.datasets))
        _raise_fd_limit(self.cfg.concurrency + 256)
        connector = aiohttp.TCPConnector(limit=self.cfg.concurrency + 16, limit_per_host=0, ttl_dns_cache=300,
                                         enable_cleanup_closed=True)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.cfg.request_timeout_s)
        background: list[asyncio.Task] = []
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self._headers) as http:
                self.http = http
                try:
                    self.server = await probe_bare_server(http, self.base, self.model)
                except ValueError as e:
                    self.reason, self.message = "fatal", str(e)
                    return
                if self.server is not None:
                    await self._bare_main(loop)
                    return
                try:
                    eps = await fetch_endpoints(http, self.base, self.model)
                    if self.policy is not None:
                        self._apply_policy(eps)
                    cat = catalogue(eps, self.model, self.provider, self.sent)
                except (CatalogueError, ValueError) as e:
                    self.reason, self.message = "fatal", str(e)
                    return
                self.spend.set_prices(cat.prompt_price, cat.completion_price, cat.request_price)
                self.check = ContextCheck(cat.context_length, self.max_tokens, self.cfg.target_model_path,
                                          self.cfg.trust_remote_code)
                reader = self.balance_reader = BalanceReader(http, self.base)
                await self._read_balance(reader)
                self.sampler = self._sampler(http, "openrouter")
                background = [loop.create_task(self._poll_balance(reader)), loop.create_task(self._tick())]
                self._save_manifest()
                await self._dispatch()
                await self._drain()
                if self.recoveries:
                    patience = self.tuning.recovery_patience_s if self.stop_grace_s else 0.0
                    if self.reason in ("interrupted", "write_error"):
                        patience = min(patience, STOPPED_PATIENCE_S)
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

    def _expected_bytes(self) -> int:
        """What this session expects to save: per dataset, the prompts left (lines of its file not
        yet answered) at the mean length so far (half of max_tokens before any), up to its budget.
        The disk must hold it before anything is asked."""
        need = 0
        for d in self.datasets:
            with open(d.spec.path, "rb") as f:
                lines = max(1, sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b"")))
            prompts = max(0, lines - len(d.store.done) - len(d.store.permanent))
            t = d.store.totals
            mean = t.completion_tokens / t.samples if t.samples else self.max_tokens / 2
            tokens = prompts * mean
            if d.spec.output_token_budget:
                tokens = min(tokens, max(0, d.spec.output_token_budget - d.budget.done))
            need += outputs.expected_bytes(os.path.getsize(d.spec.path) / lines, tokens / max(1.0, mean), tokens)
        return need

    def _sampler(self, http: aiohttp.ClientSession, source: str) -> attempts.Sampler:
        """What this session's attempts use (attempts.py), the request settings final."""
        wire = attempts.Wire(http, self.base, client.BodyMaker(self.settings), bool(self.settings.get("stream")),
                             json.dumps(self.settings, ensure_ascii=False, separators=(",", ":")), source,
                             billed=self.server is None, model=self.model, deadline_s=self.deadline_s,
                             progress_s=self.cfg.request_timeout_s, watch=self.watch)
        return attempts.Sampler(wire, self.spend, self.counts, self.aimd, self.outage, self.progress,
                                self.cfg.max_attempts, self.tuning.backoff_base_s, self.tuning.backoff_cap_s,
                                self.tuning.recovery_patience_s, self.stopped, self.money_freed, self.wake, self.recoveries, self.reserve)

    async def _bare_main(self, loop) -> None:
        """A bare OpenAI-compatible server: no prices, balance or routing (every reservation is $0),
        the requests without OpenRouter's fields; the rest as with OpenRouter."""
        self.log(self.server.notice(self.base, self.settings))
        self.settings = self.server.settings(self.settings)
        self.sampler = self._sampler(self.http, self.server.engine)
        self.config.update(request=self.settings, server=self.server.engine, routing_source=None)
        self.check = ContextCheck(self.server.max_model_len, self.max_tokens, self.cfg.target_model_path,
                                  self.cfg.trust_remote_code)
        background = loop.create_task(self._tick())
        try:
            self._save_manifest()
            await self._dispatch()
            await self._drain()
        finally:
            background.cancel()

    async def _drain(self) -> None:
        """Let the requests in flight finish, for `stop_grace_s` and never longer than a request's
        deadline (each ends by its own anyway); give up on the rest."""
        if not self.tasks:
            return
        grace = min(self.stop_grace_s, self.deadline_s)
        _, pending = await asyncio.wait(set(self.tasks), timeout=grace)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
            self.log(f"gave up on {len(pending)} requests still in flight after {grace:.0f}s")

    def _apply_policy(self, eps: list[dict]) -> None:
        """No stage-01 routing: route only where the precision policy allows (the `provider`
        parameter laid over it), and say so."""
        native, allow_unknown = self.policy
        obj, excluded = policy_routing(eps, native, allow_unknown, self.sent)
        self.provider = {**obj, **self.provider}
        self.settings["provider"] = self.provider
        self.config["request"] = self.settings
        self.config["routing_source"] = f"stage 02 precision policy (no {self.routing_name})"
        gone = "; ".join(f"{x['tag']}: {x['reason']}" for x in excluded) or "none"
        self.log(f"no {self.routing_name} from stage 01: applied the precision policy (native {native}) "
                 f"here. Allowed: {', '.join(obj['only'])}. Excluded: {gone}. The fidelity probe did not run: "
                 f"run stage 01 first to also exclude endpoints that answer unlike the first party.")

    def _close(self) -> None:
        for d in self.datasets:
            self._closing(d.store.close, d.store.raw_path)
        if self.progress is not None:
            self.progress.set(**self._progress_fields(0.0))
            self.progress.close(ended=self.reason in ("finished", "nothing_to_do"))
        self._closing(lambda: self._save_manifest(final=True), self.manifest.path)
        if self.progress is not None:       # the session ran: its last point
            self._closing(lambda: self._point(), self.timeline.path)
            self.timeline.close()
        for d in self.datasets:
            if d.reader.problems:
                self.log(d.reader.summary())

    def _closing(self, write, path) -> None:
        """A last write of the session; one the disk refuses is said, and ends the session as a write error."""
        try:
            write()
        except OSError as e:
            self.log(f"could not write {path}: {e.strerror or e}")
            if self.reason in (None, "finished", "nothing_to_do"):
                self.reason = "write_error"
                self.message = f"writing {path} failed: {e.strerror or e}"
            self.write_error = self.write_error or self.message


    # -- money: what a stop says, and the stop for a top-up ------------------------------------
    # Each request is reserved at its worst case (about 3x an average one), so once the money left is
    # less than `concurrency` worst cases, fewer requests fit in flight, and the last of the balance
    # is spent at a trickle. When the money cannot finish the job anyway, that trickle only delays
    # the top-up the job needs: below `money_bound_stop_fraction` of the slots, stop starting
    # requests, let those in flight finish (they are paid for), and stop with what to top up.
    # That tail is the end of a session that had every slot busy. A session whose money never filled
    # the slots (it started with a small balance) has no such tail: it is all trickle, and stopping it
    # would buy nothing at all, so it spends down to the floor at the concurrency its money allows and
    # ends with the balance stop.

    def _blocked_message(self, why: str, worst: float) -> tuple[str, float]:
        """(the stop's message, the top-up to finish rounded to cents, 0.0 if unknown) for a start of
        worst case `worst` that the `why` limit (balance | spend_limit) refused."""
        spend = self.spend
        top_up = round(self._top_up_usd(worst), 2)
        if why == "balance":
            floor = f" (balance_floor_usd ${spend.floor:.2f})" if spend.floor else ""
            return (f"the balance ran out: ${spend.balance_left:.4f} left{floor}, less than the next "
                    f"request could cost (${worst:.4f} at max_tokens on the dearest allowed provider)"
                    + (f"; top up about ${top_up:,.2f} to finish" if top_up else "")), top_up
        return (f"spend_limit_usd ${spend.limit:.2f} reached: spent ${spend.spent:.4f}, and the next "
                f"request could cost ${worst:.4f}, more than the ${spend.limit_left:.4f} left"
                + (f"; raise it by about ${top_up:,.2f} to finish" if top_up else "")), top_up

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

    def _top_up_usd(self, worst: float, left: tuple[float, int] | None = None) -> float:
        left = left or self._left_to_finish()
        return 0.0 if left is None else self.spend.top_up(*left, self.cfg.concurrency, worst)

    def _wind_down(self, why: str, worst: float) -> tuple[str, float] | None:
        """(the message, the top-up rounded to cents) when the run should stop for a top-up now that
        `why` refused a start of worst case `worst`; None while it should go on."""
        fraction = self.cfg.money_bound_stop_fraction
        if (not fraction or not self.was_full
                or self.in_flight >= fraction * min(self.cfg.concurrency, self.aimd.limit)):
            return None
        left = self._left_to_finish()
        if left is None or left[0] <= self.spend.left:
            return None
        need = left[0]
        top_up = round(self._top_up_usd(worst, left), 2)
        money = (f"${self.spend.left:.2f} above the balance floor" if why == "balance"
                 else f"${self.spend.left:.2f} below spend_limit_usd")
        action = "top up" if why == "balance" else "raise spend_limit_usd by"
        return (f"money keeps only {self.in_flight} of {self.cfg.concurrency} requests in flight ({money}; each "
                f"is reserved at its worst case, ${worst:.4f}) and cannot finish the job (about ${need:,.2f} "
                f"more at the cost per token so far): {action} about ${top_up:,.2f} (what is left, plus a worst "
                f"case per slot it needs, so every slot stays busy) and re-run stage 02 "
                f"(money_bound_stop_fraction: 0 spends the rest first)"), top_up

    # -- bookkeeping: the progress line, the timeline, the manifest, the result -----------------

    async def _tick(self) -> None:
        last_save = last_t = time.monotonic()
        last_tokens, rate = self.counts.completion_tokens, 0.0
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            rate = 0.7 * rate + 0.3 * (self.counts.completion_tokens - last_tokens) / max(1e-9, now - last_t)
            last_tokens, last_t = self.counts.completion_tokens, now
            self.progress.set(**self._progress_fields(rate))
            self.wake.set()       # the limit may have grown back, or a reservation been freed
            try:
                self._point()
                if now - last_save >= 2:
                    for d in self.datasets:
                        d.store.sync()
                    self._save_manifest()
                    last_save = now
            except OSError as e:    # a full disk: the session stops (write_failed)
                self.write_failed(e)

    def _point(self) -> None:
        """A line of `timeline.jsonl`, every second of every session: money, slots and tokens now
        (the report's spend-vs-balance and in-flight figures)."""
        left = self.spend.balance_left
        self.timeline.append({
            "t": round(time.time(), 2), "session": len(self.manifest.sessions), "in_flight": self.in_flight,
            "limit": self.aimd.limit, "spent": round(self.spend.spent, 6), "reserved": round(self.spend.reserved, 6),
            "balance": None if left is None else round(left, 6),
            "tokens": {d.name: d.budget.done for d in self.datasets}})

    def _progress_fields(self, rate: float) -> dict:
        """The progress line's fields; `padding`: the requests whose reply has been keep-alive alone
        (whitespace, SSE comments) for longer than request_timeout_s, each given up at its deadline."""
        f = {}
        for d in self.datasets:
            b = d.spec.output_token_budget
            f[d.name] = f"{short(d.budget.done)}/{short(b)}" if b else short(d.budget.done)
        f.update(samples=self.counts.samples, spent=f"${self.spend.spent:.4f}/{self.spend.limit:g}",
                 tok_s=round(rate), in_flight=f"{self.in_flight}/{self.aimd.limit}",
                 err=f"{100 * sum(self.counts.errors_by_kind.values()) / max(1, self.counts.attempts):.1f}%",
                 padding=self.watch.waiting(self.cfg.request_timeout_s))
        return f

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
            updated=now(), **self.counts.entry(), reserved_usd=round(self.spend.reserved, 8),
            concurrency_limit=self.aimd.limit, concurrency_cuts=self.aimd.cuts,
            skipped_too_long={d.name: d.skipped for d in self.datasets if d.skipped}, malformed_rows=problems)
        if final:
            self.entry.update(ended=now(), status=self.reason, message=self.message, reserved_usd=0.0)
        self.manifest.write(self.config, self._dataset_table(), self._provider_table(), self.spend.spent)

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
        c = self.counts
        lost = c.failed_attempts_cost + c.abandoned_reserved_usd + c.unsaved_cost
        spent = (f"spent ${c.cost + lost:.4f} this session, "
                 f"${self.spend.spent:.4f} in this run{stage_01} (limit ${self.spend.limit:.2f})")
        if lost > 0:
            unknown = (f", of which ${c.abandoned_reserved_usd:.4f} is counted at its worst case for "
                       f"{c.unknown_bills} requests whose bill could not be read" if c.unknown_bills else "")
            parts = [f"failed attempts that were billed{unknown}"] if lost > c.unsaved_cost else []
            if c.unsaved_answers:
                parts.append(f"${c.unsaved_cost:.4f} for {c.unsaved_answers} answers that came back and could not be written")
            paid = f"Paid for and not saved this session: ${lost:.4f} ({'; '.join(parts)})"
        else:
            paid = "Nothing paid for was lost"
        cached = c.errors_by_kind.get("cached", 0)
        if cached:
            paid += (f". {cached} replies came from OpenRouter's response cache (copies of earlier answers, usage "
                     f"zeroed) although every request sends X-OpenRouter-Cache: false: none was saved; turn caching "
                     f"off in the key's preset")
        if done:
            head = self.message + ": " if self.reason == "nothing_to_do" else "finished: "
            msg = f"{head}{summary}; {spent}. {paid}."
            if c.exhausted_samples:
                msg += (f" {c.exhausted_samples} samples were GIVEN UP after {self.cfg.max_attempts} failed "
                        f"attempts each ({outputs.ERRORS}); a re-run tries them again.")
        else:
            msg = (f"stopped: {self.message}. Done so far: {summary}; {spent}. {paid}; every saved response is "
                   f"kept: {TODO.get(self.reason, 're-run')} and it resumes where it stopped.")
            if c.exhausted_samples:
                msg += f" {c.exhausted_samples} samples were given up this session (a re-run tries them again)."
        return GenerationResult("finished" if done else "stopped", self.reason, msg, self.folder,
                                self.spend.spent, dict(self.entry), self._dataset_table())


# ---- a bare OpenAI-compatible server ----
OPENROUTER_ONLY = ("provider", "reasoning")  # request fields only OpenRouter understands


@dataclass(frozen=True)
class BareServer:
    engine: str                  # `owned_by` of the served model: vllm, sglang, ...
    max_model_len: int | None

    @property
    def returns_ids(self) -> bool:
        return self.engine == "vllm"

    def settings(self, settings: dict) -> dict:
        """The request settings for this server: OpenRouter's own fields left out, the sampled ids
        asked for where the engine returns them, usage asked for in a stream."""
        out = {k: v for k, v in settings.items() if k not in OPENROUTER_ONLY}
        if self.returns_ids:
            out["return_token_ids"] = True
        if out.get("stream"):
            out["stream_options"] = {"include_usage": True}
        return out

    def notice(self, base: str, settings: dict) -> str:
        dropped = [k for k in OPENROUTER_ONLY if settings.get(k)]
        return (f"{base} is a bare OpenAI-compatible server ({self.engine}), not OpenRouter: no balance, no endpoint "
                f"catalogue, no cost, so spend_limit_usd and balance_floor_usd do not apply"
                + (f"; not sent: {', '.join(dropped)} (OpenRouter only)" if dropped else "")
                + ("; the sampled token ids are saved with each response" if self.returns_ids
                   else "; this engine returns no token ids: stage 03 rebuilds them from the text"))


async def probe_bare_server(session: aiohttp.ClientSession, base: str, model: str) -> BareServer | None:
    """None for OpenRouter (or the local emulator); a BareServer for a server without `/key`.
    Raises ValueError when that server does not serve `model`."""
    try:
        async with session.get(f"{base}/key") as r:
            if r.status != 404:
                return None
        async with session.get(f"{base}/models") as r:
            listing = await r.json(content_type=None) if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None                  # unreachable or odd: the OpenRouter path reports it
    cards = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(cards, list):
        return None
    served = {c.get("id"): c for c in cards if isinstance(c, dict)}
    if model not in served:
        raise ValueError(f"{base} serves {sorted(map(str, served))}, not model {model!r}: set model to the "
                         f"served name (vllm serve --served-model-name)")
    card = served[model]
    length = card.get("max_model_len")
    return BareServer(str(card.get("owned_by") or "openai-compatible"),
                      length if isinstance(length, int) and length > 0 else None)


@contextmanager
def fewer_collections():
    """While a session runs, the cyclic garbage collector costs as much CPU as everything a session
    adds to a bare HTTP loop (bench/bench_generate.py): with thousands of requests in flight, each
    young collection at Python's threshold (700 allocations) walks the live request state again,
    and every full one walks the imported libraries too. So the objects alive at the start are
    frozen (never walked again; unfrozen after) and young collections run every GC_GEN0_THRESHOLD
    allocations; cycles are still collected."""
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count() == 0
    if frozen:
        gc.freeze()
    gc.set_threshold(max(threshold[0], GC_GEN0_THRESHOLD), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if frozen:
            gc.unfreeze()


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


TODO = {"balance": "top up the balance, then re-run", "spend_limit": "raise spend_limit_usd, then re-run",
        "fatal": "fix that, then re-run", "interrupted": "re-run",
        "write_error": "free space on that disk (or fix the folder), then re-run", "no_room": "re-run"}


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def short(n: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"
