"""Every emulator response, validated by the official OpenRouter SDK's own pydantic models.

The models are generated from OpenRouter's OpenAPI spec, so they judge the emulator rather than
agree with it. Validation is strict: a missing or mistyped field fails, and so does a value
outside one of the SDK's enums (in its default lax mode the SDK would accept any string there).
The emulator may add fields. Success and every error kind, JSON bodies and SSE chunks.
"""

import json
import time

import httpx
import pytest
from openrouter import components, errors, operations

from draftsmith.emulator import running

MODEL = "moonshotai/kimi-k2.5"
# /key still carries two fields the SDK marks deprecated (rate_limit, is_provisioning_key): required, so sent
pytestmark = [pytest.mark.emulator, pytest.mark.filterwarnings("ignore:.*DEPRECATED.*:DeprecationWarning")]

# the SDK's model for each error status of POST /chat/completions (as its chat.send maps them)
ERROR_MODELS = {400: errors.BadRequestResponseErrorData, 401: errors.UnauthorizedResponseErrorData,
                402: errors.PaymentRequiredResponseErrorData, 403: errors.ForbiddenResponseErrorData,
                404: errors.NotFoundResponseErrorData, 429: errors.TooManyRequestsResponseErrorData,
                502: errors.BadGatewayResponseErrorData, 503: errors.ServiceUnavailableResponseErrorData,
                524: errors.EdgeNetworkTimeoutResponseErrorData, 529: errors.ProviderOverloadedResponseErrorData}


def conforms(model, raw):
    """The body parsed by `model` in strict mode (raises pydantic's ValidationError otherwise)."""
    return model.model_validate_json(raw, strict=True)


def error_conforms(r: httpx.Response, status: int):
    assert r.status_code == status, r.text
    return conforms(ERROR_MODELS[status], r.content).error


def chunks(r: httpx.Response) -> list[str]:
    return [line[6:] for line in r.text.split("\n") if line.startswith("data: ") and line != "data: [DONE]"]


def body(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 40, **kw}


def pinned(slug: str, **kw):
    return body(provider={"order": [slug], "allow_fallbacks": False}, **kw)


def _ep(slug: str, name: str, **kw) -> dict:
    return {"slug": slug, "name": name, "quantization": "int4", "prompt_price": 0.5, "completion_price": 2.0, **kw}


# Real provider names (the SDK's ProviderName enum), one per behaviour to show.
PROVIDERS = [
    _ep("deepinfra", "DeepInfra", internal_reasoning_price=3.0, request_price=0.0001, discount=0.1,
        price_overrides=[{"min_prompt_tokens": 100000, "prompt_price": 1.0, "completion_price": 4.0},
                         {"utc_days": ["saturday", "sunday"], "utc_start": 100, "utc_end": 500, "prompt_price": 0.4}]),
    _ep("novita", "Novita", faults={"error_200": 1.0}),
    _ep("parasail", "Parasail", faults={"mid_stream": 1.0}),
    _ep("together", "Together", faults={"empty_200": 1.0}),
    _ep("chutes", "Chutes", faults={"rate_limit": 1.0}, retry_after_s=1),
    _ep("fireworks", "Fireworks", faults={"bad_gateway": 1.0}),
    _ep("gmicloud", "GMICloud", faults={"unavailable": 1.0}),
    _ep("siliconflow", "SiliconFlow", faults={"timeout": 1.0}),
    _ep("atlas-cloud", "AtlasCloud", faults={"overloaded": 1.0}),
    _ep("moonshotai", "Moonshot AI", faults={"cut_after_billing": 1.0}),
    _ep("baseten", "BaseTen", faults={"hang": 1.0}, supports_cancellation=False),
    _ep("nebius", "Nebius", status=-2, supported_parameters=["max_tokens", "temperature"]),
]
CONFIG = {"providers": PROVIDERS, "generation_delay_s": 0.0, "hang_s": 0.3, "credits_need_management_key": False}


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    with running(CONFIG, state_dir=tmp_path_factory.mktemp("emu")) as e:
        yield e


