"""The engine of stage 02: one aiohttp session carries up to `concurrency` requests at once, shared
by all datasets. A slot freed by one dataset goes to whichever dataset still has budget and
prompts (round robin), so the run stays full until the last budget is reached; each start
reserves its worst-case dollars first (budget.py). A worker runs one sample's attempts
(attempts.py) and takes the next job itself.

A stop (balance gone, spend limit, a refusal, SIGINT/SIGTERM) starts nothing new, gives the
requests in flight `stop_grace_s` to finish and be saved, asks the cost of what it gave up on,
and closes the files, so a re-run resumes exactly where this one ended.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from .. import client, store
from ..budget import SpendBudget, TokenBudget
from ..datasets import DatasetSpec
from ..paths import Run
from ..pricing import BalanceReader, CatalogueError, catalogue, fetch_endpoints
from ..progress import Progress
from ..providers import outputs as stage_01
from ..providers.endpoints import policy_routing
from ..retry import Aimd
from . import attempts, bare_server, bookkeeping, money
from .options import Options
from .prompt_queue import ContextCheck, DatasetQueue


class Engine:
    """One session (a start or a resume): the slots, the money and the counts that attempts.py,
    money.py and bookkeeping.py read and update as it runs."""

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

        self.manifest = store.open_manifest(run)
        self.datasets: list[DatasetQueue] = []
        self.stage_01_usd = stage_01.spent(run)
        self.routing_name = str(stage_01.routing_file(run).relative_to(run.root))   # named in messages
        config["stage_01_spent_usd"] = self.stage_01_usd
        spent = self.manifest.spent_outside_responses + self.stage_01_usd
        for spec in specs:
            saved = store.open_dataset(run, spec.name, opts.fsync_s)
            for note in saved.notes:
                log(f"resume: {note}")
            budget = TokenBudget(spec.output_token_budget, self.max_tokens)
            for duration, n in saved.lengths:
                budget.add(n, duration)
            saved.lengths = []
            spent += saved.totals.cost
            self.datasets.append(DatasetQueue(spec, saved, budget))
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
        self.entry = {"started": bookkeeping.now(), "status": "running",      # this session's line in the manifest
                      "samples_at_start": sum(len(d.store.done) for d in self.datasets)}
        self.manifest.sessions.append(self.entry)
        self.timeline = store.open_timeline(run)    # a point every second (bookkeeping.point)

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
                money.block(self, worst)
                money.maybe_wind_down(self)
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
                    self.request_stop(self.blocked[0], money.blocked_message(self))
                    break
            self.wake.clear()
            await self.wake.wait()

    async def _worker(self, job: tuple) -> None:
        while job is not None:
            await attempts.sample(self, *job)
            job = self._take()
        self.wake.set()

    async def reserve(self, worst: float) -> float:
        """Reserve the dollars of a retry, waiting while other requests hold them; 0.0 if the run
        stops first (or must stop: nothing else holds money, and still it does not fit)."""
        while self.reason is None:
            if self.spend.try_reserve(worst):
                return worst
            money.block(self, worst)
            if self.spend.reserved <= 1e-12 and not self.recoveries:
                self.request_stop(self.blocked[0], money.blocked_message(self))
                break
            self.money_freed.clear()
            try:
                await asyncio.wait_for(self.money_freed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        return 0.0

    # -- stopping ---------------------------------------------------------------------------
    def request_stop(self, reason: str, message: str = "") -> None:
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
        """Give up on everything in flight now (a second SIGINT)."""
        self.stop_grace_s = 0
        self.request_stop("interrupted", "interrupted twice")
        for t in list(self.tasks) + list(self.recoveries):
            t.cancel()

    # -- background: balance polling, progress, periodic saves ------------------------------
    async def _poll_balance(self, reader: BalanceReader) -> None:
        while self.reason is None:
            await asyncio.wait((self.stopped,), timeout=self.opts.balance_poll_s)
            balance = await reader.read()
            if balance is not None:
                self.spend.set_balance(balance)
                self.wake.set()

    # -- the whole session -------------------------------------------------------------------
    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        self.stopped = loop.create_future()
        self.wake = asyncio.Event()
        self.money_freed = asyncio.Event()      # a reservation was freed
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
                background = [loop.create_task(self._poll_balance(reader)), loop.create_task(bookkeeping.tick(self))]
                bookkeeping.save_manifest(self)
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
        background = loop.create_task(bookkeeping.tick(self))
        try:
            bookkeeping.save_manifest(self)
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
        obj, excluded = policy_routing(eps, native, allow_unknown, self.sent)
        self.provider = {**obj, **self.provider}
        self.settings["provider"] = self.provider
        self.bodies = client.BodyMaker(self.settings)
        self.settings_json = json.dumps(self.settings, ensure_ascii=False, separators=(",", ":"))
        self.config["request"] = self.settings
        self.config["routing_source"] = f"stage 02 precision policy (no {self.routing_name})"
        gone = "; ".join(f"{x['tag']}: {x['reason']}" for x in excluded) or "none"
        self.log(f"no {self.routing_name} from stage 01: applied the precision policy (native {native}) "
                 f"here. Allowed: {', '.join(obj['only'])}. Excluded: {gone}. The fidelity probe did not run: "
                 f"run stage 01 first to also exclude endpoints that answer unlike the first party.")

    def _close(self) -> None:
        for d in self.datasets:
            d.store.close()
        if self.progress is not None:
            self.progress.set(**bookkeeping.progress_fields(self, 0.0))
            self.progress.close()
        bookkeeping.save_manifest(self, final=True)
        if self.progress is not None:       # the session ran: its last point
            bookkeeping.point(self)
            self.timeline.close()
        for d in self.datasets:
            if d.reader.problems:
                self.log(d.reader.summary())



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
