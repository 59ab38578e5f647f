"""The money side of OpenRouter's contract, as the emulator plays it: what is billed when a
response is lost on the wire, budgets and key limits, routing on supported parameters, prices
with overrides, discounts, request fees and BYOK."""

import calendar

import httpx
import pytest

from draftsmith.emulator import running
from draftsmith.emulator.catalogue import Endpoint, bill, prices, worst_case

from conftest import wait_until

pytestmark = pytest.mark.emulator

MODEL = "moonshotai/kimi-k2.5"


def body(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 60, **kw}


def ep(slug="a", **kw) -> dict:
    return {"slug": slug, "name": slug.upper(), "quantization": "int4", "prompt_price": 0.5, "completion_price": 2.0,
            **kw}


def full_cost(line) -> float:
    return (line["prompt_tokens"] * 0.5 + line["completion_tokens"] * 2.0) / 1e6


def test_cut_non_streamed_response_is_billed_in_full_and_found_by_its_generation_id(tmp_path):
    cfg = {"providers": [ep(faults={"cut_after_billing": 1.0})], "generation_delay_s": 0}
    with running(cfg, state_dir=tmp_path) as emu, httpx.Client(base_url=emu.base_url, headers=emu.key.header()) as c:
        with c.stream("POST", "/chat/completions", json=body()) as r:
            assert r.status_code == 200
            gen_id = r.headers["X-Generation-Id"]
            with pytest.raises(httpx.RemoteProtocolError):
                r.read()
        [line] = emu.ledger_lines()
        assert line["generation_id"] == gen_id and line["billed"] and not line["cancelled"]
        assert line["error"] == "cut_after_billing" and line["cost"] == pytest.approx(full_cost(line))
        assert line["cost"] > 0
        assert len(line["output_ids"]) == line["completion_tokens"] > 1
        g = c.get("/generation", params={"id": gen_id}).json()["data"]
        assert g["total_cost"] == pytest.approx(line["cost"]) and g["tokens_completion"] == line["completion_tokens"]


@pytest.mark.parametrize("cancellable", [True, False])
def test_cut_stream_is_billed_so_far_only_where_the_provider_supports_cancellation(tmp_path, cancellable):
    cfg = {"providers": [ep(faults={"cut_after_billing": 1.0}, supports_cancellation=cancellable)],
           "synthetic_tokens": 400, "generation_delay_s": 0}
    with running(cfg, state_dir=tmp_path) as emu, httpx.Client(base_url=emu.base_url, headers=emu.key.header()) as c:
        seen = 0
        with c.stream("POST", "/chat/completions", json=body(stream=True, max_tokens=400, seed=3)) as r:
            gen_id = r.headers["X-Generation-Id"]
            with pytest.raises(httpx.RemoteProtocolError):
                for line in r.iter_lines():
                    assert line != "data: [DONE]"
                    seen += line.startswith("data: ")
        assert seen >= 1
        # the client has the cut at once; the emulator bills when the provider stops (or finishes)
        [line] = wait_until(emu.ledger_lines, what="the ledger line of the cut stream")
        assert line["generation_id"] == gen_id and line["billed"] and line["cancelled"] is cancellable
        assert line["cost"] == pytest.approx(full_cost(line))
        # cut within the first 64 tokens: a cancelled stream stops there, the other runs to its end
        assert (len(line["output_ids"]) <= 64) is cancellable, len(line["output_ids"])


def test_a_client_closing_a_stream_pays_the_whole_response_without_cancellation(tmp_path):
    cfg = {"providers": [ep(supports_cancellation=False, latency_s={"median": 0.05, "sigma": 0.01},
                            tokens_per_s={"median": 400, "sigma": 0.01})],
           "time_scale": 1.0, "stream_interval_s": 0.05, "synthetic_tokens": 300, "fault_scale": 0}
    with running(cfg, state_dir=tmp_path) as emu, httpx.Client(base_url=emu.base_url, headers=emu.key.header()) as c:
        with c.stream("POST", "/chat/completions", json=body(stream=True, max_tokens=300)) as r:
            for n, line in enumerate(r.iter_lines()):
                if n >= 3:
                    break
        [line] = wait_until(emu.ledger_lines, what="the ledger line of the stream the client closed")
    assert line["billed"] and not line["cancelled"] and line["error"] is None
    assert line["cost"] == pytest.approx(full_cost(line)) and line["finish_reason"] in ("stop", "length")


