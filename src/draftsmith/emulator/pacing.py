"""A response's ids at its endpoint's simulated speed, and the stream that carries them.

`Pace` says when each id is produced (time to first token, then tokens/s, drawn per response, on
the event loop's clock scaled by `time_scale`); `paced` hands out the backend's ids in the pieces a
stream sends, each when it is due; `Sender` writes those pieces as chunks and cuts the connection
where a fault says.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from typing import AsyncIterator

from .catalogue import Endpoint
from .output import Output

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
