"""Stage 02 benchmarks, side by side in one run, against the local emulator (synthetic backend, in
its own process so that its CPU is not counted as the client's).

1. Client cost: CPU seconds per 1000 responses at `--concurrency` in flight (~600-token
   responses, served as fast as the emulator can):
     floor            a bare aiohttp loop doing only POST + json.loads
     floor, gc        the same loop under stage 02's garbage-collector setting (session.py
                      fewer_collections): what stage 02 itself adds, apart from the collector
     draftsmith       the whole of stage 02: budgets, resume file, manifest, progress and all
     openai+aiohttp   AsyncOpenAI with DefaultAioHttpClient
     openai default   AsyncOpenAI with its default httpx transport
   Each client runs in a fresh process that counts only its own CPU around its work (connections
   closed included); the clients take turns for several rounds (the machine is noisy), and the
   table shows the median and the ratio to the floor.
2. Slot utilisation: every provider streams at 50 tok/s, ~400-token responses, time to first
   token 0.05 s; achieved output tok/s / (concurrency x 50 tok/s) while every slot is busy, split
   into what the client controls (slots occupied) and what the server delivered (stream speed),
   next to the bare aiohttp floor under the same server.
3. Memory: peak RSS of stage 02 at `--concurrency` in flight over 20k and over 200k prompts
   (same token budget): it must not grow with the number of prompts.

    .venv/bin/python bench/bench_generate.py            # ~20 minutes on 2 busy cores
    .venv/bin/python bench/bench_generate.py --quick    # one round of each, ~8 minutes
    .venv/bin/python bench/bench_generate.py --only cpu|slots|memory
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from draftsmith.generate import outputs
from draftsmith.emulator import read_ledger
from draftsmith.paths import Run

REPO = Path(__file__).resolve().parents[1]
MODEL = "moonshotai/kimi-k2.5"
KEY = "sk-or-v1-bench-" + "0" * 48


# --- the emulator, in its own process ------------------------------------------------------------

class Emulator:
    """`python -m draftsmith.emulator` in a child process (its CPU is not the client's)."""

    def __init__(self, workdir: Path, **config):
        n = len(list(workdir.glob("emulator-*.json")))
        self.state = workdir / f"emulator-{n}"
        cfg = workdir / f"emulator-{n}.json"
        cfg.write_text(json.dumps(config))
        ready = workdir / f"emulator-{n}.ready"
        env = {**os.environ, "DRAFTSMITH_EMULATOR_KEY": KEY}
        self.proc = subprocess.Popen([sys.executable, "-m", "draftsmith.emulator", "--port", "0", "--config", str(cfg),
                                      "--state-dir", str(self.state), "--ready-file", str(ready)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=open(workdir / "emulator.log", "ab"))
        deadline = time.time() + 300
        while not ready.exists():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"emulator did not start; see {workdir / 'emulator.log'}")
            time.sleep(0.1)
        self.base = json.loads(ready.read_text())["base_url"]

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def fast_config(tokens: int) -> dict:
    """Answers as fast as the emulator can: no simulated waiting, no faults, no capacity limits."""
    return {"backend": "synthetic", "time_scale": 0.0, "fault_scale": 0.0, "capacity_scale": 1000.0,
            "credits": 1e6, "in_flight_budget": None, "synthetic_tokens": tokens}


def paced_config(tokens: int, tok_s: float, ttft: float) -> dict:
    ep = {"slug": "bench", "name": "Bench", "quantization": "int4", "prompt_price": 0.5, "completion_price": 2.0,
          "latency_s": {"median": ttft, "sigma": 0.0}, "tokens_per_s": {"median": tok_s, "sigma": 0.0},
          "capacity": 100000}
    return {"backend": "synthetic", "time_scale": 1.0, "fault_scale": 0.0, "credits": 1e6,
            "in_flight_budget": None, "synthetic_tokens": tokens, "providers": [ep]}


def write_prompts(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "messages": [
                {"role": "user", "content": f"Question {i}: explain topic number {i % 977} in a few paragraphs."}]}) + "\n")
    return path


# --- the clients (each runs in its own process: `--client NAME`) --------------------------------

def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def prompts(path: str):
    with open(path) as f:
        for line in f:
            yield json.loads(line)["messages"]


