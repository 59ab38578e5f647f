"""What PYTHONDONTWRITEBYTECODE costs a venv installed with `pip install --no-compile` (`make venv`).

With the variable set, Python writes no bytecode, and the venv has none from its install: every
process compiles every module it imports from source, every time. Without it (the Makefile's recipes
run without it), the first process to import a module writes its bytecode and the others read it.

Three things the demo does in new processes, each timed from its start:
- a stage kernel's imports (stage 06's library and figures: torch, transformers, pandas, matplotlib);
- the local emulator, started to ready on the `tiny-test` target (the model backend);
- `from vllm import LLM`, what stage 04's and stage 06's engine processes begin with.

Each mode gets its own bytecode folder (`PYTHONPYCACHEPREFIX`), so the venv's own is never read or
written. Both start with the standard library's bytecode (the interpreter's install compiled it);
"compiled every time" runs with PYTHONDONTWRITEBYTECODE=1 and never gets more, "bytecode kept" gets
the venv's from an untimed first round. Rounds alternate the two modes so both see the same box; the table has
the medians and their ratio, measured in this run (absolute times mean little on a shared box).

    .venv/bin/python bench/bench_bytecode.py              # 2 rounds
    .venv/bin/python bench/bench_bytecode.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KERNEL = "import draftsmith.evaluate.stage, draftsmith.evaluate.figures, pandas, matplotlib.pyplot"
VLLM = "from vllm import LLM, SamplingParams"
EMULATOR = """
import os, tempfile
from pathlib import Path
from draftsmith.emulator import KEY_ENV, emulator_process, new_key
from draftsmith.emulator.config import load_config
cfg = load_config({"backend": "model", "target_model_path": "tiny-test"})
with emulator_process(Path(tempfile.mkdtemp()), cfg.model_dump_json(), {**os.environ, KEY_ENV: new_key()}):
    pass
"""
TASKS = {"a stage kernel's imports": KERNEL, "the emulator, started to ready": EMULATOR, "vLLM's import": VLLM}


def timed(code: str, env: dict) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"failed:\n{code}\n{(r.stdout + r.stderr)[-3000:]}")
    return time.perf_counter() - t0


def with_stdlib_bytecode(prefix: str) -> int:
    """Copy the standard library's bytecode into a PYTHONPYCACHEPREFIX tree; returns the file count."""
    n = 0
    for pyc in Path(sys.base_prefix, "lib").rglob("__pycache__/*.pyc"):
        if "site-packages" in pyc.parts:
            continue
        dest = Path(prefix + str(pyc.parent.parent)) / pyc.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pyc, dest)
        n += 1
    return n


def files(folder: str) -> int:
    return sum(1 for _ in Path(folder).rglob("*.pyc"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory() as kept, tempfile.TemporaryDirectory() as never:
        modes = {"compiled every time": {**base, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": never},
                 "bytecode kept": {**base, "PYTHONPYCACHEPREFIX": kept}}
        stdlib = [with_stdlib_bytecode(d) for d in (kept, never)][0]
        for code in TASKS.values():  # untimed: fills the kept folder, as a demo's first process would
            timed(code, modes["bytecode kept"])
        times = {(task, mode): [] for task in TASKS for mode in modes}
        for r in range(a.rounds):
            for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                for task, code in TASKS.items():
                    times[task, mode].append(timed(code, modes[mode]))
                    print(f"round {r + 1}: {mode}: {task}: {times[task, mode][-1]:.1f} s", flush=True)
        assert files(never) == stdlib, "bytecode was written with PYTHONDONTWRITEBYTECODE=1"
        print(f"bytecode files: {stdlib} of the standard library in both, {files(kept) - stdlib} more kept")
    print(f"\n{a.rounds} rounds, load {os.getloadavg()[0]:.1f}; seconds from the process's start, median (each round)")
    print("| | compiled every time | bytecode kept | ratio |")
    print("|---|---|---|---|")
    for task in TASKS:
        slow, fast = (statistics.median(times[task, m]) for m in modes)
        cells = [f"{statistics.median(times[task, m]):.1f} ({', '.join(f'{t:.1f}' for t in times[task, m])})"
                 for m in modes]
        print(f"| {task} | {cells[0]} | {cells[1]} | {slow / fast:.2f}x |")


if __name__ == "__main__":
    main()
