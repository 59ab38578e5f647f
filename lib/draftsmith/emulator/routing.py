"""Provider routing as OpenRouter documents it: which endpoints may serve a request, in what order.

Filters (`only`, `ignore`, `quantizations` with fp4 covering mxfp4/nvfp4 and fp8 covering mxfp8,
`max_price` in USD per million tokens, `data_collection`, `require_parameters`, context length)
narrow the endpoints; nothing left is a 404. Then the order: `order` first (a base slug such as
`deepinfra` names all of that provider's endpoints, a full slug such as `deepinfra/fp4` one), then,
if `allow_fallbacks`, the rest; `sort` by price, throughput or latency; by default endpoints with
an outage are skipped and the rest shuffled with weight 1/price² (cheap ones first, mostly).
Unknown keys in the `provider` object are a 400, as the real schema rejects them.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import ValidationError

from .catalogue import QUANTIZATIONS, Endpoint, Strict

_COVERS = {"fp4": {"fp4", "mxfp4", "nvfp4"}, "fp8": {"fp8", "mxfp8"}}


class MaxPrice(Strict):
    prompt: float | None = None
    completion: float | None = None


class ProviderPrefs(Strict):
    order: list[str] | None = None
    allow_fallbacks: bool = True
    require_parameters: bool = False
    data_collection: Literal["allow", "deny"] = "allow"
    only: list[str] | None = None
    ignore: list[str] | None = None
    quantizations: list[Literal[QUANTIZATIONS]] | None = None  # type: ignore[valid-type]
    sort: Literal["price", "throughput", "latency"] | None = None
    max_price: MaxPrice | None = None


class RoutingError(Exception):
    def __init__(self, status: int, message: str, metadata: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.metadata = status, message, metadata


NO_PROVIDERS = "No allowed providers are available for the selected model."


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
    if prefs.only is not None:
        eps = [e for e in eps if any(names(e, s) for s in prefs.only)]
    if prefs.ignore:
        eps = [e for e in eps if not any(names(e, s) for s in prefs.ignore)]
    if prefs.quantizations is not None:
        allowed = set().union(*(_COVERS.get(q, {q}) for q in prefs.quantizations)) if prefs.quantizations else set()
        eps = [e for e in eps if e.quantization in allowed]
    if prefs.max_price is not None:
        mp = prefs.max_price
        eps = [e for e in eps if (mp.prompt is None or e.prompt_price <= mp.prompt)
               and (mp.completion is None or e.completion_price <= mp.completion)]
    if prefs.data_collection == "deny":
        eps = [e for e in eps if e.data_collection == "deny"]
    if prefs.require_parameters:
        eps = [e for e in eps if used_params <= set(e.supported_parameters)]
    if not eps:
        raise RoutingError(404, NO_PROVIDERS)
    fits = [e for e in eps if prompt_tokens + max_tokens <= e.context_length and max_tokens <= e.max_completion_tokens]
    if not fits:
        longest = max(e.context_length for e in eps)
        raise RoutingError(400, f"This endpoint's maximum context length is {longest} tokens. However, you "
                                f"requested about {prompt_tokens + max_tokens} tokens ({prompt_tokens} of text "
                                f"input, {max_tokens} in the output). Please reduce the length of either one.")
    eps = fits

    if prefs.order:
        first: list[Endpoint] = []
        for s in prefs.order:
            first += [e for e in eps if names(e, s) and e not in first]
        if not prefs.allow_fallbacks:
            if not first:
                raise RoutingError(404, NO_PROVIDERS)
            return first
        return first + _default_order([e for e in eps if e not in first], prefs, rng)
    explicit = prefs.only is not None  # endpoints the user named are tried even during an outage
    ordered = _default_order(eps, prefs, rng, keep_down=explicit)
    if not ordered:
        raise RoutingError(404, NO_PROVIDERS)
    return ordered if prefs.allow_fallbacks else ordered[:1]


def _default_order(eps: list[Endpoint], prefs: ProviderPrefs, rng: random.Random, keep_down=False) -> list[Endpoint]:
    up = [e for e in eps if not e.is_down]
    down = [e for e in eps if e.is_down] if keep_down else []
    if prefs.sort == "price":
        return sorted(up, key=_price) + down
    if prefs.sort == "throughput":
        return sorted(up, key=lambda e: -e.tokens_per_s.median) + down
    if prefs.sort == "latency":
        return sorted(up, key=lambda e: e.latency_s.median) + down
    # weighted shuffle without replacement (Efraimidis-Spirakis), weight 1/price^2
    keyed = sorted(up, key=lambda e: -(rng.random() ** (_price(e) ** 2)))
    return keyed + down
