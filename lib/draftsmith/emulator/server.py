"""The local OpenRouter: an aiohttp app speaking the OpenRouter API over simulated providers.

Endpoints (under /api/v1): POST chat/completions (JSON or SSE), GET key, credits, generation?id=,
models, models/{author}/{slug}/endpoints; POST admin/topup and GET admin/state (emulator only,
admin key). A chat request goes: validate -> prompt ids (chat template) -> routing -> credit check
(402) -> reserve its worst-case cost -> try endpoints in order (capacity 429s and injected
pre-first-token faults fall back silently) -> generate (paced by the endpoint's latency and
tokens/s, scaled by `time_scale`) -> apply quirks -> bill -> ledger line. The wire format is the
one OpenRouter documents (field names, error envelope, padding, SSE comments, usage chunk).
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
from .quirks import Billing
from .routing import RoutingError, parse_prefs, route
from .synthetic import SyntheticBackend
from .wire import PROCESSING, JSONWriter, SSEWriter

API = "/api/v1"
USER_ID = "user_emulator"
MAX_CHUNK_TOKENS = 16  # a stream chunk carries at most this many tokens
_Z = {"p50": 0.0, "p75": 0.6745, "p90": 1.2816, "p99": 2.3263}
_SAMPLING_PARAMS = ("max_tokens", "temperature", "top_p", "seed", "stop", "reasoning", "include_reasoning")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def error_body(code: int, message: str, metadata: dict | None = None) -> dict:
    err = {"code": code, "message": message}
    if metadata is not None:
        err["metadata"] = metadata
    return {"error": err, "user_id": USER_ID}


def error_response(code: int, message: str, metadata: dict | None = None, headers: dict | None = None):
    return web.json_response(error_body(code, message, metadata), status=code, headers=headers)


class BadRequest(Exception):
    pass


def _gen_id() -> str:
    alphabet = string.ascii_letters + string.digits
    return f"gen-{int(time.time())}-" + "".join(secrets.choice(alphabet) for _ in range(20))


def _per_token(usd_per_million: float) -> str:
    return f"{usd_per_million / 1e6:.10f}".rstrip("0").rstrip(".") or "0"


@lru_cache(maxsize=4)
def _tokenizer(target_model_path: str | None):
    """The target tokenizer (of the checkpoint, or the built-in one); loaded once per process."""
    from ..target import load_tokenizer, make_tokenizer

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
            from ..target import resolve_target
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

    async def key(self, request):
        led = self.ledger
        limit = led.total_credits if self.cfg.key_capped else None
        balance = led.balance
        return web.json_response({"data": {
            "label": self.cfg.label, "limit": limit,
            "limit_remaining": balance if limit is not None else None, "limit_reset": None,
            "include_byok_in_limit": False, "usage": led.total_usage, "usage_daily": led.usage_daily,
            "usage_weekly": led.total_usage, "usage_monthly": led.total_usage, "byok_usage": 0,
            "is_free_tier": False, "is_provisioning_key": False,
            "rate_limit": {"requests": -1, "interval": "10s"}}})

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
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rec["time"])),
            "model": rec["model"], "origin": "", "is_byok": False, "upstream_id": None, "cache_discount": None,
            "app_id": None, "streamed": rec["stream"], "cancelled": rec["cancelled"],
            "provider_name": rec["provider_name"], "latency": rec.get("latency_ms"), "moderation_latency": None,
            "generation_time": rec.get("generation_ms"), "finish_reason": rec["finish_reason"],
            "native_finish_reason": rec.get("native_finish_reason"),
            "tokens_prompt": rec["prompt_tokens"], "tokens_completion": rec["completion_tokens"],
            "native_tokens_prompt": rec["prompt_tokens"], "native_tokens_completion": rec["completion_tokens"],
            "native_tokens_reasoning": rec["reasoning_tokens"], "native_tokens_cached": 0,
            "num_media_prompt": None, "num_media_completion": None, "num_search_results": None}})

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
            "per_request_limits": None,
            "supported_parameters": sorted({p for e in self.endpoints for p in e.supported_parameters}),
        }

    async def models(self, request):
        return web.json_response({"data": [self._model_record()]})

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
            "pricing": {"prompt": _per_token(e.prompt_price), "completion": _per_token(e.completion_price),
                        "request": "0", "image": "0", "discount": 0},
            "provider_name": e.name, "tag": e.tag, "quantization": e.quantization,
            "max_completion_tokens": e.max_completion_tokens, "max_prompt_tokens": e.context_length,
            "supported_parameters": e.supported_parameters, "status": e.status,
            "uptime_last_30m": e.uptime_last_30m, "uptime_last_1d": e.uptime_last_30m, "uptime_last_5m": e.uptime_last_30m,
            "supports_implicit_caching": False,
            "latency_last_30m": {p: round(1000 * e.latency_s.median * math.exp(e.latency_s.sigma * z), 1)
                                 for p, z in _Z.items()},
            "throughput_last_30m": {p: round(e.tokens_per_s.median * math.exp(-e.tokens_per_s.sigma * z), 1)
                                    for p, z in _Z.items()},
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
            used = {p for p in _SAMPLING_PARAMS if p in body}
            candidates = route(prefs, self.endpoints, used, len(prompt_ids), req["max_tokens"], self.rng)
        except BadRequest as e:
            return error_response(400, str(e))
        except RoutingError as e:
            return error_response(e.status, e.message, e.metadata)

        worst = max(len(prompt_ids) * e.prompt_price + req["max_tokens"] * e.completion_price
                    for e in candidates) / 1e6
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
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "max_tokens", "exclude", "enabled"}:
            raise BadRequest("reasoning: expected {effort, max_tokens, exclude, enabled}")
        if "effort" in reasoning and reasoning["effort"] not in _EFFORTS:
            raise BadRequest(f"reasoning.effort: expected one of {list(_EFFORTS)}")
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

    def _credit_check(self, candidates, prompt_tokens: int, max_tokens: int, worst: float):
        balance = self.ledger.balance
        if worst > balance:
            price = max(candidates, key=lambda e: e.completion_price)
            prompt_cost = prompt_tokens * price.prompt_price / 1e6
            afford = max(0, math.floor((balance - prompt_cost) * 1e6 / price.completion_price))
            return error_response(402, "This request requires more credits, or fewer max_tokens. You requested up "
                                       f"to {max_tokens} tokens, but can only afford {afford}. To increase, visit "
                                       "https://openrouter.ai/settings/credits and add more credits")
        if self.cfg.in_flight_budget is not None:
            budget = balance * self.cfg.in_flight_budget
            if worst > budget:
                return error_response(402, f"Request weight (${worst:.6f} worst case) exceeds your in-flight "
                                           f"spending budget (${budget:.6f}).",
                                      {"code": "weight_exceeds_budget"})
            if self.reserved + worst > budget:
                return error_response(402, f"Too much spending in flight: ${self.reserved:.6f} reserved by "
                                           f"{self.in_flight} requests, budget ${budget:.6f}. Retry when some finish.",
                                      {"code": "in_flight_budget_exhausted", "retry_after_seconds": 1},
                                      headers={"Retry-After": "1"})
        return None

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
                    "provider_name": ep.name}
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
        """Run the backend for `ep`, paced and written as OpenRouter would; bill and record it."""
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        rng = random.Random(f"{cfg.seed}|{gen_id}")
        ttft = rng.lognormvariate(math.log(ep.latency_s.median), ep.latency_s.sigma)
        tps = rng.lognormvariate(math.log(ep.tokens_per_s.median), ep.tokens_per_s.sigma)
        t0, scale, stream = loop.time(), cfg.time_scale, req["stream"]

        def due(n: int) -> float:  # when the n-th id (from 0) is produced, on the loop's clock
            return t0 + (ttft + n / tps) * scale

        out = Output(self.vocab, req, ep, gen_id, cfg.model, uniform("quirk", cfg.seed, gen_id))
        writer = SSEWriter(request, cfg.padding_interval_s) if stream else JSONWriter(request, cfg.padding_interval_s)
        if fault == "hang":
            return await self._hang(request, writer, req, ep, gen_id, attempts, prompt_ids, t_start)
        stop_after = {"mid_stream": max(1, int(rng.random() * min(req["max_tokens"], 64))),
                      "error_200": 0, "empty_200": 0}.get(fault)
        job = self._job(req, prompt_ids, ep, nth)
        t_first = None
        try:
            await writer.open()
            tokens = self._tokens(job)
            try:
                async for ids, texts in tokens:
                    pos = 0
                    while pos < len(ids) and not out.stopped:
                        end = len(ids)
                        if stop_after is not None:
                            end = min(end, pos + stop_after - len(out.ids))
                            if end <= pos:
                                break
                        if stream:  # a chunk: the ids due by now (paced), at most MAX_CHUNK_TOKENS of them
                            if scale > 0:
                                n_due = int(((loop.time() - t0) / scale - ttft) * tps) + 1
                                if n_due <= len(out.ids):
                                    self._chunk(writer, out)
                                    await writer.flush()
                                    await asyncio.sleep(max(due(len(out.ids)) - loop.time(),
                                                            writer._last + cfg.stream_interval_s * scale - loop.time()))
                                    continue
                                end = min(end, pos + n_due - len(out.ids))
                            end = min(end, pos + MAX_CHUNK_TOKENS)
                        pos += out.extend(ids[pos:end], texts[pos:end])
                        t_first = t_first or loop.time()
                        if stream:
                            self._chunk(writer, out)
                    if stream:
                        await writer.flush()
                    if out.stopped or (stop_after is not None and len(out.ids) >= stop_after):
                        break
            finally:
                job.cancelled = True
                await tokens.aclose()
            # the response (or its failure) is complete when its last id is due
            await asyncio.sleep(max(0.0, due(len(out.ids)) - loop.time()))
            cancelled = False
        except ConnectionResetError:
            writer.stop_keepalive()
            job.cancelled = cancelled = True
            self.stats["cancelled"] += 1
        billed = fault is None
        finish = None if fault in ("empty_200",) else "error" if fault else out.finish_reason
        # the ledger line exists before the client has the last byte (as /generation would)
        self._record(gen_id, ep, req, out, 200, attempts, finish=finish, billed=billed, error=fault,
                     t_start=t_start, prompt_ids=prompt_ids, cancelled=cancelled,
                     ttft_s=(t_first - t0) if t_first else None)
        self.stats["served" if fault is None else f"fault_{fault}"] += 1
        if cancelled:
            return writer.resp or web.Response(status=499)
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
               "metadata": {"raw": "upstream connection lost", "provider_name": ep.name}}
        if isinstance(writer, SSEWriter):
            if fault in ("error_200", "mid_stream"):
                r, c = out.take_delta()
                writer.event(out.chunk(r, c, finish="error", error=err))
                await writer.end()
                return writer.resp
            if fault is None:
                writer.event(out.chunk("", "", finish=out.finish_reason))
            writer.event(out.usage_chunk(out.usage(billing, prompt_ids, billed=fault is None)))
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

    async def _hang(self, request, writer, req, ep, gen_id, attempts, prompt_ids, t_start):
        """Accept, say nothing (a stream gets its headers and first comment), close after hang_s."""
        out = Output(self.vocab, req, ep, gen_id, self.cfg.model, 1.0)
        try:
            if isinstance(writer, SSEWriter):
                await writer._write(PROCESSING)
            await asyncio.sleep(self.cfg.hang_s)
        except ConnectionResetError:
            pass
        finally:
            self._record(gen_id, ep, req, out, 200, attempts, finish=None, billed=False, error="hang",
                         t_start=t_start, prompt_ids=prompt_ids, cancelled=False, ttft_s=None)
            self.stats["fault_hang"] += 1
        if request.transport is not None:
            request.transport.close()
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
        self.ledger.record({
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