@pytest.fixture(scope="module")
def client(emu):
    with httpx.Client(base_url=emu.base_url, headers=emu.key.header(), timeout=30) as c:
        yield c


def generation(client, gen_id: str):
    r = client.get("/generation", params={"id": gen_id})
    assert r.status_code == 200, r.text
    return conforms(components.GenerationResponse, r.content).data


# ---- chat completions: success ------------------------------------------------------------------

def test_completion_and_its_generation_conform(client):
    r = client.post("/chat/completions", json=pinned("deepinfra"))
    res = conforms(components.ChatResult, r.content)
    assert r.headers["X-Generation-Id"] == res.id and res.choices[0].finish_reason in ("stop", "length")
    assert res.usage.cost > 0 and res.usage.cost_details.upstream_inference_prompt_cost > 0
    g = generation(client, res.id)
    assert g.total_cost == pytest.approx(res.usage.cost) and g.native_tokens_completion == res.usage.completion_tokens


def test_stream_chunks_conform_and_the_usage_chunk_repeats_the_finish_reason(client):
    r = client.post("/chat/completions", json=pinned("deepinfra", stream=True))
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    parsed = [conforms(components.ChatStreamChunk, c) for c in chunks(r)]
    assert len(parsed) > 2 and all(c.id == r.headers["X-Generation-Id"] for c in parsed)
    last = parsed[-1]
    assert last.usage is not None and last.usage.completion_tokens > 0
    assert [c.finish_reason for c in last.choices] == [parsed[-2].choices[0].finish_reason]
    assert last.choices[0].finish_reason in ("stop", "length")


# ---- chat completions: failures inside HTTP 200 ---------------------------------------------------

def test_errors_inside_200_conform(client):
    # an error body with status 200: the error envelope; mid-stream error: a result whose choice ends in error
    r = client.post("/chat/completions", json=pinned("novita"))
    assert r.status_code == 200 and conforms(errors.BadGatewayResponseErrorData, r.content).error.code == 502
    res = conforms(components.ChatResult, client.post("/chat/completions", json=pinned("parasail")).content)
    assert res.choices[0].finish_reason == "error"
    res = conforms(components.ChatResult, client.post("/chat/completions", json=pinned("together")).content)
    assert res.choices[0].finish_reason is None and res.usage.cost == 0
    for slug in ("novita", "parasail"):  # streamed: the last chunk carries a typed error and finish_reason error
        parsed = [conforms(components.ChatStreamChunk, c)
                  for c in chunks(client.post("/chat/completions", json=pinned(slug, stream=True)))]
        err = parsed[-1].error
        assert err is not None and err.metadata is not None and err.metadata.error_type == "provider_unavailable"
        assert parsed[-1].choices[0].finish_reason == "error"
    parsed = [conforms(components.ChatStreamChunk, c)
              for c in chunks(client.post("/chat/completions", json=pinned("together", stream=True)))]
    assert parsed[-1].usage.cost == 0


def test_billed_responses_lost_on_the_wire_have_conforming_generations(emu, client):
    """A cut body and a hung connection: the header's generation id finds a conforming record."""
    for slug, stream in (("moonshotai", False), ("moonshotai", True), ("baseten", False)):
        with client.stream("POST", "/chat/completions", json=pinned(slug, stream=stream), timeout=5) as r:
            gen_id = r.headers["X-Generation-Id"]
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                r.read()
        g = generation(client, gen_id)
        assert g.total_cost > 0 and g.provider_name in ("Moonshot AI", "BaseTen")


# ---- chat completions: error statuses -------------------------------------------------------------

