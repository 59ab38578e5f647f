"""Provider routing as OpenRouter documents it: which endpoints may serve a request, in what order.

Filters (`only`, `ignore`, `quantizations` with fp4 covering mxfp4/nvfp4 and fp8 covering mxfp8,
`max_price` in USD per million tokens, `data_collection`, `require_parameters`, context length)
narrow the endpoints; nothing left is a 404 (`availability` `constraint_filtered`, naming the filters
that removed endpoints in `excluded_by`; `no_endpoints` when the `order` without fallbacks names
none; every endpoint down is a retryable 503 `temporarily_unavailable`). Then the order: `order`
first (a base slug such as `deepinfra` names all of that provider's endpoints, a full slug such as
`deepinfra/fp4` one), then, if `allow_fallbacks`, the rest; `sort` by price, throughput or
latency; by default endpoints with an outage are skipped and the rest shuffled with weight
1/price² (cheap ones first, mostly).
Unknown keys in the `provider` object are a 400, as the real schema rejects them.
"""

from __future__ import annotations

import math
import random
from typing import Literal

from pydantic import ValidationError

from .catalogue import QUANTIZATIONS, Endpoint, Strict
from .wire import availability

Z = {"p50": 0.0, "p75": 0.6745, "p90": 1.2816, "p99": 2.3263}  # standard normal quantiles
_COVERS = {"fp4": {"fp4", "mxfp4", "nvfp4"}, "fp8": {"fp8", "mxfp8"}}


class MaxPrice(Strict):
    prompt: float | None = None
    completion: float | None = None
    request: float | None = None  # USD per request
    image: float | None = None
    audio: float | None = None


class SortBy(Strict):
    by: Literal["price", "throughput", "latency", "exacto"] | None = None
    partition: Literal["model", "none"] | None = None


class Percentiles(Strict):
    p50: float | None = None
    p75: float | None = None
    p90: float | None = None
    p99: float | None = None


class ProviderPrefs(Strict):
    order: list[str] | None = None
    allow_fallbacks: bool = True
    require_parameters: bool = False
    data_collection: Literal["allow", "deny"] = "allow"
    only: list[str] | None = None
    ignore: list[str] | None = None
    quantizations: list[Literal[QUANTIZATIONS]] | None = None  # type: ignore[valid-type]
    sort: Literal["price", "throughput", "latency", "exacto"] | SortBy | None = None
    max_price: MaxPrice | None = None
    zdr: bool | None = None
    enforce_distillable_text: bool | None = None
    preferred_min_throughput: float | Percentiles | None = None  # tokens/s
    preferred_max_latency: float | Percentiles | None = None  # seconds
    options: dict | None = None  # provider-specific options, keyed by provider slug

    @property
    def sort_by(self) -> str | None:
        return self.sort.by if isinstance(self.sort, SortBy) else self.sort


