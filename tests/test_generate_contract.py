"""Stage 02 against OpenRouter's documented contract, one test per way it used to lose money or data.

The server here is a small stub that answers in the documented shapes (the official SDK's models)
and keeps its own ledger of what it billed, per generation id; each test scripts what it answers.
It is independent of our emulator on purpose: these tests hold the client to OpenRouter's
contract, not to our own reading of it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from pathlib import Path

import pytest
from aiohttp import web

from draftsmith.openrouter import pricing
from draftsmith.openrouter.api import Api
from draftsmith.openrouter.apikey import ApiKey
from draftsmith.paths import Run
from draftsmith.providers import outputs

from conftest import stage_02_at

MODEL = "moonshotai/kimi-k2.5"
PRICE_IN, PRICE_OUT = 0.5e-6, 2.0e-6
SEED_PARAMS = ["max_tokens", "temperature", "top_p", "seed", "reasoning", "stop"]


def endpoint(tag: str, quant: str = "int4", params=None, **pricing_extra) -> dict:
    return {"name": f"{tag} | {MODEL}", "model_id": MODEL, "model_name": MODEL, "context_length": 262144,
            "pricing": {"prompt": str(PRICE_IN), "completion": str(PRICE_OUT), **pricing_extra},
            "provider_name": tag.split("/")[0].title(), "tag": tag, "quantization": quant,
            "max_completion_tokens": 16384, "max_prompt_tokens": 262144,
            "supported_parameters": SEED_PARAMS if params is None else params, "status": 0,
            "uptime_last_30m": 99.0, "latency_last_30m": {"p50": 900}, "throughput_last_30m": {"p50": 40}}


class Stub:
    """OpenRouter as documented. `answer(stub, body, n)` decides each chat request (n counts from 0)
    and returns a web.Response; `ok(...)` bills and answers normally. /generation answers 404 for
    the first `gen_misses` asks of each id, as the real one does just after a request ends."""

    def __init__(self, answer, endpoints=None, key=None, credits=None, gen_misses=1):
        self.answer = answer
        self.endpoints = endpoints or [endpoint("moonshotai/int4")]
        self.key = {"label": "k", "limit": None, "limit_remaining": None, "usage": 0, "budgets": [],
                    "effective_budget": None, **(key or {})}
        self.credits = credits
        self.gen_misses = gen_misses
        self.billed: dict[str, float] = {}       # generation id -> USD
        self.bodies: list[dict] = []
        self.asks: dict[str, int] = {}
        self._ids = itertools.count()
        self.lock = threading.Lock()

    def new_id(self) -> str:
        return f"gen-{next(self._ids)}"

    def bill(self, gid: str, completion_tokens: int, prompt_tokens: int = 20, extra: float = 0.0) -> dict:
        cost = prompt_tokens * PRICE_IN + completion_tokens * PRICE_OUT + extra
        self.billed[gid] = cost
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens, "cost": cost,
                "completion_tokens_details": {"reasoning_tokens": 0}, "prompt_tokens_details": {"cached_tokens": 0},
                "cost_details": {"upstream_inference_prompt_cost": prompt_tokens * PRICE_IN,
                                 "upstream_inference_completions_cost": completion_tokens * PRICE_OUT}}

    def ok(self, gid: str | None = None, tokens: int = 10, usage: dict | None = None) -> web.Response:
        gid = gid or self.new_id()
        usage = usage or self.bill(gid, tokens)
        body = {"id": gid, "provider": "Moonshot AI", "model": MODEL, "object": "chat.completion", "created": 1,
                "choices": [{"index": 0, "finish_reason": "stop", "native_finish_reason": "stop",
                             "message": {"role": "assistant", "content": "word " * tokens, "reasoning": None}}],
                "usage": usage}
        return web.json_response(body, headers={"X-Generation-Id": gid})

    @staticmethod
    def error(status: int, message: str, metadata: dict | None = None, headers=None) -> web.Response:
        err = {"code": status, "message": message, **({"metadata": metadata} if metadata else {})}
        return web.json_response({"error": err, "user_id": "u"}, status=status, headers=headers)

    # -- the app --------------------------------------------------------------------------------
    async def chat(self, request):
        body = json.loads(await request.read())
        with self.lock:
            n = len(self.bodies)
            self.bodies.append(body)
        res = self.answer(self, body, n)
        return await res if asyncio.iscoroutine(res) else res

    async def generation(self, request):
        gid = request.query["id"]
        self.asks[gid] = self.asks.get(gid, 0) + 1
        if gid not in self.billed or self.asks[gid] <= self.gen_misses:
            return self.error(404, f"Generation {gid} not found")
        return web.json_response({"data": {"id": gid, "total_cost": self.billed[gid], "usage": self.billed[gid],
                                           "is_byok": False, "upstream_inference_cost": None}})

    async def endpoints_(self, request):
        return web.json_response({"data": {"id": MODEL, "name": MODEL, "endpoints": self.endpoints}})

    async def key_(self, request):
        return web.json_response({"data": self.key})

    async def credits_(self, request):
        if self.credits is None:
            return self.error(403, "Only management keys can fetch credits")
        return web.json_response({"data": self.credits})

    def __enter__(self):
        app = web.Application()
        app.router.add_post("/api/v1/chat/completions", self.chat)
        app.router.add_get("/api/v1/generation", self.generation)
        app.router.add_get(f"/api/v1/models/{MODEL}/endpoints", self.endpoints_)
        app.router.add_get("/api/v1/models", lambda r: web.json_response({"data": [{"id": MODEL}]}))
        app.router.add_get("/api/v1/key", self.key_)
        app.router.add_get("/api/v1/credits", self.credits_)
        ready = threading.Event()

        def serve():
            self.loop = asyncio.new_event_loop()
            self.runner = web.AppRunner(app, shutdown_timeout=0.5)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.base_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/api/v1"
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(60), "the stub server did not start"
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def total(self) -> float:
        return sum(self.billed.values())


def prompts(tmp_path: Path, n: int, tag: str = "p") -> list[dict]:
    path = tmp_path / f"{tag}.jsonl"
    path.write_text("".join(json.dumps({"id": f"{tag}-{i}", "messages": [{"role": "user", "content": f"q {i}"}]}) + "\n"
                            for i in range(n)))
    return [{"name": "p", "path": str(path)}]


def generate(stub: Stub, tmp_path: Path, ds, **kw):
    args = dict(model=MODEL, max_tokens=32, concurrency=8, spend_limit_usd=5.0, seed=0, temperature=1.0,
                native_precision="int4", log=lambda *a: None, balance_poll_s=0.2, backoff_base_s=0.01,
                backoff_cap_s=0.05, request_timeout_s=2.0, stop_grace_s=2.0, recovery_patience_s=10.0)
    args.update(kw)
    return stage_02_at(stub.base_url, ApiKey("sk-or-v1-test", "test"), Run(tmp_path, "r"), ds, **args)


def saved(tmp_path: Path) -> list[dict]:
    path = tmp_path / "r" / "generate" / "p" / "raw_responses.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def errors(tmp_path: Path) -> list[dict]:
    path = tmp_path / "r" / "generate" / "p" / "errors.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def manifest(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "r" / "generate" / "manifest.json").read_text())


# --- 1: 403 is a spent budget or a missing permission, not a bad prompt -------------------------

def test_403_stops_the_run_and_writes_no_sample_off(tmp_path):
    spent = {"on": False}

    def answer(stub, body, n):
        if n >= 10:
            spent["on"] = True
        if spent["on"]:
            return stub.error(403, "Key limit exceeded", {"error_type": "permission_denied",
                                                          "limit_source": "openrouter_key_limit"})
        return stub.ok()
    ds = prompts(tmp_path, 60)
    with Stub(answer) as stub:
        r = generate(stub, tmp_path, ds, concurrency=4)
        assert r.reason == "fatal" and not r.complete and "budget" in r.message, r.message
        assert not errors(tmp_path), "a sample was written off for a 403"
        done = len(saved(tmp_path))
        assert 0 < done < 60
        spent["on"] = False                       # the budget was raised
        stub.answer = lambda stub, body, n: stub.ok()
        again = generate(stub, tmp_path, ds, concurrency=4)
        assert again.complete and len(saved(tmp_path)) == 60


# --- 2: answers lost after billing are paid for: ask /generation, count it --------------------

def test_lost_answers_are_costed_from_generation_and_the_spend_matches_the_bills(tmp_path):
    """A third of the prompts' first answers are cut after the headers (billed in full,
    X-Generation-Id sent); others hang past the read timeout (billed too) before an answer comes.
    The manifest's spend equals the stub's bills."""
    tries: dict[str, int] = {}

    async def answer(stub, body, n, request):
        gid = stub.new_id()
        q = body["messages"][0]["content"]
        tries[q] = tries.get(q, 0) + 1
        i = int(q.split()[1])
        if tries[q] == 1 and i % 3 == 1:          # billed, headers sent, body cut
            stub.bill(gid, 10)
            resp = web.StreamResponse(status=200, headers={"X-Generation-Id": gid, "Content-Length": "4000"})
            await resp.prepare(request)
            await resp.write(b'{"id": "' + gid.encode())
            request.transport.close()
            return resp
        if tries[q] <= 2 and i % 7 == 5:         # billed, then silent past the read timeout
            stub.bill(gid, 10)
            resp = web.StreamResponse(status=200, headers={"X-Generation-Id": gid})
            await resp.prepare(request)
            await asyncio.sleep(3)
            return resp
        return stub.ok(gid)

    ds = prompts(tmp_path, 40)
    with LostStub(answer) as stub:
        # the read timeout leaves a loaded box time for the answers that come, and is still below a hang
        r = generate(stub, tmp_path, ds, concurrency=8, request_timeout_s=1.5)
        assert r.complete and len(saved(tmp_path)) == 40, r.message
        lost = stub.total - sum(x["usage"]["cost"] for x in saved(tmp_path))
        assert lost > 0
        assert r.spent_usd == pytest.approx(stub.total, abs=1e-9)
        assert manifest(tmp_path)["spent_usd"] == pytest.approx(stub.total, abs=1e-9)
        assert f"Paid for and not saved this session: ${lost:.4f}" in r.message, r.message
        assert r.session["lost_answers"] == r.session["lost_answers_costed"] > 0


class LostStub(Stub):
    """A stub whose answer functions may write raw responses (they need the request)."""

    async def chat(self, request):
        body = json.loads(await request.read())
        with self.lock:
            n = len(self.bodies)
            self.bodies.append(body)
        return await self.answer(self, body, n, request)


def test_the_spend_limit_holds_when_lost_answers_are_billed(tmp_path):
    """All answers are lost after billing: without counting them the run would spend without end."""
    async def answer(stub, body, n, request):
        gid = stub.new_id()
        stub.bill(gid, 32)
        resp = web.StreamResponse(status=200, headers={"X-Generation-Id": gid, "Content-Length": "4000"})
        await resp.prepare(request)
        request.transport.close()
        return resp

    with LostStub(answer) as stub:
        limit = 0.002
        r = generate(stub, tmp_path, prompts(tmp_path, 400), concurrency=8, spend_limit_usd=limit, max_attempts=3)
        worst = 30 * PRICE_IN + 32 * PRICE_OUT + 200 * PRICE_IN      # generous bound of one request
        assert r.reason == "spend_limit", r.message
        assert stub.total <= limit + worst
        assert r.spent_usd == pytest.approx(stub.total, abs=1e-9)


def test_requests_abandoned_at_a_stop_are_costed(tmp_path):
    """A 403 stops the run while other requests hang (billed): after the grace period they are
    given up on, and /generation still tells what they cost."""
    async def answer(stub, body, n, request):
        gid = stub.new_id()
        if n < 4:
            stub.bill(gid, 10)
            resp = web.StreamResponse(status=200, headers={"X-Generation-Id": gid})
            await resp.prepare(request)
            await asyncio.sleep(30)
            return resp
        await asyncio.sleep(0.3)
        return stub.error(403, "Workspace budget exhausted", {"error_type": "permission_denied"})

    with LostStub(answer) as stub:
        r = generate(stub, tmp_path, prompts(tmp_path, 20), concurrency=5, request_timeout_s=60, stop_grace_s=0.5)
        assert r.reason == "fatal"
        assert stub.total > 0 and r.spent_usd == pytest.approx(stub.total, abs=1e-9)
        assert "Paid for and not saved" in r.message and "Nothing paid for" not in r.message


# --- 3: endpoints without `seed` are not routed to when seed is sent with require_parameters ----

def test_endpoints_lacking_a_sent_parameter_are_excluded_and_not_priced():
    eps = [endpoint("moonshotai/int4"), endpoint("cheapseed/int4", params=["max_tokens", "temperature"],
                                                 completion=str(50 * PRICE_OUT))]
    sent = {"max_tokens", "temperature", "top_p", "seed"}
    policy = pricing.apply_policy(pricing.endpoint_table(eps), "int4", False, sent).set_index("tag")
    assert policy.loc["moonshotai/int4", "allowed"] and not policy.loc["cheapseed/int4", "allowed"]
    assert "seed" in policy.loc["cheapseed/int4", "reason"]
    cat = pricing.catalogue(eps, MODEL, {"require_parameters": True}, sent)
    assert cat.endpoints == 1 and cat.completion_price == pytest.approx(PRICE_OUT)


def test_no_endpoint_taking_seed_stops_before_sending_anything(tmp_path):
    eps = [endpoint("moonshotai/int4", params=["max_tokens", "temperature", "top_p"])]
    with Stub(lambda stub, body, n: stub.error(404, "No endpoints found that can handle the requested parameters."),
              endpoints=eps) as stub:
        r = generate(stub, tmp_path, prompts(tmp_path, 5))
        assert r.reason == "fatal" and "seed" in r.message and not stub.bodies, r.message


# --- 4, 5: refusals that retrying cannot change stop the run ----------------------------------

@pytest.mark.parametrize("status,error,words", [
    (402, {"message": "Request weight exceeds this key's whole limit",
           "metadata": {"reason": "weight_exceeds_budget", "limit_source": "openrouter_key_limit"}}, "max_tokens"),
    (503, {"message": "No endpoints found that can handle the requested parameters."}, "routing"),
    (503, {"message": "No available model provider that meets your routing requirements. Please try again later."},
     "routing"),
])
def test_refusals_that_retrying_cannot_change_stop_the_run(tmp_path, status, error, words):
    with Stub(lambda stub, body, n: stub.error(status, error["message"], error.get("metadata"))) as stub:
        r = generate(stub, tmp_path, prompts(tmp_path, 30), max_attempts=3)
        assert r.reason == "fatal" and not r.complete and words in r.message, r.message
        assert not errors(tmp_path) and len(stub.bodies) <= 8      # no sample exhausted, no storm of retries


# --- 6: one balance, read the same way by stages 01 and 02 ------------------------------------

def test_stages_01_and_02_read_the_same_balance(tmp_path):
    key = {"limit": 10.0, "limit_remaining": 9.0,
           "budgets": [{"scope": "workspace", "limit_usd": 5.0, "spend_usd": 1.5, "remaining_usd": 3.5},
                       {"scope": "key_limit", "limit_usd": 10.0, "spend_usd": 1.0, "remaining_usd": 9.0}],
           "effective_budget": {"scope": "workspace", "limit_usd": 5.0, "spend_usd": 1.5, "remaining_usd": 3.5}}
    with Stub(lambda stub, body, n: stub.ok(), key=key, credits={"total_credits": 20.0, "total_usage": 13.0}) as stub:
        usd, source = Api(stub.base_url, ApiKey("sk-or-v1-test", "t")).balance()

        async def stage_02():
            import aiohttp

            async with aiohttp.ClientSession() as s:
                return await pricing.BalanceReader(s, stub.base_url).read()
        assert usd == asyncio.run(stage_02()) == 3.5 and "budget" in source
        stub.key["effective_budget"] = None
        stub.key["budgets"] = []
        assert Api(stub.base_url, ApiKey("sk-or-v1-test", "t")).balance()[0] == 7.0   # /credits


# --- 7: the worst case includes every documented price ----------------------------------------

def test_worst_case_reservation_includes_overrides_request_and_reasoning_prices(tmp_path):
    ep = endpoint("moonshotai/int4", request="0.0001", internal_reasoning=str(3 * PRICE_OUT), discount=0.5,
                  overrides=[{"min_prompt_tokens": 128000, "prompt": str(4 * PRICE_IN), "completion": str(4 * PRICE_OUT)}])
    assert pricing.worst_prices(ep) == pytest.approx((4 * PRICE_IN, 4 * PRICE_OUT, 0.0001))
    assert pricing.default_prices(ep) == pytest.approx((0.5 * PRICE_IN, 0.5 * PRICE_OUT, 0.00005))

    # through stage 02: every request is billed at the override price plus the request fee
    def answer(stub, body, n):
        gid = stub.new_id()
        return stub.ok(gid, usage=stub.bill(gid, 32, extra=20 * 3 * PRICE_IN + 32 * 2 * PRICE_OUT + 0.0001))
    with Stub(answer, endpoints=[ep]) as stub:
        limit = 0.004
        r = generate(stub, tmp_path, prompts(tmp_path, 300), concurrency=16, spend_limit_usd=limit)
        assert r.reason == "spend_limit"
        assert stub.total <= limit, (stub.total, limit)


# --- 8: BYOK: the fee and the provider's bill: counted by the client (test_client) --------------

# --- 9: stage 02 alone never routes beyond the precision policy -------------------------------

def test_stage_02_without_stage_01_applies_the_precision_policy(tmp_path):
    eps = [endpoint("moonshotai/int4"), endpoint("fireworks/nvfp4", "nvfp4"), endpoint("atlas/unknown", "unknown"),
           endpoint("novita/fp8", "fp8")]
    logs: list[str] = []
    with Stub(lambda stub, body, n: stub.ok(), endpoints=eps) as stub:
        r = generate(stub, tmp_path, prompts(tmp_path, 5), log=logs.append)
        assert r.complete
        sent = {json.dumps(b["provider"], sort_keys=True) for b in stub.bodies}
        assert len(sent) == 1
        prov = stub.bodies[0]["provider"]
        assert prov["only"] == ["moonshotai/int4", "novita/fp8"] and prov["require_parameters"] is True
        assert not {"nvfp4", "fp4", "unknown"} & set(prov["quantizations"])
        assert any("fidelity probe did not run" in line and "fireworks/nvfp4" in line for line in logs)
        assert manifest(tmp_path)["config"]["routing_source"].startswith("stage 02 precision policy")
    with pytest.raises(ValueError, match="run stage 01 first"):
        generate(stub, tmp_path / "x", prompts(tmp_path, 5), native_precision=None)


# --- stage 01's spend counts in the run's spend limit -----------------------------------------

def test_stage_01_spend_counts_against_the_run_limit(tmp_path):
    run = Run(tmp_path, "r")
    assert outputs.record_spend(run, "pilot", 0.003) == 0.003
    assert outputs.record_spend(run, "probe", 0.001) == pytest.approx(0.004)
    assert outputs.spent(run) == pytest.approx(0.004)
    with Stub(lambda stub, body, n: stub.ok()) as stub:
        r = generate(stub, tmp_path, prompts(tmp_path, 300), spend_limit_usd=0.006)
        assert r.reason == "spend_limit"
        assert stub.total <= 0.006 - 0.004 + 1e-12 and r.spent_usd == pytest.approx(stub.total + 0.004)
        assert "stage 01 included" in r.message


# --- throttling waits, it never spends a sample's attempts -------------------------------------

def test_throttling_never_spends_attempts_and_given_up_samples_are_in_the_last_line(tmp_path):
    """Each prompt meets five 429s (with and without Retry-After) and in-flight 402s before an
    answer, with max_attempts 2: all are answered. Then a provider that always fails: the
    samples are given up and the message ends saying so."""
    seen: dict[str, int] = {}

    def answer(stub, body, n):
        q = body["messages"][0]["content"]
        seen[q] = seen.get(q, 0) + 1
        k = seen[q]
        if k <= 3:
            return stub.error(429, "Provider returned error", {"provider_name": "Moonshot AI", "raw": "busy"},
                              headers={"Retry-After": "0"} if k % 2 else None)
        if k <= 5:
            return stub.error(402, "Too much spending in flight", {"reason": "in_flight_budget_exhausted",
                                                                   "limit_source": "openrouter_in_flight_budget"})
        return stub.ok()
    with Stub(answer) as stub:
        r = generate(stub, tmp_path, prompts(tmp_path, 20), max_attempts=2)
        assert r.complete and len(saved(tmp_path)) == 20 and r.session["exhausted_samples"] == 0, r.message
        assert "GIVEN UP" not in r.message
    with Stub(lambda stub, body, n: stub.error(502, "Provider returned error", {"provider_name": "X"})) as stub:
        r = generate(stub, tmp_path / "b", prompts(tmp_path, 3), max_attempts=2)
        assert r.session["exhausted_samples"] == 3
        assert r.message.endswith("3 samples were GIVEN UP after 2 failed attempts each (errors.jsonl); "
                                  "a re-run tries them again.")
