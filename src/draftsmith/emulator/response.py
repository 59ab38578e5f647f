"""One chat response from the endpoint chosen for it, as that provider would send it.

The backend generates the ids; they go out paced by the endpoint's time to first token and
tokens/s (scaled by `time_scale`), as SSE chunks or one JSON body; the endpoint's fault for this
request is acted out (a hang, an error mid-stream, an empty or error body with status 200, an
answer billed but cut on the wire), its quirks applied (`Output`), its bill counted by its own
tokenizer (`Billing`), and the ledger line written before the client has the last byte.

Here too, each in its section below `Responses`: the pacing (`Pace`, `paced`, `Sender`), the
faults acted out (`act`: one small class a fault) and OpenRouter's response cache (`ResponseCache`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import math
import random
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from aiohttp import web

from .accounts import Ledger
from .backends import Job, SyntheticBackend, Vocab
from .catalogue import Endpoint
from .config import EmulatorConfig
from .faults import uniform
from .output import Billing, Output, logprobs_content
from .wire import JSONWriter, SSEWriter, error_body


GOLDEN = (5 ** 0.5 - 1) / 2  # the step of an endpoint's quirk draws


class Responses:
    """Generates, writes, bills and records the responses of one emulator."""

    def __init__(self, cfg: EmulatorConfig, vocab: Vocab, backend, ledger: Ledger, stats: Counter):
        self.cfg, self.vocab, self.backend, self.ledger, self.stats = cfg, vocab, backend, ledger, stats
        # every endpoint's billing tokenizer is built here, at start: built on a first request it
        # would hold up the event loop (and every request in flight) for a second or more
        kinds = {ep.quirks.billing_tokenizer for ep in cfg.endpoints()}
        self._billing = {kind: Billing(vocab.encoding, kind) for kind in kinds}
        self.served: Counter[str] = Counter()  # responses begun per endpoint tag (quirk draws)
        self.cache = ResponseCache(cfg.response_cache, cfg.cache_ttl_s)

    def quirk_draw(self, ep: Endpoint) -> float:
        """The next of `ep`'s quirk draws: a golden-ratio sequence from a seeded start, so any run of
        its responses carries each quirk at its rate, give or take two (with rate 0.1, at least one
        in any 13 responses), whichever requests they happen to be."""
        n = self.served[ep.tag]
        self.served[ep.tag] += 1
        return (uniform("quirk", self.cfg.seed, ep.tag) + n * GOLDEN) % 1.0

    def billing(self, ep: Endpoint) -> Billing:
        """How `ep` counts billed tokens."""
        kind = ep.quirks.billing_tokenizer
        if kind not in self._billing:  # an endpoint added after start
            self._billing[kind] = Billing(self.vocab.encoding, kind)
        return self._billing[kind]

    def _job(self, req, prompt_ids, ep: Endpoint, nth: int) -> Job:
        # sampling parameters the endpoint does not support are silently dropped, as on OpenRouter
        # (unless the request set provider.require_parameters, which routed around such endpoints)
        supported = set(ep.supported_parameters)
        temperature = req["temperature"] if "temperature" in supported else 1.0
        top_p = req["top_p"] if "top_p" in supported else 1.0
        seed = req["seed"] if "seed" in supported else None
        key = req["prompt_key"]
        if temperature > 0:
            key += f"|seed={seed}" if seed is not None else f"|draw={nth}|{secrets.token_hex(4)}"
        return Job(prompt_ids=prompt_ids, max_tokens=req["max_tokens"], temperature=temperature,
                   top_p=top_p, seed=seed, key=key, reasoning_max_tokens=req["reasoning_max_tokens"],
                   perturbed=ep.quirks.perturbed_model, noncanonical_rate=ep.quirks.noncanonical_rate)

    async def _tokens(self, job: Job):
        """(ids, texts) lists as the backend produces them: all at once (synthetic) or one by one."""
        if isinstance(self.backend, SyntheticBackend):
            yield self.backend.tokens(job)
        else:
            async for i, t in self.backend.stream(job):
                yield [i], [t]

    async def generate(self, request, req, prompt_ids, ep, fault, gen_id, attempts, nth, t_start):
        """Run the backend for `ep`, paced and written as OpenRouter would; bill and record it.

        A stream the client closes (or `cut_after_billing` cuts) stops being written; the endpoint
        stops generating and billing there if it `supports_cancellation`, else it finishes and bills
        the whole response. A non-streamed response is always generated and billed in full."""
        cfg = self.cfg
        rng = random.Random(f"{cfg.seed}|{gen_id}")
        pace = Pace.draw(rng, ep, cfg.stream_interval_s, cfg.time_scale)
        out = Output(self.vocab, req, ep, gen_id, cfg.model, self.quirk_draw(ep),
                     byok_fee_rate=cfg.byok_fee_rate if cfg.byok else None)
        caching = self.cache.enabled(request.headers)
        writer = self._writer(request, req["stream"], gen_id, caching)
        if fault == "hang":
            return await self._hang(writer, req, ep, out, attempts, prompt_ids, nth, t_start, pace)
        if fault == "stall":
            return await self._stall(writer, req, ep, out, attempts, prompt_ids, t_start)
        how = act(fault, rng, req, ep)
        writer.spoil = how.spoil
        sender = Sender(writer, out, req["stream"], how.cut_at, ep.supports_cancellation)
        t_first = await self._produce(self._job(req, prompt_ids, ep, nth), out, pace, how.stop_after, sender)
        if fault is None or fault in ("bad_bytes", "cut_after_billing"):
            await self._logprobs(req, ep, prompt_ids, out)
        writer.stop_keepalive()
        cancelled = not sender.going
        if cancelled:
            self.stats["cancelled"] += 1
        # the ledger line exists before the client has the last byte (as /generation would)
        self.record(gen_id, ep, req, out, 200, attempts, finish=how.finish(out), billed=how.billed, error=fault,
                    t_start=t_start, prompt_ids=prompt_ids, cancelled=cancelled,
                    ttft_s=(t_first - pace.t0) if t_first else None)
        self.stats["served" if fault is None else f"fault_{fault}"] += 1
        if sender.gone:
            return writer.resp or web.Response(status=499)
        if fault is None and caching:
            self.cache.put(req, request.headers, out)
        try:
            return await how.end(writer, out, functools.partial(out.usage, self.billing(ep), prompt_ids))
        except ConnectionResetError:  # gone at the very end: billed in full, it was all generated
            return writer.resp or web.Response(status=499)

    async def _logprobs(self, req, ep: Endpoint, prompt_ids, out: Output) -> None:
        """`out.logprobs` when the request asked for them and `ep` lists them (else dropped, as
        OpenRouter drops a parameter the endpoint does not support), after `ep`'s quirk."""
        if not req["logprobs"] or "logprobs" not in ep.supported_parameters or not out.ids \
                or isinstance(self.backend, SyntheticBackend):
            return
        top = req["top_logprobs"] if "top_logprobs" in ep.supported_parameters else 0
        chosen, tops = await asyncio.to_thread(self.backend.logprobs, prompt_ids, out.ids, ep.quirks.perturbed_model,
                                               top)
        out.logprobs = logprobs_content(self.vocab.encoding, out.ids, chosen, tops, ep.quirks.logprobs)

    def _writer(self, request, stream: bool, gen_id: str, caching: bool) -> SSEWriter | JSONWriter:
        """A stream's writer or a JSON body's, with the generation id (and a cache MISS when asked)."""
        headers = {"X-Generation-Id": gen_id}
        if caching:
            headers[STATUS_HEADER] = "MISS"
        cls = SSEWriter if stream else JSONWriter
        return cls(request, self.cfg.padding_interval_s, headers)

    async def _produce(self, job: Job, out: Output, pace: Pace, stop_after: float, sender: Sender) -> float | None:
        """Generate `job` into `out` as it comes due (`paced`), up to `stop_after` ids, writing it
        through `sender`; then wait until its last id is due (unless the endpoint stopped). Returns
        when the first id came, on the loop's clock (None: none did)."""
        loop = asyncio.get_running_loop()
        t_first = None
        try:
            await sender.writer.open()
            tokens = self._tokens(job)
            try:
                async with contextlib.aclosing(paced(tokens, out, pace, stop_after, sender)) as pieces:
                    async for ids, texts in pieces:
                        out.extend(ids, texts)
                        t_first = t_first or loop.time()
                        await sender.added()
            finally:
                job.cancelled = True
                await tokens.aclose()
            sender.end()
            if sender.going:  # the response (or its failure) is complete when its last id is due
                await pace.until(len(out.ids))
        except ConnectionResetError:  # gone before the first byte
            sender.gone = True
        return t_first

    async def _hang(self, writer, req, ep, out: Output, attempts, prompt_ids, nth, t_start, pace: Pace):
        """The provider generates and bills the response, but the client gets only the headers
        (a stream also its first comment); silence for `hang_s`, then the connection closes."""
        loop = asyncio.get_running_loop()
        t_hang = loop.time()
        try:
            if isinstance(writer, SSEWriter):
                await writer.open(keepalive=False)
            else:
                await writer.send_headers()
        except ConnectionResetError:
            pass
        job = self._job(req, prompt_ids, ep, nth)
        tokens = self._tokens(job)
        try:
            async for ids, texts in tokens:
                out.extend(ids, texts)
                if out.stopped:
                    break
        finally:
            job.cancelled = True
            await tokens.aclose()
        await pace.until(len(out.ids))
        self.record(out.gen_id, ep, req, out, 200, attempts, finish=out.finish_reason, billed=True, error="hang",
                     t_start=t_start, prompt_ids=prompt_ids, cancelled=False, ttft_s=None)
        self.stats["fault_hang"] += 1
        await asyncio.sleep(max(0.0, t_hang + self.cfg.hang_s - loop.time()))
        writer.close_connection()
        return writer.resp or web.Response(status=200)

    async def _stall(self, writer, req, ep, out: Output, attempts, prompt_ids, t_start):
        """No provider answers: the router keeps the connection alive with keep-alive (SSE comments,
        or whitespace padding of the JSON body) for `stall_s`, then ends it with a 524 (an error chunk,
        or an error body inside the 200). Nothing is billed; the ledger line is written when the
        stall ends (before the client has the 524) or when the client leaves, whichever comes first."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.cfg.stall_s
        self.stats["fault_stall"] += 1
        err = {"code": 524, "message": "A timeout occurred while waiting for the upstream model",
               "metadata": {"provider_name": ep.name, "error_type": "timeout"}}
        try:
            if isinstance(writer, SSEWriter):
                await writer.open()
            else:
                await writer.send_headers()
                writer.start_keepalive()
            while not writer.gone and loop.time() < end:
                await asyncio.sleep(min(self.cfg.padding_interval_s, max(0.0, end - loop.time())))
        except ConnectionResetError:
            pass
        finally:
            writer.stop_keepalive()
            self.record(out.gen_id, ep, req, out, 200, attempts, finish="error", billed=False, error="stall",
                        t_start=t_start, prompt_ids=prompt_ids)
        if not writer.gone:
            try:
                if isinstance(writer, SSEWriter):
                    writer.event(out.chunk("", "", finish="error", error=err))
                    await writer.end()
                else:
                    await writer.body(error_body(524, err["message"], err["metadata"]))
            except ConnectionResetError:
                pass
        return writer.resp or web.Response(status=499)

    async def replay(self, request, req, cached: Output, gen_id: str, attempts, prompt_ids, t_start):
        """A cache hit: the cached response verbatim, with usage zeroed, a new generation id and
        `X-OpenRouter-Cache-Status: HIT`; nothing billed."""
        out = copy.copy(cached)
        out.gen_id, out.created = gen_id, int(time.time())
        zero = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cost": 0.0,
                "is_byok": self.cfg.byok, "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0},
                "cost_details": {"upstream_inference_cost": 0.0 if self.cfg.byok else None,
                                 "upstream_inference_prompt_cost": 0.0, "upstream_inference_completions_cost": 0.0}}
        headers = {"X-Generation-Id": gen_id, STATUS_HEADER: "HIT"}
        self.stats["cache_hit"] += 1
        self.record(gen_id, out.ep, req, out, 200, attempts, finish=out.finish_reason, billed=False,
                    error="cache_hit", t_start=t_start, prompt_ids=prompt_ids)
        if not req["stream"]:
            return web.json_response(out.message(zero, out.finish_reason), headers=headers)
        writer = SSEWriter(request, self.cfg.padding_interval_s, headers)
        try:
            await writer.open()
            writer.event(out.chunk(out.reasoning, out.content))
            writer.event(out.chunk("", "", finish=out.finish_reason))
            writer.event(out.usage_chunk(zero, out.finish_reason))
            await writer.done()
        except ConnectionResetError:
            writer.stop_keepalive()
        return writer.resp

    def record(self, gen_id, ep: Endpoint, req, out, status, attempts, *, finish, billed, error, t_start,
                prompt_ids, cancelled=False, ttft_s=None) -> None:
        ids = out.ids if out is not None else []
        if out is not None:
            usage = out.usage(self.billing(ep), prompt_ids, billed)
        else:
            usage = {"prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0,
                     "completion_tokens_details": {"reasoning_tokens": 0}}
        now = time.monotonic()
        quirks = list(out.quirks) if out is not None else []
        if out is not None and ep.quirks.noncanonical_rate:
            quirks.append(f"noncanonical:{ep.quirks.noncanonical_rate}")
        upstream = usage["cost_details"]["upstream_inference_cost"] if out is not None else None
        self.ledger.record({
            "is_byok": self.cfg.byok, "upstream_inference_cost": upstream,
            "generation_id": gen_id, "time": time.time(), "status": status, "provider": ep.slug,
            "endpoint": ep.tag, "provider_name": ep.name, "model": self.cfg.model, "prompt_key": req["prompt_key"],
            "prompt_tokens": usage["prompt_tokens"] if out is not None else 0,
            "completion_tokens": usage["completion_tokens"],
            "reasoning_tokens": usage["completion_tokens_details"]["reasoning_tokens"],
            "cost": usage["cost"], "output_ids": ids, "finish_reason": finish, "native_finish_reason": finish,
            "cancelled": cancelled, "billed": billed, "stream": req["stream"], "attempts": attempts,
            "quirks": quirks, "error": error,
            "prompt_ids": prompt_ids, "true_prompt_tokens": len(prompt_ids), "true_completion_tokens": len(ids),
            "true_reasoning_tokens": out.n_reasoning if out is not None else 0,
            "request": {k: req[k] for k in ("max_tokens", "temperature", "top_p", "seed")},
            "latency_ms": round(1000 * ttft_s) if ttft_s is not None else None,
            "generation_ms": round(1000 * (now - t_start)),
        }, visible_after_s=self.cfg.generation_delay_s)


# ------------------------------------------------------------------------------------------------
# A response's ids at its endpoint's simulated speed, and the stream that carries them.
#
# `Pace` says when each id is produced (time to first token, then tokens/s, drawn per response, on
# the event loop's clock scaled by `time_scale`); `paced` hands out the backend's ids in the pieces a
# stream sends, each when it is due; `Sender` writes those pieces as chunks and cuts the connection
# where a fault says.


MAX_CHUNK_TOKENS = 16  # a stream chunk carries at most this many tokens


def _now() -> float:
    return asyncio.get_running_loop().time()


@dataclass(frozen=True)
class Pace:
    """When each id of one response is produced; a stream sends a chunk at most every `interval`."""
    t0: float        # the loop's clock when the response began
    ttft: float      # simulated seconds to the first id
    tps: float       # ids per simulated second after it
    interval: float  # simulated seconds between stream chunks
    scale: float     # real seconds per simulated second (0: nothing waits)

    @classmethod
    def draw(cls, rng: random.Random, ep: Endpoint, interval: float, scale: float) -> Pace:
        ttft = rng.lognormvariate(math.log(ep.latency_s.median), ep.latency_s.sigma)
        tps = rng.lognormvariate(math.log(ep.tokens_per_s.median), ep.tokens_per_s.sigma)
        return cls(_now(), ttft, tps, interval, scale)

    def due(self, n: int) -> float:
        """When the n-th id (from 0) is produced, on the loop's clock."""
        return self.t0 + (self.ttft + n / self.tps) * self.scale

    def produced(self) -> int:
        """How many ids are produced by now (`scale` > 0)."""
        return int(((_now() - self.t0) / self.scale - self.ttft) * self.tps) + 1

    async def until(self, n: int, last_write: float | None = None) -> None:
        """Wait for the n-th id; after a stream's write at `last_write`, also for its next chunk's time."""
        next_write = last_write + self.interval * self.scale if last_write is not None else 0.0
        await asyncio.sleep(max(self.due(n), next_write) - _now())


