"""How many chat completions per second the local emulator sustains on loopback (synthetic backend),
measured by an independent load generator in another process, against what stage 02 needs.

Stage 02's benchmark drives 2000 requests in flight with ~400-token responses at ~50 tokens/s per
stream, i.e. 2000 / (1 s + 400/50 s) ~ 222, call it 250 responses/s. The emulator must sustain
that with room to spare, or stage 02's numbers would measure the server instead of the client.

Scenarios (each: emulator process + load-generator process, fresh state):
  json-max     time_scale 0, 256 in flight, non-streaming: the server's ceiling for JSON answers
  stream-max   time_scale 0, 256 in flight, SSE: ceiling for streams (chunks of 16 tokens)
  stage02      time_scale 1, 2000 in flight, 400-token answers paced at 50 tokens/s, 1 s to first
               token, non-streaming: what stage 02's benchmark asks of it
  stage02-sse  the same, streaming (chunks every 0.1 s)

Run: .venv/bin/python bench/bench_emulator.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import psutil
from pathlib import Path

NEEDED = 250.0  # responses/s stage 02's benchmark needs
MODEL = "moonshotai/kimi-k2.5"

SCENARIOS = {  # ramp: seconds before counting starts (a paced response takes ~9 s)
    "json-max": dict(time_scale=0.0, inflight=256, stream=False, ramp=2.0),
    "stream-max": dict(time_scale=0.0, inflight=256, stream=True, ramp=2.0),
    "stage02": dict(time_scale=1.0, inflight=2000, stream=False, ramp=12.0),
    "stage02-sse": dict(time_scale=1.0, inflight=2000, stream=True, ramp=12.0),
}


MODEL_SCENARIO = dict(time_scale=0.0, inflight=64, stream=False, ramp=25.0, backend="model")


def emulator_config(time_scale: float, backend: str = "synthetic") -> dict:
    ep = {"quantization": "int4", "prompt_price": 0.5, "completion_price": 2.0, "capacity": 100000,
          "latency_s": {"median": 1.0, "sigma": 0.2}, "tokens_per_s": {"median": 50.0, "sigma": 0.2}}
    if backend == "model":  # the demo's set-up: the tiny target sampled for real, 64 in flight
        return {"backend": "model", "target_model_path": "tiny", "fault_scale": 0, "credits": 1e9,
                "in_flight_budget": None, "time_scale": time_scale}
    return {"time_scale": time_scale, "fault_scale": 0, "credits": 1e9, "in_flight_budget": None,
            "synthetic_tokens": 400, "synthetic_reasoning_fraction": 0.3, "padding_interval_s": 5.0,
            "providers": [{"slug": f"p{i}", "name": f"P{i}", **ep} for i in range(4)]}


# ---- the load generator (runs in its own process) ------------------------------------------------

async def generate_load(url: str, key: str, inflight: int, seconds: float, stream: bool, ramp: float,
                        max_tokens: int) -> dict:
    """Keep `inflight` requests going; count the responses completed between `ramp` and
    `ramp + seconds` (steady state)."""
    import aiohttp

    done = tokens = errors = 0
    lat: list[float] = []
    warm = time.monotonic() + ramp
    stop_at = warm + seconds
    conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(connector=conn, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def worker(w: int):
            nonlocal done, tokens, errors
            i = 0
            while time.monotonic() < stop_at:
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {w}-{i}"}],
                        "max_tokens": max_tokens, "stream": stream}
                i += 1
                t0 = time.monotonic()
                try:
                    async with s.post(url + "/chat/completions", json=body) as r:
                        raw = await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok, raw = False, b""
                t1 = time.monotonic()
                if t1 < warm or t1 > stop_at:
                    continue
                if not ok:
                    errors += 1
                    continue
                done += 1
                lat.append(t1 - t0)
                if stream:
                    last = raw.rstrip().rsplit(b"data: ", 2)[-2]
                    tokens += json.loads(last)["usage"]["completion_tokens"]
                else:
                    tokens += json.loads(raw)["usage"]["completion_tokens"]
        await asyncio.gather(*[worker(w) for w in range(inflight)])
    lat.sort()
    return {"responses_per_s": done / seconds, "tokens_per_s": tokens / seconds, "errors": errors,
            "p50_s": lat[len(lat) // 2] if lat else None, "p99_s": lat[int(len(lat) * 0.99)] if lat else None}


def client_main() -> None:
    args = json.loads(sys.argv[2])
    key = os.environ["BENCH_KEY"]
    print(json.dumps(asyncio.run(generate_load(args["url"], key, args["inflight"], args["seconds"], args["stream"],
                                               args["ramp"], args["max_tokens"]))))


# ---- orchestration -------------------------------------------------------------------------------

def run_scenario(name: str, spec: dict, seconds: float) -> dict:
    from draftsmith.emulator import KEY_ENV, new_key

    key = new_key()
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "cfg.json"
        cfg.write_text(json.dumps(emulator_config(spec["time_scale"], spec.get("backend", "synthetic"))))
        ready = Path(d) / "ready.json"
        env = {**os.environ, KEY_ENV: key}
        server = subprocess.Popen([sys.executable, "-m", "draftsmith.emulator", "--port", "0", "--config", str(cfg),
                                   "--state-dir", str(Path(d) / "state"), "--ready-file", str(ready)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            t0 = time.monotonic()
            while not ready.exists():
                if server.poll() is not None or time.monotonic() - t0 > 120:
                    raise RuntimeError(f"emulator did not start: {server.stderr.read()[-2000:]}")
                time.sleep(0.05)
            url = json.loads(ready.read_text())["base_url"]
            args = json.dumps({"url": url, "inflight": spec["inflight"], "seconds": seconds, "stream": spec["stream"],
                               "ramp": spec["ramp"], "max_tokens": 192 if spec.get("backend") == "model" else 600})
            client = subprocess.Popen([sys.executable, __file__, "--client", args], env={**os.environ, "BENCH_KEY": key},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            # the server's own CPU time over the counted window: what a response costs it, whatever
            # else the machine is doing
            proc = psutil.Process(server.pid)
            time.sleep(spec["ramp"])
            cpu0, wall0 = sum(proc.cpu_times()[:2]), time.monotonic()
            time.sleep(seconds)
            cpu1, wall1 = sum(proc.cpu_times()[:2]), time.monotonic()
            out, err = client.communicate(timeout=seconds + spec["ramp"] + 180)
            if client.returncode != 0:
                raise RuntimeError(f"load generator failed: {err[-2000:]}")
            r = json.loads(out.strip().splitlines()[-1])
            r["server_cpu_share"] = (cpu1 - cpu0) / (wall1 - wall0)
            r["server_cpu_ms"] = 1000 * (cpu1 - cpu0) / max(1, r["responses_per_s"] * seconds)
            return r
        finally:
            server.terminate()
            server.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="measured seconds per scenario (after ramp-up)")
    ap.add_argument("--only", nargs="*", choices=list(SCENARIOS), help="run only these scenarios")
    ap.add_argument("--model", action="store_true", help="also time the model backend as the demo uses it")
    args = ap.parse_args()
    if args.model:
        from draftsmith.targets.checkpoint import resolve_target

        resolve_target("tiny")  # built (once) before timing
        r = run_scenario("model-demo", MODEL_SCENARIO, args.seconds)
        print(f"model backend (tiny target, 64 in flight, max_tokens 192): {r['tokens_per_s']:.0f} output tokens/s, "
              f"{r['responses_per_s']:.1f} responses/s -> 50K demo tokens in ~{50000 / max(r['tokens_per_s'], 1e-9):.0f} s "
              f"(server used {r['server_cpu_share']:.0%} of a core)")
    rows = []
    for name, spec in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        r = run_scenario(name, spec, args.seconds)
        rows.append((name, spec, r))
        print(f"  {name}: {r}", file=sys.stderr, flush=True)
    ideal = 2000 / (1.0 + 400 / 50)
    print(f"\nemulator throughput on loopback (synthetic backend, 2 shared cores, load generator in its own "
          f"process); stage 02 needs ~{NEEDED:.0f} responses/s (ideal at 2000 in flight: {ideal:.0f}/s)\n")
    print(f"{'scenario':<12} {'in flight':>9} {'stream':>6} {'paced':>5} {'resp/s':>7} {'tokens/s':>8} "
          f"{'p50 s':>6} {'p99 s':>6} {'err':>4} {'x needed':>8} {'srv cpu':>7} {'ms/resp':>7} {'1-core resp/s':>13} "
          f"{'x needed':>8}")
    for name, spec, r in rows:
        per_core = 1000 / r["server_cpu_ms"] if r["server_cpu_ms"] else float("nan")
        print(f"{name:<12} {spec['inflight']:>9} {str(spec['stream']):>6} {str(spec['time_scale'] > 0):>5} "
              f"{r['responses_per_s']:>7.0f} {r['tokens_per_s']:>8.0f} {r['p50_s'] or 0:>6.2f} {r['p99_s'] or 0:>6.2f} "
              f"{r['errors']:>4} {r['responses_per_s'] / NEEDED:>8.2f} {r['server_cpu_share']:>7.0%} "
              f"{r['server_cpu_ms']:>7.2f} {per_core:>13.0f} {per_core / NEEDED:>8.2f}")
    print("\nresp/s: what the load generator got (the machine is shared: it and the server compete for 2 cores); "
          "srv cpu: share of one core the server used; ms/resp: server CPU per response; 1-core resp/s: "
          "what the server sustains with one core to itself (1000 / ms/resp).")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--client":
        client_main()
    else:
        main()
