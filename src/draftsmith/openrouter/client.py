"""One OpenRouter chat completion: build the body, POST it, read the answer, classify the outcome.

`complete` never raises for a bad answer or network trouble: it returns a `Reply`, or a `Failure`
whose `Action` says what the caller does next (docs/openrouter.md). A failure whose answer may have
been billed carries `maybe_billed` and the generation id, so the caller can ask `GET /generation`.
A bare vLLM or SGLang server (generate/session.py) is read the same way. Nothing here formats
the API key: it lives only in the prepared headers.

Keep-alive (whitespace padding, `: OPENROUTER PROCESSING` comments) keeps a socket read timeout
from firing, so two rules of our own give a request up: a stream with no data chunk for
`progress_s`, and a total deadline (`request_deadline`); `KeepaliveWatch` counts the requests
waiting on padding alone."""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import json
import re
import time
from dataclasses import dataclass
from enum import StrEnum

import aiohttp


RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504, 520, 522, 524, 529})
NO_CACHE = {"X-OpenRouter-Cache": "false"}   # OpenRouter's response cache off for this request
CACHE_STATUS = "X-OpenRouter-Cache-Status"   # HIT on a reply served from the cache


@dataclass(slots=True)
class Reply:
    content: str
    reasoning: str | None
    finish_reason: str
    native_finish_reason: str | None
    provider: str | None
    model: str | None
    generation_id: str | None
    usage: dict
    output_ids: list[int] | None = None  # the ids the engine sampled (a bare vLLM server, `return_token_ids`)
    prompt_ids: list[int] | None = None
    logprobs: list[dict] | None = None  # `choices[0].logprobs.content` as returned (None: none came)


class Action(StrEnum):
    """What the caller does with a failed attempt. What gives each:

      RETRY        408, 5xx from a provider, an error inside a 200 body or a stream, an empty 200, a
                   cut stream, a hung or dropped connection, a request past its deadline or a stream
                   without data (`request_deadline`), a 200 whose body cannot be read, a reply from the
                   response cache: a real failure, it spends one of the sample's attempts
      THROTTLE     429, 402 in-flight spending budget: wait it out; never spends an attempt
      UNAVAILABLE  `error.availability.retryable: true` (no capacity or endpoint just now): waited out
                   like a throttle; only these for longer than the engine's outage limit stop the run
      PERMANENT    400 (e.g. context too long): record the sample, do not retry
      FATAL        401 bad key, 403 a key/workspace/guardrail budget or permission, 404 or a routing
                   503 (no endpoint meets the routing), 402 `weight_exceeds_budget`: stop
      BALANCE      402 "can only afford": the balance is gone, stop dispatching
    """

    RETRY = "retry"              # try again, spending one of the sample's attempts
    THROTTLE = "throttle"        # slow down and try again, no attempt spent
    UNAVAILABLE = "unavailable"  # the model or its providers are down: wait, or stop after an outage
    PERMANENT = "permanent"      # this prompt cannot succeed: recorded in errors.jsonl
    FATAL = "fatal"              # the key or the routing is wrong: stop the run
    BALANCE = "balance"          # the account ran out of money: stop for a top-up


@dataclass(slots=True)
class Failure:
    action: Action
    kind: str                   # short label counted in the manifest, e.g. http_429, error_in_200, timeout
    message: str
    status: int | None = None
    retry_after: float | None = None
    provider: str | None = None
    cost: float = 0.0           # what the failed attempt was billed, if the body said so
    maybe_billed: bool = False  # the answer was lost after a provider took the request: ask /generation
    generation_id: str | None = None
    refused: bool = False       # the connection could not be opened: nobody took the request

    def __str__(self) -> str:
        where = f" from {self.provider}" if self.provider else ""
        return f"{self.kind}{where}: {self.message}"


def request_settings(model: str, max_tokens: int, temperature: float | None = None, top_p: float | None = None,
                     seed: int | None = None, provider: dict | None = None, reasoning: dict | None = None,
                     stream: bool = False) -> dict:
    """The sampling settings sent with every prompt (and recorded with every response)."""
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    s = {"model": model, "max_tokens": max_tokens}
    for k, v in (("temperature", temperature), ("top_p", top_p), ("seed", seed)):
        if v is not None:
            s[k] = v
    if provider:
        s["provider"] = provider
    if reasoning:
        s["reasoning"] = reasoning
    s["stream"] = bool(stream)
    return s


