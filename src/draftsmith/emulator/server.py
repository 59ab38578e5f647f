"""The local OpenRouter: an aiohttp app speaking the OpenRouter API over simulated providers.

Endpoints (under /api/v1): POST chat/completions (JSON or SSE), GET key, credits, generation?id=,
models, models/{author}/{slug}/endpoints; POST admin/topup and GET admin/state (emulator only,
admin key). This file holds the app (`Emulator`) and its handlers, in sections: the public
catalogue (`Listing`), chat (`Chat`: a request from its body to the endpoint that answers it) and
the request it parses (`parse`, `PromptIds`). The other parts, one concern each: `accounts` (keys,
credits, the ledger, the 403/402 money checks), `catalogue` (endpoints, prices, routing) and
`response` (generating, pacing, faults, quirks, billing, the cache, the ledger line). The wire
format is the one OpenRouter documents (field names, error envelope, `X-Generation-Id` header,
padding, SSE comments, usage chunk); every response validates against the official SDK's models
(tests/test_openrouter_conformance.py).
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
from .accounts import Accounts, Ledger
from .backends import SyntheticBackend, Vocab
from .catalogue import LOGPROB_PARAMETERS, Z, Endpoint, RoutingError, parse_prefs, route
from .config import EmulatorConfig
from .faults import BEFORE_FIRST_TOKEN, UPSTREAM_MESSAGES, Router, draw, upstream_availability
from .response import Responses
from .wire import API, availability, error_response


def _tokenizer(target_model_path: str | None):
    """The target tokenizer (of the checkpoint, or the built-in one). The emulator plays the
    provider, which runs the tokenizer code a checkpoint ships (Kimi-K2.5's): it trusts that code.
    The runner never gets here with such a checkpoint unless the user set trust_remote_code
    (`draftsmith.preflight`)."""
    from ..targets.checkpoint import load_tokenizer
    from ..targets.tiny import make_tokenizer

    if not target_model_path:
        return make_tokenizer()
    return load_tokenizer(target_model_path, trust_remote_code=True, log=lambda *a: None)


@lru_cache(maxsize=4)
def _vocab(target_model_path: str | None) -> Vocab:
    """The target's tokenizer and token facts; loaded once per process."""
    return Vocab(_tokenizer(target_model_path))


class Emulator:
    """One emulator: its target, backend and ledger, and the parts that answer; `app()` serves them."""

    def __init__(self, config: EmulatorConfig, key: str, state_dir: str | Path, admin_key: str | None = None):
        if not key:
            raise ValueError("the emulator needs an API key to accept")
        self.cfg = config
        endpoints = config.endpoints()
        if config.backend == "synthetic":  # no model to compute logprobs with: no endpoint lists them
            endpoints = [e.model_copy(update={"supported_parameters": [p for p in e.supported_parameters
                                                                        if p not in LOGPROB_PARAMETERS]})
                         for e in endpoints]
        self.ledger = Ledger(state_dir, config.credits)
        self.state_dir = Path(state_dir)
        self.vocab = _vocab(config.target_model_path)
        self.tokenizer = self.vocab.tokenizer
        self.backend = self._load_backend()
        self.stats: Counter[str] = Counter()
        self.accounts = Accounts(config, key, admin_key or config.admin_key, self.ledger)
        self.listing = Listing(config.model, endpoints)
        self.chat = Chat(config, endpoints, self.vocab, self.accounts,
                         Responses(config, self.vocab, self.backend, self.ledger, self.stats), self.stats)

    def _load_backend(self):
        if self.cfg.backend == "model":
            if not self.cfg.target_model_path:
                raise ValueError("emulator config: backend 'model' needs target_model_path")
            from ..targets.checkpoint import resolve_target
            from .model import ModelBackend

            return ModelBackend(resolve_target(self.cfg.target_model_path, log=lambda *a: None), self.vocab,
                                max_batch=self.cfg.max_batch, threads=self.cfg.threads,
                                canonical=self.cfg.canonical, seed=self.cfg.seed)
        return SyntheticBackend(self.vocab, self.cfg.synthetic_tokens, self.cfg.synthetic_reasoning_fraction)

    def close(self) -> None:
        if hasattr(self.backend, "close"):
            self.backend.close()
        self.ledger.close()

    def app(self) -> web.Application:
        acc, listing = self.accounts, self.listing
        app = web.Application(middlewares=[acc.auth], client_max_size=64 * 2**20)
        app.add_routes([
            web.post(f"{API}/chat/completions", self.chat.handle),
            web.get(f"{API}/key", acc.key),
            web.get(f"{API}/credits", acc.credits),
            web.get(f"{API}/generation", acc.generation),
            web.get(f"{API}/models", listing.models),
            web.get(f"{API}/models/{{author}}/{{slug}}/endpoints", listing.model_endpoints),
            web.post(f"{API}/admin/topup", acc.admin_topup),
            web.get(f"{API}/admin/state", self.admin_state),
        ])
        return app

    async def admin_state(self, request):
        bad = self.accounts.admin_denied(request)
        if bad:
            return bad
        acc = self.accounts
        return web.json_response({"data": {
            "in_flight": acc.in_flight, "reserved": acc.reserved, "active": dict(self.chat.active),
            "balance": self.ledger.balance, "ledger_lines": self.ledger.count, "stats": dict(self.stats),
            "model_steps": getattr(self.backend, "steps", None)}})


# ------------------------------------------------------------------------------------------------
# The public catalogue: GET models and models/{author}/{slug}/endpoints, as OpenRouter lists them.
#
# Prices go out as USD per token in strings; the latency and throughput percentiles of the last 30
# minutes come from each endpoint's simulated distributions, the ones routing's preferences use.


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


# ------------------------------------------------------------------------------------------------
# POST chat/completions: from a request to the endpoint that answers it, as OpenRouter routes it.
#
# validate (an unknown model: 400 `model_not_found`) -> prompt ids (chat template) -> key checks (403)
# -> the router's own faults (faults.Router) -> routing (404/503) -> credit checks
# (402) -> reserve its worst-case cost -> the response cache (`ResponseCache`: a hit is answered at once)
# -> try endpoints in order: a provider that is down, at
# capacity (429) or fails before its first token (an injected fault) hands the request on to the
# next one silently; when none is left the last one's error goes back -> the response
# (`response.Responses`).


# error_type of the upstream failures (OpenRouter's typed error codes)
_ERROR_TYPES = {429: "rate_limit_exceeded", 502: "provider_unavailable", 503: "provider_overloaded",
                524: "timeout", 529: "provider_overloaded"}


def _gen_id() -> str:
    alphabet = string.ascii_letters + string.digits
    return f"gen-{int(time.time())}-" + "".join(secrets.choice(alphabet) for _ in range(20))


class Chat:
    """The chat pipeline of one emulator: its handler is `handle`."""

    def __init__(self, cfg: EmulatorConfig, endpoints: list[Endpoint], vocab: Vocab, accounts: Accounts,
                 responses: Responses, stats: Counter):
        self.cfg, self.endpoints, self.accounts, self.responses, self.stats = cfg, endpoints, accounts, responses, stats
        self.prompt_ids = PromptIds(vocab)
        self.active: Counter[str] = Counter()  # in-flight requests per endpoint tag
        self.asked: Counter[str] = Counter()  # times each prompt was asked (fault draws)
        self.rng = random.Random(cfg.seed)
        self.router = Router(cfg.router_faults, cfg.seed, cfg.model)
        self._default_max_tokens = max(e.max_completion_tokens for e in endpoints)

    async def handle(self, request: web.Request):
        t_start = time.monotonic()
        self.stats["requests"] += 1
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "Invalid JSON in request body")
        if isinstance(body, dict) and body.get("model") != self.cfg.model:
            return error_response(400, f"{body.get('model')} is not a valid model ID",
                                  {"error_type": "invalid_request"}, avail=availability("model_not_found", False))
        try:
            req = parse(body, self.cfg.model, self._default_max_tokens)
            prefs = parse_prefs(body.get("provider"))
            prompt_ids = self.prompt_ids(req["messages"], req["think"])
        except BadRequest as e:
            return error_response(400, str(e), {"error_type": "invalid_request"})
        except RoutingError as e:
            return error_response(e.status, e.message, e.metadata)
        denied = self.accounts.key_denied()
        if denied is not None:
            self.stats["403"] += 1
            return denied
        refused = self.router.refusal(req["prompt_key"])
        if refused is not None:
            self.stats[f"router_{refused.status}"] += 1
            return refused
        try:
            used = {p for p in SAMPLING_PARAMS if p in body}
            candidates = route(prefs, self.endpoints, used, len(prompt_ids), req["max_tokens"], self.rng)
        except RoutingError as e:
            return error_response(e.status, e.message, e.metadata, avail=e.avail)

        worst = self.accounts.worst_case(candidates, len(prompt_ids), req["max_tokens"])
        refusal = self.accounts.credit_check(candidates, len(prompt_ids), req["max_tokens"], worst)
        if refusal is not None:
            self.stats["402"] += 1
            return refusal
        with self.accounts.hold(worst):
            return await self._serve(request, req, prompt_ids, candidates, t_start)

    async def _serve(self, request, req, prompt_ids, candidates, t_start):
        cfg, pkey = self.cfg, req["prompt_key"]
        cached = self.responses.cache.get(req, request.headers)
        if cached is not None:      # the response cache answers before any provider is tried
            return await self.responses.replay(request, req, cached, _gen_id(),
                                               [{"provider": cached.ep.tag, "status": 200, "reason": "cache_hit"}],
                                               prompt_ids, t_start)
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
            self.responses.record(gen_id, ep, req, None, status, attempts, finish=None, billed=False, error=why,
                                  t_start=t_start, prompt_ids=prompt_ids)
            return error_response(status, "Provider returned error", meta, headers,
                                  avail=upstream_availability(status, meta.get("retry_after_seconds")))
        attempts.append({"provider": chosen.tag, "status": 200, "reason": fault or "ok"})
        self.active[chosen.tag] += 1
        try:
            return await self.responses.generate(request, req, prompt_ids, chosen, fault, gen_id, attempts, nth,
                                                 t_start)
        finally:
            self.active[chosen.tag] -= 1

    async def _sleep(self, simulated_s: float) -> None:
        if self.cfg.time_scale > 0 and simulated_s > 0:
            await asyncio.sleep(simulated_s * self.cfg.time_scale)


