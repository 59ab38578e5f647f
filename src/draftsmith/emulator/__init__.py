"""The local OpenRouter emulator: the embedded default of the demo and the ground truth of tests.

In a test, `running(config, state_dir=...)` serves it from a background thread for the duration of
a block; as a process (`python -m draftsmith.emulator`, see its `__main__`) it serves tests that
SIGKILL the client and `api_base: local`. The key comes from the environment, never argv. State
(account and ledger) lives in the state dir and survives restarts; `top_up(state_dir, usd)` adds
credits with the server up or down."""

from __future__ import annotations

import asyncio
import secrets
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..openrouter.apikey import ApiKey
from .config import ADMIN_KEY_ENV, KEY_ENV, EmulatorConfig, load_config
from .ledger import read_ledger, top_up

__all__ = ["running", "serve", "Handle", "EmulatorConfig", "load_config", "read_ledger", "top_up",
           "KEY_ENV", "ADMIN_KEY_ENV", "new_key"]


def new_key() -> str:
    return "sk-or-v1-emu-" + secrets.token_hex(24)


@dataclass
class Handle:
    base_url: str
    key: ApiKey
    admin_key: str
    state_dir: Path
    emulator: object = field(repr=False, default=None)  # the server.Emulator (in-process only)

    @property
    def ledger(self):
        return self.emulator.ledger

    def ledger_lines(self) -> list[dict]:
        return read_ledger(self.state_dir)

    def top_up(self, usd: float) -> None:
        top_up(self.state_dir, usd)


async def serve(emulator, host: str, port: int):
    """Start the app of `emulator` on host:port (0 = a free port); returns (runner, port)."""
    from aiohttp import web

    runner = web.AppRunner(emulator.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


@contextmanager
def running(config: EmulatorConfig | dict | str | None = None, *, state_dir: str | Path, key: str | None = None,
            admin_key: str | None = None, host: str = "127.0.0.1", port: int = 0) -> Iterator[Handle]:
    """An emulator serving in a background thread (its own event loop, a free port) for the
    duration of the block:

        with running(config, state_dir=tmp) as emu:       # config: EmulatorConfig, dict, file or None
            emu.base_url, emu.key, emu.admin_key, emu.state_dir, emu.ledger_lines()
    """
    from .server import Emulator

    cfg = config if isinstance(config, EmulatorConfig) else load_config(config)
    key = key or new_key()
    admin_key = admin_key or cfg.admin_key or secrets.token_hex(16)
    ready = threading.Event()
    box: dict = {}
    loop = asyncio.new_event_loop()

    def main():
        asyncio.set_event_loop(loop)
        try:
            emu = Emulator(cfg, key, state_dir, admin_key)
            runner, bound = loop.run_until_complete(serve(emu, host, port))
            box.update(emu=emu, runner=runner, port=bound)
        except BaseException as e:  # report start-up failures to the caller
            box["error"] = e
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        emu.close()
        loop.close()

    thread = threading.Thread(target=main, name="draftsmith-emulator", daemon=True)
    thread.start()
    ready.wait()
    if "error" in box:
        thread.join()
        raise box["error"]
    try:
        yield Handle(f"http://{host}:{box['port']}/api/v1", ApiKey(key, "emulator"), admin_key,
                     Path(state_dir), box["emu"])
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