def sent_parameters(settings: dict) -> set[str]:
    """The request parameters that `require_parameters: true` makes OpenRouter check against each
    endpoint's `supported_parameters`."""
    return {k for k in settings if k not in ("model", "messages", "provider", "stream", "usage")}


class BodyMaker:
    """Request bodies as bytes: the constant settings are serialized once, the messages per prompt."""

    def __init__(self, settings: dict):
        self.settings = settings
        self._head = json.dumps(settings, ensure_ascii=False, separators=(",", ":"))[:-1] + ',"messages":'

    def body(self, messages_json: str) -> bytes:
        return (self._head + messages_json + "}").encode("utf-8")


def messages_json(messages: list[dict]) -> str:
    return json.dumps(messages, ensure_ascii=False, separators=(",", ":"))


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """`Retry-After` as seconds: a number, or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


ROUTING_WORDS = ("no endpoints", "no allowed providers", "no providers", "routing", "requirements")
# availability codes that are not retryable stop the run, under these kinds (engine hints name the fix)
STOP_CODES = {"model_not_found": "model_not_found", "wrong_endpoint": "wrong_endpoint",
              "constraint_filtered": "constraint_filtered", "no_endpoints": "no_provider"}


def _seconds(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None


def classify_error(status: int, error: dict | None, retry_after: float | None = None, in_200: bool = False) -> Failure:
    """A failure from an HTTP status and the `error` object of the envelope (or of a 200 body / chunk).
    `error.availability` {code, retryable, retry_after} is read first: retryable is waited out; not
    retryable keeps the action of its code (those in STOP_CODES stop the run), else of the status.
    A 402 is told apart by `metadata.limit_source` first; without these fields the status, the
    reason and the words of the message decide (table on `Action`)."""
    error = error if isinstance(error, dict) else {}
    meta = error.get("metadata") if isinstance(error.get("metadata"), dict) else {}
    message = str(error.get("message") or f"HTTP {status}")
    raw = meta.get("raw")
    if raw and isinstance(raw, str) and raw not in message:
        message = f"{message} ({raw[:300]})"
    provider = meta.get("provider_name")
    if retry_after is None:
        retry_after = _seconds(meta.get("retry_after_seconds"))
    code = error.get("code")
    avail = error.get("availability")
    if isinstance(avail, dict) and isinstance(avail.get("retryable"), bool):
        f = _by_availability(avail, status, message, retry_after, provider, in_200)
        if f is not None:
            return f
    if in_200:
        # Errors inside a 200 are retryable, except the unambiguous account and routing ones.
        status = code if isinstance(code, int) and code in (401, 402, 403, 404) else None
    f = Failure(Action.RETRY, "error_in_200" if in_200 else f"http_{status}", message, status, retry_after, provider)
    if status is None:
        return f
    reason = str(meta.get("reason") or meta.get("code") or error.get("code") or "").lower()
    if status == 401:
        f.action, f.kind = Action.FATAL, "unauthorized"
    elif status == 403:
        f.action, f.kind = Action.FATAL, "forbidden"
    elif status == 404 or (status == 503 and not provider and any(w in message.lower() for w in ROUTING_WORDS)):
        f.action, f.kind = Action.FATAL, "no_provider"
    elif status == 402:
        source = meta.get("limit_source")
        if reason == "weight_exceeds_budget":
            f.action, f.kind = Action.FATAL, "weight_exceeds_budget"
        elif source == "openrouter_in_flight_budget":
            f.action, f.kind = Action.THROTTLE, "in_flight_budget"
        elif source == "openrouter_credits":
            f.action, f.kind = Action.BALANCE, "balance"
        elif "in_flight" in reason or "in-flight" in message.lower() or "in flight" in message.lower():
            f.action, f.kind = Action.THROTTLE, "in_flight_budget"
        else:
            f.action, f.kind = Action.BALANCE, "balance"
    elif status == 429:
        f.action = Action.THROTTLE
    elif status in RETRY_STATUSES or status >= 500:
        f.action = Action.RETRY
    elif 400 <= status < 500:
        f.action = Action.PERMANENT
        f.kind = "bad_request" if status == 400 else f"http_{status}"
    return f


def _by_availability(avail: dict, status: int, message: str, retry_after: float | None, provider: str | None,
                     in_200: bool) -> Failure | None:
    """The failure `error.availability` says; None for a non-retryable code it does not name (the
    status decides then). Its `retry_after` wins over the header's."""
    code = str(avail.get("code") or "unavailable")
    where = "error_in_200" if in_200 else f"http_{status}"
    if avail["retryable"]:
        wait = _seconds(avail.get("retry_after"))
        return Failure(Action.UNAVAILABLE, where, f"{message} [{code}, retryable]", status if not in_200 else None,
                       wait if wait is not None else retry_after, provider)
    if code not in STOP_CODES:
        return None
    what = avail.get("excluded_by") or avail.get("constraint")
    if code == "constraint_filtered" and what:
        message = f"{message} (filtered by {json.dumps(what, ensure_ascii=False)[:300]})"
    return Failure(Action.FATAL, STOP_CODES[code], message, status if not in_200 else None, retry_after, provider)


