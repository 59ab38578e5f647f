"""openrouter/client.py: every way an OpenRouter answer can look, sorted into what the engine does next.

The wire-level cases (padding, SSE comments, cut streams, hung connections) are served by a tiny
in-process aiohttp app that replays exact bytes; the emulator tests in test_generate*.py cover the
same paths end to end.
"""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from draftsmith.openrouter import client
from draftsmith.openrouter.client import SLOWEST_TOKENS_PER_S, KeepaliveWatch, request_deadline

pytestmark = pytest.mark.emulator

OK = {"id": "gen-1", "provider": "Novita", "model": "moonshotai/kimi-k2.5", "object": "chat.completion",
      "choices": [{"index": 0, "finish_reason": "stop", "native_finish_reason": "stop",
                   "message": {"role": "assistant", "content": "Hello.", "reasoning": "Think."}}],
      "usage": {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23, "cost": 0.0000195,
                "completion_tokens_details": {"reasoning_tokens": 1}}}


def test_padded_json_body_parses():
    r = client.parse_completion(b"\n\n   \n" + json.dumps(OK).encode())
    assert isinstance(r, client.Reply)
    assert (r.content, r.reasoning, r.finish_reason, r.provider, r.generation_id) == \
        ("Hello.", "Think.", "stop", "Novita", "gen-1")
    assert r.usage == {"prompt_tokens": 20, "completion_tokens": 3, "reasoning_tokens": 1, "cost": 0.0000195}


def test_length_finish_is_a_result_not_a_retry():
    body = json.loads(json.dumps(OK))
    body["choices"][0]["finish_reason"] = "length"
    assert isinstance(client.parse_completion(json.dumps(body).encode()), client.Reply)


def test_a_billed_answer_all_in_withheld_reasoning_is_kept_for_stage_03_to_name():
    """max_tokens ran out inside the reasoning and the provider did not return it: no text, but a
    full-length answer billed. It is kept (paid work; asking again would pay twice), and stage 03
    names it dropped_reasoning against its provider; an empty body with nothing billed is retried."""
    body = json.loads(json.dumps(OK))
    body["choices"][0].update(finish_reason="length", message={"role": "assistant", "content": ""})
    body["usage"].update(completion_tokens=32, completion_tokens_details={"reasoning_tokens": 32})
    r = client.parse_completion(json.dumps(body).encode())
    assert isinstance(r, client.Reply) and (r.content, r.reasoning, r.finish_reason) == ("", None, "length")
    assert r.usage["completion_tokens"] == 32


@pytest.mark.parametrize("mutate,kind", [
    (lambda b: b.update(error={"code": 502, "message": "Provider returned error"}) or b.pop("choices"), "error_in_200"),
    (lambda b: b["choices"][0].update(finish_reason="error"), "finish_error"),
    (lambda b: b["choices"][0].update(finish_reason=None, message={"role": "assistant", "content": ""}), "empty"),
    (lambda b: b.update(choices=[]), "no_choices"),
    (lambda b: b["choices"][0].update(message={"content": "", "reasoning": None}) or
     b["usage"].update(completion_tokens=0), "empty"),
])
def test_errors_inside_200_are_retryable(mutate, kind):
    body = json.loads(json.dumps(OK))
    mutate(body)
    f = client.parse_completion(json.dumps(body).encode())
    assert isinstance(f, client.Failure) and f.action == "retry" and f.kind == kind


def test_error_in_200_with_a_balance_code_stops():
    f = client.parse_completion(json.dumps({"error": {"code": 402, "message": "can only afford 10"}}).encode())
    assert (f.action, f.kind) == ("balance", "balance")