class Sender:
    """Writes a stream's chunks as ids are added to `out` (a JSON body: nothing) and closes the
    connection once `cut_at` ids are in (None: never). `gone` once the connection is closed;
    `going` while the endpoint keeps generating: not once gone, if it `cancels`."""

    def __init__(self, writer, out: Output, stream: bool, cut_at: int | None, cancels: bool):
        self.writer, self.out, self.stream, self.cut_at, self.cancels = writer, out, stream, cut_at, cancels
        self.gone = False

    @property
    def going(self) -> bool:
        return not (self.gone and self.cancels)

    @property
    def last_write(self) -> float | None:
        """When the stream last wrote (None: it is gone)."""
        return None if self.gone else self.writer.last_write

    def room(self) -> float:
        """How many ids may be added before the cut: at least one while it is ahead."""
        if self.cut_at is None or self.gone:
            return math.inf
        return max(1, self.cut_at - len(self.out.ids))

    async def added(self) -> None:
        """Ids were added: queue their text as one chunk; at the cut, send it and cut."""
        if self.stream and not self.gone:
            self._queue()
            if self._at_cut():
                await self.flush()

    async def flush(self) -> None:
        """Send the queued chunks of a stream still open; cut the connection there if the cut is reached."""
        if not self.stream or self.gone:
            return
        self._queue()
        try:
            await self.writer.flush()
        except ConnectionResetError:
            self.gone = True
        if not self.gone and self._at_cut():
            self._cut()

    def end(self) -> None:
        """The response is complete: a stream shorter than its cut is cut before its end."""
        if self.cut_at is not None and not self.gone:
            self._cut()

    def _cut(self) -> None:
        self.writer.close_connection()
        self.gone = True

    def _at_cut(self) -> bool:
        return self.cut_at is not None and len(self.out.ids) >= self.cut_at

    def _queue(self) -> None:
        r, c = self.out.take_delta()
        if r or c:
            self.writer.event(self.out.chunk(r, c))


