"""The simulated provider endpoints of the served model, and the default catalogue.

An endpoint is what OpenRouter lists under `/models/{author}/{slug}/endpoints`: one provider
serving the model at one quantization and price. Besides what OpenRouter shows (tag, quantization,
prices, status, context), each simulated endpoint carries what only the emulator knows: its speed
distributions, its concurrency capacity, its injected fault rates and its quirks (bugs a real
provider may have that the stages must catch).

The default catalogue imitates Kimi-K2.5 on OpenRouter in 2026: several int4 endpoints at
different prices (one of them cheap and secretly serving a perturbed model), two `unknown`, one
nvfp4, one fp4 that is up and one fp4 that is down. Six of the int4 endpoints list `logprobs`: two
return them exactly, one with its token splits quirk, and one each none, rounded and placeholders.

Below the catalogue: what a request costs at an endpoint (`prices`, `bill`, `worst_case`), and
OpenRouter's provider routing, which endpoints may serve a request and in what order (`route`).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .wire import availability


QUANTIZATIONS = ("int4", "int8", "fp4", "mxfp4", "nvfp4", "fp6", "fp8", "mxfp8", "fp16", "bf16", "fp32", "unknown")
SUPPORTED_PARAMETERS = ["max_tokens", "temperature", "top_p", "seed", "stop", "reasoning", "include_reasoning"]
LOGPROB_PARAMETERS = ["logprobs", "top_logprobs"]  # listed by the endpoints that return logprobs


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Faults(Strict):
    """Per-request probabilities of each injected failure (drawn from a seeded hash, see faults.py).

    Before the first token (OpenRouter falls back to the next provider when it can): `rate_limit`
    (429), `bad_gateway` (502), `unavailable` (503), `timeout` (524), `overloaded` (529).
    After the response started (no fallback possible): `error_200` (HTTP 200 whose body or
    stream carries an `error`), `mid_stream` (some tokens, then an error and finish_reason
    `error`), `empty_200` (200 with no content and no finish reason, as on a cold start), `hang`
    (the provider generates and bills the response, but the client only gets the headers, with
    `X-Generation-Id`; the connection stays silent for `hang_s`, then closes),
    `cut_after_billing` (non-streaming: generated and billed in full, headers sent, then the
    connection closes before the body completes; streaming: the stream is cut mid-way, billed in
    full unless the endpoint `supports_cancellation`, then for the tokens produced so far),
    `stall` (no provider answers: the router keeps the connection alive with keep-alive, SSE
    comments or whitespace padding of a JSON body, for the config's `stall_s` real seconds, then
    ends it with a 524: an error chunk, or an error body inside the 200; nothing is billed),
    `bad_bytes` (generated and billed in full, but the JSON body, or one chunk of a stream,
    carries bytes that are not UTF-8 inside the text)."""

    rate_limit: float = 0.0
    bad_gateway: float = 0.0
    unavailable: float = 0.0
    timeout: float = 0.0
    overloaded: float = 0.0
    error_200: float = 0.0
    mid_stream: float = 0.0
    empty_200: float = 0.0
    hang: float = 0.0
    cut_after_billing: float = 0.0
    stall: float = 0.0
    bad_bytes: float = 0.0

    def scaled(self, factor: float) -> "Faults":
        return Faults(**{k: min(1.0, v * factor) for k, v in self.model_dump().items()})


class Quirks(Strict):
    """Provider bugs, off by default.

    `noncanonical_rate`: per generated token, the chance of a token split the tokenizer would not
    produce from the text (model backend: a non-canonical candidate is kept instead of rejected;
    synthetic backend: a multi-byte token is split in two). `billing_tokenizer`: `merges-dropped`
    counts the billed prompt and completion tokens with a weaker tokenizer (the target's
    tokenizer.json with most of its BPE merges dropped), so usage disagrees with the ids served.
    `strip_whitespace`: leading/trailing whitespace stripped from the returned content.
    `reasoning_truncate_rate` / `reasoning_drop_rate`: the returned reasoning is cut to its first
    `output.TRUNCATE_CHARS` characters / null on that fraction of responses (reasoning_tokens and
    completion_tokens still billed in full); the draws follow each other evenly, so an endpoint's
    responses, however few or reordered, carry the rate give or take two.
    `perturbed_model`: serves the target with Gaussian noise of this relative size added to its
    weights (as an undeclared quantization would); 0 = the real weights.
    `logprobs`, for an endpoint that lists `logprobs`: `exact` returns the logprobs of the model it
    serves; `absent` returns none (null) although it lists them; `rounded` returns them rounded to
    two decimals; `placeholder` returns 0 for every token and alternative, as some APIs do."""

    noncanonical_rate: float = 0.0
    billing_tokenizer: Literal["target", "merges-dropped"] = "target"
    strip_whitespace: bool = False
    reasoning_truncate_rate: float = 0.0
    reasoning_drop_rate: float = 0.0
    perturbed_model: float = 0.0
    logprobs: Literal["exact", "absent", "rounded", "placeholder"] = "exact"


class PriceOverride(Strict):
    """A conditional price, as OpenRouter lists them under `pricing.overrides`: it applies when
    every condition it gives holds (prompt longer than `min_prompt_tokens`; UTC weekday in
    `utc_days`; UTC clock, as HHMM, in [utc_start, utc_end), wrapping past midnight); among those
    that apply, later entries win per price; prices it omits are the endpoint's. USD per million."""

    min_prompt_tokens: int | None = Field(None, ge=0)
    utc_days: list[Literal["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]] | None = None
    utc_start: int | None = Field(None, ge=0, le=2400)
    utc_end: int | None = Field(None, ge=0, le=2400)
    prompt_price: float | None = Field(None, ge=0)
    completion_price: float | None = Field(None, ge=0)


class Dist(Strict):
    """A lognormal distribution given by its median and the sigma of its log."""

    median: float
    sigma: float = 0.3


class Endpoint(Strict):
    """One simulated provider endpoint. Prices are USD per million tokens, except `request_price`
    (USD per request). `discount` multiplies the token prices by (1 - discount);
    `internal_reasoning_price`, if set, prices the reasoning tokens instead of the completion price;
    `price_overrides` are conditional prices (long prompts, times of day)."""

    slug: str = Field(description="provider slug, e.g. deepinfra")
    name: str = Field(description="provider display name, e.g. DeepInfra")
    quantization: Literal[QUANTIZATIONS]  # type: ignore[valid-type]
    prompt_price: float = Field(ge=0)
    completion_price: float = Field(gt=0)
    status: int = 0  # 0 ok; negative = degraded/down (down endpoints fail every request with 503)
    uptime_last_30m: float = 99.5
    context_length: int = 262144
    max_completion_tokens: int = 65536
    supported_parameters: list[str] = Field(default_factory=lambda: list(SUPPORTED_PARAMETERS))
    data_collection: Literal["allow", "deny"] = "deny"
    zdr: bool = True  # zero data retention (`provider.zdr: true` routes only to these)
    supports_cancellation: bool = True  # a stream closed by the client stops generation and billing
    request_price: float = Field(0.0, ge=0)
    internal_reasoning_price: float | None = Field(None, ge=0)
    discount: float = Field(0.0, ge=0, le=1)
    price_overrides: list[PriceOverride] = Field(default_factory=list)
    latency_s: Dist = Dist(median=1.0)  # time to first token
    tokens_per_s: Dist = Dist(median=40.0)  # per stream
    capacity: int = 400  # concurrent requests; beyond it the provider answers 429
    retry_after_s: float | None = None  # Retry-After sent with this provider's 429s, if any
    faults: Faults = Faults()
    quirks: Quirks = Quirks()

    @property
    def tag(self) -> str:
        return f"{self.slug}/{self.quantization}"

    @property
    def is_down(self) -> bool:
        return self.status < 0


# The usual background fault rates of a busy provider (each per request).
_BACKGROUND = Faults(rate_limit=0.01, bad_gateway=0.004, unavailable=0.004, timeout=0.002, overloaded=0.002,
                     error_200=0.004, mid_stream=0.004, empty_200=0.003, hang=0.0005)


def default_catalogue() -> list[Endpoint]:
    """Kimi-K2.5 as OpenRouter listed it in 2026 (provider names and prices approximate)."""
    E = Endpoint
    LP = SUPPORTED_PARAMETERS + LOGPROB_PARAMETERS
    return [
        E(slug="moonshotai", name="Moonshot AI", quantization="int4", prompt_price=0.60, completion_price=2.50,
          supported_parameters=LP, latency_s=Dist(median=1.4), tokens_per_s=Dist(median=35), capacity=400,
          retry_after_s=2, faults=_BACKGROUND),
        E(slug="deepinfra", name="DeepInfra", quantization="int4", prompt_price=0.45, completion_price=2.25,
          supported_parameters=LP, latency_s=Dist(median=0.8), tokens_per_s=Dist(median=45), capacity=500,
          faults=_BACKGROUND),
        E(slug="deepinfra", name="DeepInfra", quantization="fp4", prompt_price=0.40, completion_price=1.90,
          latency_s=Dist(median=0.7), tokens_per_s=Dist(median=70), capacity=400, faults=_BACKGROUND),
        E(slug="parasail", name="Parasail", quantization="int4", prompt_price=0.50, completion_price=2.20,
          latency_s=Dist(median=1.0), tokens_per_s=Dist(median=50), capacity=300, retry_after_s=1,
          faults=_BACKGROUND, supported_parameters=LP, quirks=Quirks(strip_whitespace=True, logprobs="rounded")),
        E(slug="novita", name="Novita", quantization="int4", prompt_price=0.55, completion_price=2.40,
          latency_s=Dist(median=1.5), tokens_per_s=Dist(median=30), capacity=300,
          faults=_BACKGROUND, supported_parameters=LP,
          quirks=Quirks(billing_tokenizer="merges-dropped", logprobs="absent")),
        E(slug="together", name="Together", quantization="int4", prompt_price=0.50, completion_price=2.30,
          latency_s=Dist(median=0.9), tokens_per_s=Dist(median=55), capacity=400,
          faults=_BACKGROUND, supported_parameters=LP, quirks=Quirks(noncanonical_rate=0.01)),
        E(slug="siliconflow", name="SiliconFlow", quantization="int4", prompt_price=0.50, completion_price=2.20,
          latency_s=Dist(median=2.0), tokens_per_s=Dist(median=25), capacity=200,
          faults=_BACKGROUND, supported_parameters=LP,
          quirks=Quirks(reasoning_truncate_rate=0.2, reasoning_drop_rate=0.1, logprobs="placeholder")),
        E(slug="chutes", name="Chutes", quantization="int4", prompt_price=0.38, completion_price=1.80,
          latency_s=Dist(median=2.5, sigma=0.6), tokens_per_s=Dist(median=25), capacity=600,
          uptime_last_30m=97.0, faults=_BACKGROUND.scaled(2), quirks=Quirks(perturbed_model=0.5)),
        E(slug="atlas-cloud", name="AtlasCloud", quantization="unknown", prompt_price=0.45, completion_price=2.10,
          latency_s=Dist(median=1.2), tokens_per_s=Dist(median=40), capacity=300, faults=_BACKGROUND),
        E(slug="gmicloud", name="GMICloud", quantization="unknown", prompt_price=0.50, completion_price=2.00,
          latency_s=Dist(median=1.1), tokens_per_s=Dist(median=45), capacity=300, faults=_BACKGROUND),
        E(slug="fireworks", name="Fireworks", quantization="nvfp4", prompt_price=0.60, completion_price=2.50,
          latency_s=Dist(median=0.5), tokens_per_s=Dist(median=110), capacity=600, faults=_BACKGROUND),
        E(slug="baseten", name="BaseTen", quantization="fp4", prompt_price=0.60, completion_price=2.50,
          status=-2, uptime_last_30m=12.0, latency_s=Dist(median=0.6), tokens_per_s=Dist(median=90),
          capacity=300, faults=_BACKGROUND),
    ]


# ------------------------------------------------------------------------------------------------
# What one request costs at one endpoint: the prices in force, the bill, and the worst case.
#
# OpenRouter lists a default price per token and, on some endpoints, conditional `overrides`
# (longer prompts, times of day), a `discount` (token prices times 1 - discount), a price for
# internal reasoning tokens and a fee per request. The bill applies all of them; the worst case held
# against the balance while a request runs counts token prices only, as OpenRouter's estimate does.


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


# ------------------------------------------------------------------------------------------------
# Provider routing as OpenRouter documents it: which endpoints may serve a request, in what order.
#
# Filters (`only`, `ignore`, `quantizations` with fp4 covering mxfp4/nvfp4 and fp8 covering mxfp8,
# `max_price` in USD per million tokens, `data_collection`, `require_parameters`, context length)
# narrow the endpoints; nothing left is a 404 (`availability` `constraint_filtered`, naming the filters
# that removed endpoints in `excluded_by`; `no_endpoints` when the `order` without fallbacks names
# none; every endpoint down is a retryable 503 `temporarily_unavailable`). Then the order: `order`
# first (a base slug such as `deepinfra` names all of that provider's endpoints, a full slug such as
# `deepinfra/fp4` one), then, if `allow_fallbacks`, the rest; `sort` by price, throughput or
# latency; by default endpoints with an outage are skipped and the rest shuffled with weight
# 1/price² (cheap ones first, mostly).
# Unknown keys in the `provider` object are a 400, as the real schema rejects them.


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
