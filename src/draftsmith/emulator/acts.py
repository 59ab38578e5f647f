"""How a response that started acts out the fault drawn for it (or none), one small class a fault.

An `Act` says how many ids the endpoint adds before the fault strikes (`stop_after`), where a
stream is cut (`cut_at`), whether its text carries bytes that are not UTF-8 (`spoil`), whether it
is billed, the finish reason the ledger records, and how the response ends on the wire (`end`).
A `hang` or a `stall` takes the whole response instead (`Responses`).
"""

from __future__ import annotations

import math
import random
from typing import Callable, Protocol

from aiohttp import web

from .catalogue import Endpoint
from .output import Output
from .wire import SSEWriter, error_body

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