def test_upstream_error_statuses_conform(client):
    for slug, status in (("chutes", 429), ("fireworks", 502), ("gmicloud", 503), ("siliconflow", 524),
                         ("atlas-cloud", 529)):
        err = error_conforms(client.post("/chat/completions", json=pinned(slug)), status)
        assert err.metadata["provider_name"] and err.metadata["error_type"]
    # every endpoint left by the filters is down: no provider meets the routing requirements
    error_conforms(client.post("/chat/completions", json=body(provider={"only": ["nebius"]})), 503)  # pinned
    err = error_conforms(client.post("/chat/completions", json=body(provider={"ignore": [p["slug"] for p in
                                                                                       PROVIDERS[:-1]]})), 503)
    assert err.metadata["error_type"] == "provider_unavailable"


def test_request_and_routing_errors_conform(emu, client):
    r = client.post("/chat/completions", content=b"{oops", headers={"Content-Type": "application/json"})
    error_conforms(r, 400)
    error_conforms(client.post("/chat/completions", json=body(max_tokens=10**6)), 400)
    error_conforms(client.post("/chat/completions", json=body(provider={"sort": "cheapest"})), 400)
    error_conforms(httpx.post(emu.base_url + "/chat/completions", json=body()), 401)
    error_conforms(client.post("/chat/completions", json=body(provider={"quantizations": ["bf16"]})), 404)
    err = error_conforms(client.post("/chat/completions", json=body(
        seed=1, provider={"only": ["nebius"], "require_parameters": True})), 404)
    assert "requested parameters" in err.message
    error_conforms(client.get("/generation", params={"id": "gen-unknown"}), 404)
    error_conforms(client.get("/models/nobody/nothing/endpoints"), 404)


# ---- availability (the August 2026 contract) -----------------------------------------------------
# The pinned SDK (openrouter 1.3.84, the newest on the registry) does not model `error.availability`:
# its error models ignore the field, so the envelope around it is what the SDK judges here, and the
# field's own shape is checked against the documented one.
AVAILABILITY_CODES = {"model_not_found", "capacity_exhausted", "temporarily_unavailable", "constraint_filtered",
                      "no_endpoints"}


def availability_of(r: httpx.Response, status: int) -> dict:
    error_conforms(r, status)
    a = r.json()["error"]["availability"]
    assert a["code"] in AVAILABILITY_CODES and isinstance(a["retryable"], bool), a
    assert a["retry_after"] is None or a["retry_after"] >= 0
    return a


def test_every_availability_error_carries_the_availability_object(emu, client):
    for slug, status, code in (("chutes", 429, "capacity_exhausted"), ("fireworks", 502, "temporarily_unavailable"),
                               ("gmicloud", 503, "temporarily_unavailable"),
                               ("siliconflow", 524, "temporarily_unavailable"),
                               ("atlas-cloud", 529, "temporarily_unavailable")):
        a = availability_of(client.post("/chat/completions", json=pinned(slug)), status)
        assert (a["code"], a["retryable"]) == (code, True)
    assert availability_of(client.post("/chat/completions", json=pinned("chutes")), 429)["retry_after"] == 1
    a = availability_of(client.post("/chat/completions", json=body(model="moonshotai/kimi-k9")), 400)
    assert (a["code"], a["retryable"]) == ("model_not_found", False)
    a = availability_of(client.post("/chat/completions", json=body(provider={"quantizations": ["bf16"]})), 404)
    assert (a["code"], a["retryable"], a["excluded_by"]) == ("constraint_filtered", False, ["quantizations"])
    a = availability_of(client.post("/chat/completions", json=body(
        seed=1, provider={"only": ["nebius"], "require_parameters": True})), 404)
    assert a["code"] == "constraint_filtered" and a["constraint"] == {"require_parameters": ["max_tokens", "seed"]}
    a = availability_of(client.post("/chat/completions", json=body(
        provider={"order": ["nobody"], "allow_fallbacks": False})), 404)
    assert (a["code"], a["retryable"]) == ("no_endpoints", False)
    a = availability_of(client.post("/chat/completions", json=body(provider={"ignore": [
        p["slug"] for p in PROVIDERS[:-1]]})), 503)
    assert (a["code"], a["retryable"]) == ("temporarily_unavailable", True)