async def paced(tokens, out: Output, pace: Pace, stop_after: float, sender: Sender) -> AsyncIterator[tuple[list, list]]:
    """The backend's (ids, texts) in the pieces to add to `out`: on a stream each as it comes due, at
    most MAX_CHUNK_TOKENS (none due: the queued chunks go out and it waits); never past `stop_after`
    ids in all or the sender's cut; until the response stops, or the sender (`going`) does."""
    async for ids, texts in tokens:
        pos = 0
        while sender.going and pos < len(ids) and not out.stopped:
            n = min(len(ids) - pos, stop_after - len(out.ids), sender.room())
            if n <= 0:
                break
            if sender.stream:
                if pace.scale > 0:
                    due = pace.produced() - len(out.ids)
                    if due <= 0:
                        await sender.flush()
                        await pace.until(len(out.ids), sender.last_write)
                        continue
                    n = min(n, due)
                n = min(n, MAX_CHUNK_TOKENS)
            yield ids[pos:pos + n], texts[pos:pos + n]
            pos += n
        await sender.flush()
        if not sender.going or out.stopped or len(out.ids) >= stop_after:
            break


# ------------------------------------------------------------------------------------------------
# How a response that started acts out the fault drawn for it (or none), one small class a fault.
#
# An `Act` says how many ids the endpoint adds before the fault strikes (`stop_after`), where a
# stream is cut (`cut_at`), whether its text carries bytes that are not UTF-8 (`spoil`), whether it
# is billed, the finish reason the ledger records, and how the response ends on the wire (`end`).
# A `hang` or a `stall` takes the whole response instead (`Responses`).


