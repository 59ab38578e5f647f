"""The public catalogue: GET models and models/{author}/{slug}/endpoints, as OpenRouter lists them.

Prices go out as USD per token in strings; the latency and throughput percentiles of the last 30
minutes come from each endpoint's simulated distributions, the ones routing's preferences use.
"""

from __future__ import annotations

import math

from aiohttp import web

from .catalogue import Endpoint
from .routing import Z
from .wire import API, error_response


def _per_token(usd_per_million: float) -> str:
    return f"{usd_per_million / 1e6:.10f}".rstrip("0").rstrip(".") or "0"


def _pricing(e: Endpoint) -> dict:
    """An endpoint's `pricing` as OpenRouter lists it: USD per token as strings (request: per request)."""
    out = {"prompt": _per_token(e.prompt_price), "completion": _per_token(e.completion_price),
           "request": f"{e.request_price:.10f}".rstrip("0").rstrip(".") or "0", "image": "0",
           "discount": e.discount}
    if e.internal_reasoning_price is not None:
        out["internal_reasoning"] = _per_token(e.internal_reasoning_price)
    if e.price_overrides:
        out["overrides"] = []
        for o in e.price_overrides:
            entry = {k: getattr(o, k) for k in ("min_prompt_tokens", "utc_days", "utc_start", "utc_end")
                     if getattr(o, k) is not None}
            if o.prompt_price is not None:
                entry["prompt"] = _per_token(o.prompt_price)
            if o.completion_price is not None:
                entry["completion"] = _per_token(o.completion_price)
            out["overrides"].append(entry)
    return out


class Listing:
    """The handlers listing one model served by `endpoints`."""

    def __init__(self, model: str, endpoints: list[Endpoint]):
        self.model, self.endpoints = model, endpoints

    def _model_record(self) -> dict:
        up = [e for e in self.endpoints if not e.is_down] or self.endpoints
        cheapest = min(up, key=lambda e: e.prompt_price + e.completion_price)
        name = self.model
        return {
            "id": name, "canonical_slug": name, "name": name.split("/")[-1], "created": 1769500000,
            "description": f"{name}, served by the draftsmith emulator",
            "context_length": max(e.context_length for e in self.endpoints),
            "architecture": {"modality": "text->text", "input_modalities": ["text"], "output_modalities": ["text"],
                             "tokenizer": "Other", "instruct_type": None},
            "pricing": {"prompt": _per_token(cheapest.prompt_price), "completion": _per_token(cheapest.completion_price),
                        "request": "0", "image": "0", "web_search": "0", "internal_reasoning": "0"},
            "top_provider": {"context_length": cheapest.context_length,
                             "max_completion_tokens": cheapest.max_completion_tokens, "is_moderated": False},
            "per_request_limits": None, "default_parameters": None, "supported_voices": None,
            "links": {"details": f"{API}/models/{name}/endpoints"},
            "supported_parameters": sorted({p for e in self.endpoints for p in e.supported_parameters}),
        }

    async def models(self, request):
        return web.json_response({"data": [self._model_record()], "links": {"next": None}, "total_count": 1})

    async def model_endpoints(self, request):
        mid = f"{request.match_info['author']}/{request.match_info['slug']}"
        if mid != self.model:
            return error_response(404, f"No endpoints found for {mid}.")
        rec = self._model_record()
        eps = [self._endpoint_record(e) for e in self.endpoints]
        return web.json_response({"data": {k: rec[k] for k in ("id", "name", "created", "description", "architecture")}
                                  | {"endpoints": eps}})

    def _endpoint_record(self, e: Endpoint) -> dict:
        return {
            "name": f"{e.name} | {self.model}", "model_id": self.model, "model_name": self.model,
            "context_length": e.context_length,
            "pricing": _pricing(e),
            "provider_name": e.name, "tag": e.tag, "quantization": e.quantization,
            "service_tier": None, "native_tools": {}, "supports_diarization": False,
            "supports_tool_choice": {"auto": False, "function": False, "none": False, "required": False},
            "max_completion_tokens": e.max_completion_tokens, "max_prompt_tokens": e.context_length,
            "supported_parameters": e.supported_parameters, "status": e.status,
            "uptime_last_30m": e.uptime_last_30m, "uptime_last_1d": e.uptime_last_30m, "uptime_last_5m": e.uptime_last_30m,
            "supports_implicit_caching": False,
            "latency_last_30m": {p: round(1000 * e.latency_s.median * math.exp(e.latency_s.sigma * z), 1)
                                 for p, z in Z.items()},
            "throughput_last_30m": {p: round(e.tokens_per_s.median * math.exp(-e.tokens_per_s.sigma * z), 1)
                                    for p, z in Z.items()},
        }