@pytest.mark.parametrize("code,status,retryable", [("temporarily_unavailable", 503, True),
                                                   ("no_endpoints", 404, True),
                                                   ("capacity_exhausted", 429, True),
                                                   ("model_not_found", 400, False)])
def test_a_router_outage_answers_conforming_availability_errors_then_ends(tmp_path, code, status, retryable):
    cfg = {"router_faults": {"outage_after": 1, "outage_s": 0.5, "outage_code": code, "retry_after_s": 2}}
    with running(cfg, state_dir=tmp_path) as emu:
        c = httpx.Client(base_url=emu.base_url, headers=emu.key.header())
        assert c.post("/chat/completions", json=body()).status_code == 200
        r = c.post("/chat/completions", json=body())
        a = availability_of(r, status)
        assert (a["code"], a["retryable"]) == (code, retryable)
        if retryable:
            assert a["retry_after"] == 2 and r.headers["Retry-After"] == "2"
        time.sleep(0.6)
        assert c.post("/chat/completions", json=body()).status_code == 200


def test_payment_and_permission_errors_conform(tmp_path):
    ep = [_ep("deepinfra", "DeepInfra")]
    cases = [  # (config, request, status, limit_source, reason)
        ({"credits": 0.0001}, body(max_tokens=1000), 402, "openrouter_credits", None),
        ({"in_flight_budget": 0.5}, body(max_tokens=3_000_000), 402, "openrouter_credits", "weight_exceeds_budget"),
        ({"key_budget_usd": 0.001}, body(max_tokens=1000), 402, "openrouter_key_limit", "weight_exceeds_budget"),
        ({"key_budget_usd": 0.0}, body(), 403, "openrouter_key_limit", None),
        ({"key_forbidden": True}, body(), 403, None, None),
    ]
    for i, (cfg, req, status, source, reason) in enumerate(cases):
        cfg = {"providers": [{**ep[0], "max_completion_tokens": 4_000_000, "context_length": 5_000_000}], **cfg}
        with running(cfg, state_dir=tmp_path / str(i)) as emu:
            r = httpx.post(emu.base_url + "/chat/completions", json=req, headers=emu.key.header())
            err = error_conforms(r, status)
            assert err.metadata.get("limit_source") == source and err.metadata.get("reason") == reason, err


def test_in_flight_budget_402_conforms_and_says_when_to_retry(tmp_path):
    import asyncio

    import aiohttp

    cfg = {"providers": [_ep("deepinfra", "DeepInfra", latency_s={"median": 0.5, "sigma": 0.01},
                             tokens_per_s={"median": 1000, "sigma": 0.01})],
           "time_scale": 1.0, "credits": 0.01, "in_flight_budget": 0.5, "synthetic_tokens": 10}
    with running(cfg, state_dir=tmp_path) as emu:
        async def main():
            async with aiohttp.ClientSession(headers=emu.key.header()) as s:
                async def one():
                    async with s.post(emu.base_url + "/chat/completions", json=body(max_tokens=1500)) as r:
                        return r.status, r.headers.get("Retry-After"), await r.read()
                return await asyncio.gather(*[one() for _ in range(4)])
        refused = [(ra, raw) for status, ra, raw in asyncio.run(main()) if status == 402]
    assert refused
    for retry_after, raw in refused:
        err = conforms(errors.PaymentRequiredResponseErrorData, raw).error
        # as in the wild: the balance shortage's "can only afford" text; only limit_source tells them apart
        assert "can only afford" in err.message and "reason" not in err.metadata and retry_after == "1"
        assert err.metadata["limit_source"] == "openrouter_in_flight_budget" and err.metadata["remedy_hint"]


# ---- account and catalogue ------------------------------------------------------------------------

