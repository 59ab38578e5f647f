"""Stage 02 against OpenRouter's documented contract, one test per way it used to lose money or data.

Each contract is tested once, against the emulator playing OpenRouter (src/draftsmith/emulator),
with the fault that breaks it as a parameter; the emulator's ledger is the referee for what was
paid. A small stub (`Stub`: the documented shapes, its own ledger, each answer scripted) stays
only for what the emulator cannot produce: a 403 at a chosen moment while chosen requests hang,
a workspace budget below the key's limit, and the 503 routing refusals.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from pathlib import Path

import pytest
from aiohttp import web

from draftsmith.emulator import running
from draftsmith.openrouter import pricing
from draftsmith.openrouter.api import Api
from draftsmith.openrouter.apikey import ApiKey
from draftsmith.paths import Run
from draftsmith.providers import outputs

from conftest import stage_02_at
from test_generate_e2e import assert_whole_and_unique, billed, emu_config, prompts_file
from test_generate_e2e import generate as emu_generate
from test_generate_e2e import saved as emu_saved

pytestmark = pytest.mark.emulator

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


def errors(tmp_path: Path) -> list[dict]:
    path = tmp_path / "r" / "generate" / "p" / "errors.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def manifest(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "r" / "generate" / "manifest.json").read_text())



def ledger_cost(emu) -> float:
    return sum(x["cost"] for x in emu.ledger_lines() if x["billed"])


def one_file(tmp_path: Path, n: int, tag: str) -> list[dict]:
    return [{"name": "p", "path": str(prompts_file(tmp_path / f"{tag}.jsonl", n, tag))}]


# --- a 403 is a spent budget or a missing permission, not a bad prompt ----------------------

@pytest.mark.parametrize("refusal", ["key_budget_usd", "key_forbidden"])
def test_a_403_stops_the_run_writes_no_sample_off_and_a_rerun_finishes(tmp_path, refusal):
    """The key's budget runs out (it shows in /key, then 403 past it) or the key lacks permission
    (403 on every request): the run stops, never by writing the remaining samples off; once the
    budget is raised (the permission given) the re-run answers the rest, paying nothing twice."""
    refused = {"key_budget_usd": 0.002} if refusal == "key_budget_usd" else {"key_forbidden": True}
    ds = one_file(tmp_path, 300, refusal)
    with running(emu_config(credits=100.0, fault_scale=0.0, **refused), state_dir=tmp_path / "emu") as emu:
        r = emu_generate(emu, tmp_path, ds, concurrency=4)
        assert r.reason in ("balance", "fatal") and not r.complete, r.message
        assert not errors(tmp_path), "a sample was written off for a 403"
        done = len(emu_saved(tmp_path, "p"))
        assert (0 < done < 300) if refusal == "key_budget_usd" else done == 0
        assert r.spent_usd == pytest.approx(ledger_cost(emu), abs=1e-6) and r.spent_usd <= 0.002 + 1e-9
    with running(emu_config(credits=100.0, fault_scale=0.0), state_dir=tmp_path / "emu") as emu:
        again = emu_generate(emu, tmp_path, ds, concurrency=4)
        assert again.complete, again.message
        rows = emu_saved(tmp_path, "p")
        assert_whole_and_unique(rows)
        assert len(rows) == 300 and max(billed(emu).values()) == 1


# --- answers lost after billing are paid for: ask /generation, count it ---------------------

@pytest.mark.parametrize("stream", [False, True])
def test_answers_billed_then_lost_are_counted_and_the_spend_equals_the_ledger(tmp_path, stream):
    faults = {"cut_after_billing": 0.25, "hang": 0.05}
    # hangs outlast the read timeout; every other answer comes well within it (a client time-out of an
    # answer still on its way has no generation id to ask about, and is counted at its worst case)
    with running(emu_config(credits=100.0, faults=faults, hang_s=6.0), state_dir=tmp_path / "emu") as emu:
        r = emu_generate(emu, tmp_path, one_file(tmp_path, 60, f"lost{stream}"), stream=stream,
                         request_timeout_s=3.0, max_attempts=10)
        assert r.complete, r.message
        rows = emu_saved(tmp_path, "p")
        assert_whole_and_unique(rows)
        assert len(rows) == 60
        lost = [x for x in emu.ledger_lines() if x["billed"] and x["error"] in ("cut_after_billing", "hang")]
        assert lost, "no answer was lost: raise the fault rates"
        assert r.session["unknown_bills"] == 0, r.session
        assert r.spent_usd == pytest.approx(ledger_cost(emu), abs=1e-6)
        assert "Paid for and not saved this session" in r.message, r.message


@pytest.mark.parametrize("faults", [{}, {"cut_after_billing": 0.6}], ids=["no_faults", "answers_lost"])
def test_the_spend_limit_holds_and_the_spend_equals_the_ledger(tmp_path, faults):
    """Without counting the answers lost after billing, the run would spend without end."""
    with running(emu_config(credits=100.0, faults=faults or None, fault_scale=1.0 if faults else 0.0),
                 state_dir=tmp_path / "emu") as emu:
        limit = 0.004
        r = emu_generate(emu, tmp_path, one_file(tmp_path, 400, "limit"), concurrency=16, spend_limit_usd=limit,
                         max_attempts=20)
        assert r.reason == "spend_limit" and "spend_limit_usd" in r.message, r.message
        worst = max(x["cost"] for x in emu.ledger_lines() if x["billed"]) * 4   # generous: one request's worst case
        assert limit / 2 < ledger_cost(emu) <= limit + (worst if faults else 0.0)
        assert r.spent_usd == pytest.approx(ledger_cost(emu), abs=1e-6)


class LostStub(Stub):
    """A stub whose answer functions may write raw responses (they need the request)."""

    async def chat(self, request):
        body = json.loads(await request.read())
        with self.lock:
            n = len(self.bodies)
            self.bodies.append(body)
        return await self.answer(self, body, n, request)



def test_requests_abandoned_at_a_stop_are_costed(tmp_path):
    """A 403 stops the run while other requests hang (billed): after the grace period they are
    given up on, and /generation still tells what they cost. Stub: the emulator cannot hold
    chosen requests while the 403 comes at a chosen moment."""
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



# --- endpoints without `seed` are not routed to when seed is sent with require_parameters ---

def test_endpoints_lacking_a_sent_parameter_are_excluded_and_not_priced():
    eps = [endpoint("moonshotai/int4"), endpoint("cheapseed/int4", params=["max_tokens", "temperature"],
                                                 completion=str(50 * PRICE_OUT))]
    sent = {"max_tokens", "temperature", "top_p", "seed"}
    policy = pricing.apply_policy(pricing.endpoint_table(eps), "int4", False, sent).set_index("tag")
    assert policy.loc["moonshotai/int4", "allowed"] and not policy.loc["cheapseed/int4", "allowed"]
    assert "seed" in policy.loc["cheapseed/int4", "reason"]
    cat = pricing.catalogue(eps, MODEL, {"require_parameters": True}, sent)
    assert cat.endpoints == 1 and cat.completion_price == pytest.approx(PRICE_OUT)



def test_endpoints_without_seed_are_not_used_and_none_at_all_stops_before_sending(tmp_path):
    no_seed = ["max_tokens", "temperature", "top_p", "stop", "reasoning", "include_reasoning"]
    eps = [{"slug": "a", "name": "A", "quantization": "int4", "prompt_price": 0.5, "completion_price": 2.0,
            "supported_parameters": no_seed},
           {"slug": "b", "name": "B", "quantization": "int4", "prompt_price": 0.6, "completion_price": 2.2}]
    ds = one_file(tmp_path, 20, "seed")
    with running(emu_config(credits=10.0, fault_scale=0.0, providers=eps), state_dir=tmp_path / "emu") as emu:
        r = emu_generate(emu, tmp_path, ds, seed=0)
        assert r.complete, r.message
        assert {x["provider_name"] for x in emu.ledger_lines() if x["billed"]} == {"B"}
    with running(emu_config(credits=10.0, fault_scale=0.0, providers=eps[:1]), state_dir=tmp_path / "emu2") as emu:
        r = emu_generate(emu, tmp_path / "two", ds, seed=0)
        assert r.reason == "fatal" and "seed" in r.message, r.message
        assert not emu.ledger_lines()


# --- refusals that retrying cannot change stop the run --------------------------------------

def test_a_request_heavier_than_the_whole_budget_stops_at_once(tmp_path):
    """402 weight_exceeds_budget: no retry can fit it; the message names max_tokens."""
    with running(emu_config(credits=100.0, fault_scale=0.0, key_budget_usd=0.00001), state_dir=tmp_path / "emu") as emu:
        r = emu_generate(emu, tmp_path, one_file(tmp_path, 30, "weight"), max_tokens=4000, max_attempts=3)
        assert r.reason in ("fatal", "balance") and not r.complete, r.message
        assert "max_tokens" in r.message, r.message
        assert not any(x["billed"] for x in emu.ledger_lines())
        assert not emu_saved(tmp_path, "p")


@pytest.mark.parametrize("message", [
    "No endpoints found that can handle the requested parameters.",
    "No available model provider that meets your routing requirements. Please try again later."])
def test_a_503_routing_refusal_stops_the_run_without_a_storm_of_retries(tmp_path, message):
    """Stub: the emulator refuses these routes with a 404 (the seed test above), never a 503."""
    with Stub(lambda stub, body, n: stub.error(503, message)) as stub:
        r = generate(stub, tmp_path, prompts(tmp_path, 30), max_attempts=3)
        assert r.reason == "fatal" and not r.complete and "routing" in r.message, r.message
        assert not errors(tmp_path) and len(stub.bodies) <= 8      # no sample exhausted, no storm of retries


# --- one balance, read the same way by stages 01 and 02 -------------------------------------

def test_stages_01_and_02_read_the_same_balance(tmp_path):
    """Stub: the emulator's key has one budget; here a workspace budget below the key's limit wins."""
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



# --- the worst case includes every documented price ------------------------------------------

def test_the_worst_case_reservation_includes_overrides_request_and_reasoning_prices(tmp_path):
    ep = endpoint("moonshotai/int4", request="0.0001", internal_reasoning=str(3 * PRICE_OUT), discount=0.5,
                  overrides=[{"min_prompt_tokens": 128000, "prompt": str(4 * PRICE_IN), "completion": str(4 * PRICE_OUT)}])
    assert pricing.worst_prices(ep) == pytest.approx((4 * PRICE_IN, 4 * PRICE_OUT, 0.0001))
    assert pricing.default_prices(ep) == pytest.approx((0.5 * PRICE_IN, 0.5 * PRICE_OUT, 0.00005))
    # through stage 02: every request is billed at the override's price (any prompt is long enough) plus the fee
    dear = [{"slug": "moonshotai", "name": "Moonshot AI", "quantization": "int4", "prompt_price": 0.5,
             "completion_price": 2.0, "request_price": 0.0001, "internal_reasoning_price": 6.0,
             "price_overrides": [{"min_prompt_tokens": 1, "prompt_price": 2.0, "completion_price": 8.0}]}]
    with running(emu_config(credits=100.0, fault_scale=0.0, providers=dear), state_dir=tmp_path / "emu") as emu:
        limit = 0.004
        r = emu_generate(emu, tmp_path, one_file(tmp_path, 300, "worst"), concurrency=16, spend_limit_usd=limit)
        assert r.reason == "spend_limit", r.message
        assert 0 < ledger_cost(emu) <= limit


# --- stage 02 alone never routes beyond the precision policy ----------------------------------

def test_stage_02_without_stage_01_applies_the_precision_policy(tmp_path):
    eps = [{"slug": s, "name": s.title(), "quantization": q, "prompt_price": 0.5, "completion_price": 2.0}
           for s, q in (("moonshotai", "int4"), ("fireworks", "nvfp4"), ("atlas", "unknown"), ("novita", "fp8"))]
    ds = one_file(tmp_path, 40, "policy")
    with running(emu_config(credits=10.0, fault_scale=0.0, providers=eps), state_dir=tmp_path / "emu") as emu:
        r = emu_generate(emu, tmp_path, ds)
        assert r.complete, r.message
        assert {x["provider_name"] for x in emu.ledger_lines() if x["billed"]} <= {"Moonshotai", "Novita"}
        assert any("fidelity probe did not run" in line and "fireworks/nvfp4" in line for line in r.logs)
        assert manifest(tmp_path)["config"]["routing_source"].startswith("stage 02 precision policy")
        with pytest.raises(ValueError, match="run stage 01 first"):
            emu_generate(emu, tmp_path / "x", ds, native_precision=None)


# --- stage 01's spend counts in the run's spend limit -----------------------------------------

def test_stage_01_spend_counts_against_the_run_limit(tmp_path):
    run = Run(tmp_path, "r")
    assert outputs.record_spend(run, "pilot", 0.003) == 0.003
    assert outputs.record_spend(run, "probe", 0.001) == pytest.approx(0.004)
    assert outputs.spent(run) == pytest.approx(0.004)
    with running(emu_config(credits=100.0, fault_scale=0.0), state_dir=tmp_path / "emu") as emu:
        r = emu_generate(emu, tmp_path, one_file(tmp_path, 300, "s01"), spend_limit_usd=0.006)
        assert r.reason == "spend_limit", r.message
        assert ledger_cost(emu) <= 0.006 - 0.004 + 1e-12
        assert r.spent_usd == pytest.approx(ledger_cost(emu) + 0.004, abs=1e-6)
        assert "stage 01 included" in r.message