def _usage(u: dict | None) -> dict:
    u = u if isinstance(u, dict) else {}
    details = u.get("completion_tokens_details") or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    out = {"prompt_tokens": u.get("prompt_tokens"), "completion_tokens": u.get("completion_tokens"),
           "reasoning_tokens": details.get("reasoning_tokens"), "cost": u.get("cost")}
    if cached:
        out["cached_tokens"] = cached
    if u.get("is_byok"):
        out["cost"] = _cost(u)
        out["byok_fee"] = u.get("cost")
    return out


def _cost(u) -> float:
    """USD billed: `usage.cost`, plus the provider's own bill when it was the user's key (BYOK:
    `usage.cost` is then OpenRouter's fee, `cost_details.upstream_inference_cost` the provider's)."""
    if not isinstance(u, dict):
        return 0.0
    c = u.get("cost")
    total = float(c) if isinstance(c, (int, float)) else 0.0
    if u.get("is_byok"):
        up = (u.get("cost_details") or {}).get("upstream_inference_cost")
        total += float(up) if isinstance(up, (int, float)) else 0.0
    return total


def parse_completion(raw: bytes) -> Reply | Failure:
    """A non-streaming 200 body (possibly whitespace-padded). A body that cannot be read (no
    body, bytes that are not UTF-8, cut or other JSON, no choices and no usage) may have been
    billed: `maybe_billed`, its generation id the body's when it can be read (else the caller's)."""
    if not raw.strip():
        return Failure(Action.RETRY, "empty", "HTTP 200 with an empty body", maybe_billed=True)
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError as e:
        return Failure(Action.RETRY, "bad_bytes", f"HTTP 200 body is not UTF-8 ({e.reason} at byte {e.start})",
                       maybe_billed=True, generation_id=_body_id(raw))
    except ValueError:
        return Failure(Action.RETRY, "bad_json", f"HTTP 200 body is not JSON: {raw.strip()[:120]!r}", maybe_billed=True,
                       generation_id=_body_id(raw))
    if not isinstance(obj, dict):
        return Failure(Action.RETRY, "bad_json", "HTTP 200 body is not a JSON object", maybe_billed=True)
    if obj.get("error"):
        f = classify_error(200, obj["error"], in_200=True)
        f.cost = _cost(obj.get("usage"))
        return f
    choices = obj.get("choices")
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        gid = obj.get("id") if isinstance(obj.get("id"), str) else None
        return Failure(Action.RETRY, "no_choices", "HTTP 200 without choices", provider=obj.get("provider"),
                       cost=_cost(obj.get("usage")), maybe_billed=not isinstance(obj.get("usage"), dict),
                       generation_id=gid)
    choice = choices[0]
    msg = choice.get("message") or {}
    res = _reply(obj, msg.get("content"), msg.get("reasoning") or msg.get("reasoning_content"),
                 choice.get("finish_reason"), choice.get("native_finish_reason"), obj.get("usage"), choice.get("error"))
    if isinstance(res, Reply):
        res.output_ids, res.prompt_ids = _ids(choice.get("token_ids")), _ids(obj.get("prompt_token_ids"))
        content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
        res.logprobs = content if isinstance(content, list) else None
    return res


