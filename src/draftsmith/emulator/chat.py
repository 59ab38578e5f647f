"""POST chat/completions: from a request to the endpoint that answers it, as OpenRouter routes it.

validate (an unknown model: 400 `model_not_found`) -> prompt ids (chat template) -> key checks (403)
-> the router's own faults (faults.Router) -> routing (404/503) -> credit checks
(402) -> reserve its worst-case cost -> the response cache (cache.py: a hit is answered at once)
-> try endpoints in order: a provider that is down, at
capacity (429) or fails before its first token (an injected fault) hands the request on to the
next one silently; when none is left the last one's error goes back -> the response
(`response.Responses`).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import secrets
import string
import time
from collections import Counter

from aiohttp import web

from .accounts import Accounts
from .backends import Vocab
from .catalogue import Endpoint
from .config import EmulatorConfig
from .faults import BEFORE_FIRST_TOKEN, UPSTREAM_MESSAGES, Router, draw, upstream_availability
from .request import SAMPLING_PARAMS, BadRequest, PromptIds, parse
from .response import Responses
from .routing import RoutingError, parse_prefs, route
from .wire import availability, error_response

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