class RoutingError(Exception):
    def __init__(self, status: int, message: str, metadata: dict | None = None, avail: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.metadata, self.avail = status, message, metadata, avail


NO_PROVIDERS = "No allowed providers are available for the selected model."
NO_PARAMETERS = ("No endpoints found that can handle the requested parameters. To learn more about provider "
                 "routing, visit: https://openrouter.ai/docs/guides/routing/provider-selection")
ALL_DOWN = "No available model provider that meets your routing requirements. Please try again later."


def parse_prefs(obj) -> ProviderPrefs:
    if obj is None:
        return ProviderPrefs()
    if not isinstance(obj, dict):
        raise RoutingError(400, "provider: expected an object")
    try:
        return ProviderPrefs(**obj)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        raise RoutingError(400, f"Invalid provider preferences: provider.{field}: {err['msg']}") from None


def names(ep: Endpoint, slug: str) -> bool:
    s = slug.lower()
    return s == ep.slug.lower() or s == ep.tag.lower()


def _price(ep: Endpoint) -> float:
    return ep.prompt_price + ep.completion_price


def route(prefs: ProviderPrefs, endpoints: list[Endpoint], used_params: set[str], prompt_tokens: int,
          max_tokens: int, rng: random.Random) -> list[Endpoint]:
    """The endpoints to try, in order; raises RoutingError (404/400) when none may serve."""
    eps = list(endpoints)
    excluded_by: list[str] = []

    def keep(name: str, kept: list[Endpoint]) -> list[Endpoint]:
        if len(kept) < len(eps):
            excluded_by.append(name)
        return kept

    if prefs.only is not None:
        eps = keep("only", [e for e in eps if any(names(e, s) for s in prefs.only)])
    if prefs.ignore:
        eps = keep("ignore", [e for e in eps if not any(names(e, s) for s in prefs.ignore)])
    if prefs.quantizations is not None:
        allowed = set().union(*(_COVERS.get(q, {q}) for q in prefs.quantizations)) if prefs.quantizations else set()
        eps = keep("quantizations", [e for e in eps if e.quantization in allowed])
    if prefs.max_price is not None:
        mp = prefs.max_price
        eps = keep("max_price", [e for e in eps if (mp.prompt is None or e.prompt_price <= mp.prompt)
                                 and (mp.completion is None or e.completion_price <= mp.completion)
                                 and (mp.request is None or e.request_price <= mp.request)])
    if prefs.data_collection == "deny":
        eps = keep("data_collection", [e for e in eps if e.data_collection == "deny"])
    if prefs.zdr:
        eps = keep("zdr", [e for e in eps if e.zdr])
    if not eps:
        raise RoutingError(404, NO_PROVIDERS, {"error_type": "not_found"},
                           availability("constraint_filtered", False, excluded_by=excluded_by))
    if prefs.require_parameters:
        eps = [e for e in eps if used_params <= set(e.supported_parameters)]
        if not eps:
            raise RoutingError(404, NO_PARAMETERS, {"error_type": "not_found",
                                                    "requested_parameters": sorted(used_params)},
                               availability("constraint_filtered", False, excluded_by=["require_parameters"],
                                            constraint={"require_parameters": sorted(used_params)}))
    fits = [e for e in eps if prompt_tokens + max_tokens <= e.context_length and max_tokens <= e.max_completion_tokens]
    if not fits:
        longest = max(e.context_length for e in eps)
        raise RoutingError(400, f"This endpoint's maximum context length is {longest} tokens. However, you "
                                f"requested about {prompt_tokens + max_tokens} tokens ({prompt_tokens} of text "
                                f"input, {max_tokens} in the output). Please reduce the length of either one.",
                           {"error_type": "context_length_exceeded"})
    eps = fits

    if prefs.order:
        first: list[Endpoint] = []
        for s in prefs.order:
            first += [e for e in eps if names(e, s) and e not in first]
        if not prefs.allow_fallbacks:
            if not first:
                raise RoutingError(404, NO_PROVIDERS, {"error_type": "not_found"},
                                   availability("no_endpoints", False))
            return first
        return first + _default_order([e for e in eps if e not in first], prefs, rng)
    explicit = prefs.only is not None  # endpoints the user named are tried even during an outage
    ordered = _default_order(eps, prefs, rng, keep_down=explicit)
    if not ordered:
        raise RoutingError(503, ALL_DOWN, {"error_type": "provider_unavailable"},
                           availability("temporarily_unavailable", True))
    return ordered if prefs.allow_fallbacks else ordered[:1]


def _meets(e: Endpoint, prefs: ProviderPrefs) -> bool:
    """Whether `e` meets the preferred throughput and latency (median and spread of its speeds)."""
    for want, dist, floor in ((prefs.preferred_min_throughput, e.tokens_per_s, True),
                              (prefs.preferred_max_latency, e.latency_s, False)):
        if want is None:
            continue
        cuts = {"p50": want} if isinstance(want, (int, float)) else {k: v for k, v in want.model_dump().items()
                                                                       if v is not None}
        for p, cut in cuts.items():
            # throughput: its p-th percentile counts from the slow end; latency from the fast end
            value = dist.median * math.exp((-1 if floor else 1) * dist.sigma * Z[p])
            if (value < cut) if floor else (value > cut):
                return False
    return True


def _default_order(eps: list[Endpoint], prefs: ProviderPrefs, rng: random.Random, keep_down=False) -> list[Endpoint]:
    up = [e for e in eps if not e.is_down]
    down = [e for e in eps if e.is_down] if keep_down else []
    by = prefs.sort_by
    if by == "price":
        keyed = sorted(up, key=_price)
    elif by == "throughput":
        keyed = sorted(up, key=lambda e: -e.tokens_per_s.median)
    elif by == "latency":
        keyed = sorted(up, key=lambda e: e.latency_s.median)
    else:  # weighted shuffle without replacement (Efraimidis-Spirakis), weight 1/price^2
        keyed = sorted(up, key=lambda e: -(rng.random() ** (_price(e) ** 2)))
    if prefs.preferred_min_throughput is not None or prefs.preferred_max_latency is not None:
        keyed = [e for e in keyed if _meets(e, prefs)] + [e for e in keyed if not _meets(e, prefs)]
    return keyed + down