_GEN_ID = re.compile(rb'"id"\s*:\s*"(gen-[A-Za-z0-9_-]{1,100})"')


def _body_id(raw: bytes) -> str | None:
    """The generation id named in a body that cannot be parsed, if it can be seen."""
    m = _GEN_ID.search(raw[:4096])
    return m[1].decode("ascii") if m else None


def _ids(v) -> list[int] | None:
    """Token ids as a server returned them, or None when absent or not a list of ids."""
    return v if isinstance(v, list) and v and all(type(t) is int for t in v) else None


def _reply(head: dict, content, reasoning, finish, native, usage, choice_error=None) -> Reply | Failure:
    provider = head.get("provider")
    if finish == "error" or choice_error:
        err = choice_error if isinstance(choice_error, dict) else {"message": "finish_reason error"}
        f = classify_error(200, err, in_200=True)
        f.kind, f.provider, f.cost = "finish_error", f.provider or provider, _cost(usage)
        return f
    if not finish:
        kind = "empty" if not content and not reasoning else "no_finish_reason"
        return Failure(Action.RETRY, kind, "HTTP 200 without a finish reason (cold start?)", provider=provider,
                       cost=_cost(usage))
    u = _usage(usage)
    if not content and not reasoning and not u["completion_tokens"]:
        return Failure(Action.RETRY, "empty", f"empty completion (finish_reason {finish})", provider=provider,
                       cost=_cost(usage))
    return Reply(content or "", reasoning or None, finish, native, provider, head.get("model"), head.get("id"), u)


async def _read_stream(resp: aiohttp.ClientResponse, progress_s: float | None = None,
                       watch: KeepaliveWatch | None = None, token: int | None = None) -> Reply | Failure:
    """The SSE stream of a 200. No data chunk (a token, reasoning, the usage, a finish, an error)
    for `progress_s` (None: no such rule) gives it up as stalled, however many comments came.
    Streams carry `:` comment lines and the usage in a final chunk with no choices; a bare server's
    reasoning may come as `reasoning_content` and vLLM's sampled ids as `token_ids`."""
    head: dict = {}
    content: list[str] = []
    reasoning: list[str] = []
    finish = native = usage = None
    output_ids: list[int] = []
    prompt_ids = None
    done = False
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(progress_s) as quiet:
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue                      # blank separators, `: OPENROUTER PROCESSING`, event:
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except UnicodeDecodeError as e:
                    return Failure(Action.RETRY, "bad_bytes", f"stream chunk is not UTF-8 ({e.reason})",
                                   provider=head.get("provider"), maybe_billed=True, generation_id=head.get("id"))
                except ValueError:
                    return Failure(Action.RETRY, "bad_json", f"stream chunk is not JSON: {data[:120]!r}",
                                   provider=head.get("provider"), maybe_billed=True, generation_id=head.get("id"))
                if not head:
                    head = {"id": chunk.get("id"), "provider": chunk.get("provider"), "model": chunk.get("model")}
                prompt_ids = prompt_ids or _ids(chunk.get("prompt_token_ids"))
                if chunk.get("error"):
                    f = classify_error(200, chunk["error"], in_200=True)
                    f.kind, f.provider = "stream_error", f.provider or head.get("provider")
                    f.cost = _cost(chunk.get("usage"))
                    return f
                moved = False
                if chunk.get("usage"):
                    usage, moved = chunk["usage"], True
                for c in chunk.get("choices") or ():
                    delta = c.get("delta") or {}
                    if delta.get("content"):
                        content.append(delta["content"])
                        moved = True
                    if delta.get("reasoning") or delta.get("reasoning_content"):
                        reasoning.append(delta.get("reasoning") or delta["reasoning_content"])
                        moved = True
                    more = _ids(c.get("token_ids"))
                    if more:
                        output_ids += more
                        moved = True
                    if c.get("finish_reason"):
                        finish, native, moved = c["finish_reason"], c.get("native_finish_reason"), True
                        if c.get("error"):
                            return _reply(head, None, None, "error", native, usage, c["error"])
                if moved:
                    if progress_s is not None:
                        quiet.reschedule(loop.time() + progress_s)
                    if watch is not None:
                        watch.progress(token)
    except TimeoutError:
        if not quiet.expired():
            raise                                 # the request's own deadline (complete)
        return Failure(Action.RETRY, "stalled", f"no data in the stream for {progress_s:g}s (keep-alive comments only)",
                       provider=head.get("provider"), maybe_billed=True, generation_id=head.get("id"))
    if not done and not (finish and usage):
        return Failure(Action.RETRY, "stream_cut", "stream ended before [DONE]", provider=head.get("provider"),
                       cost=_cost(usage), maybe_billed=usage is None, generation_id=head.get("id"))
    res = _reply(head, "".join(content), "".join(reasoning), finish, native, usage)
    if isinstance(res, Reply):
        res.output_ids, res.prompt_ids = output_ids or None, prompt_ids
    return res


