"""When to try a failed request again, and how many requests to keep in flight meanwhile.

Backoff is exponential with full jitter (so thousands of failed requests do not come back in
step), never shorter than what the server asked for (`Retry-After` or
`metadata.retry_after_seconds`). Concurrency follows AIMD, like TCP: when throttling answers
(429s, in-flight-budget 402s) pass `threshold` of the answers of the last round trip, the limit is
cut by a factor, at most once per round trip; every success gives a little back, so the limit
recovers to `concurrency` within a few dozen calm round trips. A stray 429 (providers send some
all the time) changes nothing; a storm is not made worse by hammering.
"""

from __future__ import annotations

import random
import time


def backoff_delay(attempt: int, retry_after: float | None = None, base: float = 1.0, cap: float = 60.0,
                  rng: random.Random | None = None) -> float:
    """Seconds to wait before attempt `attempt + 1` (attempt counts from 1)."""
    rng = rng or random
    delay = rng.uniform(0, min(cap, base * 2 ** (attempt - 1)))
    if retry_after is not None:
        delay = max(delay, min(retry_after, 10 * cap) * rng.uniform(1.0, 1.2))
    return delay


class Aimd:
    """The number of requests allowed in flight: `limit` (an int view of a float window)."""

    def __init__(self, max_limit: int, min_limit: int = 1, decrease: float = 0.7, recover_rtts: float = 30.0,
                 threshold: float = 0.05):
        self.max_limit = max_limit
        self.min_limit = max(1, min(min_limit, max_limit))
        self.decrease = decrease
        self.threshold = threshold
        self.window = float(max_limit)
        # Additive increase: about max_limit * (1 - decrease) regained over `recover_rtts` round trips.
        self.step = max(1.0, max_limit * (1 - decrease) / recover_rtts)
        self.rtt = 1.0                 # EWMA of request latency, seconds
        self._last_cut = -1e18
        self._period = (-1e18, 0, 0)   # (start, answers, throttles) of the current round trip
        self._previous = (0, 0)        # (answers, throttles) of the one before
        self.cuts = 0

    @property
    def limit(self) -> int:
        return int(self.window)

    def observe_latency(self, seconds: float) -> None:
        self.rtt += 0.05 * (seconds - self.rtt)

    def _count(self, throttled: bool, now: float) -> float:
        """Count one answer; the share of throttles over the last one to two round trips (0 while
        there are fewer than two)."""
        start, n, t = self._period
        if now - start > max(0.5, self.rtt):
            self._previous = (n, t)
            start, n, t = now, 0, 0
        self._period = (start, n + 1, t + throttled)
        n_all, t_all = n + 1 + self._previous[0], t + throttled + self._previous[1]
        return t_all / n_all if t_all >= 2 else 0.0

    def on_success(self, now: float | None = None) -> None:
        self._count(False, time.monotonic() if now is None else now)
        if self.window < self.max_limit:
            self.window = min(self.max_limit, self.window + self.step / max(1.0, self.window))

    def on_throttle(self, now: float | None = None) -> bool:
        """A throttling answer; returns True if it cut the limit."""
        now = time.monotonic() if now is None else now
        share = self._count(True, now)
        if share < self.threshold or now - self._last_cut < max(0.5, self.rtt):
            return False
        self._last_cut = now
        self.window = max(float(self.min_limit), self.window * self.decrease)
        self.cuts += 1
        return True
