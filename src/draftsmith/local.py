"""`api_base: local`: run a stage against the local OpenRouter emulator instead of the real one.

`open_api` yields (base_url, key). For a real `api_base` it only reads the key; for `local` it
starts the emulator as a child process serving the target checkpoint, its state in
`run.dir("emulator")` so every stage of the run sees the same account, and stops it on exit (the
emulator also stops by itself if this process dies). The key reaches the child through its
environment, never its command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .openrouter.apikey import ENV_VAR, ApiKey, api_key_for, read_api_key
from .paths import Run

START_TIMEOUT_S = 300


@contextmanager
def open_api(api_base: str, api_key_file: str | None, run: Run, target_model_path: str | None,
             emulator: dict | None = None, model: str | None = None) -> Iterator[tuple[str, ApiKey]]:
    """`with open_api(api_base, api_key_file, run, target_model_path, emulator, model) as (base_url,
    key)`. With `local`, the emulator runs on a free port and serves the target under the model's
    name; the key is the one from `api_key_file` / $OPENROUTER_API_KEY if there is one, else a
    random throwaway key. `emulator` is the notebooks' `emulator` parameter, a dict of emulator
    config fields (draftsmith.emulator.config), e.g. {"time_scale": 0.0, "credits": 5.0,
    "fault_scale": 1.0}; its `backend` defaults to `model` (the target itself answers), and tests
    may pass `synthetic`."""
    if api_base != "local":
        yield api_base.rstrip("/"), api_key_for(api_base, api_key_file)
        return
    from .emulator import KEY_ENV, new_key
    from .emulator.config import load_config
    from .targets.checkpoint import resolve_target

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
