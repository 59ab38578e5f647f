"""What one request costs at one endpoint: the prices in force, the bill, and the worst case.

OpenRouter lists a default price per token and, on some endpoints, conditional `overrides`
(longer prompts, times of day), a `discount` (token prices times 1 - discount), a price for
internal reasoning tokens and a fee per request. The bill applies all of them; the worst case held
against the balance while a request runs counts token prices only, as OpenRouter's estimate does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .catalogue import Endpoint, PriceOverride

_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


@dataclass(frozen=True)
class Prices:
    """USD per million tokens (reasoning tokens at `reasoning`), after the discount; `request` USD."""

    prompt: float
    completion: float
    reasoning: float
    request: float


def _applies(o: PriceOverride, prompt_tokens: int, now: float) -> bool:
    if o.min_prompt_tokens is not None and not prompt_tokens > o.min_prompt_tokens:
        return False
    t = time.gmtime(now)
    if o.utc_days is not None and _DAYS[t.tm_wday] not in o.utc_days:
        return False
    if o.utc_start is not None or o.utc_end is not None:
        clock, start, end = t.tm_hour * 100 + t.tm_min, o.utc_start or 0, o.utc_end if o.utc_end is not None else 2400
        inside = start <= clock < end if start <= end else (clock >= start or clock < end)
        if not inside:
            return False
    return True


def prices(ep: Endpoint, prompt_tokens: int, now: float | None = None) -> Prices:
    """The prices `ep` charges a request with this many prompt tokens at `now` (default: now)."""
    now = time.time() if now is None else now
    prompt, completion = ep.prompt_price, ep.completion_price
    for o in ep.price_overrides:
        if _applies(o, prompt_tokens, now):
            prompt = o.prompt_price if o.prompt_price is not None else prompt
            completion = o.completion_price if o.completion_price is not None else completion
    reasoning = ep.internal_reasoning_price if ep.internal_reasoning_price is not None else completion
    keep = 1.0 - ep.discount
    return Prices(prompt * keep, completion * keep, reasoning * keep, ep.request_price)


def bill(p: Prices, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int) -> tuple[float, float, float]:
    """(prompt cost, completion cost, request fee) in USD; reasoning tokens are part of the completion."""
    answer = completion_tokens - reasoning_tokens
    return (prompt_tokens * p.prompt / 1e6,
            (answer * p.completion + reasoning_tokens * p.reasoning) / 1e6,
            p.request)


def worst_case(ep: Endpoint, prompt_tokens: int, max_tokens: int, now: float | None = None) -> float:
    """The most a request may cost in tokens (every completion token at the dearer of the two prices)."""
    p = prices(ep, prompt_tokens, now)
    return (prompt_tokens * p.prompt + max_tokens * max(p.completion, p.reasoning)) / 1e6