async def _read_body(resp: aiohttp.ClientResponse, watch: KeepaliveWatch | None, token: int | None) -> bytes:
    """A JSON body; the watch learns when its first byte other than padding comes."""
    if watch is None:
        return await resp.read()
    parts: list[bytes] = []
    padding = True
    async for chunk in resp.content.iter_any():
        if padding and chunk.strip():
            padding = False
            watch.end(token)
        parts.append(chunk)
    return b"".join(parts)


def _cached(res: Reply, headers) -> bool:
    """A reply served from OpenRouter's response cache: the header says HIT, or text came with
    usage zeroed (no prompt and no completion tokens). Such a copy of an earlier answer is billed
    nothing and is never a new sample; callers send `NO_CACHE` so that none should come."""
    if str(headers.get(CACHE_STATUS, "")).strip().upper() == "HIT":
        return True
    u = res.usage
    return u.get("prompt_tokens") == 0 and u.get("completion_tokens") == 0 and bool(res.content or res.reasoning)


async def complete(session: aiohttp.ClientSession, url: str, headers: dict | None, body: bytes, stream: bool,
                   timeout: aiohttp.ClientTimeout | None = None, seen: dict | None = None,
                   progress_s: float | None = None, deadline_s: float | None = None,
                   watch: KeepaliveWatch | None = None) -> Reply | Failure:
    """POST one chat completion and classify the outcome; never raises for a bad answer or network trouble.
    `headers` and `timeout` default to the session's (which must then carry the key and a read timeout).
    `seen["generation_id"]` is set as soon as the response headers name it, so a caller that gives
    up on the request (cancels it) still knows which generation to ask the bill of.
    `progress_s`: a stream with no data chunk for this long is given up (`stalled`); `deadline_s`:
    a request not over within this long is given up (`deadline`), keep-alive or not (`request_deadline`);
    `watch` counts this request while its reply is keep-alive alone."""
    kw = {"timeout": timeout} if timeout is not None else {}
    seen = {} if seen is None else seen
    answered = False        # a provider took the request: from here on a lost answer may be billed
    sent = time.monotonic()
    token = None
    try:
        async with asyncio.timeout(deadline_s) as limit:
            async with session.post(url, data=body, headers=headers, **kw) as resp:
                status = resp.status
                if status == 200:
                    answered = True
                    seen["generation_id"] = resp.headers.get("X-Generation-Id")
                    if watch is not None:
                        token = watch.begin(sent)
                    res = await _read_stream(resp, progress_s, watch, token) if stream \
                        else parse_completion(await _read_body(resp, watch, token))
                    if isinstance(res, Reply) and _cached(res, resp.headers):
                        res = Failure(Action.RETRY, "cached", "a reply from OpenRouter's response cache (a copy of an "
                                      "earlier answer, usage zeroed): not a new sample", provider=res.provider,
                                      cost=res.usage.get("cost") or 0.0, generation_id=res.generation_id)
                    if isinstance(res, Failure) and not res.generation_id:
                        res.generation_id = seen["generation_id"]
                    return res
                raw = await resp.read()
                ra = retry_after_seconds(resp.headers.get("Retry-After"))
    except asyncio.TimeoutError:
        if limit.expired():
            idle = token is not None and watch.waits(token)
            return _lost(Failure(Action.RETRY, "deadline", f"not over within its {deadline_s:g}s deadline"
                                 + (" (keep-alive padding only)" if idle else "")), seen, answered)
        return _lost(Failure(Action.RETRY, "timeout", "no data within the read timeout (hung connection)"), seen, answered)
    except aiohttp.ClientPayloadError as e:
        return _lost(Failure(Action.RETRY, "connection", f"response cut off: {type(e).__name__}"), seen, True)
    except (aiohttp.ClientError, OSError) as e:
        refused = isinstance(e, (aiohttp.ClientConnectorError, ConnectionRefusedError))
        return _lost(Failure(Action.RETRY, "connection", f"{type(e).__name__}: {e}"[:300], refused=refused),
                     seen, answered)
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
        # a body of the wrong shape (or an SSE line too long to buffer): one bad answer, not a crash
        return _lost(Failure(Action.RETRY, "bad_response", f"{type(e).__name__}: {e}"[:300]), seen, answered)
    finally:
        if token is not None:
            watch.end(token)
    try:
        env = json.loads(raw) if raw.strip() else {}
    except ValueError:
        env = {}
    err = env.get("error") if isinstance(env, dict) else None
    if not isinstance(err, dict):
        err = {"message": raw[:200].decode("utf-8", "replace").strip() or f"HTTP {status}"}
    return classify_error(status, err, ra)