async def run_floor(base, n, conc, path, gc_like_stage_02=False):
    import aiohttp

    if gc_like_stage_02:
        from draftsmith.generate.session import fewer_collections
        with fewer_collections():
            return await run_floor(base, n, conc, path)

    url, headers = base + "/chat/completions", {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc + 16)) as s:
        it = prompts(path)
        done = tokens = 0

        async def worker():
            nonlocal done, tokens
            for m in it:
                async with s.post(url, json={"model": MODEL, "max_tokens": 1024, "messages": m}, headers=headers) as r:
                    body = json.loads(await r.read())
                    assert "choices" in body, body
                    done += 1
                    tokens += body["usage"]["completion_tokens"]
        c0, t0 = cpu(), time.time()
        await asyncio.gather(*[worker() for _ in range(conc)])
    return cpu() - c0, time.time() - t0, done, tokens      # closing the connections counts too, as for all


async def run_openai(base, n, conc, path, aio: bool):
    from openai import AsyncOpenAI, DefaultAioHttpClient

    # Only the timeout is changed from the defaults: 2000 requests queue at a 2-core server for longer
    # than the default connect timeout (5 s).
    client = AsyncOpenAI(base_url=base, api_key=KEY, timeout=600.0,
                         http_client=DefaultAioHttpClient(timeout=600.0) if aio else None)
    it = prompts(path)
    done = 0

    async def worker():
        nonlocal done
        for m in it:
            r = await client.chat.completions.create(model=MODEL, messages=m, max_tokens=1024)
            assert r.choices
            done += 1
    c0, t0 = cpu(), time.time()
    await asyncio.gather(*[worker() for _ in range(conc)])
    await client.close()
    return cpu() - c0, time.time() - t0, done, None


def run_draftsmith(base, n, conc, path, out, budget=None, max_tokens=1024):
    from draftsmith.config import GenerateConfig
    from draftsmith.generate.stage import run_at
    from draftsmith.openrouter.apikey import ApiKey

    ds = {"name": "bench", "path": path}
    if budget:
        ds["output_token_budget"] = budget
    c0, t0 = cpu(), time.time()
    cfg = GenerateConfig(datasets=[ds], model=MODEL, max_tokens=max_tokens, concurrency=conc, spend_limit_usd=1e5,
                         native_precision="int4", target_model_path=None)
    r = run_at(base, ApiKey(KEY, "bench"), Run(out, "bench"), cfg, log=lambda *a: None)
    assert r.complete, r.message
    print(json.dumps({"peak_in_flight": r.session["peak_in_flight"]}), file=sys.stderr)
    return cpu() - c0, time.time() - t0, r.session["samples"], r.session["completion_tokens"]


def client_main(a) -> None:
    if a.client in ("floor", "floor, gc"):
        res = asyncio.run(run_floor(a.base, a.n, a.conc, a.prompts, gc_like_stage_02=a.client == "floor, gc"))
    elif a.client in ("openai+aiohttp", "openai default"):
        res = asyncio.run(run_openai(a.base, a.n, a.conc, a.prompts, aio=a.client == "openai+aiohttp"))
    else:
        res = run_draftsmith(a.base, a.n, a.conc, a.prompts, a.out, a.budget, a.max_tokens)
    cpu_s, wall_s, done, tokens = res
    print(json.dumps({"cpu_s": cpu_s, "wall_s": wall_s, "responses": done, "tokens": tokens, "maxrss_mb": peak_rss_mb()}))