def test_key_credits_models_and_endpoints_conform(emu, client):
    key = conforms(operations.GetCurrentKeyResponse, client.get("/key").content).data
    assert key.limit is not None and key.effective_budget.scope == "key_limit"
    assert key.budgets == [key.effective_budget]
    conforms(operations.GetCreditsResponse, client.get("/credits").content)
    models = conforms(components.ModelsListResponse, client.get("/models").content)
    assert [m.id for m in models.data] == [MODEL] and "seed" in models.data[0].supported_parameters
    eps = conforms(operations.ListEndpointsResponse, client.get(f"/models/{MODEL}/endpoints").content).data.endpoints
    di = next(e for e in eps if e.tag == "deepinfra/int4")
    assert di.pricing.discount == 0.1 and float(di.pricing.request) == pytest.approx(1e-4)
    assert float(di.pricing.internal_reasoning) == pytest.approx(3e-6)
    assert [o.min_prompt_tokens for o in di.pricing.overrides] == [100000, None]
    assert float(di.pricing.overrides[0].completion) == pytest.approx(4e-6)
    assert next(e for e in eps if e.tag == "nebius/int4").supported_parameters == ["max_tokens", "temperature"]


def test_uncapped_key_budgeted_key_byok_and_management_only_credits_conform(tmp_path):
    ep = [_ep("deepinfra", "DeepInfra")]
    cfg = {"providers": ep, "key_capped": False, "credits_need_management_key": True, "generation_delay_s": 0}
    with running(cfg, state_dir=tmp_path / "a") as emu, \
            httpx.Client(base_url=emu.base_url, headers=emu.key.header()) as c:
        key = conforms(operations.GetCurrentKeyResponse, c.get("/key").content).data
        assert key.limit is None and key.budgets == [] and key.effective_budget is None
        error_conforms(c.get("/credits"), 403)
    cfg = {"providers": ep, "key_budget_usd": 2.5, "byok": True, "generation_delay_s": 0}
    with running(cfg, state_dir=tmp_path / "b") as emu, \
            httpx.Client(base_url=emu.base_url, headers=emu.key.header()) as c:
        res = conforms(components.ChatResult, c.post("/chat/completions", json=body()).content)
        assert res.usage.is_byok and res.usage.cost_details.upstream_inference_cost > res.usage.cost > 0
        g = generation(c, res.id)
        assert g.is_byok and g.upstream_inference_cost == pytest.approx(res.usage.cost_details.upstream_inference_cost)
        key = conforms(operations.GetCurrentKeyResponse, c.get("/key").content).data
        assert key.limit == 2.5 and key.effective_budget.spend_usd == pytest.approx(res.usage.cost)
        assert key.byok_usage == pytest.approx(res.usage.cost_details.upstream_inference_cost)


def test_strict_validation_catches_a_missing_or_mistyped_field(client):
    """The oracle can fail: the same bodies with one field dropped or retyped do not validate."""
    from pydantic import ValidationError

    j = client.post("/chat/completions", json=pinned("deepinfra")).json()
    del j["choices"][0]["finish_reason"]
    with pytest.raises(ValidationError):
        conforms(components.ChatResult, json.dumps(j))
    eps = client.get(f"/models/{MODEL}/endpoints").json()
    eps["data"]["endpoints"][0]["quantization"] = "int3"  # not one of the SDK's enum values
    with pytest.raises(ValidationError):
        conforms(operations.ListEndpointsResponse, json.dumps(eps))
    key = client.get("/key").json()
    key["data"]["usage"] = "0.1"
    with pytest.raises(ValidationError):
        conforms(operations.GetCurrentKeyResponse, json.dumps(key))


# ---- logprobs (the model backend computes them) ----------------------------------------------------

