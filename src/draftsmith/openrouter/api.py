"""Stage 01's synchronous face of the one HTTP stack (aiohttp, as stage 02 uses): the model's
endpoints, the balance, and its few chat completions (the pilot, the fidelity probe).

Each call runs its own short-lived event loop in a worker thread (`blocking`), because a Jupyter
kernel already runs a loop in the main thread. Answers are classified by `client.complete` (errors
inside 200s, empty answers, 402 kinds), the endpoints read by `pricing.fetch_endpoints` and the
balance by `pricing.BalanceReader`: the same code as stage 02's; failures worth retrying are
retried with `retry.backoff_delay`.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, TypeVar

import aiohttp

from ..progress import Progress
from .apikey import ApiKey
from .client import NO_CACHE, Action, Reply, complete
from .pricing import BalanceReader, fetch_endpoints
from .retry import backoff_delay

T = TypeVar("T")
IN_FLIGHT = 16      # stage 01's requests in flight at a time


class ApiError(RuntimeError):
    def __init__(self, status: int | None, message: str):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status


def blocking(headers: dict, timeout: float, work: Callable[[aiohttp.ClientSession], Awaitable[T]]) -> T:
    """`work(session)` run to its end from synchronous code, on a fresh event loop in a worker thread
    (Jupyter may already run one in this thread), with a session of its own."""
    async def main() -> T:
        limits = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        async with aiohttp.ClientSession(headers=headers, timeout=limits) as session:
            return await work(session)

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, main()).result()


class Api:
    def __init__(self, base_url: str, key: ApiKey, timeout: float = 120.0, attempts: int = 6):
        self.base_url, self.timeout, self.attempts = base_url.rstrip("/"), timeout, attempts
        self._headers = {**key.header(), "Content-Type": "application/json", **NO_CACHE}

    def _blocking(self, work: Callable[[aiohttp.ClientSession], Awaitable[T]]) -> T:
        return blocking(self._headers, self.timeout, work)

    def endpoints(self, model: str) -> list[dict]:
        """The model's endpoints (`pricing.fetch_endpoints`), once `/models` lists the model."""
        async def work(session: aiohttp.ClientSession) -> list[dict]:
            async with session.get(self.base_url + "/models") as r:
                body = _json(await r.read())
                if r.status != 200:
                    raise ApiError(r.status, _message(body))
            if model not in {m.get("id") for m in body.get("data") or []}:
                raise ValueError(f"model {model!r} is not listed by {self.base_url}/models")
            return await fetch_endpoints(session, self.base_url, model)
        return self._blocking(work)

    def balance(self) -> tuple[float | None, str]:
        """USD left and where that figure comes from (`pricing.BalanceReader`, read once)."""
        async def work(session: aiohttp.ClientSession) -> tuple[float | None, str]:
            reader = BalanceReader(session, self.base_url)
            return await reader.read(), reader.source
        return self._blocking(work)

    def chat(self, body: bytes) -> Reply:
        """A usable non-streaming completion of a request body (`client.BodyMaker`); raises
        ApiError on what must not be retried or after the last attempt."""
        return self._blocking(lambda session: self._chat(session, body))

    def chat_all(self, bodies: list[bytes], desc: str, failures: bool = False) -> list[Reply]:
        """The replies to `bodies`, in their order, `IN_FLIGHT` at a time, with a progress bar;
        `failures`: an ApiError in place of each request that failed, instead of raising the first."""
        async def work(session: aiohttp.ClientSession) -> list[Reply]:
            gate = asyncio.Semaphore(IN_FLIGHT)

            async def one(body: bytes) -> Reply | ApiError:
                async with gate:
                    try:
                        reply = await self._chat(session, body)
                    except ApiError as e:
                        if not failures:
                            raise
                        reply = e
                bar.update()
                return reply
            return list(await asyncio.gather(*map(one, bodies)))

        with Progress(total=len(bodies), desc=desc, unit="req") as bar:
            return self._blocking(work)

    async def _chat(self, session: aiohttp.ClientSession, body: bytes) -> Reply:
        for attempt in range(1, self.attempts + 1):
            outcome = await complete(session, self.base_url + "/chat/completions", None, body, stream=False)
            if isinstance(outcome, Reply):
                return outcome
            if outcome.action not in (Action.RETRY, Action.THROTTLE, Action.UNAVAILABLE) or attempt == self.attempts:
                raise ApiError(outcome.status, str(outcome))
            await asyncio.sleep(backoff_delay(attempt, outcome.retry_after, base=0.25, cap=8.0))
        raise AssertionError("unreachable")


def _json(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"{}")  # OpenRouter may pad bodies with leading whitespace
    except json.JSONDecodeError:
        return {"error": {"message": f"not JSON: {raw[:80]!r}"}}
    return body if isinstance(body, dict) else {"error": {"message": f"not a JSON object: {raw[:80]!r}"}}


def _message(body: dict) -> str:
    err = body.get("error") or {}
    return str(err.get("message", body))[:300]
