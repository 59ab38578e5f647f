"""Writing a chat response the way OpenRouter does: SSE streams and padded JSON bodies.

Streams start with `: OPENROUTER PROCESSING` and repeat that comment while nothing else is sent
for `interval` seconds; chunks are `data: {json}` lines, then a usage chunk with empty `choices`,
then `data: [DONE]`. Events ready at the same moment go out in one write (fewer syscalls). Non-streaming responses that take longer than `interval` commit to HTTP 200
and send whitespace every `interval` as keep-alive, so the JSON body (or an error body, still with
status 200) follows leading whitespace. Every response carries the `headers` it was given (the
server passes `X-Generation-Id`). `spoil` makes the next text sent carry bytes that are not
UTF-8 (a provider's broken encoding). `cut` sends the headers and part of the body, then closes the
connection (a response lost on the wire). A client gone away shows up as ConnectionResetError.
Errors go out in OpenRouter's envelope, `{"error": {code, message, metadata}, "user_id"}`; an error
about whether the model can be served carries `error.availability` {code, retryable, retry_after,
...} as OpenRouter's have since August 2026 (`availability`).
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

API = "/api/v1"  # every path the emulator serves starts with it
PROCESSING = b": OPENROUTER PROCESSING\n\n"
USER_ID = "user_emulator"


def availability(code: str, retryable: bool, retry_after: float | None = None, **more) -> dict:
    """`error.availability`: model_not_found, capacity_exhausted, temporarily_unavailable,
    constraint_filtered or no_endpoints; `more` adds `excluded_by` / `constraint` where they apply."""
    return {"code": code, "retryable": retryable, "retry_after": retry_after, **more}


def error_body(code: int, message: str, metadata: dict | None = None, avail: dict | None = None) -> dict:
    err = {"code": code, "message": message}
    if metadata is not None:
        err["metadata"] = metadata
    if avail is not None:
        err["availability"] = avail
    return {"error": err, "user_id": USER_ID}


def error_response(code: int, message: str, metadata: dict | None = None, headers: dict | None = None,
                   avail: dict | None = None):
    return web.json_response(error_body(code, message, metadata, avail), status=code, headers=headers)


def _dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


NOT_UTF8 = b"\xff\xfe"    # never valid in UTF-8


def spoiled(data: bytes) -> bytes | None:
    """`data` (a body or chunk) with bytes that are not UTF-8 put inside its text (the content,
    else the reasoning); None when it carries no text."""
    for key in (b'"content":"', b'"reasoning":"'):
        i = data.find(key)
        if i >= 0 and data[i + len(key):i + len(key) + 1] != b'"':
            i += len(key) + 1
            return data[:i] + NOT_UTF8 + data[i:]
    return None


class _Writer:
    def __init__(self, request: web.Request, interval: float, headers: dict | None = None):
        self.request, self.interval, self.headers = request, interval, dict(headers or {})
        self.resp: web.StreamResponse | None = None
        self._lock = asyncio.Lock()
        self._last = asyncio.get_running_loop().time()
        self._keepalive: asyncio.Task | None = None
        self.gone = False
        self.spoil = False      # the next text sent carries bytes that are not UTF-8 (`spoiled`)

    async def _write(self, data: bytes) -> None:
        async with self._lock:
            await self._write_locked(data)

    async def _write_locked(self, data: bytes) -> None:
        if self.resp is None:
            await self._prepare()
        try:
            await self.resp.write(data)
        except ConnectionResetError:
            self.gone = True
            raise
        self._last = asyncio.get_running_loop().time()

    async def _prepare(self) -> None:
        raise NotImplementedError

    @property
    def last_write(self) -> float:
        """When bytes last went out (at first: when the writer was made), on the event loop's clock."""
        return self._last

    def start_keepalive(self) -> None:
        self._keepalive = asyncio.create_task(self._keepalive_loop())

    async def _keepalive_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await asyncio.sleep(max(0.0, self._last + self.interval - loop.time()))
                if loop.time() - self._last >= self.interval:
                    await self._write(self.KEEPALIVE)
        except ConnectionResetError:
            pass

    def stop_keepalive(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None

    async def send_headers(self) -> None:
        """Commit the status and headers now (nothing of the body yet)."""
        async with self._lock:
            if self.resp is None:
                await self._prepare()

    def close_connection(self) -> None:
        """Drop the connection mid-response, as a network failure would."""
        self.stop_keepalive()
        self.gone = True
        if self.request.transport is not None:
            self.request.transport.close()


class SSEWriter(_Writer):
    KEEPALIVE = PROCESSING

    async def _prepare(self) -> None:
        self.resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"} | self.headers)
        await self.resp.prepare(self.request)

    async def open(self, keepalive: bool = True) -> None:
        """Send the headers and the first comment; then repeat it while nothing else is sent (`keepalive`)."""
        self._buf: list[bytes] = []
        await self._write(PROCESSING)
        if keepalive:
            self.start_keepalive()

    def event(self, obj) -> None:
        """Queue one `data:` event; `flush` sends the queued ones in one write."""
        data = _dumps(obj)
        if self.spoil:
            bad = spoiled(data)
            if bad is not None:
                data, self.spoil = bad, False
        self._buf.append(b"data: " + data + b"\n\n")

    async def flush(self) -> None:
        if self._buf:
            data, self._buf = b"".join(self._buf), []
            await self._write(data)

    async def done(self) -> None:
        self.stop_keepalive()
        self._buf.append(b"data: [DONE]\n\n")
        await self.flush()
        await self.resp.write_eof()

    async def end(self) -> None:
        """End the stream without [DONE] (after an error chunk)."""
        self.stop_keepalive()
        await self.flush()
        await self.resp.write_eof()


class JSONWriter(_Writer):
    KEEPALIVE = b"\n"

    async def _prepare(self) -> None:
        self.resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"} | self.headers)
        await self.resp.prepare(self.request)

    async def open(self) -> None:
        self.start_keepalive()

    async def body(self, obj, status: int = 200) -> web.StreamResponse:
        """The JSON body: a plain response if nothing was sent yet, else after the padding."""
        self.stop_keepalive()
        data = _dumps(obj)
        if self.spoil:
            data = spoiled(data) or data + NOT_UTF8
        async with self._lock:
            if self.resp is None:
                return web.Response(body=data, status=status, content_type="application/json",
                                    headers=self.headers)
            await self._write_locked(data)
            await self.resp.write_eof()
            return self.resp

    async def cut(self, obj) -> web.StreamResponse:
        """The headers and the first half of the JSON body, then the connection closes."""
        self.stop_keepalive()
        data = _dumps(obj)
        async with self._lock:
            try:
                await self._write_locked(data[: len(data) // 2])
            except ConnectionResetError:
                pass
        self.close_connection()
        return self.resp
