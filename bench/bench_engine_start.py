"""A vLLM engine's first start on the CPU, with vLLM inspecting the model class in a second Python
process (as shipped) and in the engine's own (`targets.vllm_fixes.fix_cpu_model_inspection_process`).

Each start is a new process with an empty vLLM cache (`VLLM_CACHE_ROOT`), as on a first run with a
fresh HOME (a new user's `make demo`, CI); rounds alternate the two so both see the same box. Prints
the seconds from `LLM(...)` to a ready engine, the greedy tokens of one prompt (they must be equal),
and the ratio, measured in this run (absolute times mean little on a shared box).

    .venv/bin/python bench/bench_engine_start.py                 # tiny-test, 2 rounds
    .venv/bin/python bench/bench_engine_start.py --target tiny --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(mode: str, target: str) -> None:
    from draftsmith.targets import vllm_fixes

    if mode == "in-process":
        assert vllm_fixes.fix_cpu_model_inspection_process()
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=target, dtype="float32", max_model_len=512, enforce_eager=True, distributed_executor_backend="uni")
    up = time.perf_counter() - t0
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=8, temperature=0.0),
                       use_tqdm=False)[0].outputs[0].token_ids
    print("[result] " + json.dumps({"up_s": up, "tokens": list(out)}), flush=True)


def child_result(script: str, mode: str, args: list[str], env: dict) -> dict:
    """Run `script --child MODE ARGS` in a new process with `env`; the JSON of its `[result]` line."""
    r = subprocess.run([sys.executable, script, "--child", mode, *args], env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{mode}: the engine process failed:\n{(r.stdout + r.stderr)[-3000:]}")
    line = next(x for x in r.stdout.splitlines() if x.startswith("[result] "))
    return json.loads(line.split(" ", 1)[1])


def start(mode: str, target: str) -> dict:
    from draftsmith.targets.vllm import vllm_env

    with tempfile.TemporaryDirectory() as cache:
        return child_result(__file__, mode, ["--target", target], {**vllm_env(), "VLLM_CACHE_ROOT": cache})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tiny-test")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.target)
        return
    from draftsmith.targets.checkpoint import resolve_target

    target = str(resolve_target(a.target))
    times = {"subprocess (as shipped)": [], "in-process": []}
    tokens = set()
    for r in range(a.rounds):
        for mode in (list(times) if r % 2 == 0 else list(times)[::-1]):
            got = start("in-process" if mode == "in-process" else "stock", target)
            times[mode].append(got["up_s"])
            tokens.add(tuple(got["tokens"]))
            print(f"round {r + 1}: {mode}: engine up in {got['up_s']:.1f} s", flush=True)
    base = statistics.median(times["subprocess (as shipped)"])
    print(f"\n{a.target}, empty vLLM cache, {a.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    print(f"| model class inspected | engine up, median (s) | each round (s) | ratio |")
    print(f"|---|---|---|---|")
    for mode, ts in times.items():
        m = statistics.median(ts)
        print(f"| {mode} | {m:.1f} | {', '.join(f'{t:.1f}' for t in ts)} | {base / m:.2f}x |")
    print(f"greedy tokens equal in every start: {len(tokens) == 1}")


if __name__ == "__main__":
    main()
