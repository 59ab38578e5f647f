"""OpenRouter's response cache, as its docs describe it: off unless a request sends
`X-OpenRouter-Cache: true` or the key's preset turns it on. A cached request asked again within
the time to live gets the earlier response verbatim (whatever the temperature), with `usage`
zeroed, a new generation id and the header `X-OpenRouter-Cache-Status: HIT`; a cached request
that is not found gets `MISS`. Nothing is billed for a hit.

The config's `response_cache` picks the account: `off`, `preset` (on, unless the request sends
`X-OpenRouter-Cache: false`), `always` (on whatever the request sends: the reply a client must
recognise when caching comes anyway).
"""

from __future__ import annotations

import time
from collections import OrderedDict

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
