"""How long a set of test files takes in one process and shared among pytest-xdist workers (`make test`'s
TEST_WORKERS), on this machine, one setting after the other in this run.

Each setting runs the same files with `make test`'s options (`--dist loadfile --no-loadscope-reorder`:
each file whole on one worker, heaviest tier first); the table has each setting's wall time, the CPU
time of it and of every process it started (user + system), and its speed-up over one process. The
default files are a cross-section of the tiers (notebooks, crashes, torchrun, the emulator, units),
about 6 and a half minutes in one process on two idle cores; `--files` takes others (`tests` for
the whole suite: about an hour for the three settings).

    .venv/bin/python bench/bench_test_workers.py
    .venv/bin/python bench/bench_test_workers.py --workers 0 2 3 4 --files tests/test_hidden.py tests/test_drafter.py
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = ["tests/test_run_guard.py", "tests/test_runner.py", "tests/test_hidden.py", "tests/test_drafter.py",
         "tests/test_generate_e2e.py", "tests/test_generate_stalls.py", "tests/test_emulator.py",
         "tests/test_tokens_emulator.py", "tests/test_report_html.py", "tests/test_summary.py"]


def run(workers: int, files: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s of pytest and its children, pytest's last line) of one run of `files`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
                           "--dist", "loadfile", "--no-loadscope-reorder", *files],
                          cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    last = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    if proc.returncode:
        sys.exit(f"{workers} workers: pytest exited {proc.returncode}: {last}\n{proc.stdout[-3000:]}")
    return wall, cpu, re.sub(r"\s*in [0-9.]+s.*", "", last).strip("= ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2, 3],
                    help="settings of TEST_WORKERS to time (0: one process); the first is the baseline")
    ap.add_argument("--files", nargs="+", default=FILES, help="test files or folders, relative to the repository")
    args = ap.parse_args()
    print(f"{os.cpu_count()} CPUs; {len(args.files)} test paths; load average before: {os.getloadavg()[0]:.2f}",
          flush=True)
    rows = []
    for n in args.workers:
        wall, cpu, tests = run(n, args.files)
        rows.append((n, wall, cpu, tests))
        print(f"  {n} workers: {wall:.0f} s ({tests})", flush=True)
    base = rows[0][1]
    print()
    print("| workers | wall (s) | CPU, all processes (s) | speed-up over the first | tests |")
    print("|---|---|---|---|---|")
    for n, wall, cpu, tests in rows:
        print(f"| {n or 'one process'} | {wall:.3g} | {cpu:.3g} | {base / wall:#.3g}x | {tests} |")


if __name__ == "__main__":
    main()