Usage = Callable[[bool], dict]  # the usage object, billed or not, counted when called


class Act(Protocol):
    stop_after: float       # ids the endpoint adds in all (math.inf: until the response ends)
    cut_at: int | None      # a stream's connection closes once it has this many ids
    spoil: bool
    billed: bool

    def finish(self, out: Output) -> str | None: ...
    async def end(self, writer, out: Output, usage: Usage) -> web.StreamResponse: ...


class Answer:
    """No fault, or `bad_bytes` (`spoil`): the whole response, billed, ending with its finish reason
    (a stream: a finish chunk, the usage chunk and [DONE])."""
    stop_after, cut_at, billed = math.inf, None, True

    def __init__(self, spoil: bool):
        self.spoil = spoil

    def finish(self, out: Output) -> str:
        return out.finish_reason

    async def end(self, writer, out: Output, usage: Usage) -> web.StreamResponse:
        if isinstance(writer, SSEWriter):
            writer.event(out.chunk("", "", finish=out.finish_reason))
            writer.event(out.usage_chunk(usage(True), out.finish_reason))
            await writer.done()
            return writer.resp
        return await writer.body(out.message(usage(True), out.finish_reason))


class Cut:
    """`cut_after_billing`: generated and billed in full; a stream's connection closes after `cut_at`
    ids (so it ends there), a JSON body's half way through."""
    stop_after, spoil, billed = math.inf, False, True

    def __init__(self, cut_at: int | None):
        self.cut_at = cut_at

    def finish(self, out: Output) -> str:
        return out.finish_reason

    async def end(self, writer, out: Output, usage: Usage) -> web.StreamResponse:
        return await writer.cut(out.message(usage(True), out.finish_reason))


