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
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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
    `quirks.TRUNCATE_CHARS` characters / null on that fraction of responses (reasoning_tokens and
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

