"""Money questions, answered once for stages 01 and 02: what a request may cost, what a lost
request did cost, and how much money is left.

`catalogue` prices the endpoints the `provider` routing lets serve at their worst (`Prices.cost`
is the one worst-case rule: stage 02's reservations, stage 01's pilot and probe);
`generation_cost` asks the bill of a lost request; `BalanceReader` is the one reading of the money
left. `BITS` and `FAMILIES` make a quantization name mean the same endpoints everywhere.

The endpoints as a table and the precision policy: `apply_policy` marks each endpoint allowed or
excluded with the reason (below the native precision, `unknown` unless allowed, down, or not
listing a parameter we send: with `require_parameters: true` OpenRouter never routes there, so it
is neither planned nor priced); `routing_object` is the `provider` object stage 02 sends, and
`policy_routing` the same object built by stage 02 when stage 01 did not run."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Iterable, NamedTuple

import aiohttp
import pandas as pd

from .retry import backoff_delay

# Quantization formats: how many bits each keeps, and which formats a routing name stands for, so
# that "fp4" means the same endpoints to stage 01's precision policy and to the pricing of the
# endpoints a routing may pick.
BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "mxfp8": 8, "int8": 8, "fp6": 6,
        "int4": 4, "fp4": 4, "mxfp4": 4, "nvfp4": 4}

# OpenRouter's `quantizations` routing filter: a family name also lets its variants through
FAMILIES = {"fp4": {"fp4", "mxfp4", "nvfp4"}, "fp8": {"fp8", "mxfp8"}}


def below_native(quantization: str, native_precision: str) -> bool:
    """True when serving at `quantization` loses precision against weights natively at
    `native_precision`: fewer bits, or as many bits in another format (int4 QAT weights
    re-quantized to fp4/nvfp4 lose accuracy)."""
    if quantization == native_precision or quantization not in BITS:
        return False
    return BITS[quantization] <= BITS[native_precision]


def routed(quantizations) -> set[str]:
    """The formats a `quantizations` routing list lets serve, its families' variants included."""
    names = set(quantizations)
    for family, members in FAMILIES.items():
        if family in names:
            names |= members
    return names


class CatalogueError(RuntimeError):
    """The endpoints of the model could not be read: nothing can be priced, so nothing is sent."""


@dataclass
class Catalogue:
    prompt_price: float          # worst USD per prompt token
    completion_price: float      # worst USD per completion token
    request_price: float         # worst USD per request
    context_length: int | None   # the largest among the allowed endpoints
    endpoints: int               # how many endpoints routing may pick


def _usd(x) -> float:
    try:
        return float(x or 0)
    except (TypeError, ValueError):
        return 0.0


class Prices(NamedTuple):
    """Prices of an endpoint or a routing (`worst_prices`, `default_prices`). `cost` over worst
    prices is the one worst-case rule: stage 02's reservations and stage 01's paid pilot and probe
    use it. A request routed among several endpoints may cost the highest of their prices
    (`highest`)."""

    prompt: float        # USD per prompt token
    completion: float    # USD per completion token
    request: float       # USD per request

    def cost(self, prompt_tokens: float, completion_tokens: float, requests: float = 1) -> float:
        """USD of `requests` requests holding these tokens in all."""
        return prompt_tokens * self.prompt + completion_tokens * self.completion + requests * self.request


def highest(prices: Iterable[Prices]) -> Prices:
    """The most any of these endpoints charges per token and per request: the worst case of a
    request that routing may send to any of them."""
    prices = list(prices)
    return Prices(*(max(p[i] for p in prices) for i in range(3)))


def worst_prices(ep: dict) -> Prices:
    """The most this endpoint can charge per token / per request: the highest of its default price,
    each of its `overrides` (long-context and time-based prices may start to apply mid-run) and, for
    completion tokens, `internal_reasoning`; `request` once per request. `discount` is left out: it
    can end while requests are in flight, and a bill above the reservation would break the spend limit."""
    pricing = ep.get("pricing") or {}
    prompt, completion = _usd(pricing.get("prompt")), _usd(pricing.get("completion"))
    completion = max(completion, _usd(pricing.get("internal_reasoning")))
    for o in pricing.get("overrides") or []:
        if isinstance(o, dict):
            prompt = max(prompt, _usd(o.get("prompt")))
            completion = max(completion, _usd(o.get("completion")))
    return Prices(prompt, completion, _usd(pricing.get("request")))