class MidStream:
    """`mid_stream`: `stop_after` ids, then an error (a stream: an error chunk and no [DONE]); not billed."""
    cut_at, spoil, billed = None, False, False

    def __init__(self, stop_after: int, ep: Endpoint):
        self.stop_after, self.error = stop_after, _upstream_lost(ep)

    def finish(self, out: Output) -> str:
        return "error"

    async def end(self, writer, out: Output, usage: Usage) -> web.StreamResponse:
        if isinstance(writer, SSEWriter):
            return await _error_chunk(writer, out, self.error)
        return await writer.body(out.message(usage(False), "error", error=self.error))


class Error200:
    """`error_200`: no ids, status 200 with an error body (a stream: an error chunk); not billed."""
    stop_after, cut_at, spoil, billed = 0, None, False, False

    def __init__(self, ep: Endpoint):
        self.error = _upstream_lost(ep)

    def finish(self, out: Output) -> str:
        return "error"

    async def end(self, writer, out: Output, usage: Usage) -> web.StreamResponse:
        if isinstance(writer, SSEWriter):
            return await _error_chunk(writer, out, self.error)
        return await writer.body(error_body(502, self.error["message"], self.error["metadata"]))


class Empty200:
    """`empty_200`: no ids, no text and no finish reason, as on a cold start; not billed."""
    stop_after, cut_at, spoil, billed = 0, None, False, False

    def finish(self, out: Output) -> None:
        return None

    async def end(self, writer, out: Output, usage: Usage) -> web.StreamResponse:
        if isinstance(writer, SSEWriter):
            writer.event(out.usage_chunk(usage(False), None))
            await writer.done()
            return writer.resp
        out.content, out.reasoning = "", ""
        return await writer.body(out.message(usage(False) | {"cost": 0.0}, None))