# ------------------------------------------------------------------------------------------------
# A chat request's body, checked as OpenRouter checks it, and its prompt as token ids.
#
# `parse` turns the JSON body into the settings the rest of the pipeline uses (or raises BadRequest,
# a 400 naming the field); `PromptIds` applies the target's chat template, as the provider would,
# remembering recent prompts (a run asks each one many times: retries, samples, the pilot).


SAMPLING_PARAMS = ("max_tokens", "temperature", "top_p", "seed", "stop", "reasoning", "include_reasoning", "logprobs",
                   "top_logprobs")
MAX_TOP_LOGPROBS = 20
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SUMMARIES = ("auto", "concise", "detailed")
_REMEMBERED = 50_000  # prompts whose ids are kept


class BadRequest(Exception):
    pass


def parse(body, model: str, default_max_tokens: int) -> dict:
    """The request's settings: messages, sampling, stream, reasoning, and its prompt's `prompt_key`."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if body.get("model") != model:
        raise BadRequest(f"{body.get('model')} is not a valid model ID")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages: expected a non-empty array")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}]: expected {{role: system|user|assistant, content: string}}")
        messages.append({"role": m["role"], "content": m["content"]})
    max_tokens = body.get("max_tokens", default_max_tokens)
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
    logprobs = body.get("logprobs", False)
    if logprobs is None:
        logprobs = False
    if not isinstance(logprobs, bool):
        raise BadRequest("logprobs: expected a boolean")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise BadRequest(f"top_logprobs: expected an integer in [0, {MAX_TOP_LOGPROBS}]")
    if top and not logprobs:
        raise BadRequest("top_logprobs: needs logprobs true")
    return {"messages": messages, "max_tokens": max_tokens, "temperature": float(temperature),
            "top_p": float(top_p), "seed": seed, "stop": stop, "stream": stream, "think": think,
            "exclude_reasoning": exclude, "reasoning_max_tokens": rmax, "logprobs": logprobs,
            "top_logprobs": top or 0, "prompt_key": stable_id(messages)}


class PromptIds:
    """The prompt as the target sees it; with reasoning off, `</think>` closes it at once."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._prompts: OrderedDict[str, list[int]] = OrderedDict()

    def __call__(self, messages: list[dict], think: bool) -> list[int]:
        key = stable_id(messages)
        ids = self._prompts.get(key)
        if ids is None:
            try:
                text = self.vocab.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # the template raises on conversations it cannot render
                raise BadRequest(f"messages: cannot apply the chat template: {e}") from None
            # what apply_chat_template(tokenize=True) does, minus its Python overhead
            ids = self.vocab.encoding.template([text])[0]
            self._prompts[key] = ids
            if len(self._prompts) > _REMEMBERED:
                self._prompts.popitem(last=False)
        return ids if think else ids + [self.vocab.end_think]