def default_prices(ep: dict) -> Prices:
    """(prompt, completion, request) USD at the default conditions, after the endpoint's discount:
    what a typical request pays (for plans, not for reservations)."""
    pricing = ep.get("pricing") or {}
    keep = 1.0 - min(1.0, max(0.0, _usd(pricing.get("discount"))))
    return Prices(keep * _usd(pricing.get("prompt")), keep * _usd(pricing.get("completion")),
                  keep * _usd(pricing.get("request")))


def lacks_parameters(ep: dict, sent: set[str]) -> list[str]:
    """The sent parameters this endpoint does not list (routing with require_parameters skips it)."""
    listed = ep.get("supported_parameters")
    if not isinstance(listed, list):
        return []            # not listed at all: cannot tell, assume it takes them
    return sorted(set(sent) - set(listed))


def endpoint_allowed(ep: dict, provider: dict, sent: set[str] = frozenset()) -> bool:
    """Whether OpenRouter's routing filters in `provider` let this endpoint serve a request that
    sends the parameters `sent`."""
    tag = str(ep.get("tag") or ep.get("provider_name") or "").lower()
    slugs = {tag, tag.split("/")[0]}
    only = [s.lower() for s in provider.get("only") or []]
    if provider.get("allow_fallbacks") is False and provider.get("order"):
        only += [s.lower() for s in provider["order"]]
    if only and not slugs & set(only):
        return False
    if slugs & {s.lower() for s in provider.get("ignore") or []}:
        return False
    quants = provider.get("quantizations")
    if quants and ep.get("quantization") not in routed(quants):
        return False
    if provider.get("require_parameters") and lacks_parameters(ep, sent):
        return False
    max_price = provider.get("max_price") or {}
    pricing = ep.get("pricing") or {}
    return all(_usd(pricing.get(k)) * 1e6 <= float(max_price[k]) for k in ("prompt", "completion") if k in max_price)


async def fetch_endpoints(session: aiohttp.ClientSession, base: str, model: str) -> list[dict]:
    """The `endpoints` of `GET /models/{model}/endpoints`; CatalogueError if they cannot be read."""
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
    return eps


def catalogue(eps: list[dict], model: str, provider: dict, sent: set[str] = frozenset()) -> Catalogue:
    """The worst prices and the context over the endpoints `provider` lets serve (only, ignore,
    order without fallbacks, quantizations, max_price, and with `require_parameters` only those
    listing every parameter in `sent`) among `eps` (`GET /models/{model}/endpoints`); CatalogueError
    (before anything is sent) if routing lets none serve."""
    allowed = [e for e in eps if endpoint_allowed(e, provider, sent)]
    if not allowed:
        lacking = {e.get("tag"): lacks_parameters(e, sent) for e in eps if lacks_parameters(e, sent)}
        hint = (f"; with require_parameters, endpoints lacking a sent parameter are skipped: {lacking}"
                if provider.get("require_parameters") and lacking else "")
        raise CatalogueError(f"no endpoint of {model} satisfies the routing {json.dumps(provider)}{hint}. "
                             f"Every request would be refused (no_provider, 404/503): check `provider`, `seed` "
                             f"and the routing stage 01 chose (notebook 01's last table)")
    worst = highest(worst_prices(e) for e in allowed)
    ctx = [e["context_length"] for e in allowed if isinstance(e.get("context_length"), int)]
    return Catalogue(worst.prompt, worst.completion, worst.request, max(ctx) if ctx else None, len(allowed))


