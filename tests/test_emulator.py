"""The local OpenRouter emulator, through HTTP as a client sees it (synthetic backend)."""

import asyncio
import json
import math
from collections import Counter

import aiohttp
import httpx
import pytest

from draftsmith.datasets import stable_id
from draftsmith.emulator import read_ledger, running, top_up
from draftsmith.emulator.catalogue import default_catalogue
from draftsmith.emulator.config import load_config
from draftsmith.emulator.output import TRUNCATE_CHARS

from conftest import wait_until

pytestmark = pytest.mark.emulator

MODEL = "moonshotai/kimi-k2.5"
QUIET = {"fault_scale": 0, "generation_delay_s": 0.0}


def msgs(text="What does os.path.join do?"):
    return [{"role": "user", "content": text}]


def body(**kw):
    return {"model": MODEL, "messages": msgs(kw.pop("text", "What does os.path.join do?")), "max_tokens": 60, **kw}


def post_at_once(emu, n: int, **kw) -> list[tuple[int, dict, dict]]:
    """n identical chat requests sent together: (status, headers, JSON body) of each."""
    async def main():
        async with aiohttp.ClientSession(headers=emu.key.header()) as s:
            async def one():
                async with s.post(emu.base_url + "/chat/completions", json=body(**kw)) as r:
                    return r.status, dict(r.headers), await r.json(content_type=None)
            return await asyncio.gather(*[one() for _ in range(n)])
    return asyncio.run(main())


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    with running(QUIET, state_dir=tmp_path_factory.mktemp("emu")) as e:
        yield e


@pytest.fixture(scope="module")
def client(emu):
    with httpx.Client(base_url=emu.base_url, headers=emu.key.header(), timeout=30) as c:
        yield c


def sse_events(text: str) -> tuple[list[str], list]:
    """(comment lines, data payloads) of an SSE body, asserting its framing."""
    comments, data = [], []
    for block in text.split("\n\n"):
        if not block:
            continue
        for line in block.split("\n"):
            if line.startswith(":"):
                comments.append(line)
            else:
                assert line.startswith("data: "), line
                payload = line[6:]
                data.append(payload if payload == "[DONE]" else json.loads(payload))
    return comments, data


# ---- endpoints and error envelope -------------------------------------------------------------

def test_chat_completion_has_openrouter_fields_and_usage_matches_ledger(emu, client):
    r = client.post("/chat/completions", json=body(provider={"order": ["moonshotai"], "allow_fallbacks": False}))
    assert r.status_code == 200
    j = r.json()
    assert j["id"].startswith("gen-") and j["object"] == "chat.completion" and j["provider"] == "Moonshot AI"
    ch = j["choices"][0]
    assert ch["finish_reason"] in ("stop", "length") and ch["native_finish_reason"] == ch["finish_reason"]
    assert ch["message"]["role"] == "assistant" and isinstance(ch["message"]["reasoning"], str)
    assert ch["message"]["reasoning_details"][0]["type"] == "reasoning.text"
    u = j["usage"]
    line = [x for x in emu.ledger_lines() if x["generation_id"] == j["id"]][0]
    assert line["prompt_key"] == stable_id(msgs())
    tok = emu.emulator.tokenizer
    assert line["prompt_ids"] == tok.apply_chat_template(msgs(), add_generation_prompt=True, return_dict=False)
    assert u["prompt_tokens"] == len(line["prompt_ids"])
    assert u["completion_tokens"] == len(line["output_ids"]) <= 60
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    ep = [e for e in default_catalogue() if e.tag == "moonshotai/int4"][0]
    assert u["cost"] == pytest.approx((u["prompt_tokens"] * ep.prompt_price + u["completion_tokens"] * ep.completion_price) / 1e6)
    assert line["cost"] == pytest.approx(u["cost"]) and line["provider"] == "moonshotai"
    # the text returned is exactly the ids served
    full = tok.decode(line["output_ids"])
    reasoning, _, rest = full.partition("</think>")
    assert reasoning == ch["message"]["reasoning"]
    assert rest.replace("<｜end▁of▁sentence｜>", "") == ch["message"]["content"]
    assert u["completion_tokens_details"]["reasoning_tokens"] == len(tok.encode(reasoning, add_special_tokens=False))


