"""One chat response from the endpoint chosen for it, as that provider would send it.

The backend generates the ids; they go out paced by the endpoint's time to first token and
tokens/s (scaled by `time_scale`), as SSE chunks or one JSON body; the endpoint's fault for this
request is acted out (a hang, an error mid-stream, an empty or error body with status 200, an
answer billed but cut on the wire), its quirks applied (`Output`), its bill counted by its own
tokenizer (`Billing`), and the ledger line written before the client has the last byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import random
import secrets
import time
from collections import Counter

from aiohttp import web

from .acts import act
from .backends import Job, Vocab
from .cache import STATUS_HEADER, ResponseCache
from .catalogue import Endpoint
from .config import EmulatorConfig
from . import logprobs
from .faults import uniform
from .ledger import Ledger
from .output import Output
from .pacing import Pace, Sender, paced
from .quirks import Billing
from .synthetic import SyntheticBackend
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
        out.logprobs = logprobs.content(self.vocab.encoding, out.ids, chosen, tops, ep.quirks.logprobs)

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
