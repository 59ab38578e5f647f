"""The local OpenRouter emulator: the embedded default of the demo and the ground truth of tests.

`api_base: local` (`open_api`) runs it as a child process (`emulator_process`, `python -m
draftsmith.emulator`) serving the target checkpoint, its state in `run.dir("emulator")` so every
stage of the run sees the same account; it stops on exit, or by itself if the parent dies. In a
test, `running(config, state_dir=...)` serves it from a background thread for the duration of a
block; tests that SIGKILL the client use the process. The key comes from the environment, never
argv. State (account and ledger) lives in the state dir and survives restarts;
`top_up(state_dir, usd)` adds credits with the server up or down."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..openrouter.apikey import ENV_VAR, ApiKey, api_key_for, read_api_key
from ..paths import Run
from .accounts import read_ledger, top_up
from .config import ADMIN_KEY_ENV, KEY_ENV, EmulatorConfig, load_config

__all__ = ["open_api", "emulator_process", "running", "serve", "Handle", "EmulatorConfig", "load_config",
           "read_ledger", "top_up", "KEY_ENV", "ADMIN_KEY_ENV", "new_key"]

START_TIMEOUT_S = 300


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


@contextmanager
def open_api(api_base: str, api_key_file: str | None, run: Run, target_model_path: str | None,
             emulator: dict | None = None, model: str | None = None) -> Iterator[tuple[str, ApiKey]]:
    """`with open_api(api_base, api_key_file, run, target_model_path, emulator, model) as (base_url,
    key)`. With `local`, the emulator runs on a free port and serves the target under the model's
    name; the key is the one from `api_key_file` / $OPENROUTER_API_KEY if there is one, else a
    random throwaway key. `emulator` is the notebooks' `emulator` parameter, a dict of emulator
    config fields (`EmulatorConfig`), e.g. {"time_scale": 0.0, "credits": 5.0,
    "fault_scale": 1.0}; its `backend` defaults to `model` (the target itself answers), and tests
    may pass `synthetic`."""
    if api_base != "local":
        yield api_base.rstrip("/"), api_key_for(api_base, api_key_file)
        return
    from ..targets.checkpoint import resolve_target

    if api_key_file or os.environ.get(ENV_VAR, "").strip():
        key = read_api_key(api_key_file)
    else:
        key = ApiKey(new_key(), "throwaway key of the local emulator")
    fields = {"backend": "model", **(emulator or {})}
    if target_model_path:
        fields["target_model_path"] = str(resolve_target(target_model_path))  # builds a built-in target here, visibly
    if model:
        fields["model"] = model
    cfg = load_config(fields)
    env = dict(os.environ, **{KEY_ENV: key.reveal()})
    env.pop(ENV_VAR, None)
    with emulator_process(run.dir("emulator"), cfg.model_dump_json(indent=1), env) as (_, base_url):
        yield base_url, key


@contextmanager
def emulator_process(state: Path, config_json: str, env: dict) -> Iterator[tuple[subprocess.Popen, str]]:
    """`python -m draftsmith.emulator` with its config, ready file, log and account in `state`, on a
    free port; yields (the process, its base URL) once it serves, and stops it on exit."""
    state.mkdir(parents=True, exist_ok=True)
    (state / "config.json").write_text(config_json)
    ready = state / "ready.json"
    ready.unlink(missing_ok=True)
    log = open(state / "emulator.log", "a")
    proc = subprocess.Popen(
        [sys.executable, "-m", "draftsmith.emulator", "--port", "0", "--config", str(state / "config.json"),
         "--state-dir", str(state), "--ready-file", str(ready), "--parent-pid", str(os.getpid())],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        yield proc, _wait_ready(proc, ready, state / "emulator.log")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_ready(proc: subprocess.Popen, ready: Path, log: Path) -> str:
    t0 = time.monotonic()
    while time.monotonic() - t0 < START_TIMEOUT_S:
        if ready.exists():
            return json.loads(ready.read_text())["base_url"]
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-15:]
            raise RuntimeError("the local emulator failed to start (exit code %s); end of %s:\n%s"
                               % (proc.returncode, log, "\n".join(tail)))
        time.sleep(0.05)
    raise TimeoutError(f"the local emulator did not start within {START_TIMEOUT_S}s; see {log}")