def act(fault: str | None, rng: random.Random, req: dict, ep: Endpoint) -> Act:
    """The act of `fault` for one response; `rng` draws where `mid_stream` strikes and a stream is cut
    (each within the first 64 ids and `max_tokens`)."""
    strike, cut = (max(1, int(rng.random() * min(req["max_tokens"], 64))) for _ in range(2))
    match fault:
        case None | "bad_bytes":
            return Answer(spoil=fault == "bad_bytes")
        case "cut_after_billing":
            return Cut(cut if req["stream"] else None)
        case "mid_stream":
            return MidStream(strike, ep)
        case "error_200":
            return Error200(ep)
        case "empty_200":
            return Empty200()
    raise ValueError(f"{fault!r} is not a fault of a response that started")


def _upstream_lost(ep: Endpoint) -> dict:
    return {"code": 502, "message": "Provider returned error",
            "metadata": {"raw": "upstream connection lost", "provider_name": ep.name,
                         "error_type": "provider_unavailable"}}


async def _error_chunk(writer: SSEWriter, out: Output, error: dict) -> web.StreamResponse:
    """The text not yet sent with finish reason `error` and `error`, then the end (no [DONE])."""
    r, c = out.take_delta()
    writer.event(out.chunk(r, c, finish="error", error=error))
    await writer.end()
    return writer.resp