def test_key_budget_shows_on_key_and_refuses_with_403_once_spent(tmp_path):
    cfg = {"providers": [ep()], "key_budget_usd": 0.0004, "fault_scale": 0}
    with running(cfg, state_dir=tmp_path) as emu, httpx.Client(base_url=emu.base_url, headers=emu.key.header()) as c:
        k = c.get("/key").json()["data"]
        assert k["limit"] == 0.0004 and k["limit_remaining"] == 0.0004
        assert k["effective_budget"]["scope"] == "key_limit" and k["budgets"] == [k["effective_budget"]]
        statuses = [c.post("/chat/completions", json=body(max_tokens=20)).status_code for _ in range(12)]
        assert statuses[0] == 200 and statuses[-1] == 403
        r = c.post("/chat/completions", json=body(max_tokens=20))
        meta = r.json()["error"]["metadata"]
        assert meta["limit_source"] == "openrouter_key_limit" and meta["spend_usd"] >= 0.0004
        k = c.get("/key").json()["data"]
        assert k["limit_remaining"] == 0 and k["effective_budget"]["spend_usd"] == pytest.approx(
            sum(x["cost"] for x in emu.ledger_lines()))
        # a request alone above the whole limit can never pass: weight_exceeds_budget, not "wait"
    with running({**cfg, "key_budget_usd": 0.01}, state_dir=tmp_path / "b") as emu:
        r = httpx.post(emu.base_url + "/chat/completions", json=body(max_tokens=6000), headers=emu.key.header())
        assert r.status_code == 402 and r.json()["error"]["metadata"]["reason"] == "weight_exceeds_budget"


def test_forbidden_key_gets_403_on_every_request(tmp_path):
    with running({"providers": [ep()], "key_forbidden": True}, state_dir=tmp_path) as emu:
        r = httpx.post(emu.base_url + "/chat/completions", json=body(), headers=emu.key.header())
        assert r.status_code == 403 and r.json()["error"]["metadata"]["error_type"] == "permission_denied"
        assert emu.ledger_lines() == []


def test_require_parameters_skips_endpoints_without_seed(tmp_path):
    no_seed = ["max_tokens", "temperature", "top_p", "stop", "reasoning", "include_reasoning"]
    providers = [ep("a", supported_parameters=no_seed), ep("b", prompt_price=0.6)]
    with running({"providers": providers, "fault_scale": 0}, state_dir=tmp_path) as emu, \
            httpx.Client(base_url=emu.base_url, headers=emu.key.header()) as c:
        strict = {"require_parameters": True}
        served = {c.post("/chat/completions", json=body(seed=3, provider=strict)).json()["provider"] for _ in range(12)}
        assert served == {"B"}
        # without seed, or without require_parameters, A serves too (the seed then silently dropped)
        assert "A" in {c.post("/chat/completions", json=body(provider=strict)).json()["provider"] for _ in range(12)}
        assert "A" in {c.post("/chat/completions", json=body(seed=3)).json()["provider"] for _ in range(12)}
        r = c.post("/chat/completions", json=body(seed=3, provider={**strict, "only": ["a"]}))
        assert r.status_code == 404 and "requested parameters" in r.json()["error"]["message"]


def test_documented_provider_fields_are_accepted_and_unknown_ones_rejected(tmp_path):
    providers = [ep("slow", tokens_per_s={"median": 10}, latency_s={"median": 3.0}),
                 ep("fast", prompt_price=0.9, tokens_per_s={"median": 90}, latency_s={"median": 0.3})]
    with running({"providers": providers, "fault_scale": 0}, state_dir=tmp_path) as emu, \
            httpx.Client(base_url=emu.base_url, headers=emu.key.header()) as c:
        def served(provider, **kw):
            r = c.post("/chat/completions", json=body(provider=provider, **kw))
            assert r.status_code == 200, r.text
            return r.json()["provider"]

        assert served({"sort": {"by": "throughput", "partition": "none"}}) == "FAST"
        assert served({"sort": {"by": "price"}}) == "SLOW"
        assert served({"preferred_min_throughput": 50}) == "FAST"
        assert served({"preferred_max_latency": {"p90": 1.0}}) == "FAST"
        assert served({"zdr": True, "enforce_distillable_text": False, "sort": "price"}, reasoning={"summary": "auto"}) \
            == "SLOW"
        assert c.post("/chat/completions", json=body(provider={"zdr": True, "fastest": True})).status_code == 400
        assert c.post("/chat/completions", json=body(reasoning={"summary": "verbose"})).status_code == 400


