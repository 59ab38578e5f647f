"""When a request that makes no progress is given up, whatever keeps its connection alive.

While no provider has answered, OpenRouter keeps the connection busy (a JSON body padded with
whitespace, a stream with `: OPENROUTER PROCESSING` comments), so a socket read timeout never
fires. Two rules of our own decide instead (client.complete applies them): a stream with no data
chunk for `progress_s` is hung, and every request has a total deadline (`request_deadline`). A
request given up by either is a lost answer that may have been billed. `KeepaliveWatch` tells how
many requests are waiting on padding alone."""

from __future__ import annotations

import itertools
import time

# the slowest rate a working provider keeps over a whole answer (Kimi-K2.5's endpoints list 25-110
# tokens/s)
SLOWEST_TOKENS_PER_S = 10.0


def request_deadline(max_tokens: int, request_timeout_s: float, override: float | None = None) -> float:
    """Seconds a request may take in all: `override` if given, else
    `request_timeout_s + max_tokens / SLOWEST_TOKENS_PER_S` (a first byte, then the whole answer at
    the slowest credible rate). A JSON body is padding until its first other byte, and padding is
    normal while the provider generates, so only a total deadline bounds it; it holds for streams too."""
    if override is not None:
        return float(override)
    return float(request_timeout_s) + max_tokens / SLOWEST_TOKENS_PER_S


class KeepaliveWatch:
    """The requests answered (HTTP 200) whose reply has so far been keep-alive alone (whitespace
    padding, SSE comments), each with when its wait began: `begin` when the headers come (the wait
    counts from when the request was sent), `progress` when data comes (a stream's data chunk
    starts the wait afresh; a JSON body's first byte ends it: call `end`), `end` when it is over."""

    def __init__(self):
        self._since: dict[int, float] = {}
        self._ids = itertools.count()

    def begin(self, since: float | None = None) -> int:
        token = next(self._ids)
        self._since[token] = time.monotonic() if since is None else since
        return token

    def progress(self, token: int) -> None:
        if token in self._since:
            self._since[token] = time.monotonic()

    def end(self, token: int) -> None:
        self._since.pop(token, None)

    def waits(self, token: int) -> bool:
        """Whether this request's reply is still keep-alive alone."""
        return token in self._since

    def waiting(self, longer_than_s: float = 0.0, now: float | None = None) -> int:
        """How many have had nothing but keep-alive for more than `longer_than_s`."""
        now = time.monotonic() if now is None else now
        return sum(1 for t in self._since.values() if now - t > longer_than_s)