def test_stream_sends_comment_chunks_usage_chunk_and_done(emu, client):
    r = client.post("/chat/completions", json=body(stream=True, max_tokens=80,
                                                    provider={"only": ["deepinfra/int4"]}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.startswith(": OPENROUTER PROCESSING\n\n")
    comments, data = sse_events(r.text)
    assert data[-1] == "[DONE]"
    usage_chunk = data[-2]
    assert usage_chunk["usage"]["completion_tokens"] > 0
    chunks = data[:-2]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == usage_chunk["id"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    # the usage chunk's one choice repeats the finish reason, with nothing more to add
    [last] = usage_chunk["choices"]
    assert last["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"] and last["delta"]["content"] == ""
    assert r.headers["X-Generation-Id"] == usage_chunk["id"]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning") or "" for c in chunks)
    content = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    line = [x for x in emu.ledger_lines() if x["generation_id"] == usage_chunk["id"]][0]
    tok = emu.emulator.tokenizer
    assert tok.decode(line["output_ids"]).replace("<｜end▁of▁sentence｜>", "") == reasoning + "</think>" + content \
        or (line["finish_reason"] == "length" and "</think>" not in tok.decode(line["output_ids"]))
    assert usage_chunk["usage"]["completion_tokens"] == len(line["output_ids"])
    assert len(chunks) > 2  # streamed in pieces


def test_missing_or_wrong_key_is_401(emu):
    r = httpx.post(emu.base_url + "/chat/completions", json=body())
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    r = httpx.get(emu.base_url + "/key", headers={"Authorization": "Bearer sk-or-v1-wrong"})
    assert r.status_code == 401 and "message" in r.json()["error"]


@pytest.mark.parametrize("bad, needle", [
    ({"model": "nobody/nothing"}, "not a valid model ID"),
    ({"messages": []}, "messages"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"provider": {"orderr": ["x"]}}, "orderr"),
    ({"provider": {"quantizations": ["int3"]}}, "quantizations"),
    ({"reasoning": {"effort": "huge"}}, "effort"),
])
def test_bad_requests_are_400_with_the_field_named(client, bad, needle):
    r = client.post("/chat/completions", json={**body(), **bad})
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"] and r.json()["error"]["code"] == 400


def test_invalid_json_is_400(client):
    r = client.post("/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400


def test_models_and_endpoints_catalogue(emu, client):
    models = client.get("/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    assert float(models[0]["pricing"]["completion"]) > 0 and "seed" in models[0]["supported_parameters"]
    eps = client.get(f"/models/{MODEL}/endpoints").json()["data"]["endpoints"]
    tags = {e["tag"]: e for e in eps}
    assert {"moonshotai/int4", "fireworks/nvfp4", "baseten/fp4", "atlas-cloud/unknown"} <= set(tags)
    assert tags["baseten/fp4"]["status"] < 0 and tags["moonshotai/int4"]["status"] == 0
    m = tags["moonshotai/int4"]
    assert float(m["pricing"]["prompt"]) == pytest.approx(0.60e-6) and float(m["pricing"]["completion"]) == pytest.approx(2.5e-6)
    for k in ("provider_name", "quantization", "context_length", "max_completion_tokens", "uptime_last_30m",
              "latency_last_30m", "throughput_last_30m", "supported_parameters"):
        assert k in m
    assert m["latency_last_30m"]["p50"] < m["latency_last_30m"]["p99"]
    assert client.get("/models/nobody/nothing/endpoints").status_code == 404


def test_generation_is_404_for_the_delay_then_native_counts(tmp_path):
    # the delay leaves a loaded box time for the first ask
    with running({**QUIET, "generation_delay_s": 3.0}, state_dir=tmp_path) as emu:
        c = httpx.Client(base_url=emu.base_url, headers=emu.key.header())
        j = c.post("/chat/completions", json=body()).json()
        r = c.get("/generation", params={"id": j["id"]})
        assert r.status_code == 404 and r.json()["error"]["code"] == 404
        import time

        time.sleep(3.1)  # the delay runs from the ledger line, written before the answer came
        g = c.get("/generation", params={"id": j["id"]}).json()["data"]
        assert g["id"] == j["id"] and g["total_cost"] == pytest.approx(j["usage"]["cost"])
        assert g["native_tokens_completion"] == j["usage"]["completion_tokens"]
        assert g["native_tokens_prompt"] == j["usage"]["prompt_tokens"]
        assert g["provider_name"] == j["provider"]
        assert c.get("/generation", params={"id": "gen-nope"}).status_code == 404


# ---- routing ------------------------------------------------------------------------------------

def _served_by(client, **provider):
    r = client.post("/chat/completions", json=body(max_tokens=5, provider=provider))
    return r.status_code, (r.json().get("provider") if r.status_code == 200 else r.json()["error"]["message"])


def test_routing_order_without_fallbacks_pins_the_endpoint(client):
    assert _served_by(client, order=["novita"], allow_fallbacks=False) == (200, "Novita")
    assert _served_by(client, order=["deepinfra/fp4"], allow_fallbacks=False) == (200, "DeepInfra")


def test_routing_filters(emu, client):
    seen = Counter(_served_by(client, quantizations=["fp4"])[1] for _ in range(30))
    assert set(seen) <= {"DeepInfra", "Fireworks"}  # fp4 covers nvfp4; baseten/fp4 is down
    assert "Fireworks" in seen
    seen = Counter(_served_by(client, quantizations=["int4"], ignore=["chutes", "deepinfra"])[1] for _ in range(30))
    assert seen and not set(seen) & {"Chutes", "DeepInfra", "Fireworks", "AtlasCloud", "GMICloud", "BaseTen"}
    seen = Counter(_served_by(client, only=["parasail", "together"])[1] for _ in range(20))
    assert set(seen) <= {"Parasail", "Together"}
    assert _served_by(client, sort="price", quantizations=["int4"]) == (200, "Chutes")
    assert _served_by(client, sort="throughput") == (200, "Fireworks")
    seen = {_served_by(client, max_price={"completion": 2.0})[1] for _ in range(15)}
    assert seen <= {"Chutes", "DeepInfra", "GMICloud"}
    # deepinfra (base slug) names both its endpoints, deepinfra/int4 only one
    assert {_served_by(client, only=["deepinfra/int4"])[1] for _ in range(5)} == {"DeepInfra"}
    lines = emu.ledger_lines()
    assert {x["endpoint"] for x in lines if x["provider"] == "deepinfra"} <= {"deepinfra/int4", "deepinfra/fp4"}


def test_default_routing_skips_down_and_prefers_cheap(client):
    seen = Counter(_served_by(client)[1] for _ in range(120))
    assert "BaseTen" not in seen
    assert seen["Chutes"] > seen["Moonshot AI"]  # weight 1/price^2


def test_nothing_matches_is_404_and_pinned_down_provider_fails(client):
    status, msg = _served_by(client, quantizations=["bf16"])
    assert status == 404 and msg == "No allowed providers are available for the selected model."
    assert _served_by(client, only=["nobody"])[0] == 404
    r = client.post("/chat/completions", json=body(provider={"order": ["baseten"], "allow_fallbacks": False}))
    assert r.status_code == 503 and r.json()["error"]["metadata"]["provider_name"] == "BaseTen"
    # with fallbacks the next endpoint serves silently
    assert _served_by(client, order=["baseten", "novita"])[1] == "Novita"


def test_context_length_exceeded_is_400(client):
    r = client.post("/chat/completions", json=body(max_tokens=300000))
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]


def test_pre_first_token_failure_falls_back_silently(tmp_path):
    cfg = {"generation_delay_s": 0, "providers": [
        {"slug": "a", "name": "A", "quantization": "int4", "prompt_price": 0.5, "completion_price": 2,
         "faults": {"bad_gateway": 1.0}},
        {"slug": "b", "name": "B", "quantization": "int4", "prompt_price": 0.6, "completion_price": 2.5}]}
    with running(cfg, state_dir=tmp_path) as emu:
        c = httpx.Client(base_url=emu.base_url, headers=emu.key.header())
        r = c.post("/chat/completions", json=body(provider={"order": ["a", "b"]}))
        assert r.status_code == 200 and r.json()["provider"] == "B"
        line = emu.ledger_lines()[-1]
        assert [a["provider"] for a in line["attempts"]] == ["a/int4", "b/int4"]
        assert line["attempts"][0]["status"] == 502
        r = c.post("/chat/completions", json=body(provider={"order": ["a"], "allow_fallbacks": False}))
        assert r.status_code == 502
        err = r.json()["error"]
        assert err["message"] == "Provider returned error" and err["metadata"]["provider_name"] == "A"
        assert "raw" in err["metadata"] and emu.ledger_lines()[-1]["cost"] == 0


def test_capacity_overflow_is_upstream_429_with_retry_after(tmp_path):
    cfg = {**QUIET, "time_scale": 1.0, "providers": [
        {"slug": "a", "name": "A", "quantization": "int4", "prompt_price": 0.5, "completion_price": 2,
         "capacity": 2, "retry_after_s": 3, "latency_s": {"median": 2.0, "sigma": 0.01}}]}

    with running(cfg, state_dir=tmp_path) as emu:
        results = post_at_once(emu, 5, max_tokens=3)
    statuses = Counter(s for s, _, _ in results)
    assert statuses == {200: 2, 429: 3}
    for status, headers, j in results:
        if status == 429:
            assert headers["Retry-After"] == "3" and j["error"]["metadata"]["retry_after_seconds"] == 3


def test_capacities_shrink_a_provider_and_the_overflow_falls_back_silently(tmp_path):
    slow = {"latency_s": {"median": 2.0, "sigma": 0.01}}
    cfg = {**QUIET, "time_scale": 1.0, "capacities": {"a/int4": 1}, "providers": [
        {"slug": "a", "name": "A", "quantization": "int4", "prompt_price": 0.5, "completion_price": 2, **slow},
        {"slug": "b", "name": "B", "quantization": "int4", "prompt_price": 0.6, "completion_price": 2.5, **slow}]}
    with running(cfg, state_dir=tmp_path) as emu:
        results = post_at_once(emu, 5, max_tokens=3, provider={"order": ["a", "b"]})
        lines = emu.ledger_lines()
    assert Counter((s, j["provider"]) for s, _, j in results) == {(200, "A"): 1, (200, "B"): 4}
    overflow = [line["attempts"] for line in lines if line["attempts"][-1]["provider"] == "b/int4"]
    assert len(overflow) == 4 and all(a[0] == {"provider": "a/int4", "status": 429, "reason": "capacity"}
                                      for a in overflow)


def test_capacities_must_name_an_endpoint(tmp_path):
    bad = tmp_path / "emulator.yaml"
    bad.write_text("capacities: {parasail/fp8: 3}\n")
    with pytest.raises(ValueError, match=r"emulator.yaml: capacities: no endpoint tagged parasail/fp8 .*parasail/int4"):
        load_config(bad)
    with pytest.raises(ValueError, match=r"capacities.parasail/int4: .*greater than or equal to 1"):
        load_config({"capacities": {"parasail/int4": 0}})
    assert {e.tag: e.capacity for e in load_config({"capacities": {"parasail/int4": 3}, "capacity_scale": 2}
                                                   ).endpoints()}["parasail/int4"] == 6


# ---- credits and ledger -------------------------------------------------------------------------

def test_key_and_credits_reflect_spend_and_survive_restart(tmp_path):
    with running({**QUIET, "credits": 2.0}, state_dir=tmp_path) as emu:
        c = httpx.Client(base_url=emu.base_url, headers=emu.key.header())
        costs = [c.post("/chat/completions", json=body(text=f"q{i}")).json()["usage"]["cost"] for i in range(5)]
        k = c.get("/key").json()["data"]
        assert k["usage"] == pytest.approx(sum(costs)) and k["limit"] == 2.0
        assert k["limit_remaining"] == pytest.approx(2.0 - sum(costs))
        cr = c.get("/credits").json()["data"]
        assert cr["total_credits"] == 2.0 and cr["total_usage"] == pytest.approx(sum(costs))
        assert sum(x["cost"] for x in read_ledger(tmp_path)) == pytest.approx(sum(costs))
    # a second emulator on the same state dir (config credits ignored: the account exists) sees it all
    with running({**QUIET, "credits": 99.0, "key_capped": False, "credits_need_management_key": True},
                 state_dir=tmp_path) as emu:
        c = httpx.Client(base_url=emu.base_url, headers=emu.key.header())
        k = c.get("/key").json()["data"]
        assert k["limit"] is None and k["limit_remaining"] is None and k["usage"] == pytest.approx(sum(costs))
        assert c.get("/credits").status_code == 403


def test_402_when_max_tokens_exceed_what_the_balance_affords_then_top_up(tmp_path):
    ep = {"slug": "a", "name": "A", "quantization": "int4", "prompt_price": 1.0, "completion_price": 10.0}
    with running({**QUIET, "credits": 0.001, "providers": [ep], "admin_key": "adm"}, state_dir=tmp_path) as emu:
        c = httpx.Client(base_url=emu.base_url, headers=emu.key.header())
        prompt_tokens = len(emu.emulator.chat.prompt_ids(msgs(), True))
        r = c.post("/chat/completions", json=body(max_tokens=1000))
        assert r.status_code == 402
        afford = math.floor((0.001 - prompt_tokens * 1e-6) / 1e-5)
        assert r.json()["error"]["message"] == (
            "This request requires more credits, or fewer max_tokens. You requested up to 1000 tokens, but can only "
            f"afford {afford}. To increase, visit https://openrouter.ai/settings/credits and add more credits")
        assert c.post("/chat/completions", json=body(max_tokens=afford)).status_code == 200
        assert emu.ledger_lines() and len(emu.ledger_lines()) == 1  # the 402 never reached a provider
        # top up through the admin endpoint (wrong admin key refused), and offline
        assert httpx.post(emu.base_url + "/admin/topup", json={"amount": 1}, headers={"Authorization": "Bearer x"}).status_code == 401
        r = httpx.post(emu.base_url + "/admin/topup", json={"amount": 0.02}, headers={"Authorization": "Bearer adm"})
        assert r.status_code == 200 and r.json()["data"]["total_credits"] == pytest.approx(0.021)
        assert c.post("/chat/completions", json=body(max_tokens=1000)).status_code == 200
        top_up(tmp_path, 5.0)  # another process could do this; the running server sees it
        assert c.get("/credits").json()["data"]["total_credits"] == pytest.approx(5.021)


def test_in_flight_budget_402_is_distinguishable_and_retryable(tmp_path):
    ep = {"slug": "a", "name": "A", "quantization": "int4", "prompt_price": 1.0, "completion_price": 10.0,
          "latency_s": {"median": 0.5, "sigma": 0.01}, "tokens_per_s": {"median": 10000, "sigma": 0.01}}
    cfg = {**QUIET, "credits": 0.05, "providers": [ep], "time_scale": 1.0, "in_flight_budget": 0.5}

    with running(cfg, state_dir=tmp_path) as emu:
        results = post_at_once(emu, 4, max_tokens=1000)
        # each request reserves ~$0.01 of a $0.025 budget: two fit, two are refused
        assert Counter(s for s, _, _ in results) == {200: 2, 402: 2}
        for s, h, j in results:
            if s == 402:
                meta = j["error"]["metadata"]
                assert meta["limit_source"] == "openrouter_in_flight_budget" and h["Retry-After"] == "1"
        c = httpx.Client(base_url=emu.base_url, headers=emu.key.header())
        r = c.post("/chat/completions", json=body(max_tokens=3000))
        assert r.status_code == 402 and r.json()["error"]["metadata"]["code"] == "weight_exceeds_budget"


# ---- faults -------------------------------------------------------------------------------------

FAULTS = {"rate_limit": 0.1, "bad_gateway": 0.05, "unavailable": 0.05, "timeout": 0.05, "overloaded": 0.05,
          "error_200": 0.05, "mid_stream": 0.05, "empty_200": 0.05}
ONE = [{"slug": "a", "name": "A", "quantization": "int4", "prompt_price": 0.5, "completion_price": 2,
        "faults": FAULTS, "retry_after_s": 2}]


def _classify(status: int, j: dict) -> str:
    if status != 200:
        return str(status)
    if "error" in j and not j.get("choices"):
        return "error_200"
    ch = j["choices"][0]
    if ch["finish_reason"] == "error":
        return "mid_stream"
    if ch["finish_reason"] is None and ch["message"]["content"] == "":
        return "empty_200"
    return "ok"


async def _fire(url, headers, n, concurrency, stream=False):
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(headers=headers) as s:
        async def one(i):
            async with sem, s.post(url + "/chat/completions", json=body(text=f"prompt {i}", max_tokens=20,
                                                                         stream=stream)) as r:
                raw = await r.text()
                return i, r.status, raw
        return await asyncio.gather(*[one(i) for i in range(n)])


def test_seeded_fault_rates_match_config_and_do_not_depend_on_arrival_order(tmp_path):
    n = 600
    with running({"providers": ONE, "seed": 7, "generation_delay_s": 0}, state_dir=tmp_path / "a") as emu:
        seq = asyncio.run(_fire(emu.base_url, emu.key.header(), n, 1))
    with running({"providers": ONE, "seed": 7, "generation_delay_s": 0}, state_dir=tmp_path / "b") as emu:
        conc = asyncio.run(_fire(emu.base_url, emu.key.header(), n, 64))
        lines = emu.ledger_lines()
    kinds_seq = {i: _classify(s, json.loads(raw)) for i, s, raw in seq}
    kinds_conc = {i: _classify(s, json.loads(raw)) for i, s, raw in conc}
    assert kinds_seq == kinds_conc  # same faults whatever the order of arrival
    got = Counter(kinds_seq.values())
    expect = {"429": 0.1, "502": 0.05, "503": 0.05, "524": 0.05, "529": 0.05, "error_200": 0.05,
              "mid_stream": 0.05, "empty_200": 0.05}
    for kind, rate in expect.items():
        sd = math.sqrt(n * rate * (1 - rate))
        assert abs(got[kind] - n * rate) < 4 * sd, (kind, got)
    assert got["ok"] == pytest.approx(n * 0.55, abs=4 * math.sqrt(n * 0.25))
    # faults are never billed; the rest is
    assert all((x["cost"] == 0) == (x["error"] is not None) for x in lines)
    # a 429 from this provider carries Retry-After
    r429 = [raw for i, s, raw in seq if s == 429]
    assert json.loads(r429[0])["error"]["metadata"]["retry_after_seconds"] == 2


def test_faults_inside_streams(tmp_path):
    faults = {"error_200": 0.2, "mid_stream": 0.2, "empty_200": 0.2}
    prov = [{**ONE[0], "faults": faults}]
    with running({"providers": prov, "seed": 3, "generation_delay_s": 0}, state_dir=tmp_path) as emu:
        res = asyncio.run(_fire(emu.base_url, emu.key.header(), 80, 16, stream=True))
        lines = {x["generation_id"]: x for x in emu.ledger_lines()}
    seen = Counter()
    for _, status, raw in res:
        assert status == 200 and raw.startswith(": OPENROUTER PROCESSING")
        _, data = sse_events(raw)
        gen = next(d["id"] for d in data if isinstance(d, dict))
        kind = lines[gen]["error"] or "ok"
        seen[kind] += 1
        if kind in ("error_200", "mid_stream"):
            assert data[-1] != "[DONE]" and "error" in data[-1]
            assert data[-1]["choices"][0]["finish_reason"] == "error"
            assert data[-1]["error"]["metadata"]["error_type"] == "provider_unavailable"
            if kind == "mid_stream":
                assert any(c["choices"][0]["delta"].get("reasoning") or c["choices"][0]["delta"]["content"]
                           for c in data)
        elif kind == "empty_200":
            assert data[-1] == "[DONE]" and data[-2]["usage"]["cost"] == 0
            assert all(not c["choices"] for c in data[:-2]) and data[-2]["choices"][0]["finish_reason"] is None
        else:
            assert data[-1] == "[DONE]" and data[-2]["usage"]["cost"] > 0
    assert set(seen) == {"ok", "error_200", "mid_stream", "empty_200"}


def test_hung_connection_sends_headers_then_silence_and_is_billed(tmp_path):
    """The provider generated the response: it is billed, and the generation id sent with the
    headers finds its cost on /generation although the body never came."""
    prov = [{**ONE[0], "faults": {"hang": 1.0}}]
    with running({"providers": prov, "hang_s": 3.0, "generation_delay_s": 0}, state_dir=tmp_path) as emu:
        c = httpx.Client(base_url=emu.base_url, headers=emu.key.header())
        for stream in (False, True):
            with c.stream("POST", "/chat/completions", json=body(stream=stream), timeout=1.5) as r:
                assert r.status_code == 200
                gen_id = r.headers["X-Generation-Id"]
                with pytest.raises(httpx.ReadTimeout):
                    for chunk in r.iter_bytes():
                        assert not chunk.strip(b": OPENROUTER PROCESSING\n")  # no data, at most the comment
            [line] = wait_until(lambda: [x for x in emu.ledger_lines() if x["generation_id"] == gen_id],
                                what=f"the ledger line of hung {gen_id}")
            assert line["error"] == "hang" and line["billed"]
            assert line["cost"] == pytest.approx((line["prompt_tokens"] * 0.5 + line["completion_tokens"] * 2) / 1e6)
            assert line["cost"] > 0 and not line["cancelled"]
            g = c.get("/generation", params={"id": gen_id}).json()["data"]
            assert g["total_cost"] == pytest.approx(line["cost"]) and g["native_tokens_completion"] > 0
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            c.post("/chat/completions", json=body(), timeout=15)  # closed after hang_s, body unfinished


def test_slow_json_response_is_padded_with_whitespace(tmp_path):
    prov = [{**ONE[0], "faults": {}, "latency_s": {"median": 0.5, "sigma": 0.01}}]
    with running({"providers": prov, "time_scale": 1.0, "padding_interval_s": 0.1}, state_dir=tmp_path) as emu:
        r = httpx.post(emu.base_url + "/chat/completions", json=body(max_tokens=5), headers=emu.key.header())
    assert r.status_code == 200 and r.content[:1] == b"\n" and r.content.lstrip()[:1] == b"{"
    assert json.loads(r.content)["choices"][0]["message"]


def test_paced_stream_repeats_processing_comments_while_waiting(tmp_path):
    prov = [{**ONE[0], "faults": {}, "latency_s": {"median": 1.0, "sigma": 0.01}}]
    with running({"providers": prov, "time_scale": 1.0, "padding_interval_s": 0.1}, state_dir=tmp_path) as emu:
        r = httpx.post(emu.base_url + "/chat/completions", json=body(max_tokens=5, stream=True),
                       headers=emu.key.header())
    comments, data = sse_events(r.text)
    assert len(comments) >= 3 and data[-1] == "[DONE]"


def test_cancelled_stream_is_billed_up_to_where_it_stopped(tmp_path):
    prov = [{**ONE[0], "faults": {}, "latency_s": {"median": 0.05, "sigma": 0.01},
             "tokens_per_s": {"median": 100, "sigma": 0.01}}]
    with running({"providers": prov, "time_scale": 1.0, "stream_interval_s": 0.05, "synthetic_tokens": 2000},
                 state_dir=tmp_path) as emu:
        with httpx.Client(base_url=emu.base_url, headers=emu.key.header()) as c:
            with c.stream("POST", "/chat/completions", json=body(max_tokens=2000, stream=True)) as r:
                got = 0
                for line in r.iter_lines():
                    got += line.startswith("data: ")
                    if got >= 3:
                        break
        lines = wait_until(emu.ledger_lines, what="the ledger line of the stream the client closed")
    line = lines[-1]
    assert line["cancelled"] is True and line["billed"] is True
    assert 0 < len(line["output_ids"]) < 1000 and line["completion_tokens"] == len(line["output_ids"])
    assert line["cost"] == pytest.approx((line["prompt_tokens"] * 0.5 + line["completion_tokens"] * 2) / 1e6)


# ---- quirks (synthetic backend) -----------------------------------------------------------------

def _one_from(client, slug, **kw):
    r = client.post("/chat/completions", json=body(provider={"order": [slug], "allow_fallbacks": False}, **kw))
    assert r.status_code == 200
    return r.json()


def test_quirky_providers_change_text_or_billing_but_not_the_ids_served(emu, client):
    tok = emu.emulator.tokenizer

    def ledger(j):
        return [x for x in emu.ledger_lines() if x["generation_id"] == j["id"]][0]

    # other billing tokenizer: both counts differ from the served ids, cost follows the billed counts
    j = _one_from(client, "novita", max_tokens=200, text="Contrast heteroscedasticity with antidisestablishmentarianism.")
    line = ledger(j)
    assert j["usage"]["completion_tokens"] > len(line["output_ids"]) and j["usage"]["prompt_tokens"] > line["true_prompt_tokens"]
    # stripped whitespace: where the served content opens with a blank line, the returned one does not
    for i in range(16):
        j = _one_from(client, "parasail", max_tokens=300, text=f"strip {i}")
        line = ledger(j)
        full = tok.decode(line["output_ids"])
        served = full.split("</think>", 1)[1].replace("<｜end▁of▁sentence｜>", "") if "</think>" in full else ""
        if served.startswith("\n\n"):
            assert j["choices"][0]["message"]["content"] == served.strip()
            break
    else:
        pytest.fail("no parasail response served content opening with a blank line")
    # non-canonical splits (1% of tokens): the text re-tokenizes to fewer ids than were served and billed
    for i in range(6):
        j = _one_from(client, "together", max_tokens=400, text=f"long answer please {i}")
        line = ledger(j)
        assert len(line["output_ids"]) == j["usage"]["completion_tokens"]
        if len(tok.encode(tok.decode(line["output_ids"]), add_special_tokens=False)) < len(line["output_ids"]):
            break
    else:
        pytest.fail("no non-canonical split in 6 answers of ~400 tokens")
    # truncated / dropped reasoning: billed reasoning tokens stay those served
    modes = Counter()
    for i in range(80):
        j = _one_from(client, "siliconflow", max_tokens=200, text=f"reason {i}")
        line = ledger(j)
        served_reasoning = tok.decode(line["output_ids"]).split("</think>")[0]
        got = j["choices"][0]["message"]["reasoning"]
        assert j["usage"]["completion_tokens_details"]["reasoning_tokens"] == line["true_reasoning_tokens"]
        modes["dropped" if got is None else "truncated" if got != served_reasoning else "full"] += 1
        if got and got != served_reasoning:
            assert served_reasoning.startswith(got) and len(got) == TRUNCATE_CHARS
    assert modes["dropped"] and modes["truncated"] and modes["full"]


def test_an_endpoints_reasoning_quirks_come_at_their_rates_in_any_run_of_its_responses(tmp_path):
    # SiliconFlow drops 10% and cuts 20% of its reasoning: 50 responses sent at once, in whatever
    # order they arrive, carry 5 and 10 of them, give or take two (independent draws miss that about
    # half the time)
    with running(QUIET, state_dir=tmp_path) as emu:
        replies = post_at_once(emu, 50, max_tokens=40, provider={"order": ["siliconflow"], "allow_fallbacks": False})
        lines = emu.ledger_lines()
    assert [s for s, _, _ in replies] == [200] * 50
    quirks = Counter(q for x in lines for q in x["quirks"])
    assert len(lines) == 50 and 3 <= quirks["reasoning_dropped"] <= 7 and 8 <= quirks["reasoning_truncated"] <= 12, quirks


def test_reasoning_exclude_and_disable(emu, client):
    j = _one_from(client, "moonshotai", reasoning={"exclude": True})
    assert j["choices"][0]["message"]["reasoning"] is None
    assert j["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    j = _one_from(client, "moonshotai", reasoning={"enabled": False}, max_tokens=200)
    assert j["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    line = [x for x in emu.ledger_lines() if x["generation_id"] == j["id"]][0]
    assert emu.emulator.vocab.end_think not in line["output_ids"]
    j = _one_from(client, "moonshotai", reasoning={"max_tokens": 5}, max_tokens=200)
    assert j["usage"]["completion_tokens_details"]["reasoning_tokens"] <= 5


def test_temperature_zero_is_deterministic_and_identical_across_clean_providers(client):
    a = _one_from(client, "moonshotai", temperature=0)["choices"][0]["message"]
    b = _one_from(client, "deepinfra", temperature=0)["choices"][0]["message"]
    assert (a["reasoning"], a["content"]) == (b["reasoning"], b["content"])
    s1 = _one_from(client, "moonshotai", seed=5)["choices"][0]["message"]["reasoning"]
    s2 = _one_from(client, "moonshotai", seed=5)["choices"][0]["message"]["reasoning"]
    s3 = _one_from(client, "moonshotai", seed=6)["choices"][0]["message"]["reasoning"]
    assert s1 == s2 != s3


def test_synthetic_text_is_canonical(emu):
    from draftsmith.emulator.backends import Job

    be, tok, v = emu.emulator.backend, emu.emulator.tokenizer, emu.emulator.vocab
    for k in range(200):
        ids, texts = be.tokens(Job(prompt_ids=[0, 128821], max_tokens=[37, 150, 600][k % 3], key=str(k)))
        assert "".join(texts) == tok.decode(ids).replace("</think>", "").replace("<｜end▁of▁sentence｜>", "")
        text = tok.decode(ids)
        parts = text.replace("<｜end▁of▁sentence｜>", "").split("</think>")
        rebuilt = []
        for n, part in enumerate(parts):
            rebuilt += ([v.end_think] if n else []) + tok.encode(part, add_special_tokens=False)
        assert rebuilt + ([v.eos] if ids[-1] == v.eos else []) == ids


def test_require_parameters_and_data_collection_filter_endpoints(tmp_path):
    base = {"quantization": "int4", "prompt_price": 0.5, "completion_price": 2}
    prov = [{"slug": "noseed", "name": "NoSeed", **base, "supported_parameters": ["max_tokens", "temperature"]},
            {"slug": "keeps", "name": "Keeps", **base, "prompt_price": 0.6, "data_collection": "allow"}]
    with running({**QUIET, "providers": prov}, state_dir=tmp_path) as emu:
        c = httpx.Client(base_url=emu.base_url, headers=emu.key.header())
        r = c.post("/chat/completions", json=body(seed=1, provider={"require_parameters": True}))
        assert r.status_code == 200 and r.json()["provider"] == "Keeps"
        r = c.post("/chat/completions", json=body(seed=1, provider={"require_parameters": True, "data_collection": "deny"}))
        assert r.status_code == 404
        # without require_parameters the seed is silently dropped by the endpoint that lacks it
        texts = {c.post("/chat/completions", json=body(seed=1, provider={"data_collection": "deny"})).json()
                 ["choices"][0]["message"]["reasoning"] for _ in range(3)}
        assert len(texts) == 3
        texts = {c.post("/chat/completions", json=body(seed=1, provider={"only": ["keeps"]})).json()
                 ["choices"][0]["message"]["reasoning"] for _ in range(3)}
        assert len(texts) == 1


# ---- the router's own faults (availability errors) ----------------------------------------------

def test_router_faults_answer_retryable_404s_and_503s_at_their_rates_and_a_retry_draws_afresh(tmp_path):
    cfg = {**QUIET, "synthetic_tokens": 5, "router_faults": {"temporarily_unavailable": 0.2, "no_endpoints": 0.1}}
    with running(cfg, state_dir=tmp_path) as emu:
        c = httpx.Client(base_url=emu.base_url, headers=emu.key.header(), timeout=60)
        seen = Counter()
        for i in range(200):
            r = c.post("/chat/completions", json=body(text=f"prompt {i}", max_tokens=5))
            a = r.json()["error"]["availability"] if r.status_code != 200 else None
            seen[(r.status_code, a and a["code"], a and a["retryable"])] += 1
        assert set(seen) == {(200, None, None), (503, "temporarily_unavailable", True), (404, "no_endpoints", True)}
        assert 20 <= seen[(503, "temporarily_unavailable", True)] <= 60 and 8 <= seen[(404, "no_endpoints", True)] <= 35
        # the same prompt asked again until it is served: each ask draws anew
        tries = 1
        while c.post("/chat/completions", json=body(text="prompt again", max_tokens=5)).status_code != 200:
            tries += 1
        assert tries < 20


def test_router_faults_are_checked_fields(tmp_path):
    with pytest.raises(ValueError, match="router_faults.outage_code"):
        running({"router_faults": {"outage_code": "sometimes"}}, state_dir=tmp_path).__enter__()


def test_a_stall_keeps_the_connection_alive_then_ends_with_a_524_and_bills_nothing(tmp_path):
    prov = [{**ONE[0], "faults": {"stall": 1.0}}]
    with running({"providers": prov, "stall_s": 0.6, "padding_interval_s": 0.1, "generation_delay_s": 0},
                 state_dir=tmp_path) as emu:
        h = emu.key.header()
        r = httpx.post(emu.base_url + "/chat/completions", json=body(), headers=h, timeout=10)
        assert r.status_code == 200 and r.content[:3] == b"\n\n\n"          # padded, then the error body
        assert json.loads(r.content)["error"]["code"] == 524
        r = httpx.post(emu.base_url + "/chat/completions", json=body(stream=True), headers=h, timeout=10)
        comments, data = sse_events(r.text)
        assert len(comments) >= 4 and data[-1]["error"]["code"] == 524 and data[-1] != "[DONE]"
        lines = emu.ledger_lines()
    assert [(x["error"], x["billed"], x["cost"]) for x in lines] == [("stall", False, 0.0)] * 2


def test_bad_bytes_are_billed_in_full_and_are_not_utf8(tmp_path):
    prov = [{**ONE[0], "faults": {"bad_bytes": 1.0}}]
    with running({"providers": prov, "generation_delay_s": 0}, state_dir=tmp_path) as emu:
        h = emu.key.header()
        for stream in (False, True):
            r = httpx.post(emu.base_url + "/chat/completions", json=body(stream=stream), headers=h, timeout=10)
            assert r.status_code == 200
            with pytest.raises(UnicodeDecodeError):
                r.content.decode("utf-8")
            assert r.content.decode("utf-8", "replace").count("\ufffd") >= 1
        lines = emu.ledger_lines()
    assert [(x["error"], x["billed"]) for x in lines] == [("bad_bytes", True)] * 2 and all(x["cost"] > 0 for x in lines)


@pytest.mark.parametrize("mode,header,cached", [("off", None, False), ("off", "true", True), ("preset", None, True),
                                                ("preset", "false", False), ("always", "false", True)])
def test_the_response_cache_answers_a_repeated_request_with_usage_zeroed(tmp_path, mode, header, cached):
    clean = [{**ONE[0], "faults": {}}]
    with running({"providers": clean, "response_cache": mode, "generation_delay_s": 0}, state_dir=tmp_path) as emu:
        h = {**emu.key.header(), **({"X-OpenRouter-Cache": header} if header else {})}
        first, again = (httpx.post(emu.base_url + "/chat/completions", json=body(temperature=1.0), headers=h,
                                   timeout=10) for _ in range(2))
        stream = httpx.post(emu.base_url + "/chat/completions", json=body(temperature=1.0, stream=True), headers=h,
                            timeout=10)
        lines = emu.ledger_lines()
    a, b = first.json(), again.json()
    assert a["id"] != b["id"] and a["usage"]["completion_tokens"] > 0
    if not cached:
        assert "X-OpenRouter-Cache-Status" not in again.headers or again.headers["X-OpenRouter-Cache-Status"] == "MISS"
        assert all(x["billed"] for x in lines)
        return
    assert first.headers["X-OpenRouter-Cache-Status"] == "MISS" and again.headers["X-OpenRouter-Cache-Status"] == "HIT"
    assert b["choices"][0]["message"] == a["choices"][0]["message"]      # verbatim, whatever the temperature
    assert (b["usage"]["prompt_tokens"], b["usage"]["completion_tokens"], b["usage"]["cost"]) == (0, 0, 0)
    _, data = sse_events(stream.text)
    assert stream.headers["X-OpenRouter-Cache-Status"] == "HIT" and data[-1] == "[DONE]"
    assert "".join(d["choices"][0]["delta"]["content"] for d in data[:-1] if d["choices"]) == \
        a["choices"][0]["message"]["content"] and data[-2]["usage"]["cost"] == 0
    assert [x["error"] for x in lines] == [None, "cache_hit", "cache_hit"] and lines[1]["cost"] == 0
