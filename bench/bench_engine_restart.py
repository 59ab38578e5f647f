"""Engines started one after another in one process, as stage 06 starts one per method: as before
(vLLM loads the tokenizer, and its renderer deep-copies it twice; every garbage collection walks
every object of the process) and as now (`skip_tokenizer_init`, what is alive between engines
frozen with `gc.freeze`: `evaluate/engine.py`).

Each mode is a new process that applies `targets.vllm_fixes` as the stage does, then starts
`--engines` engines in turn (no speculation, then n-gram, alternating) and decodes one prompt
greedily with each; rounds alternate the modes so both see the same box. Prints the seconds from
`LLM(...)` to a ready engine (the first start of a process apart: it imports what the model
needs) and from `del llm` to collected, the greedy tokens (they must be equal), and the ratio,
measured in this run (absolute times mean little on a shared box).

    .venv/bin/python bench/bench_engine_restart.py                  # tiny-test, 2 rounds of 4 engines
    .venv/bin/python bench/bench_engine_restart.py --target tiny --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

MODES = ("as before", "now")


def child(mode: str, target: str, engines: int) -> None:
    import gc

    from draftsmith.targets.vllm_fixes import apply_fixes

    apply_fixes(log=lambda m: None)
    from vllm import LLM, SamplingParams

    now = mode == "now"
    if now:
        gc.freeze()
    ups, downs, outputs = [], [], set()
    for i in range(engines):
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3} if i % 2 else None
        t0 = time.perf_counter()
        llm = LLM(model=target, dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
                  distributed_executor_backend="uni", enable_prefix_caching=False, disable_log_stats=False,
                  skip_tokenizer_init=now, **({"speculative_config": spec} if spec else {}))
        ups.append(time.perf_counter() - t0)
        out = llm.generate([{"prompt_token_ids": [0, 5, 6, 7, 100, 200]}],
                           SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0].outputs[0]
        outputs.add(tuple(out.token_ids))
        t1 = time.perf_counter()
        del llm
        gc.collect()
        if now:
            gc.freeze()
        downs.append(time.perf_counter() - t1)
    print("[result] " + json.dumps({"up_s": ups, "down_s": downs, "tokens": sorted(outputs)}), flush=True)


def run(mode: str, target: str, engines: int) -> dict:
    from bench_engine_start import child_result     # this folder is on the path of a script run from it
    from draftsmith.targets.vllm import vllm_env

    return child_result(__file__, mode, ["--target", target, "--engines", str(engines)], vllm_env())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tiny-test")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.target, a.engines)
        return
    from draftsmith.targets.checkpoint import resolve_target

    target = str(resolve_target(a.target))
    ups = {m: [] for m in MODES}
    downs = {m: [] for m in MODES}
    tokens = set()
    for r in range(a.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            got = run(mode, target, a.engines)
            ups[mode] += got["up_s"][1:]
            downs[mode] += got["down_s"]
            tokens.update(tuple(t) for t in got["tokens"])
            print(f"round {r + 1}: {mode}: engines up in {', '.join(f'{t:.1f}' for t in got['up_s'])} s, "
                  f"collected in {', '.join(f'{t:.1f}' for t in got['down_s'])} s", flush=True)
    print(f"\n{a.target}, {a.engines} engines per process, {a.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    print("| engines | start, 2nd engine on, median (s) | teardown, median (s) | start ratio |")
    print("|---|---|---|---|")
    base = statistics.median(ups[MODES[0]])
    for mode in MODES:
        up, down = statistics.median(ups[mode]), statistics.median(downs[mode])
        print(f"| {mode} | {up:.1f} | {down:.1f} | {base / up:.2f}x |")
    print(f"greedy tokens equal in every engine: {len(tokens) == 1}")


if __name__ == "__main__":
    main()