def peak_rss_mb() -> float:
    """This process's peak RSS. (Not ru_maxrss: Linux carries the parent's peak across fork+exec.)"""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_client(name, base, n, conc, prompts_path, out=None, budget=None, max_tokens=1024, env=None) -> dict:
    cmd = [sys.executable, __file__, "--client", name, "--base", base, "--n", str(n), "--conc", str(conc),
           "--prompts", str(prompts_path), "--out", str(out or tempfile.mkdtemp()), "--max-tokens", str(max_tokens)]
    if budget:
        cmd += ["--budget", str(budget)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DRAFTSMITH_PROGRESS": "log",
                                                                 "DRAFTSMITH_PROGRESS_INTERVAL": "10", **(env or {})})
    if p.returncode != 0:
        raise RuntimeError(f"client {name} failed:\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for line in p.stderr.splitlines():
        if line.startswith('{"peak_in_flight"'):
            out.update(json.loads(line))
    return out


# --- the three benchmarks ---------------------------------------------------------------------

def bench_cpu(work: Path, n: int, conc: int, reps: int, openai_reps: int) -> None:
    emu = Emulator(work, **fast_config(600))
    try:
        path = write_prompts(work / "cpu_prompts.jsonl", n)
        names = ["floor", "floor, gc", "draftsmith", "openai+aiohttp", "openai default"]
        runs = {k: [] for k in names}
        run_client("floor", emu.base, n, conc, path)           # warm the emulator up
        for rep in range(reps):
            order = names if rep < openai_reps else names[:3]
            order = order if rep % 2 == 0 else order[::-1]      # alternate who goes first
            for name in order:
                out = work / f"cpu-{name.replace(' ', '_').replace('+', '_').replace(',', '')}-{rep}"
                r = run_client(name, emu.base, n, conc, path, out)
                assert r["responses"] == n, (name, r)
                runs[name].append(r)
                print(f"  round {rep + 1}: {name:15s} {1000 * r['cpu_s'] / n:.3f} CPU-s/1000, "
                      f"{r['wall_s']:.1f}s wall", flush=True)
    finally:
        emu.close()
    med = {k: statistics.median(1000 * r["cpu_s"] / n for r in v) for k, v in runs.items()}
    print(f"\n## Client CPU per 1000 responses ({n} responses of ~600 tokens, {conc} in flight; median of "
          f"{reps} rounds for floor and draftsmith, {openai_reps} for openai)\n")
    print("| client | CPU-s / 1000 | x floor | wall s | rounds (CPU-s/1000) |")
    print("|---|---|---|---|---|")
    for name in names:
        per = [1000 * r["cpu_s"] / n for r in runs[name]]
        print(f"| {name} | {med[name]:.3f} | {med[name] / med['floor']:.2f} | "
              f"{statistics.median(r['wall_s'] for r in runs[name]):.1f} | {', '.join(f'{x:.3f}' for x in per)} |")
    pairs = [d["cpu_s"] / f["cpu_s"] for f, d in zip(runs["floor"], runs["draftsmith"])]
    print(f"\ndraftsmith / floor = {med['draftsmith'] / med['floor']:.2f} (target <= 1.10; round by round "
          f"{', '.join(f'{x:.2f}' for x in pairs)}); draftsmith / (floor, gc) = "
          f"{med['draftsmith'] / med['floor, gc']:.2f}; best openai / draftsmith = "
          f"{min(med['openai+aiohttp'], med['openai default']) / med['draftsmith']:.2f}")


def bench_slots(work: Path, conc: int, seconds: float) -> None:
    tok_s, tokens, ttft = 50.0, 400, 0.05
    emu = Emulator(work, **paced_config(tokens, tok_s, ttft))
    try:
        # no token budget (its taper near the end would empty slots on purpose): the prompts run out instead
        path = write_prompts(work / "slot_prompts.jsonl", int(conc * tok_s * seconds / tokens))
        out = work / "slots"
        server = psutil.Process(emu.proc.pid)
        c0 = sum(server.cpu_times()[:2])
        r = run_client("draftsmith", emu.base, 0, conc, path, out)
        server_cpu = sum(server.cpu_times()[:2]) - c0
        floor = run_client("floor", emu.base, 0, conc, path)      # the same prompts, the same server
        ledger = {x["generation_id"]: x for x in read_ledger(emu.state)}
    finally:
        emu.close()
    rows = [r for _, r in outputs.read_responses(Run(out, "bench"), "bench")]
    last_start = max(x["started_at"] for x in rows)
    first_end = min(x["completed_at"] for x in rows)
    lo, hi = first_end + 2.0, last_start       # every slot busy: after the first responses, before the last dispatch
    # tokens produced inside the window: each response's tokens spread evenly over its time in flight
    toks = sum(x["usage"]["completion_tokens"] * max(0.0, min(hi, x["completed_at"]) - max(lo, x["started_at"]))
               / max(1e-9, x["completed_at"] - x["started_at"]) for x in rows)
    achieved = toks / (hi - lo)
    # the client's part: how much of the slot-time a request was outstanding
    busy = sum(max(0.0, min(hi, x["completed_at"]) - max(lo, x["started_at"])) for x in rows)
    occupancy = busy / (conc * (hi - lo))
    # the server's part: how fast a stream was delivered, as the client saw it and as the server timed it
    client_speed = sum(x["usage"]["completion_tokens"] for x in rows) / sum(x["latency_s"] for x in rows)
    served = [ledger[x["generation_id"]] for x in rows if x["generation_id"] in ledger]
    server_speed = statistics.median(g["completion_tokens"] / (g["generation_ms"] / 1000) for g in served)
    mean_len = statistics.mean(x["usage"]["completion_tokens"] for x in rows)
    ideal = (mean_len / tok_s) / (mean_len / tok_s + ttft)
    wall = r["wall_s"]
    print(f"\n## Slot utilisation ({conc} in flight, {tok_s:.0f} tok/s per stream, ~{tokens}-token responses, "
          f"ttft {ttft}s; {len(rows)} responses, full-slot window {hi - lo:.0f}s)\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| achieved output tok/s | {achieved:,.0f} |")
    print(f"| concurrency x per-stream tok/s | {conc * tok_s:,.0f} |")
    print(f"| **utilisation** = achieved / (concurrency x 50 tok/s), target >= 0.95 | **{achieved / (conc * tok_s):.3f}** |")
    print(f"| made of: slot occupancy (the client's part: a request outstanding in every slot) | {occupancy:.3f} |")
    print(f"| and: mean stream speed seen by the client (ttft included) / 50 tok/s | {client_speed / tok_s:.3f} |")
    print(f"| stream speed as the emulator timed it (request in to body out) | {server_speed:.1f} tok/s |")
    print(f"| best possible with the ttft ({ttft}s per {mean_len:.0f}-token response) | {ideal:.3f} |")
    print(f"| stage 02 CPU busy / emulator CPU busy (cores) | {r['cpu_s'] / wall:.2f} / {server_cpu / wall:.2f} |")
    print(f"| whole run, tokens / wall: draftsmith vs bare aiohttp floor | {r['tokens'] / wall:,.0f} vs "
          f"{floor['tokens'] / floor['wall_s']:,.0f} tok/s = {r['tokens'] / wall / (floor['tokens'] / floor['wall_s']):.2f} |")
    print("\nOccupancy is what the client controls; the stream speed is the emulator's and the machine's "
          "(a loaded 2-core box delays both processes' timers).")


def bench_memory(work: Path, conc: int, sizes: tuple[int, ...], budget: int) -> None:
    emu = Emulator(work, **fast_config(300))
    rows = []
    try:
        for n in sizes:
            path = write_prompts(work / f"mem_prompts_{n}.jsonl", n)
            r = run_client("draftsmith", emu.base, 0, conc, path, work / f"mem-{n}", budget=budget, max_tokens=512)
            rows.append((n, r))
    finally:
        emu.close()
    base = rows[0][1]["maxrss_mb"]
    print(f"\n## Peak RSS of stage 02 ({conc} in flight, max_tokens 512, output_token_budget {budget:,} = about "
          f"{rows[0][1]['responses']:,} responses)\n")
    print("| prompts in the dataset | responses | peak in flight | peak RSS MB | x smallest |")
    print("|---|---|---|---|---|")
    for n, r in rows:
        print(f"| {n:,} | {r['responses']:,} | {r.get('peak_in_flight')} | {r['maxrss_mb']:.0f} | "
              f"{r['maxrss_mb'] / base:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["cpu", "slots", "memory"])
    ap.add_argument("--concurrency", type=int, default=2000)
    # client mode (internal)
    ap.add_argument("--client")
    ap.add_argument("--base")
    ap.add_argument("--n", type=int, default=0)
    ap.add_argument("--conc", type=int, default=2000)
    ap.add_argument("--prompts")
    ap.add_argument("--out")
    ap.add_argument("--budget", type=int)
    ap.add_argument("--max-tokens", type=int, default=1024)
    a = ap.parse_args()
    if a.client:
        client_main(a)
        return
    with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp:
        work = Path(tmp)
        conc = a.concurrency
        if a.only in (None, "cpu"):
            bench_cpu(work, n=4000, conc=conc, reps=1 if a.quick else 5, openai_reps=1 if a.quick else 2)
        if a.only in (None, "slots"):
            bench_slots(work, conc=conc, seconds=20 if a.quick else 30)
        if a.only in (None, "memory"):
            # 512-token max_tokens: a budget of 1.1M tokens lets all `conc` start at once (worst case 2000 x 512)
            bench_memory(work, conc=conc, sizes=(20_000, 200_000), budget=1_100_000)


if __name__ == "__main__":
    main()
