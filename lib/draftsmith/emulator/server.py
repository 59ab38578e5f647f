"""The local OpenRouter: an aiohttp app speaking the OpenRouter API over simulated providers.

Endpoints (under /api/v1): POST chat/completions (JSON or SSE), GET key, credits, generation?id=,
models, models/{author}/{slug}/endpoints; POST admin/topup and GET admin/state (emulator only,
admin key). A chat request goes: validate -> prompt ids (chat template) -> key checks (403: no
permission, key budget spent) -> routing (404/503) -> credit checks (402, whose metadata names the
`limit_source` and, for the in-flight budget, the `reason`) -> reserve its worst-case cost -> try
endpoints in order (capacity 429s and injected pre-first-token faults fall back silently) ->
generate (paced by the endpoint's latency and tokens/s, scaled by `time_scale`) -> apply quirks ->
bill -> ledger line. The wire format is the one OpenRouter documents (field names, error envelope,
`X-Generation-Id` header, padding, SSE comments, usage chunk); every response validates against
the official SDK's models (tests/test_openrouter_conformance.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import secrets
import string
import time
from collections import Counter, OrderedDict
from functools import lru_cache
from pathlib import Path

from aiohttp import web

from ..datasets import stable_id
from .backends import Job, Vocab
from .catalogue import Endpoint
from .config import EmulatorConfig
from .faults import BEFORE_FIRST_TOKEN, UPSTREAM_MESSAGES, draw, uniform
from .ledger import Ledger
from .output import Output
from .prices import prices, worst_case
from .quirks import Billing
from .routing import Z, RoutingError, parse_prefs, route
from .synthetic import SyntheticBackend
from .wire import PROCESSING, JSONWriter, SSEWriter

API = "/api/v1"
USER_ID = "user_emulator"
MAX_CHUNK_TOKENS = 16  # a stream chunk carries at most this many tokens
_SAMPLING_PARAMS = ("max_tokens", "temperature", "top_p", "seed", "stop", "reasoning", "include_reasoning")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SUMMARIES = ("auto", "concise", "detailed")
# error_type of the upstream failures (OpenRouter's typed error codes)
_ERROR_TYPES = {429: "rate_limit_exceeded", 502: "provider_unavailable", 503: "provider_overloaded",
                524: "timeout", 529: "provider_overloaded"}
_REMEDY = {
    "openrouter_credits": "Add credits at https://openrouter.ai/settings/credits, or lower max_tokens.",
    "openrouter_key_limit": "Raise this API key's credit limit, or lower max_tokens.",
    "openrouter_in_flight_budget": "Retry after your in-flight requests settle (see the Retry-After header). "
                                   "Adding credits raises your in-flight budget, up to a capped ceiling.",
}


def error_body(code: int, message: str, metadata: dict | None = None) -> dict:
    err = {"code": code, "message": message}
    if metadata is not None:
        err["metadata"] = metadata
    return {"error": err, "user_id": USER_ID}


def error_response(code: int, message: str, metadata: dict | None = None, headers: dict | None = None):
    return web.json_response(error_body(code, message, metadata), status=code, headers=headers)


def _payment_required(message: str, limit_source: str, reason: str | None = None, retry_after: int | None = None):
    """A 402 as OpenRouter documents it: `limit_source`, a `remedy_hint`, and for the in-flight
    budget the `reason` (`in_flight_budget_exhausted` comes with Retry-After)."""
    meta = {"error_type": "payment_required", "limit_source": limit_source, "remedy_hint": _REMEDY[limit_source]}
    headers = None
    if reason is not None:
        meta |= {"reason": reason, "code": reason}  # `code`: the name the emulator used before
    if retry_after is not None:
        meta["retry_after_seconds"] = retry_after
        headers = {"Retry-After": str(retry_after)}
    return error_response(402, message, meta, headers)


class BadRequest(Exception):
    pass


def _gen_id() -> str:
    alphabet = string.ascii_letters + string.digits
    return f"gen-{int(time.time())}-" + "".join(secrets.choice(alphabet) for _ in range(20))


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


@lru_cache(maxsize=4)
def _tokenizer(target_model_path: str | None):
    """The target tokenizer (of the checkpoint, or the built-in one); loaded once per process."""
    from ..target.checkpoint import load_tokenizer
    from ..target.tiny import make_tokenizer

    return load_tokenizer(target_model_path, log=lambda *a: None) if target_model_path else make_tokenizer()


class Emulator:
    """State and handlers of one emulator; `app()` is the aiohttp application."""

    def __init__(self, config: EmulatorConfig, key: str, state_dir: str | Path, admin_key: str | None = None):
        if not key:
            raise ValueError("the emulator needs an API key to accept")
        self.cfg = config
        self.endpoints: list[Endpoint] = config.endpoints()
        self._key, self._admin_key = key, admin_key or config.admin_key
        self.ledger = Ledger(state_dir, config.credits)
        self.state_dir = Path(state_dir)
        self.vocab = Vocab(self._load_tokenizer())
        self.tokenizer = self.vocab.tokenizer
        self._fast_tok = self.tokenizer._tokenizer
        self.backend = self._load_backend()
        self._billing: dict[str, Billing] = {}
        self.active: Counter[str] = Counter()  # in-flight requests per endpoint tag
        self.reserved = 0.0  # worst-case USD of the requests in flight
        self.in_flight = 0
        self.asked: Counter[str] = Counter()  # times each prompt was asked (fault draws)
        self.rng = random.Random(config.seed)
        self._prompts: OrderedDict[str, list[int]] = OrderedDict()
        self.stats: Counter[str] = Counter()

    def _load_tokenizer(self):
        return _tokenizer(self.cfg.target_model_path)

    def _load_backend(self):
        if self.cfg.backend == "model":
            if not self.cfg.target_model_path:
                raise ValueError("emulator config: backend 'model' needs target_model_path")
            from ..target.checkpoint import resolve_target
            from .model import ModelBackend

            return ModelBackend(resolve_target(self.cfg.target_model_path, log=lambda *a: None), self.vocab,
                                max_batch=self.cfg.max_batch, threads=self.cfg.threads,
                                canonical=self.cfg.canonical, seed=self.cfg.seed)
        return SyntheticBackend(self.vocab, self.cfg.synthetic_tokens, self.cfg.synthetic_reasoning_fraction)

    def billing(self, ep: Endpoint) -> Billing:
        """How `ep` counts billed tokens (its other tokenizer is built on first use)."""
        kind = ep.quirks.billing_tokenizer
        if kind not in self._billing:
            self._billing[kind] = Billing(self.tokenizer, kind)
        return self._billing[kind]

    def close(self) -> None:
        if hasattr(self.backend, "close"):
            self.backend.close()
        self.ledger.close()

    # ---- app -----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 2**20)
        app.add_routes([
            web.post(f"{API}/chat/completions", self.chat),
            web.get(f"{API}/key", self.key),
            web.get(f"{API}/credits", self.credits),
            web.get(f"{API}/generation", self.generation),
            web.get(f"{API}/models", self.models),
            web.get(f"{API}/models/{{author}}/{{slug}}/endpoints", self.model_endpoints),
            web.post(f"{API}/admin/topup", self.admin_topup),
            web.get(f"{API}/admin/state", self.admin_state),
        ])
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        path = request.path
        if path.startswith(f"{API}/models") or path.startswith(f"{API}/admin/"):
            return await handler(request)  # the catalogue is public; admin checks its own key
        auth = request.headers.get("Authorization", "")
        if not auth:
            return error_response(401, "No auth credentials found")
        if not auth.startswith("Bearer ") or not secrets.compare_digest(auth[7:].strip(), self._key):
            return error_response(401, "User not found.")
        return await handler(request)

    # ---- account ---------------------------------------------------------------------------------

    def _key_budget(self) -> dict | None:
        """The key's own limit as a `/key` budget entry: `key_budget_usd`, else (with `key_capped`)
        the credits; None when the key is uncapped."""
        led = self.ledger
        _ = led.balance  # picks up top-ups written by another process
        limit = self.cfg.key_budget_usd
        if limit is None and self.cfg.key_capped:
            limit = led.total_credits
        if limit is None:
            return None
        return {"budget_id": None, "guardrail_id": None, "include_byok": False, "limit_usd": limit,
                "remaining_usd": max(0.0, limit - led.total_usage), "reset_interval": None, "resets_at": None,
                "scope": "key_limit", "spend_usd": led.total_usage}

    async def key(self, request):
        led = self.ledger
        budget = self._key_budget()
        return web.json_response({"data": {
            "label": self.cfg.label, "limit": budget["limit_usd"] if budget else None,
            "limit_remaining": budget["remaining_usd"] if budget else None, "limit_reset": None,
            "budgets": [budget] if budget else [], "effective_budget": budget,
            "include_byok_in_limit": False, "usage": led.total_usage, "usage_daily": led.usage_daily,
            "usage_weekly": led.total_usage, "usage_monthly": led.total_usage,
            "byok_usage": led.byok_usage, "byok_usage_daily": led.byok_usage_daily,
            "byok_usage_weekly": led.byok_usage, "byok_usage_monthly": led.byok_usage,
            "is_free_tier": False, "is_management_key": False, "is_provisioning_key": False,
            "allowed_data_regions": ["global"], "creator_user_id": None, "organization_id": None,
            "workspace_id": None, "free_model_daily_requests": {"limit": 1000, "remaining": 1000, "used": 0},
            "rate_limit": {"requests": -1, "interval": "10s", "note": "deprecated: always -1"}}})

    async def credits(self, request):
        if self.cfg.credits_need_management_key:
            return error_response(403, "Only management keys can fetch credits")
        led = self.ledger
        _ = led.balance  # picks up top-ups written by another process
        return web.json_response({"data": {"total_credits": led.total_credits, "total_usage": led.total_usage}})

    async def generation(self, request):
        gen_id = request.query.get("id", "")
        if not gen_id:
            return error_response(400, "Missing required query parameter: id")
        rec = self.ledger.generation(gen_id)
        if rec is None:
            return error_response(404, f"Generation {gen_id} not found")
        return web.json_response({"data": {
            "id": rec["generation_id"], "total_cost": rec["cost"], "usage": rec["cost"],
            "upstream_inference_cost": rec.get("upstream_inference_cost"), "is_byok": rec.get("is_byok", False),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rec["time"])),
            "model": rec["model"], "origin": "", "upstream_id": None, "cache_discount": None,
            "app_id": None, "streamed": rec["stream"], "cancelled": rec["cancelled"], "api_type": "completions",
            "provider_name": rec["provider_name"], "latency": rec.get("latency_ms"), "moderation_latency": None,
            "generation_time": rec.get("generation_ms"), "finish_reason": rec["finish_reason"],
            "native_finish_reason": rec.get("native_finish_reason"),
            "tokens_prompt": rec["prompt_tokens"], "tokens_completion": rec["completion_tokens"],
            "native_tokens_prompt": rec["prompt_tokens"], "native_tokens_completion": rec["completion_tokens"],
            "native_tokens_reasoning": rec["reasoning_tokens"], "native_tokens_cached": 0,
            "native_tokens_completion_images": None, "num_media_prompt": None, "num_media_completion": None,
            "num_search_results": None, "num_fetches": None, "num_input_audio_prompt": None,
            "provider_responses": [{"status": a["status"], "endpoint_id": a["provider"]} for a in rec["attempts"]],
            "data_region": "global", "external_user": None, "http_referer": None, "preset_id": None,
            "router": None, "service_tier": None, "user_agent": None, "web_search_engine": None,
            "workspace_id": None}})

    async def admin_topup(self, request):
        bad = self._admin_denied(request)
        if bad:
            return bad
        try:
            body = await request.json()
            amount = body["amount"]
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
                raise ValueError
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            return error_response(400, 'body must be {"amount": <positive USD>}')
        self.ledger.top_up(float(amount))
        led = self.ledger
        return web.json_response({"data": {"total_credits": led.total_credits, "total_usage": led.total_usage,
                                           "balance": led.balance}})

    async def admin_state(self, request):
        bad = self._admin_denied(request)
        if bad:
            return bad
        return web.json_response({"data": {
            "in_flight": self.in_flight, "reserved": self.reserved, "active": dict(self.active),
            "balance": self.ledger.balance, "ledger_lines": self.ledger.count, "stats": dict(self.stats),
            "model_steps": getattr(self.backend, "steps", None)}})

    def _admin_denied(self, request):
        if not self._admin_key:
            return error_response(403, "admin endpoint disabled: no admin_key configured")
        auth = request.headers.get("Authorization", "")
        if not secrets.compare_digest(auth[7:].strip() if auth.startswith("Bearer ") else "", self._admin_key):
            return error_response(401, "admin key required")
        return None

    # ---- catalogue -------------------------------------------------------------------------------

    def _model_record(self) -> dict:
        up = [e for e in self.endpoints if not e.is_down] or self.endpoints
        cheapest = min(up, key=lambda e: e.prompt_price + e.completion_price)
        name = self.cfg.model
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
        if mid != self.cfg.model:
            return error_response(404, f"No endpoints found for {mid}.")
        rec = self._model_record()
        eps = [self._endpoint_record(e) for e in self.endpoints]
        return web.json_response({"data": {k: rec[k] for k in ("id", "name", "created", "description", "architecture")}
                                  | {"endpoints": eps}})

    def _endpoint_record(self, e: Endpoint) -> dict:
        return {
            "name": f"{e.name} | {self.cfg.model}", "model_id": self.cfg.model, "model_name": self.cfg.model,
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

    # ---- chat completions ------------------------------------------------------------------------

    async def chat(self, request: web.Request):
        t_start = time.monotonic()
        self.stats["requests"] += 1
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "Invalid JSON in request body")
        try:
            req = self._parse(body)
            prefs = parse_prefs(body.get("provider"))
            prompt_ids = self._prompt_ids(req["messages"], req["think"])
        except BadRequest as e:
            return error_response(400, str(e), {"error_type": "invalid_request"})
        except RoutingError as e:
            return error_response(e.status, e.message, e.metadata)
        denied = self._key_denied()
        if denied is not None:
            self.stats["403"] += 1
            return denied
        try:
            used = {p for p in _SAMPLING_PARAMS if p in body}
            candidates = route(prefs, self.endpoints, used, len(prompt_ids), req["max_tokens"], self.rng)
        except RoutingError as e:
            return error_response(e.status, e.message, e.metadata)

        worst = max(worst_case(e, len(prompt_ids), req["max_tokens"]) for e in candidates)
        if self.cfg.byok:  # the provider bills the user; OpenRouter holds only its fee
            worst *= self.cfg.byok_fee_rate
        refusal = self._credit_check(candidates, len(prompt_ids), req["max_tokens"], worst)
        if refusal is not None:
            self.stats["402"] += 1
            return refusal
        self.reserved += worst
        self.in_flight += 1
        try:
            return await self._serve(request, req, prompt_ids, candidates, t_start)
        finally:
            self.reserved -= worst
            self.in_flight -= 1

    def _parse(self, body) -> dict:
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        model = body.get("model")
        if model != self.cfg.model:
            raise BadRequest(f"{model} is not a valid model ID")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("messages: expected a non-empty array")
        messages = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                    or not isinstance(m.get("content"), str):
                raise BadRequest(f"messages[{i}]: expected {{role: system|user|assistant, content: string}}")
            messages.append({"role": m["role"], "content": m["content"]})
        max_tokens = body.get("max_tokens", max(e.max_completion_tokens for e in self.endpoints))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest("max_tokens: expected a positive integer")
        temperature = body.get("temperature", 1.0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise BadRequest("temperature: expected a number in [0, 2]")
        top_p = body.get("top_p", 1.0)
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise BadRequest("top_p: expected a number in (0, 1]")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("seed: expected an integer")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise BadRequest("stop: expected a string or an array of strings")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("stream: expected a boolean")
        reasoning = body.get("reasoning") or {}
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "max_tokens", "exclude", "enabled", "summary"}:
            raise BadRequest("reasoning: expected {effort, max_tokens, exclude, enabled, summary}")
        if reasoning.get("effort") is not None and reasoning["effort"] not in _EFFORTS:
            raise BadRequest(f"reasoning.effort: expected one of {list(_EFFORTS)}")
        if reasoning.get("summary") is not None and reasoning["summary"] not in _SUMMARIES:
            raise BadRequest(f"reasoning.summary: expected one of {list(_SUMMARIES)}")
        think = reasoning.get("enabled", True) is not False and reasoning.get("effort") != "none"
        exclude = bool(reasoning.get("exclude", False)) or body.get("include_reasoning") is False
        rmax = reasoning.get("max_tokens")
        if rmax is not None and (isinstance(rmax, bool) or not isinstance(rmax, int) or rmax < 0):
            raise BadRequest("reasoning.max_tokens: expected a non-negative integer")
        return {"messages": messages, "max_tokens": max_tokens, "temperature": float(temperature),
                "top_p": float(top_p), "seed": seed, "stop": stop, "stream": stream, "think": think,
                "exclude_reasoning": exclude, "reasoning_max_tokens": rmax, "prompt_key": stable_id(messages)}

    def _prompt_ids(self, messages: list[dict], think: bool) -> list[int]:
        """The prompt as the target sees it; with reasoning off, `</think>` closes it at once."""
        key = stable_id(messages)
        ids = self._prompts.get(key)
        if ids is None:
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # the template raises on conversations it cannot render
                raise BadRequest(f"messages: cannot apply the chat template: {e}") from None
            # what apply_chat_template(tokenize=True) does, minus its Python overhead
            ids = self._fast_tok.encode(text, add_special_tokens=False).ids
            self._prompts[key] = ids
            if len(self._prompts) > 50_000:
                self._prompts.popitem(last=False)
        return ids if think else ids + [self.vocab.end_think]

    def _key_denied(self):
        """403 before routing: the key lacks permission, or its own budget is spent."""
        if self.cfg.key_forbidden:
            return error_response(403, "This API key is not allowed to make this request.",
                                  {"error_type": "permission_denied"})
        limit, spent = self.cfg.key_budget_usd, self.ledger.total_usage
        if limit is not None and spent >= limit:
            return error_response(403, f"Key limit exceeded: this key has spent ${spent:.6f} of its ${limit:.6f} limit.",
                                  {"error_type": "permission_denied", "limit_source": "openrouter_key_limit",
                                   "scope": "key_limit", "limit_usd": limit, "spend_usd": spent,
                                   "resets_at": None})
        return None

    def _credit_check(self, candidates, prompt_tokens: int, max_tokens: int, worst: float):
        """402 when this request's worst case does not fit: the key's whole limit, the balance, or
        the in-flight budget (a share of the balance held by the requests running)."""
        balance = self.ledger.balance
        limit = self.cfg.key_budget_usd
        if limit is not None and worst > limit:  # (a key budget merely spent is a 403, see _key_denied)
            return _payment_required(f"Request weight (${worst:.6f} worst case) exceeds this key's whole "
                                     f"limit (${limit:.6f}).", "openrouter_key_limit", "weight_exceeds_budget")
        if worst > balance:
            return _payment_required(self._cannot_afford(candidates, prompt_tokens, max_tokens, balance),
                                     "openrouter_credits")
        if self.cfg.in_flight_budget is not None and not self.cfg.byok:
            budget = balance * self.cfg.in_flight_budget
            if worst > budget:
                return _payment_required(f"Request weight (${worst:.6f} worst case) exceeds your in-flight "
                                         f"spending budget (${budget:.6f}).", "openrouter_credits",
                                         "weight_exceeds_budget")
            if self.reserved + worst > budget:
                return _payment_required(f"Too much spending in flight: ${self.reserved:.6f} reserved by "
                                         f"{self.in_flight} requests, budget ${budget:.6f}. Retry when some finish.",
                                         "openrouter_in_flight_budget", "in_flight_budget_exhausted", retry_after=1)
        return None

    def _cannot_afford(self, candidates, prompt_tokens: int, max_tokens: int, usd: float) -> str:
        dearest = max(candidates, key=lambda e: worst_case(e, prompt_tokens, max_tokens))
        p = prices(dearest, prompt_tokens)
        per_token = max(p.completion, p.reasoning) * (self.cfg.byok_fee_rate if self.cfg.byok else 1.0)
        afford = max(0, math.floor((usd - prompt_tokens * p.prompt / 1e6) * 1e6 / per_token))
        return ("This request requires more credits, or fewer max_tokens. You requested up "
                f"to {max_tokens} tokens, but can only afford {afford}. To increase, visit "
                "https://openrouter.ai/settings/credits and add more credits")

    # ---- serving ---------------------------------------------------------------------------------

    async def _serve(self, request, req, prompt_ids, candidates, t_start):
        cfg, pkey = self.cfg, req["prompt_key"]
        nth = self.asked[pkey]
        self.asked[pkey] += 1
        attempts, last = [], None
        chosen, fault = None, None
        for ep in candidates:
            if ep.is_down:
                last = (ep, 503, "provider is down")
            elif self.active[ep.tag] >= ep.capacity:
                last = (ep, 429, "capacity")
            else:
                fault = draw(ep.faults, cfg.seed, ep.tag, pkey, nth)
                if fault in BEFORE_FIRST_TOKEN:
                    last = (ep, BEFORE_FIRST_TOKEN[fault], fault)
                    await self._sleep(0.2 * ep.latency_s.median)  # an upstream error takes a moment
                else:
                    chosen = ep
                    break
            attempts.append({"provider": ep.tag, "status": last[1], "reason": last[2]})
        gen_id = _gen_id()
        if chosen is None:
            ep, status, why = last
            self.stats[f"upstream_{status}"] += 1
            meta = {"raw": json.dumps({"error": {"message": UPSTREAM_MESSAGES[status], "type": why}}),
                    "provider_name": ep.name, "error_type": _ERROR_TYPES[status]}
            headers = None
            if status == 429 and ep.retry_after_s is not None:
                meta["retry_after_seconds"] = ep.retry_after_s
                headers = {"Retry-After": str(math.ceil(ep.retry_after_s))}
            self._record(gen_id, ep, req, None, status, attempts, finish=None, billed=False, error=why,
                         t_start=t_start, prompt_ids=prompt_ids)
            return error_response(status, "Provider returned error", meta, headers)
        attempts.append({"provider": chosen.tag, "status": 200, "reason": fault or "ok"})
        self.active[chosen.tag] += 1
        try:
            return await self._generate(request, req, prompt_ids, chosen, fault, gen_id, attempts, nth, t_start)
        finally:
            self.active[chosen.tag] -= 1

    async def _sleep(self, simulated_s: float) -> None:
        if self.cfg.time_scale > 0 and simulated_s > 0:
            await asyncio.sleep(simulated_s * self.cfg.time_scale)

    def _job(self, req, prompt_ids, ep: Endpoint, nth: int) -> Job:
        # sampling parameters the endpoint does not support are silently dropped, as on OpenRouter
        # (unless the request set provider.require_parameters, which routed around such endpoints)
        supported = set(ep.supported_parameters)
        temperature = req["temperature"] if "temperature" in supported else 1.0
        top_p = req["top_p"] if "top_p" in supported else 1.0
        seed = req["seed"] if "seed" in supported else None
        key = req["prompt_key"]
        if temperature > 0:
            key += f"|seed={seed}" if seed is not None else f"|draw={nth}|{secrets.token_hex(4)}"
        return Job(prompt_ids=prompt_ids, max_tokens=req["max_tokens"], temperature=temperature,
                   top_p=top_p, seed=seed, key=key, reasoning_max_tokens=req["reasoning_max_tokens"],
                   perturbed=ep.quirks.perturbed_model, noncanonical_rate=ep.quirks.noncanonical_rate)

    async def _tokens(self, job: Job):
        """(ids, texts) lists as the backend produces them: all at once (synthetic) or one by one."""
        if isinstance(self.backend, SyntheticBackend):
            yield self.backend.tokens(job)
        else:
            async for i, t in self.backend.stream(job):
                yield [i], [t]

    async def _generate(self, request, req, prompt_ids, ep, fault, gen_id, attempts, nth, t_start):
        """Run the backend for `ep`, paced and written as OpenRouter would; bill and record it.

        A stream the client closes (or `cut_after_billing` cuts) stops being written; the endpoint
        stops generating and billing there if it `supports_cancellation`, else it finishes and bills
        the whole response. A non-streamed response is always generated and billed in full."""
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        rng = random.Random(f"{cfg.seed}|{gen_id}")
        ttft = rng.lognormvariate(math.log(ep.latency_s.median), ep.latency_s.sigma)
        tps = rng.lognormvariate(math.log(ep.tokens_per_s.median), ep.tokens_per_s.sigma)
        t0, scale, stream = loop.time(), cfg.time_scale, req["stream"]

        def due(n: int) -> float:  # when the n-th id (from 0) is produced, on the loop's clock
            return t0 + (ttft + n / tps) * scale

        out = Output(self.vocab, req, ep, gen_id, cfg.model, uniform("quirk", cfg.seed, gen_id),
                     byok_fee_rate=cfg.byok_fee_rate if cfg.byok else None)
        headers = {"X-Generation-Id": gen_id}
        writer = SSEWriter(request, cfg.padding_interval_s, headers) if stream else \
            JSONWriter(request, cfg.padding_interval_s, headers)
        if fault == "hang":
            return await self._hang(writer, req, ep, out, attempts, prompt_ids, nth, t_start, due)
        stop_after = {"mid_stream": max(1, int(rng.random() * min(req["max_tokens"], 64))),
                      "error_200": 0, "empty_200": 0}.get(fault)
        cut_at = max(1, int(rng.random() * min(req["max_tokens"], 64))) \
            if fault == "cut_after_billing" and stream else None
        job = self._job(req, prompt_ids, ep, nth)
        t_first = None
        gone = False  # the stream's connection is closed: nothing more is written

        async def send() -> bool:
            nonlocal gone
            try:
                await writer.flush()
            except ConnectionResetError:
                gone = True
            if not gone and cut_at is not None and len(out.ids) >= cut_at:
                writer.close_connection()
                gone = True
            return not (gone and ep.supports_cancellation)

        try:
            await writer.open()
            tokens = self._tokens(job)
            try:
                going = True
                async for ids, texts in tokens:
                    pos = 0
                    while going and pos < len(ids) and not out.stopped:
                        end = len(ids)
                        if stop_after is not None:
                            end = min(end, pos + stop_after - len(out.ids))
                            if end <= pos:
                                break
                        if cut_at is not None and not gone:
                            end = min(end, pos + max(1, cut_at - len(out.ids)))
                        if stream:  # a chunk: the ids due by now (paced), at most MAX_CHUNK_TOKENS of them
                            if scale > 0:
                                n_due = int(((loop.time() - t0) / scale - ttft) * tps) + 1
                                if n_due <= len(out.ids):
                                    if not gone:
                                        self._chunk(writer, out)
                                        going = await send()
                                    next_write = writer._last + cfg.stream_interval_s * scale if not gone else 0.0
                                    await asyncio.sleep(max(due(len(out.ids)), next_write) - loop.time())
                                    continue
                                end = min(end, pos + n_due - len(out.ids))
                            end = min(end, pos + MAX_CHUNK_TOKENS)
                        pos += out.extend(ids[pos:end], texts[pos:end])
                        t_first = t_first or loop.time()
                        if stream and not gone:
                            self._chunk(writer, out)
                            if cut_at is not None and len(out.ids) >= cut_at:
                                going = await send()
                    if stream and not gone:
                        going = await send()
                    if not going or out.stopped or (stop_after is not None and len(out.ids) >= stop_after):
                        break
            finally:
                job.cancelled = True
                await tokens.aclose()
            if stream and cut_at is not None and not gone:  # a response shorter than the cut: cut before its end
                writer.close_connection()
                gone = True
            # the response (or its failure) is complete when its last id is due
            if not (gone and ep.supports_cancellation):
                await asyncio.sleep(max(0.0, due(len(out.ids)) - loop.time()))
        except ConnectionResetError:  # gone before the first byte
            gone = True
        writer.stop_keepalive()
        cancelled = gone and ep.supports_cancellation
        if cancelled:
            self.stats["cancelled"] += 1
        billed = fault in (None, "cut_after_billing")
        finish = None if fault in ("empty_200",) else "error" if fault not in (None, "cut_after_billing") \
            else out.finish_reason
        # the ledger line exists before the client has the last byte (as /generation would)
        self._record(gen_id, ep, req, out, 200, attempts, finish=finish, billed=billed, error=fault,
                     t_start=t_start, prompt_ids=prompt_ids, cancelled=cancelled,
                     ttft_s=(t_first - t0) if t_first else None)
        self.stats["served" if fault is None else f"fault_{fault}"] += 1
        if gone:
            return writer.resp or web.Response(status=499)
        if fault == "cut_after_billing":  # non-streaming: billed in full, lost on the wire
            return await writer.cut(out.message(out.usage(self.billing(ep), prompt_ids, True), finish))
        try:
            return await self._finish(writer, out, fault, prompt_ids, ep)
        except ConnectionResetError:  # gone at the very end: billed in full, it was all generated
            return writer.resp or web.Response(status=499)

    def _chunk(self, writer: SSEWriter, out: Output) -> None:
        r, c = out.take_delta()
        if r or c:
            writer.event(out.chunk(r, c))

    async def _finish(self, writer, out: Output, fault: str | None, prompt_ids, ep: Endpoint):
        billing = self.billing(ep)
        err = {"code": 502, "message": "Provider returned error",
               "metadata": {"raw": "upstream connection lost", "provider_name": ep.name,
                            "error_type": "provider_unavailable"}}
        if isinstance(writer, SSEWriter):
            if fault in ("error_200", "mid_stream"):
                r, c = out.take_delta()
                writer.event(out.chunk(r, c, finish="error", error=err))
                await writer.end()
                return writer.resp
            finish = out.finish_reason if fault is None else None
            if fault is None:
                writer.event(out.chunk("", "", finish=finish))
            writer.event(out.usage_chunk(out.usage(billing, prompt_ids, billed=fault is None), finish))
            await writer.done()
            return writer.resp
        if fault == "error_200":
            return await writer.body(error_body(502, "Provider returned error", err["metadata"]))
        usage = out.usage(billing, prompt_ids, billed=fault is None)
        if fault == "mid_stream":
            return await writer.body(out.message(usage, "error", error=err))
        if fault == "empty_200":
            out.content, out.reasoning = "", ""
            return await writer.body(out.message(usage | {"cost": 0.0}, None))
        return await writer.body(out.message(usage, out.finish_reason))

    async def _hang(self, writer, req, ep, out: Output, attempts, prompt_ids, nth, t_start, due):
        """The provider generates and bills the response, but the client gets only the headers
        (a stream also its first comment); silence for `hang_s`, then the connection closes."""
        loop = asyncio.get_running_loop()
        t_hang = loop.time()
        try:
            if isinstance(writer, SSEWriter):
                await writer._write(PROCESSING)
            else:
                await writer.send_headers()
        except ConnectionResetError:
            pass
        job = self._job(req, prompt_ids, ep, nth)
        tokens = self._tokens(job)
        try:
            async for ids, texts in tokens:
                out.extend(ids, texts)
                if out.stopped:
                    break
        finally:
            job.cancelled = True
            await tokens.aclose()
        await asyncio.sleep(max(0.0, due(len(out.ids)) - loop.time()))
        self._record(out.gen_id, ep, req, out, 200, attempts, finish=out.finish_reason, billed=True, error="hang",
                     t_start=t_start, prompt_ids=prompt_ids, cancelled=False, ttft_s=None)
        self.stats["fault_hang"] += 1
        await asyncio.sleep(max(0.0, t_hang + self.cfg.hang_s - loop.time()))
        writer.close_connection()
        return writer.resp or web.Response(status=200)

    def _record(self, gen_id, ep: Endpoint, req, out, status, attempts, *, finish, billed, error, t_start,
                prompt_ids, cancelled=False, ttft_s=None) -> None:
        ids = out.ids if out is not None else []
        if out is not None:
            usage = out.usage(self.billing(ep), prompt_ids, billed)
        else:
            usage = {"prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0,
                     "completion_tokens_details": {"reasoning_tokens": 0}}
        now = time.monotonic()
        quirks = list(out.quirks) if out is not None else []
        if out is not None and ep.quirks.noncanonical_rate:
            quirks.append(f"noncanonical:{ep.quirks.noncanonical_rate}")
        upstream = usage["cost_details"]["upstream_inference_cost"] if out is not None else None
        self.ledger.record({
            "is_byok": self.cfg.byok, "upstream_inference_cost": upstream,
            "generation_id": gen_id, "time": time.time(), "status": status, "provider": ep.slug,
            "endpoint": ep.tag, "provider_name": ep.name, "model": self.cfg.model, "prompt_key": req["prompt_key"],
            "prompt_tokens": usage["prompt_tokens"] if out is not None else 0,
            "completion_tokens": usage["completion_tokens"],
            "reasoning_tokens": usage["completion_tokens_details"]["reasoning_tokens"],
            "cost": usage["cost"], "output_ids": ids, "finish_reason": finish, "native_finish_reason": finish,
            "cancelled": cancelled, "billed": billed, "stream": req["stream"], "attempts": attempts,
            "quirks": quirks, "error": error,
            "prompt_ids": prompt_ids, "true_prompt_tokens": len(prompt_ids), "true_completion_tokens": len(ids),
            "true_reasoning_tokens": out.n_reasoning if out is not None else 0,
            "request": {k: req[k] for k in ("max_tokens", "temperature", "top_p", "seed")},
            "latency_ms": round(1000 * ttft_s) if ttft_s is not None else None,
            "generation_ms": round(1000 * (now - t_start)),
        }, visible_after_s=self.cfg.generation_delay_s)