def _lost(f: Failure, seen: dict, answered: bool) -> Failure:
    """The answer was lost on the way. Once the request was sent, a provider may have taken (and
    billed) it even before any header came back (a hung connection), so only a connection that
    could not be opened is surely free; the generation id is known if the headers arrived."""
    f.generation_id = seen.get("generation_id")
    f.maybe_billed = answered or f.kind in ("timeout", "deadline") or not f.refused
    return f


# ---- when a request that makes no progress behind keep-alive is given up ----
# the slowest rate a working provider keeps over a whole answer (Kimi-K2.5's endpoints list 25-110
# tokens/s)
SLOWEST_TOKENS_PER_S = 10.0


def request_deadline(max_tokens: int, request_timeout_s: float, override: float | None = None) -> float:
    """Seconds a request may take in all: `override` if given, else
    `request_timeout_s + max_tokens / SLOWEST_TOKENS_PER_S` (a first byte, then the whole answer at
    the slowest credible rate). A JSON body is padding until its first other byte, and padding is
    normal while the provider generates, so only a total deadline bounds it; it holds for streams too."""
    if override is not None:
        return float(override)
    return float(request_timeout_s) + max_tokens / SLOWEST_TOKENS_PER_S


class KeepaliveWatch:
    """The requests answered (HTTP 200) whose reply has so far been keep-alive alone (whitespace
    padding, SSE comments), each with when its wait began: `begin` when the headers come (the wait
    counts from when the request was sent), `progress` when data comes (a stream's data chunk
    starts the wait afresh; a JSON body's first byte ends it: call `end`), `end` when it is over."""

    def __init__(self):
        self._since: dict[int, float] = {}
        self._ids = itertools.count()

    def begin(self, since: float | None = None) -> int:
        token = next(self._ids)
        self._since[token] = time.monotonic() if since is None else since
        return token

    def progress(self, token: int) -> None:
        if token in self._since:
            self._since[token] = time.monotonic()

    def end(self, token: int) -> None:
        self._since.pop(token, None)

    def waits(self, token: int) -> bool:
        """Whether this request's reply is still keep-alive alone."""
        return token in self._since

    def waiting(self, longer_than_s: float = 0.0, now: float | None = None) -> int:
        """How many have had nothing but keep-alive for more than `longer_than_s`."""
        now = time.monotonic() if now is None else now
        return sum(1 for t in self._since.values() if now - t > longer_than_s)
