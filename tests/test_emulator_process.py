"""The emulator as a separate process, and `api_base: local` through draftsmith.emulator.open_api."""

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from draftsmith.emulator import KEY_ENV, open_api, read_ledger
from draftsmith.paths import Run

from conftest import wait_until

pytestmark = pytest.mark.emulator

MODEL = "moonshotai/kimi-k2.5"


def test_process_takes_its_key_from_the_environment_and_stops_cleanly(tmp_path, api_key_file):
    _, key = api_key_file
    cfg = tmp_path / "emu.yaml"
    cfg.write_text("fault_scale: 0\ncredits: 3.0\ngeneration_delay_s: 0\n")
    state, ready = tmp_path / "state", tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "draftsmith.emulator", "--port", "0", "--config", str(cfg),
                             "--state-dir", str(state), "--ready-file", str(ready)],
                            env={**os.environ, KEY_ENV: key}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(ready.exists, what="the emulator's ready file", timeout_s=120, proc=proc)
        info = json.loads(ready.read_text())
        assert info["pid"] == proc.pid
        assert key not in open(f"/proc/{proc.pid}/cmdline").read()
        h = {"Authorization": f"Bearer {key}"}
        r = httpx.post(info["base_url"] + "/chat/completions", headers=h, timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20})
        assert r.status_code == 200
        k = httpx.get(info["base_url"] + "/key", headers=h).json()["data"]
        assert k["usage"] == pytest.approx(r.json()["usage"]["cost"]) and k["limit"] == 3.0
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert key not in out
    assert len(read_ledger(state)) == 1


def test_process_refuses_to_start_without_a_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    r = subprocess.run([sys.executable, "-m", "draftsmith.emulator", "--state-dir", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and KEY_ENV in r.stderr


def test_open_api_local_starts_and_stops_the_emulator_and_every_stage_shares_the_account(tmp_path, tiny_target,
                                                                                         monkeypatch):
    """Two stages of one run, each with its own emulator process (the synthetic backend here, for
    speed: the model backend behind open_api is exercised by tests/test_providers.py end to end)."""
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    run = Run(tmp_path, "r1")
    settings = {"fault_scale": 0, "credits": 1.0, "generation_delay_s": 0, "backend": "synthetic"}
    with open_api("local", None, run, str(tiny_target), settings, MODEL) as (url, key):
        assert url.startswith("http://127.0.0.1:") and url.endswith("/api/v1")
        r = httpx.post(url + "/chat/completions", headers=key.header(), timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        assert r.status_code == 200
        cost = r.json()["usage"]["cost"]
        pid = json.loads((run.dir("emulator") / "ready.json").read_text())["pid"]
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/key", headers=key.header(), timeout=2)
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    # the next stage of the run: a new emulator process, a new throwaway key, the same account
    with open_api("local", None, run, str(tiny_target), settings, MODEL) as (url2, key2):
        k = httpx.get(url2 + "/key", headers=key2.header()).json()["data"]
        assert k["usage"] == pytest.approx(cost) and k["limit_remaining"] == pytest.approx(1.0 - cost)
    line = read_ledger(run.dir("emulator"))[0]
    assert line["model"] == MODEL and line["output_ids"]


def test_open_api_remote_only_reads_the_key(tmp_path, api_key_file):
    path, key = api_key_file
    with open_api("https://openrouter.ai/api/v1/", str(path), Run(tmp_path, "r"), None) as (url, k):
        assert url == "https://openrouter.ai/api/v1" and k.reveal() == key
    assert not (tmp_path / "r" / "emulator").exists()
