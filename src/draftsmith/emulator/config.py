"""The emulator's configuration: one YAML/JSON mapping, every field optional.

Unknown fields are an error naming the field (`load_config` reports the file). Times marked
"simulated" are multiplied by `time_scale` (0 = no simulated waiting at all, the default for
tests; 1 = as slow as the real thing); the others are real seconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from .catalogue import Endpoint, Faults, Strict, default_catalogue
from .faults import RouterFaults

KEY_ENV = "DRAFTSMITH_EMULATOR_KEY"
ADMIN_KEY_ENV = "DRAFTSMITH_EMULATOR_ADMIN_KEY"


class EmulatorConfig(Strict):
    model: str = "moonshotai/kimi-k2.5"  # the model id served
    backend: Literal["synthetic", "model"] = "synthetic"
    target_model_path: str | None = None  # model backend: the checkpoint (or built-in name) to serve;
    #                                       synthetic: its tokenizer (default: the built-in target tokenizer)
    seed: int = 0  # seeds routing, fault draws, synthetic text and unseeded sampling
    time_scale: float = Field(0.0, ge=0)  # multiplies simulated latency/throughput waits
    stream_interval_s: float = Field(0.2, gt=0)  # simulated: SSE chunks carry the tokens due each interval
    providers: list[Endpoint] | None = None  # None: the default Kimi-K2.5 catalogue
    fault_scale: float = Field(1.0, ge=0)  # multiplies every provider's fault rates (0 = no faults)
    faults: Faults | None = None  # if given, replaces every provider's fault rates (then fault_scale)
    hang_s: float = Field(30.0, ge=0)  # real seconds a hung connection stays silent before closing
    stall_s: float = Field(900.0, ge=0)  # real seconds a `stall` fault keeps the connection alive before its 524
    response_cache: Literal["off", "preset", "always"] = "off"  # OpenRouter's response cache (response.py): off
    #   (only for a request sending `X-OpenRouter-Cache: true`), preset (the key's preset turns it on; a request
    #   sending `X-OpenRouter-Cache: false` is not cached), always (on whatever the request sends)
    cache_ttl_s: float = Field(300.0, gt=0)  # real seconds a cached response is served again
    router_faults: RouterFaults = RouterFaults()  # OpenRouter's own retryable errors and outage (faults.py)
    capacities: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)  # endpoint tag
    #   (slug/quantization) -> its concurrency capacity, replacing the catalogue's (the demo's small quirky providers)
    capacity_scale: float = Field(1.0, gt=0)  # multiplies every provider's concurrency capacity
    credits: float = Field(10.0, ge=0)  # initial credits in USD, used only when the state dir is new
    key_capped: bool = True  # /key shows limit = credits (False: limit null; use /credits)
    credits_need_management_key: bool = False  # /credits answers 403 to the plain key
    key_budget_usd: float | None = Field(None, ge=0)  # the key's own limit: /key limit and budgets; once
    #                                                  spent, chat requests get 403 (None: no key budget)
    key_forbidden: bool = False  # every chat request gets 403: the key lacks permission
    byok: bool = False  # the user's own provider keys: usage.cost is OpenRouter's fee, upstream cost apart
    byok_fee_rate: float = Field(0.05, ge=0)  # the fee, as a fraction of the upstream cost
    in_flight_budget: float | None = Field(1.0, ge=0)  # worst-case cost in flight <= this x balance; None = off
    generation_delay_s: float = Field(1.0, ge=0)  # real seconds /generation answers 404 after completion
    padding_interval_s: float = Field(2.0, gt=0)  # real seconds between keep-alive padding / SSE comments
    admin_key: str | None = None  # enables POST /api/v1/admin/topup (also $DRAFTSMITH_EMULATOR_ADMIN_KEY)
    label: str = "draftsmith-emulator"
    # model backend
    max_batch: int = Field(64, ge=1)  # sequences decoded together
    threads: int = Field(1, ge=1)  # torch threads of the model backend (1: leaves a core to the server and client)
    canonical: bool = True  # reject non-canonical candidate tokens while sampling
    synthetic_tokens: int = Field(300, ge=1)  # synthetic backend: median response length (tokens)
    synthetic_reasoning_fraction: float = Field(0.4, ge=0, le=1)

    @model_validator(mode="after")
    def _capacities_name_endpoints(self) -> "EmulatorConfig":
        tags = [e.tag for e in (self.providers if self.providers is not None else default_catalogue())]
        unknown = sorted(set(self.capacities) - set(tags))
        if unknown:
            raise ValueError(f"capacities: no endpoint tagged {', '.join(unknown)} "
                             f"(the endpoints: {', '.join(tags)})")
        return self

    def endpoints(self) -> list[Endpoint]:
        eps = self.providers if self.providers is not None else default_catalogue()
        out = []
        for ep in eps:
            faults = (self.faults if self.faults is not None else ep.faults).scaled(self.fault_scale)
            capacity = self.capacities.get(ep.tag, ep.capacity)
            out.append(ep.model_copy(update={"faults": faults,
                                             "capacity": max(1, round(capacity * self.capacity_scale))}))
        tags = [e.tag for e in out]
        dup = sorted({t for t in tags if tags.count(t) > 1})
        if dup:
            raise ValueError(f"providers: repeated endpoint tags {dup} (slug/quantization must be unique)")
        return out


def load_config(source: str | os.PathLike | dict | None = None, **overrides) -> EmulatorConfig:
    """A config from a YAML/JSON file, a dict, or defaults; `overrides` win. Errors name the
    file and the field."""
    where = "emulator config"
    data: dict = {}
    if isinstance(source, dict):
        data = dict(source)
    elif source is not None:
        path = Path(source)
        where = str(path)
        if not path.is_file():
            raise FileNotFoundError(f"emulator config {where!r} not found")
        text = path.read_text(encoding="utf-8")
        try:
            data = (json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)) or {}
        except (yaml.YAMLError, json.JSONDecodeError) as e:
            raise ValueError(f"{where}: not valid YAML/JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be a mapping of field names to values")
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return EmulatorConfig(**data)
    except ValidationError as e:
        problems = "; ".join(".".join(str(x) for x in err["loc"]) + ": " * bool(err["loc"])
                             + err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise ValueError(f"{where}: {problems}") from None
