"""The emulator's model backend: one decode step (`emulator.model.Engine.step`) on the `tiny` target
with 1, 16 and all 64 slots in flight, with its torch threads at 1 (the emulator's default, leaving a
core to the server and the client) and at 2 (what `params/demo.yaml` gives the demo's emulator).

A step costs about the same whatever is in flight for the forward (every slot is computed, so a
seeded request samples the same ids under any load) and in proportion to the sequences in flight
for the sampling. Each setting runs in a new process, with the end-of-turn id masked so that every
sequence stays in flight; rounds alternate the thread counts so both see the same box (an idle one:
on a loaded box the second thread competes with the load, and the table says so). Prints milliseconds per step, median of the rounds, and the ratio, measured in this run
(absolute times mean little on a shared box).

    .venv/bin/python bench/bench_emulator_step.py              # 2 rounds, 30 steps each
    .venv/bin/python bench/bench_emulator_step.py --rounds 3 --steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

IN_FLIGHT = (1, 16, 64)


def child(threads: int, in_flight: int, steps: int) -> None:
    import time

    import torch

    from draftsmith.emulator.backends import Job
    from draftsmith.emulator.model import Engine, _Seq
    from draftsmith.emulator.server import _vocab
    from draftsmith.targets.checkpoint import load_target, resolve_target

    torch.set_num_threads(threads)
    path = resolve_target("tiny", log=lambda *a: None)
    vocab = _vocab(str(path))
    engine = Engine(load_target(path, "cpu"), vocab, 64, canonical=True)
    engine.banned = torch.tensor(sorted(set(engine.banned.tolist()) | {vocab.eos}))  # no answer ends here
    prompt = vocab.encoding.plain(["Explain how a hash map handles collisions."])[0]
    for i in range(in_flight):
        job = Job(prompt_ids=list(prompt), max_tokens=10_000, temperature=1.0, top_p=1.0, seed=i, key=f"k{i}",
                  reasoning_max_tokens=None, perturbed=0.0, noncanonical_rate=0.0)
        engine.waiting.put(_Seq(job, lambda item: None))
    with torch.inference_mode():
        for _ in range(3):  # admits (prefills) every sequence
            engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        ms = (time.perf_counter() - t0) / steps * 1000
    print("[result] " + json.dumps({"ms": ms, "active": len(engine.active)}), flush=True)


def run(threads: int, in_flight: int, steps: int) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", str(threads), "--in-flight", str(in_flight),
                        "--steps", str(steps)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"threads {threads}, {in_flight} in flight failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return json.loads(next(x for x in r.stdout.splitlines() if x.startswith("[result] ")).split(" ", 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--child", type=int)
    ap.add_argument("--in-flight", type=int)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.in_flight, a.steps)
        return
    times = {(n, t): [] for n in IN_FLIGHT for t in (1, 2)}
    active = {}
    for r in range(a.rounds):
        for t in ((1, 2) if r % 2 == 0 else (2, 1)):
            for n in IN_FLIGHT:
                got = run(t, n, a.steps)
                times[n, t].append(got["ms"])
                active[n] = got["active"]
                print(f"round {r + 1}: threads {t}, {n} in flight: {got['ms']:.1f} ms/step", flush=True)
    print(f"\n`tiny`, 64 slots, {a.steps} steps, {a.rounds} rounds, load {os.getloadavg()[0]:.1f}; ms per step, median (each round)")
    print("| in flight | 1 thread | 2 threads | ratio |")
    print("|---|---|---|---|")
    for n in IN_FLIGHT:
        one, two = (statistics.median(times[n, t]) for t in (1, 2))
        cells = [f"{statistics.median(times[n, t]):.1f} ({', '.join(f'{x:.1f}' for x in times[n, t])})" for t in (1, 2)]
        print(f"| {active[n]} | {cells[0]} | {cells[1]} | {one / two:.2f}x |")


if __name__ == "__main__":
    main()