def balance_from(key: dict | None, credits: dict | None) -> tuple[float | None, str]:
    """USD left and where that figure comes from: the lowest of the account's credits (`/credits`,
    when the key may read it), the key's own limit (`/key` `limit_remaining`) and every budget layer
    the key is held to (`/key` `budgets`, of which `effective_budget` blocks first); None when none
    of them caps spending."""
    found: list[tuple[float, str]] = []
    key = key or {}
    if key.get("limit_remaining") is not None:
        found.append((_usd(key["limit_remaining"]), "/key limit_remaining"))
    layers = [b for b in (key.get("budgets") or []) if isinstance(b, dict)]
    if isinstance(key.get("effective_budget"), dict):
        layers.append(key["effective_budget"])
    for b in layers:
        if b.get("remaining_usd") is not None:
            found.append((_usd(b["remaining_usd"]), f"/key budget {b.get('scope', '?')}"))
    if credits and credits.get("total_credits") is not None:
        found.append((_usd(credits["total_credits"]) - _usd(credits.get("total_usage")),
                      "/credits total_credits - total_usage"))
    if not found:
        return None, "uncapped: no credits readable, no key limit, no budget"
    return min(found, key=lambda x: x[0])


async def generation_cost(session: aiohttp.ClientSession, base: str, generation_id: str, patience_s: float,
                          stop: asyncio.Future | None = None) -> float | None:
    """What `GET /generation?id=` says a request cost (OpenRouter's charge plus the provider's for
    BYOK); None if it is not known within `patience_s`. It is 404 for a moment after the request
    ends, so it is asked again with backoff meanwhile."""
    loop = asyncio.get_running_loop()
    deadline, attempt = loop.time() + patience_s, 0
    while True:
        attempt += 1
        try:
            async with session.get(f"{base}/generation", params={"id": generation_id}) as r:
                if r.status == 200:
                    d = (await r.json(content_type=None)).get("data") or {}
                    cost = _usd(d.get("total_cost"))
                    if d.get("is_byok"):
                        cost += _usd(d.get("upstream_inference_cost"))
                    return cost
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            pass
        left = deadline - loop.time()
        if left <= 0:
            return None
        await asyncio.sleep(min(left, backoff_delay(min(attempt, 6), None, base=0.5, cap=10.0) + 0.1))


class BalanceReader:
    """`balance_from` over the live API (stage 02 polls it; stage 01 reads it through
    `api.Api.balance`); remembers that a plain key may not read /credits. `source` says where the
    last figure came from, or why there was none."""

    def __init__(self, session: aiohttp.ClientSession, base: str):
        self.session, self.base = session, base
        self.use_credits = True
        self.source = ""
        self._refused = ""      # why /credits is not asked any more

    async def _get(self, path: str) -> tuple[int, dict]:
        async with self.session.get(self.base + path) as r:
            body = await r.json(content_type=None) if r.status == 200 else await r.read()
            if r.status != 200:
                try:
                    body = json.loads(body or b"{}").get("error") or {}
                except (ValueError, AttributeError):
                    body = {}
            return r.status, body if isinstance(body, dict) else {}

    async def read(self) -> float | None:
        credits = None
        try:
            status, key = await self._get("/key")
            if status != 200:
                self.source = f"/key unreadable: HTTP {status}: {str(key.get('message', ''))[:200]}"
                return None
            if self.use_credits:
                status, body = await self._get("/credits")
                if status == 200:
                    credits = body.get("data") or {}
                elif status in (401, 403, 404):
                    self.use_credits = False      # a plain key: /key is all there is
                    self._refused = f" (/credits refused: HTTP {status}: {str(body.get('message', ''))[:200]})"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as e:
            self.source = f"unreadable: {type(e).__name__}"
            return None
        usd, source = balance_from(key.get("data") or {}, credits)
        self.source = source + self._refused
        return usd


