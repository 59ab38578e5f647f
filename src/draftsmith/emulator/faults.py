"""Seeded fault injection: which failure (if any) an endpoint shows for one attempt, and the
router's own failures (`RouterFaults`: retryable availability errors before any provider is
tried, and a router-wide outage).

The draw is a hash of (seed, endpoint, prompt, how many times this prompt was asked before), not
of arrival order, so a run at 2000 in flight meets the same faults as the same run done one request
at a time, a retry of a failed prompt draws afresh, and over many requests each fault's share
converges to its configured rate. The outage is a window of real time: it starts at the
`outage_after`-th chat request after that and lasts `outage_s`.
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from collections import Counter
from typing import Literal

from pydantic import Field

from .catalogue import Faults, Strict
from .wire import availability, error_response

# failures before the first token: OpenRouter may fall back to the next endpoint
BEFORE_FIRST_TOKEN = {"rate_limit": 429, "bad_gateway": 502, "unavailable": 503, "timeout": 524, "overloaded": 529}
# the others (error_200, mid_stream, empty_200, hang) happen after the response started: the client sees them

UPSTREAM_MESSAGES = {
    429: "Rate limit exceeded: too many requests, please retry shortly",
    502: "Bad gateway: upstream connection reset",
    503: "Service temporarily unavailable",
    524: "A timeout occurred while waiting for the upstream model",
    529: "The model is overloaded, please retry",
}


def uniform(*parts) -> float:
    """A number in [0, 1) fixed by `parts`."""
    h = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return struct.unpack("<Q", h)[0] / 2.0**64


def draw(faults: Faults, seed: int, endpoint_tag: str, prompt_key: str, nth: int) -> str | None:
    """The fault name drawn for this attempt, or None."""
    u = uniform("fault", seed, endpoint_tag, prompt_key, nth)
    acc = 0.0
    for name, rate in faults.model_dump().items():
        acc += rate
        if u < acc:
            return name
    return None


# the availability error each upstream status becomes once every provider tried has failed
UPSTREAM_AVAILABILITY = {429: "capacity_exhausted"}   # the others: temporarily_unavailable

OUTAGE_CODES = Literal["temporarily_unavailable", "no_endpoints", "capacity_exhausted", "model_not_found"]
ROUTER_ERRORS = {  # code: (status, message, error_type, retryable)
    "temporarily_unavailable": (503, "All providers failed with transient errors or timeouts. Please try again "
                                     "later.", "provider_unavailable", True),
    "no_endpoints": (404, "No endpoints are available for this model right now.", "not_found", True),
    "capacity_exhausted": (429, "Capacity for this model is exhausted. Please try again later.",
                           "rate_limit_exceeded", True),
    "model_not_found": (400, "{model} is not a valid model ID", "invalid_request", False),
}


def upstream_availability(status: int, retry_after: float | None = None) -> dict:
    """What the router says when the last provider it tried failed with `status` (all retryable)."""
    return availability(UPSTREAM_AVAILABILITY.get(status, "temporarily_unavailable"), True, retry_after)


class RouterFaults(Strict):
    """Failures of OpenRouter itself, before any provider is tried: shares of chat requests
    answered with a retryable `temporarily_unavailable` 503 or `no_endpoints` 404, and an outage:
    from the `outage_after`-th request on, every request gets `outage_code` for `outage_s` real
    seconds (`model_not_found` is not retryable: the model pulled from the router)."""

    temporarily_unavailable: float = Field(0.0, ge=0, le=1)
    no_endpoints: float = Field(0.0, ge=0, le=1)
    outage_after: int = Field(0, ge=0)   # requests served before the outage starts
    outage_s: float = Field(0.0, ge=0)   # 0: no outage
    outage_code: OUTAGE_CODES = "temporarily_unavailable"  # type: ignore[valid-type]
    retry_after_s: float | None = Field(None, ge=0)  # sent in availability.retry_after and Retry-After


class Router:
    """The router faults of one emulator: `refusal` answers a chat request, or returns None."""

    def __init__(self, cfg: RouterFaults, seed: int, model: str):
        self.cfg, self.seed, self.model = cfg, seed, model
        self.requests = 0
        self.asked: Counter[str] = Counter()
        self.outage_started: float | None = None

    def in_outage(self, now: float) -> bool:
        c = self.cfg
        if c.outage_s <= 0 or self.requests <= c.outage_after:
            return False
        if self.outage_started is None:
            self.outage_started = now
        return now - self.outage_started < c.outage_s

    def refusal(self, prompt_key: str, now: float | None = None):
        c = self.cfg
        self.requests += 1
        nth = self.asked[prompt_key]
        self.asked[prompt_key] += 1
        if self.in_outage(time.monotonic() if now is None else now):
            return self.error(c.outage_code)
        u = uniform("router", self.seed, prompt_key, nth)
        if u < c.temporarily_unavailable:
            return self.error("temporarily_unavailable")
        if u < c.temporarily_unavailable + c.no_endpoints:
            return self.error("no_endpoints")
        return None

    def error(self, code: str):
        status, message, error_type, retryable = ROUTER_ERRORS[code]
        wait = self.cfg.retry_after_s if retryable else None
        headers = {"Retry-After": str(math.ceil(wait))} if wait is not None else None
        return error_response(status, message.format(model=self.model), {"error_type": error_type}, headers,
                              availability(code, retryable, wait))
