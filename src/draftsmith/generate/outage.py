"""When OpenRouter itself is down: the clock that turns a long run of retryable availability errors
into a clean stop.

Each retryable `error.availability` answer is waited out (attempts.py); one that comes while no
response has arrived for longer than `limit_s` since the first of them means the router answers
nothing but such errors: the run stops, saying so, and a re-run resumes. Any response resets the
clock, so the scattered retryable errors of a busy run never add up to a stop.
"""

from __future__ import annotations

from collections import Counter


class Outage:
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
