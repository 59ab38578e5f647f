"""Seeded fault injection: which failure (if any) an endpoint shows for one attempt.

The draw is a hash of (seed, endpoint, prompt, how many times this prompt was asked before), not
of arrival order, so a run at 2000 in flight meets the same faults as the same run done one request
at a time, a retry of a failed prompt draws afresh, and over many requests each fault's share
converges to its configured rate.
"""

from __future__ import annotations

import hashlib
import struct

from .catalogue import Faults

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