@pytest.mark.parametrize("status,error,action,kind", [
    (400, {"message": "This endpoint's maximum context length is 262144 tokens"}, "permanent", "bad_request"),
    # 403: a key/workspace/guardrail budget is spent or the key lacks permission: stop, never write samples off
    (403, {"message": "Key limit exceeded", "metadata": {"reasons": ["x"]}}, "fatal", "forbidden"),
    (401, {"message": "No auth credentials found"}, "fatal", "unauthorized"),
    (404, {"message": "No allowed providers are available for the selected model."}, "fatal", "no_provider"),
    (402, {"message": "This request requires more credits, or fewer max_tokens. You requested up to 4096 "
                      "tokens, but can only afford 1200."}, "balance", "balance"),
    (402, {"message": "Too much spend in flight", "metadata": {"code": "in_flight_budget_exhausted"}},
     "throttle", "in_flight_budget"),
    (402, {"message": "Too much spend in flight", "metadata": {"reason": "in_flight_budget_exhausted",
                                                               "limit_source": "key"}}, "throttle", "in_flight_budget"),
    # this one request is over the whole budget: retrying can never help
    (402, {"message": "request weight exceeds budget", "metadata": {"reason": "weight_exceeds_budget",
                                                                    "limit_source": "key"}},
     "fatal", "weight_exceeds_budget"),
    (408, {"message": "timeout"}, "retry", "http_408"),
    (429, {"message": "Provider returned error", "metadata": {"raw": "rate limited", "provider_name": "Novita",
                                                               "retry_after_seconds": 7}}, "throttle", "http_429"),
    (429, {"message": "Rate limit exceeded"}, "throttle", "http_429"),
    (500, {}, "retry", "http_500"), (502, {}, "retry", "http_502"), (503, {}, "retry", "http_503"),
    (503, {"message": "Provider returned error", "metadata": {"provider_name": "Novita", "raw": "overloaded"}},
     "retry", "http_503"),
    # a 503 from the router itself: no endpoint meets the routing requirements
    (503, {"message": "No endpoints found that can handle the requested parameters."}, "fatal", "no_provider"),
    (503, {"message": "No allowed providers are available for the selected model."}, "fatal", "no_provider"),
    (524, {}, "retry", "http_524"), (529, {}, "retry", "http_529"),
    (422, {"message": "unprocessable"}, "permanent", "http_422"),
])
def test_status_classification(status, error, action, kind):
    f = client.classify_error(status, error)
    assert (f.action, f.kind) == (action, kind)
    if status == 429 and error.get("metadata"):
        assert f.retry_after == 7 and f.provider == "Novita" and "rate limited" in f.message


def _avail(code, retryable, **kw):
    return {"code": code, "retryable": retryable, "retry_after": None, **kw}


@pytest.mark.parametrize("status,error,action,kind", [
    # retryable: waited out, whatever the status would have said (a 404 used to stop the run)
    (404, {"message": "No allowed providers are available for the selected model.",
           "availability": _avail("no_endpoints", True)}, "unavailable", "http_404"),
    (503, {"message": "No available model provider that meets your routing requirements.",
           "availability": _avail("temporarily_unavailable", True)}, "unavailable", "http_503"),
    (429, {"message": "Capacity exhausted", "availability": _avail("capacity_exhausted", True)},
     "unavailable", "http_429"),
    (404, {"message": "filtered", "availability": _avail("constraint_filtered", True)}, "unavailable", "http_404"),
    # not retryable: the action of the code
    (400, {"message": "moonshotai/kimi-k9 is not a valid model ID", "availability": _avail("model_not_found", False)},
     "fatal", "model_not_found"),
    (400, {"message": "wrong endpoint", "availability": _avail("wrong_endpoint", False)}, "fatal", "wrong_endpoint"),
    (404, {"message": "No endpoints", "availability": _avail("no_endpoints", False)}, "fatal", "no_provider"),
    (404, {"message": "No allowed providers", "availability": _avail("constraint_filtered", False,
                                                                      excluded_by=["quantizations"])},
     "fatal", "constraint_filtered"),
    # a code we do not know, not retryable: the status decides, as before
    (503, {"message": "Provider returned error", "metadata": {"provider_name": "Novita"},
           "availability": _avail("something_new", False)}, "retry", "http_503"),
    # no object (or a malformed one): today's rules
    (404, {"message": "No allowed providers", "availability": "soon"}, "fatal", "no_provider"),
    # 402: limit_source first; a real 402 carries the "can only afford" text with either source
    (402, {"message": "You requested up to 4096 tokens, but can only afford 1200.",
           "metadata": {"limit_source": "openrouter_in_flight_budget"}}, "throttle", "in_flight_budget"),
    (402, {"message": "You requested up to 4096 tokens, but can only afford 1200.",
           "metadata": {"limit_source": "openrouter_credits", "reason": "in_flight_budget_exhausted"}},
     "balance", "balance"),
    (402, {"message": "Request weight exceeds budget", "metadata": {"limit_source": "openrouter_credits",
                                                                    "reason": "weight_exceeds_budget"}},
     "fatal", "weight_exceeds_budget"),
])
def test_availability_decides_first_and_limit_source_tells_402s_apart(status, error, action, kind):
    f = client.classify_error(status, error)
    assert (f.action, f.kind) == (action, kind), f


