"""What the API says a request may cost and how much money is left.

Prices come from `GET /models/{model}/endpoints`: the highest prompt and completion price among
the endpoints the `provider` routing object allows (only, ignore, order without fallbacks,
quantizations, max_price), so that a worst-case reservation holds whichever of them serves. The
balance comes from `GET /key` (the key's own limit) and `GET /credits` (the account; plain keys
may be refused it, then only /key counts), whichever is lower.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp

_FP4 = {"fp4", "mxfp4", "nvfp4"}


class CatalogueError(RuntimeError):
    """The endpoints of the model could not be read: nothing can be priced, so nothing is sent."""


@dataclass
class Catalogue:
    prompt_price: float          # worst USD per prompt token
    completion_price: float      # worst USD per completion token
    context_length: int | None   # the largest among the allowed endpoints
    endpoints: int               # how many endpoints routing may pick


def endpoint_allowed(ep: dict, provider: dict) -> bool:
    """Whether OpenRouter's routing filters in `provider` let this endpoint serve."""
    tag = str(ep.get("tag") or ep.get("provider_name") or "").lower()
    slugs = {tag, tag.split("/")[0]}
    only = [s.lower() for s in provider.get("only") or []]
    if provider.get("allow_fallbacks") is False and provider.get("order"):
        only += [s.lower() for s in provider["order"]]
    if only and not slugs & set(only):
        return False
    if slugs & {s.lower() for s in provider.get("ignore") or []}:
        return False
    quants = set(provider.get("quantizations") or [])
    if quants:
        if "fp4" in quants:
            quants |= _FP4
        if "fp8" in quants:
            quants.add("mxfp8")
        if ep.get("quantization") not in quants:
            return False
    max_price = provider.get("max_price") or {}
    pricing = ep.get("pricing") or {}
    return all(float(pricing.get(k, 0)) * 1e6 <= float(max_price[k]) for k in ("prompt", "completion") if k in max_price)


async def fetch_catalogue(session: aiohttp.ClientSession, base: str, model: str, provider: dict) -> Catalogue:
    where = f"GET {base}/models/{model}/endpoints"
    try:
        async with session.get(f"{base}/models/{model}/endpoints") as r:
            status, body = r.status, await r.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise CatalogueError(f"{where}: cannot reach the API ({type(e).__name__}: {e})") from None
    if status in (401, 403):
        raise CatalogueError(f"{where}: HTTP {status}: the API key was refused; check api_key_file")
    if status != 200:
        raise CatalogueError(f"{where}: HTTP {status}: cannot price requests; check `model`")
    try:
        eps = (json.loads(body).get("data") or {}).get("endpoints") or []
    except (ValueError, AttributeError):
        raise CatalogueError(f"{where}: the answer is not the documented JSON") from None
    if not eps:
        raise CatalogueError(f"{where}: model {model!r} has no endpoints")
    # If routing excludes everything the API answers 404 to each request, which stops the run with
    # its message; price over all endpoints meanwhile.
    allowed = [e for e in eps if endpoint_allowed(e, provider)] or eps
    ctx = [e["context_length"] for e in allowed if isinstance(e.get("context_length"), int)]
    return Catalogue(max(float((e.get("pricing") or {}).get("prompt", 0)) for e in allowed),
                     max(float((e.get("pricing") or {}).get("completion", 0)) for e in allowed),
                     max(ctx) if ctx else None, len(allowed))


class BalanceReader:
    """USD left on the account, or None when neither /key nor /credits shows a cap."""

    def __init__(self, session: aiohttp.ClientSession, base: str):
        self.session, self.base = session, base
        self.use_credits = True

    async def read(self) -> float | None:
        left = []
        try:
            async with self.session.get(f"{self.base}/key") as r:
                if r.status == 200:
                    d = (await r.json(content_type=None)).get("data") or {}
                    if d.get("limit_remaining") is not None:
                        left.append(float(d["limit_remaining"]))
            if self.use_credits:
                async with self.session.get(f"{self.base}/credits") as r:
                    if r.status == 200:
                        d = (await r.json(content_type=None)).get("data") or {}
                        if d.get("total_credits") is not None:
                            left.append(float(d["total_credits"]) - float(d.get("total_usage") or 0))
                    elif r.status in (401, 403, 404):
                        self.use_credits = False      # a plain key: /key is all there is
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return None
        return min(left) if left else None