# ---- the endpoint table and the precision policy ----
def endpoint_table(eps: list[dict]) -> pd.DataFrame:
    """One row per endpoint: provider, tag, quantization, $/M in and out at the default conditions
    after any discount, the worst $/M in and out (overrides, internal reasoning) and $ per request,
    the parameters it supports, status, uptime, p50 latency (s) and p50 throughput (tokens/s)."""
    rows = []
    for e in eps:
        lat, thr = e.get("latency_last_30m") or {}, e.get("throughput_last_30m") or {}
        (p_in, p_out, _), (w_in, w_out, w_req) = default_prices(e), worst_prices(e)
        params = e.get("supported_parameters")
        rows.append({
            "provider": e["provider_name"], "tag": e["tag"], "quantization": e.get("quantization") or "unknown",
            "price_in": p_in * 1e6, "price_out": p_out * 1e6, "price_in_worst": w_in * 1e6,
            "price_out_worst": w_out * 1e6, "price_request": w_req,
            "supported_parameters": ",".join(params) if isinstance(params, list) else None,
            "status": e.get("status", 0), "uptime": e.get("uptime_last_30m"),
            "latency_p50_s": lat["p50"] / 1000 if lat.get("p50") is not None else None,
            "throughput_p50": thr.get("p50"), "context_length": e.get("context_length"),
            "max_completion_tokens": e.get("max_completion_tokens"),
        })
    return pd.DataFrame(rows)


def table_worst_prices(table: pd.DataFrame) -> list[Prices]:
    """Each endpoint's worst prices (`pricing.worst_prices`), read back from the table's columns."""
    return [Prices(r["price_in_worst"] / 1e6, r["price_out_worst"] / 1e6, r["price_request"])
            for _, r in table.iterrows()]


def apply_policy(table: pd.DataFrame, native_precision: str, allow_unknown_quantization: bool,
                 sent: set[str] = frozenset()) -> pd.DataFrame:
    """The table with `allowed` and `reason` columns; `sent`: the parameters every request sends
    (with `require_parameters: true`, an endpoint that does not list one of them is never used)."""
    if native_precision not in BITS:
        raise ValueError(f"native_precision {native_precision!r}: expected one of {sorted(BITS)}")
    allowed, reasons = [], []
    for _, row in table.iterrows():
        q = row["quantization"]
        listed = row.get("supported_parameters")
        lacking = lacks_parameters({"supported_parameters": listed.split(",") if isinstance(listed, str) else None},
                                   sent)
        if row["status"] is not None and row["status"] < 0:
            why = f"down (status {row['status']}, uptime {row['uptime']}%)"
        elif below_native(q, native_precision):
            why = f"{q} is below the native {native_precision}"
        elif q == "unknown" and not allow_unknown_quantization:
            why = "quantization unknown (allow_unknown_quantization to use it)"
        elif q not in BITS and q != "unknown":
            why = f"unrecognised quantization {q!r}"
        elif lacking:
            why = (f"does not support {', '.join(lacking)}, which every request sends with require_parameters "
                   f"(OpenRouter never routes it there; set the parameter to null to drop it)")
        else:
            why = ""
        allowed.append(not why)
        reasons.append(why)
    return table.assign(allowed=allowed, reason=reasons)


def routing_object(policy: pd.DataFrame, native_precision: str, allow_unknown_quantization: bool) -> dict:
    """The OpenRouter `provider` object that restricts routing to the allowed endpoints."""
    tags = policy.loc[policy["allowed"], "tag"].tolist()
    if not tags:
        reasons = "; ".join(f"{r['tag']}: {r['reason']}" for _, r in policy.iterrows())
        raise ValueError(f"no endpoint is allowed: {reasons}")
    quants = sorted(set(policy.loc[policy["allowed"], "quantization"]) | {native_precision}
                    | ({"unknown"} if allow_unknown_quantization else set()))
    return {"only": tags, "quantizations": quants, "allow_fallbacks": True, "require_parameters": True}


def exclusions(policy: pd.DataFrame) -> list[dict]:
    return [{"tag": r["tag"], "provider": r["provider"], "quantization": r["quantization"], "reason": r["reason"]}
            for _, r in policy.iterrows() if not r["allowed"]]


def policy_routing(eps: list[dict], native_precision: str, allow_unknown_quantization: bool,
                   sent: set[str]) -> tuple[dict, list[dict]]:
    """Stage 02 without stage 01: the same precision policy over the endpoint list, as the provider
    object and the exclusions (there is no fidelity probe here)."""
    policy = apply_policy(endpoint_table(eps), native_precision, allow_unknown_quantization, sent)
    return routing_object(policy, native_precision, allow_unknown_quantization), exclusions(policy)