def test_availability_retry_after_wins_over_the_header():
    err = {"message": "busy", "availability": {"code": "capacity_exhausted", "retryable": True, "retry_after": 12}}
    assert client.classify_error(429, err, retry_after=3).retry_after == 12
    err["availability"]["retry_after"] = None
    assert client.classify_error(429, err, retry_after=3).retry_after == 3


def test_constraint_filtered_names_what_filtered():
    f = client.classify_error(404, {"message": "No allowed providers", "availability": _avail(
        "constraint_filtered", False, excluded_by=["quantizations", "max_price"])})
    assert "quantizations" in str(f) and "max_price" in str(f)


def test_availability_inside_a_200_and_in_a_stream_chunk_is_read_first():
    retryable = {"code": 503, "message": "Provider returned error",
                 "availability": _avail("temporarily_unavailable", True)}
    f = client.parse_completion(json.dumps({"error": retryable}).encode())
    assert (f.action, f.kind) == ("unavailable", "error_in_200")
    gone = {"code": 400, "message": "x is not a valid model ID", "availability": _avail("model_not_found", False)}
    assert client.parse_completion(json.dumps({"error": gone}).encode()).action == "fatal"
    chunk = _sse({**HEAD, "choices": [{"index": 0, "delta": {"content": "Hi"}}]}, {**HEAD, "error": retryable},
                 done=False)
    f = _post(chunk, stream=True)
    assert (f.action, f.kind) == ("unavailable", "stream_error")


def test_retry_after_header_forms():
    assert client.retry_after_seconds("3") == 3.0
    assert client.retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert client.retry_after_seconds("soon") is None and client.retry_after_seconds(None) is None


def test_body_carries_settings_and_messages():
    s = client.request_settings("m/x", 64, 1.0, 0.95, 7, {"only": ["a"]}, {"enabled": True}, stream=True)
    body = json.loads(client.BodyMaker(s).body(client.messages_json([{"role": "user", "content": "héllo"}])))
    assert body == {**s, "messages": [{"role": "user", "content": "héllo"}]}
    assert "provider" not in client.request_settings("m/x", 64, provider={})
    with pytest.raises(ValueError, match="max_tokens"):
        client.request_settings("m/x", 0)


# --- on the wire -----------------------------------------------------------------------------

def _sse(*chunks, done=True, comments=True) -> bytes:
    out = [b": OPENROUTER PROCESSING\n\n"] if comments else []
    for c in chunks:
        out.append(b"data: " + json.dumps(c).encode() + b"\n\n")
        if comments:
            out.append(b": OPENROUTER PROCESSING\n\n")
    if done:
        out.append(b"data: [DONE]\n\n")
    return b"".join(out)