LOGPROB_PROVIDERS = [
    _ep("deepinfra", "DeepInfra", supported_parameters=["max_tokens", "temperature", "top_p", "seed", "logprobs",
                                                        "top_logprobs"]),
    _ep("novita", "Novita", supported_parameters=["max_tokens", "temperature", "logprobs", "top_logprobs"],
        quirks={"logprobs": "absent"}),
    _ep("parasail", "Parasail", supported_parameters=["max_tokens", "temperature", "logprobs", "top_logprobs"],
        quirks={"logprobs": "rounded"}),
    _ep("siliconflow", "SiliconFlow", supported_parameters=["max_tokens", "temperature", "logprobs", "top_logprobs"],
        quirks={"logprobs": "placeholder"}),
    _ep("fireworks", "Fireworks"),  # does not list logprobs
]


@pytest.fixture(scope="module")
def model_client(tmp_path_factory):
    cfg = {"providers": LOGPROB_PROVIDERS, "backend": "model", "target_model_path": "tiny-test",
           "generation_delay_s": 0.0}
    with running(cfg, state_dir=tmp_path_factory.mktemp("emu-model")) as e, \
            httpx.Client(base_url=e.base_url, headers=e.key.header(), timeout=120) as c:
        yield c


def test_logprobs_conform_and_are_the_served_models_own(model_client):
    """Bodies and stream chunks with logprobs validate; the values are log_softmax of the target's own
    float32 logits at each id served (before temperature), with the requested alternatives."""
    import torch

    from draftsmith.emulator.model import model_logprobs
    from draftsmith.targets.checkpoint import load_target, load_tokenizer, resolve_target

    r = model_client.post("/chat/completions", json=pinned("deepinfra", logprobs=True, top_logprobs=3,
                                                           temperature=0.7))
    res = conforms(components.ChatResult, r.content)
    content = res.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)
    path = resolve_target("tiny-test", log=lambda *a: None)
    tok = load_tokenizer(path)
    prompt = tok.apply_chat_template(body()["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
    vocab = tok.get_vocab()
    from draftsmith.encoding import Encoding
    enc = Encoding(tok)
    ids = []
    for t in content:  # the ids served, read back from each token's bytes
        match = [i for i in {vocab.get(t.token), *enc.template([t.token])[0][:1]} if i is not None
                 and enc.token_bytes([i])[0] == bytes(t.bytes_)]
        ids.append(match[0])
    expected, _ = model_logprobs(load_target(path, "cpu"), list(prompt), ids, 0)
    assert [t.logprob for t in content] == pytest.approx(expected, abs=1e-4)
    assert [bytes(t.bytes_) for t in content] == enc.token_bytes(ids)
    s = model_client.post("/chat/completions", json=pinned("deepinfra", stream=True, logprobs=True))
    parsed = [conforms(components.ChatStreamChunk, c) for c in chunks(s)]
    finish = [c for c in parsed if c.choices and c.choices[0].finish_reason in ("stop", "length")][0]
    assert len(finish.choices[0].logprobs.content) == parsed[-1].usage.completion_tokens


def test_logprob_quirks_and_endpoints_that_do_not_list_them(model_client):
    """absent: null although listed; rounded: two decimals; placeholder: 0 for every token; an endpoint
    that does not list logprobs drops the parameter (null), as OpenRouter does; bad values are a 400."""
    def lp(slug):
        r = model_client.post("/chat/completions", json=pinned(slug, logprobs=True, top_logprobs=1))
        res = conforms(components.ChatResult, r.content)
        return res.choices[0].logprobs and res.choices[0].logprobs.content

    assert lp("novita") is None and lp("fireworks") is None
    rounded = [t.logprob for t in lp("parasail")]
    assert rounded and all(x == round(x, 2) for x in rounded) and len(set(rounded)) > 1
    assert {t.logprob for t in lp("siliconflow")} == {0.0}
    eps = model_client.get(f"/models/{MODEL}/endpoints").json()["data"]["endpoints"]
    assert {e["tag"].split("/")[0] for e in eps if "logprobs" in e["supported_parameters"]} == \
        {"deepinfra", "novita", "parasail", "siliconflow"}
    for bad in ({"logprobs": "yes"}, {"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}):
        error_conforms(model_client.post("/chat/completions", json=pinned("deepinfra", **bad)), 400)