def test_prices_apply_overrides_discount_reasoning_price_and_request_fee():
    e = Endpoint(**ep(discount=0.5, request_price=0.001, internal_reasoning_price=4.0,
                      price_overrides=[{"min_prompt_tokens": 1000, "prompt_price": 1.0, "completion_price": 3.0},
                                       {"utc_days": ["monday"], "utc_start": 2300, "utc_end": 100,
                                        "completion_price": 1.0}]))
    tuesday_noon = calendar.timegm((2026, 3, 3, 12, 0, 0))
    monday_late, tuesday_early = calendar.timegm((2026, 3, 2, 23, 30, 0)), calendar.timegm((2026, 3, 3, 0, 30, 0))
    p = prices(e, 1000, tuesday_noon)  # "more than 1000 prompt tokens": not yet
    assert (p.prompt, p.completion, p.reasoning, p.request) == (0.25, 1.0, 2.0, 0.001)
    p = prices(e, 1001, tuesday_noon)
    assert (p.prompt, p.completion, p.reasoning) == (0.5, 1.5, 2.0)
    assert prices(e, 10, monday_late).completion == 0.5 and prices(e, 10, tuesday_early).completion == 1.0
    assert prices(e, 10, calendar.timegm((2026, 3, 2, 22, 0, 0))).completion == 1.0  # monday, outside the window
    # the later matching entry wins per price
    assert prices(e, 2000, monday_late).completion == 0.5 and prices(e, 2000, monday_late).prompt == 0.5
    p = prices(e, 2000, tuesday_noon)
    assert bill(p, 2000, 100, 40) == pytest.approx((2000 * 0.5e-6, (60 * 1.5 + 40 * 2.0) / 1e6, 0.001))
    assert worst_case(e, 2000, 100, tuesday_noon) == pytest.approx((2000 * 0.5 + 100 * 2.0) / 1e6)


def test_responses_are_billed_at_the_prices_in_force(tmp_path):
    e = ep(discount=0.2, request_price=0.002, internal_reasoning_price=5.0,
           price_overrides=[{"min_prompt_tokens": 5, "prompt_price": 0.7}])
    with running({"providers": [e], "fault_scale": 0}, state_dir=tmp_path) as emu:
        j = httpx.post(emu.base_url + "/chat/completions", json=body(), headers=emu.key.header()).json()
        [line] = emu.ledger_lines()
    u = j["usage"]
    r = u["completion_tokens_details"]["reasoning_tokens"]
    assert u["prompt_tokens"] > 5 and r > 0
    want = (u["prompt_tokens"] * 0.7 + (u["completion_tokens"] - r) * 2.0 + r * 5.0) * 0.8 / 1e6 + 0.002
    assert u["cost"] == pytest.approx(want) and line["cost"] == pytest.approx(want)
    assert u["cost_details"]["upstream_inference_prompt_cost"] == pytest.approx(u["prompt_tokens"] * 0.7 * 0.8 / 1e6)


def test_byok_cost_is_the_fee_and_the_upstream_cost_is_apart(tmp_path):
    cfg = {"providers": [ep()], "fault_scale": 0, "byok": True, "byok_fee_rate": 0.05}
    with running(cfg, state_dir=tmp_path) as emu:
        j = httpx.post(emu.base_url + "/chat/completions", json=body(), headers=emu.key.header()).json()
        [line] = emu.ledger_lines()
        k = httpx.get(emu.base_url + "/key", headers=emu.key.header()).json()["data"]
    u = j["usage"]
    upstream = (u["prompt_tokens"] * 0.5 + u["completion_tokens"] * 2.0) / 1e6
    assert u["is_byok"] and u["cost_details"]["upstream_inference_cost"] == pytest.approx(upstream)
    assert u["cost"] == pytest.approx(0.05 * upstream) and line["cost"] == pytest.approx(u["cost"])
    assert k["usage"] == pytest.approx(u["cost"]) and k["byok_usage"] == pytest.approx(upstream)