HEAD = {"id": "gen-2", "provider": "Parasail", "model": "moonshotai/kimi-k2.5", "object": "chat.completion.chunk"}
STREAM_OK = _sse(
    {**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "reasoning": "Hm, "}}]},
    {**HEAD, "choices": [{"index": 0, "delta": {"reasoning": "ok."}}]},
    {**HEAD, "choices": [{"index": 0, "delta": {"content": "Hi"}}]},
    {**HEAD, "choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": "stop",
                          "native_finish_reason": "eos"}]},
    {**HEAD, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6, "cost": 1e-5,
                                      "completion_tokens_details": {"reasoning_tokens": 3}}})
STREAM_ERROR = _sse(
    {**HEAD, "choices": [{"index": 0, "delta": {"content": "Hi"}}]},
    {**HEAD, "error": {"code": "server_error", "message": "upstream died"},
     "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]}, done=False)
STREAM_CUT = _sse({**HEAD, "choices": [{"index": 0, "delta": {"content": "Hi"}}]}, done=False)


def _serve(handler, fn):
    async def main():
        app = web.Application()
        app.router.add_post("/api/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as s:
                return await fn(s, f"http://127.0.0.1:{port}/api/v1/chat/completions")
        finally:
            await runner.cleanup()
    return asyncio.run(main())


def _post(raw: bytes, status=200, stream=False, headers=None, delay_after=None, timeout=None):
    async def handler(request):
        resp = web.StreamResponse(status=status, headers=headers or {})
        await resp.prepare(request)
        # write in small pieces, as a server streaming would
        for i in range(0, len(raw), 7):
            await resp.write(raw[i:i + 7])
        if delay_after:
            await asyncio.sleep(delay_after)
        return resp

    async def go(s, url):
        return await client.complete(s, url, {"Authorization": "Bearer sk-test"}, b"{}", stream,
                                     timeout or aiohttp.ClientTimeout(total=None, sock_read=5))
    return _serve(handler, go)


def test_stream_with_comments_and_final_usage_chunk():
    r = _post(STREAM_OK, stream=True)
    assert isinstance(r, client.Reply)
    assert (r.content, r.reasoning, r.finish_reason, r.native_finish_reason, r.provider, r.generation_id) == \
        ("Hi there", "Hm, ok.", "stop", "eos", "Parasail", "gen-2")
    assert r.usage["completion_tokens"] == 6 and r.usage["reasoning_tokens"] == 3


def test_mid_stream_error_is_retryable():
    f = _post(STREAM_ERROR, stream=True)
    assert isinstance(f, client.Failure) and (f.action, f.kind) == ("retry", "stream_error")


def test_stream_cut_before_done_is_retryable_and_may_be_billed():
    f = _post(STREAM_CUT, stream=True)
    assert (f.action, f.kind) == ("retry", "stream_cut")
    # a provider that cannot cancel bills a cut stream: the engine asks /generation about gen-2
    assert f.maybe_billed and f.generation_id == "gen-2"


def test_non_streamed_answer_cut_after_billing_carries_the_generation_id():
    """OpenRouter bills a non-streamed request in full even if the answer never arrives; the
    X-Generation-Id header names it, so its cost can be asked for."""
    async def handler(request):
        resp = web.StreamResponse(status=200, headers={"X-Generation-Id": "gen-cut", "Content-Length": "5000"})
        await resp.prepare(request)
        await resp.write(json.dumps(OK).encode()[:40])
        request.transport.close()
        return resp

    async def go(s, url):
        return await client.complete(s, url, {}, b"{}", False, aiohttp.ClientTimeout(total=None, sock_read=5))
    f = _serve(handler, go)
    assert isinstance(f, client.Failure) and f.action == "retry"
    assert f.maybe_billed and f.generation_id == "gen-cut"


def test_a_request_cancelled_in_flight_leaves_its_generation_id():
    async def handler(request):
        resp = web.StreamResponse(status=200, headers={"X-Generation-Id": "gen-slow"})
        await resp.prepare(request)
        await asyncio.sleep(5)
        return resp

    async def go(s, url):
        seen = {}
        t = asyncio.ensure_future(client.complete(s, url, {}, b"{}", False, seen=seen))

        async def headers_in():
            while not seen:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(headers_in(), 30)  # cancelled once its headers are in, its body not yet
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        return seen
    assert _serve(handler, go) == {"generation_id": "gen-slow"}


def test_byok_cost_is_the_fee_plus_the_upstream_bill():
    body = json.loads(json.dumps(OK))
    body["usage"].update(cost=0.00001, is_byok=True, cost_details={
        "upstream_inference_cost": 0.0002, "upstream_inference_prompt_cost": 0.00005,
        "upstream_inference_completions_cost": 0.00015})
    r = client.parse_completion(json.dumps(body).encode())
    assert r.usage["cost"] == pytest.approx(0.00021) and r.usage["byok_fee"] == 0.00001
    # without BYOK the upstream figures are a breakdown of usage.cost, not an extra bill
    body["usage"]["is_byok"] = False
    assert client.parse_completion(json.dumps(body).encode()).usage["cost"] == 0.00001


def test_padded_json_on_the_wire():
    r = _post(b" " * 300 + b"\n" + json.dumps(OK).encode())
    assert isinstance(r, client.Reply) and r.content == "Hello."


def test_hung_connection_hits_the_read_timeout():
    f = _post(b"", delay_after=3, timeout=aiohttp.ClientTimeout(total=None, sock_read=0.3),
              headers={"X-Generation-Id": "gen-hung"})
    assert (f.action, f.kind) == ("retry", "timeout") and f.maybe_billed and f.generation_id == "gen-hung"


def test_429_envelope_and_retry_after_header():
    env = {"error": {"code": 429, "message": "Provider returned error",
                     "metadata": {"provider_name": "Novita", "raw": "slow down"}}, "user_id": "u"}
    f = _post(json.dumps(env).encode(), status=429, headers={"Retry-After": "4"})
    assert (f.action, f.kind, f.status, f.retry_after, f.provider) == ("throttle", "http_429", 429, 4.0, "Novita")
    assert not f.maybe_billed       # an error status is an answer: nothing was billed


def test_non_json_error_body_still_classified():
    f = _post(b"<html>Bad Gateway</html>", status=502)
    assert (f.action, f.kind) == ("retry", "http_502") and "Bad Gateway" in f.message


def test_connection_refused_is_retryable():
    async def go():
        async with aiohttp.ClientSession() as s:
            return await client.complete(s, "http://127.0.0.1:9/x", {}, b"{}", False)
    f = asyncio.run(go())
    assert (f.action, f.kind) == (client.Action.RETRY, "connection") and f.action is client.Action.RETRY
    assert f.refused and not f.maybe_billed   # never reached anyone: known from the exception's type, not its name


def test_body_of_the_wrong_shape_is_a_retry_not_a_crash():
    body = json.loads(json.dumps(OK))
    body["choices"][0]["message"] = "not an object"
    f = _post(json.dumps(body).encode())
    assert (f.action, f.kind) == ("retry", "bad_response")


# --- progress rules, unreadable bodies, the response cache -----------------------------------

def _keepalive(first: bytes, beat: bytes, seconds: float, headers: dict):
    """A 200 that sends `first`, then `beat` every 0.05 s for `seconds`: a socket never idle."""
    async def handler(request):
        resp = web.StreamResponse(status=200, headers=headers)
        await resp.prepare(request)
        await resp.write(first)
        for _ in range(int(seconds / 0.05)):
            await asyncio.sleep(0.05)
            await resp.write(beat)
        return resp
    return handler


def test_a_stream_of_comments_alone_is_given_up_when_no_data_chunk_comes():
    """The read timeout never fires (a comment every 0.05 s); no data chunk for progress_s does."""
    first = _sse({**HEAD, "choices": [{"index": 0, "delta": {"content": "Hi"}}]}, done=False, comments=False)
    watch = KeepaliveWatch()

    async def go(s, url):
        return await client.complete(s, url, {}, b"{}", True, aiohttp.ClientTimeout(total=None, sock_read=0.3),
                                     progress_s=0.6, watch=watch)
    f = _serve(_keepalive(first, b": OPENROUTER PROCESSING\n\n", 5, {"X-Generation-Id": "gen-st"}), go)
    assert (f.action, f.kind) == ("retry", "stalled") and f.maybe_billed and f.generation_id == "gen-2"
    assert watch.waiting() == 0     # over: no longer counted


def test_a_padded_json_body_is_given_up_at_its_deadline_and_counted_while_it_waits():
    watch = KeepaliveWatch()
    seen_waiting = []

    async def go(s, url):
        t = asyncio.ensure_future(client.complete(s, url, {}, b"{}", False,
                                                  aiohttp.ClientTimeout(total=None, sock_read=0.3),
                                                  deadline_s=1.0, watch=watch))
        while not t.done():
            seen_waiting.append(watch.waiting(0.2))
            await asyncio.sleep(0.05)
        return await t
    f = _serve(_keepalive(b"\n", b"\n", 5, {"X-Generation-Id": "gen-pad"}), go)
    assert (f.action, f.kind) == ("retry", "deadline") and f.maybe_billed and f.generation_id == "gen-pad"
    assert "padding only" in f.message and max(seen_waiting) == 1 and watch.waiting() == 0


def test_the_deadline_derives_from_max_tokens_at_the_slowest_credible_rate_unless_given():
    assert request_deadline(8192, 600.0) == pytest.approx(600 + 8192 / SLOWEST_TOKENS_PER_S)
    assert request_deadline(8192, 600.0, 120.0) == 120.0


@pytest.mark.parametrize("raw,kind", [
    (json.dumps(OK).encode().replace(b"Hello.", b"Hel\xff\xfelo."), "bad_bytes"),
    (json.dumps(OK).encode()[:60], "bad_json"),
    (b"[1, 2]", "bad_json"),
    (b"   \n  ", "empty"),
    (json.dumps({"id": "gen-1", "choices": []}).encode(), "no_choices"),
])
def test_a_200_body_that_cannot_be_read_may_have_been_billed(raw, kind):
    f = _post(raw, headers={"X-Generation-Id": "gen-1"})
    assert (f.action, f.kind) == ("retry", kind) and f.maybe_billed and f.generation_id == "gen-1"


def test_a_stream_chunk_that_is_not_utf8_may_have_been_billed():
    raw = STREAM_OK.replace(b'"Hi"', b'"H\xffi"')
    f = _post(raw, stream=True)
    assert (f.action, f.kind) == ("retry", "bad_bytes") and f.maybe_billed and f.generation_id == "gen-2"


def test_a_reply_from_the_response_cache_is_no_new_sample():
    hit = _post(json.dumps(OK).encode(), headers={"X-OpenRouter-Cache-Status": "HIT"})
    assert (hit.action, hit.kind, hit.cost) == ("retry", "cached", OK["usage"]["cost"]) and not hit.maybe_billed
    zeroed = json.loads(json.dumps(OK))
    zeroed["usage"].update(prompt_tokens=0, completion_tokens=0, total_tokens=0, cost=0,
                           completion_tokens_details={"reasoning_tokens": 0})
    f = _post(json.dumps(zeroed).encode())
    assert (f.kind, f.cost) == ("cached", 0)
    assert isinstance(_post(json.dumps(OK).encode(), headers={"X-OpenRouter-Cache-Status": "MISS"}), client.Reply)