# ------------------------------------------------------------------------------------------------
# OpenRouter's response cache, as its docs describe it: off unless a request sends
# `X-OpenRouter-Cache: true` or the key's preset turns it on. A cached request asked again within
# the time to live gets the earlier response verbatim (whatever the temperature), with `usage`
# zeroed, a new generation id and the header `X-OpenRouter-Cache-Status: HIT`; a cached request
# that is not found gets `MISS`. Nothing is billed for a hit.
#
# The config's `response_cache` picks the account: `off`, `preset` (on, unless the request sends
# `X-OpenRouter-Cache: false`), `always` (on whatever the request sends: the reply a client must
# recognise when caching comes anyway).


REQUEST_HEADER = "X-OpenRouter-Cache"
STATUS_HEADER = "X-OpenRouter-Cache-Status"
MAX_ENTRIES = 100_000


class ResponseCache:
    """The cached responses (the `Output` each answer was made of), by request."""

    def __init__(self, mode: str, ttl_s: float):
        self.mode, self.ttl_s = mode, ttl_s
        self._entries: OrderedDict[str, tuple[float, object]] = OrderedDict()

    def enabled(self, headers) -> bool:
        """Whether caching applies to a request with these headers."""
        asked = str(headers.get(REQUEST_HEADER, "")).strip().lower()
        if self.mode == "always" or asked == "true":
            return True
        return self.mode == "preset" and asked != "false"

    @staticmethod
    def key(req: dict) -> str:
        """What makes two requests the same to the cache: the prompt and every sampling setting."""
        return "|".join(str(req[k]) for k in ("prompt_key", "max_tokens", "temperature", "top_p", "seed", "stop",
                                              "think", "exclude_reasoning", "reasoning_max_tokens", "logprobs",
                                              "top_logprobs"))

    def get(self, req: dict, headers):
        """The cached answer to this request, or None (not cached, expired, or caching off for it)."""
        if not self.enabled(headers):
            return None
        key = self.key(req)
        hit = self._entries.get(key)
        if hit is None:
            return None
        if time.monotonic() - hit[0] > self.ttl_s:
            del self._entries[key]
            return None
        return hit[1]

    def put(self, req: dict, headers, out) -> None:
        if not self.enabled(headers):
            return
        self._entries[self.key(req)] = (time.monotonic(), out)
        self._entries.move_to_end(self.key(req))
        if len(self._entries) > MAX_ENTRIES:
            self._entries.popitem(last=False)
