"""A small synchronous OpenRouter client for stage 01's few requests (the endpoint list, the pilot,
the fidelity probe). Answers are classified by stage 02's `client` (errors inside 200s, empty
answers, 402 kinds) and retried with its backoff."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from .apikey import ApiKey
from .client import Failure, Reply, classify_error, parse_completion, retry_after_seconds
from ..progress import Progress
from .retry import backoff_delay


class ApiError(RuntimeError):
    def __init__(self, status: int | None, message: str):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status


class Api:
    def __init__(self, base_url: str, key: ApiKey, timeout: float = 120.0, attempts: int = 6):
        self.base_url, self.attempts = base_url.rstrip("/"), attempts
        self._http = httpx.Client(headers={**key.header(), "Content-Type": "application/json"}, timeout=timeout)

    def get(self, path: str, **params) -> dict:
        r = self._http.get(self.base_url + path, params=params or None)
        body = _json(r)
        if r.status_code != 200:
            raise ApiError(r.status_code, _message(body))
        return body

    def chat(self, body: bytes) -> Reply:
        """A usable non-streaming completion of a request body (`client.BodyMaker`); raises
        ApiError on what must not be retried or after the last attempt."""
        for attempt in range(1, self.attempts + 1):
            try:
                r = self._http.post(self.base_url + "/chat/completions", content=body)
            except (httpx.TimeoutException, httpx.TransportError) as e:
                outcome = Failure("retry", "connection", type(e).__name__)
            else:
                outcome = parse_completion(r.content) if r.status_code == 200 else \
                    classify_error(r.status_code, _json(r).get("error"), retry_after_seconds(r.headers.get("Retry-After")))
            if isinstance(outcome, Reply):
                return outcome
            if outcome.action not in ("retry", "throttle", "unavailable") or attempt == self.attempts:
                raise ApiError(outcome.status, str(outcome))
            time.sleep(backoff_delay(attempt, outcome.retry_after, base=0.25, cap=8.0))
        raise AssertionError("unreachable")

    def chat_all(self, bodies: list[bytes], desc: str) -> list[Reply]:
        """The replies to `bodies`, in their order, 16 at a time, with a progress bar."""
        with Progress(total=len(bodies), desc=desc, unit="req") as bar, ThreadPoolExecutor(16) as pool:
            def one(body: bytes) -> Reply:
                reply = self.chat(body)
                bar.update()
                return reply
            return list(pool.map(one, bodies))

    def close(self) -> None:
        self._http.close()


def _json(r: httpx.Response) -> dict:
    try:
        return json.loads(r.content or b"{}")  # OpenRouter may pad bodies with leading whitespace
    except json.JSONDecodeError:
        return {"error": {"message": f"not JSON: {r.content[:80]!r}"}}


def _message(body: dict) -> str:
    err = body.get("error") or {}
    return str(err.get("message", body))[:300]
