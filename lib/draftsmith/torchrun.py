"""Run a draftsmith module as `nproc` torchrun processes on this machine (one per GPU, or gloo on
CPU), streaming their output into `log`.

Stages 04 and 05 resume where they stopped (whole shards, the last checkpoint), so a failed
torchrun is simply started again, up to `attempts` times in all. A fresh torchrun gets a fresh
rendezvous; with torchrun's own `--max-restarts` instead, gloo's connectFullMesh of the restarted
ranks was refused in 4 of the 5 restarts tried here (torch 2.13, CPU)."""

from __future__ import annotations

import collections
import subprocess
import sys


def torchrun(nproc: int, module: str, args: list[str], *, attempts: int = 2, log=print) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, *args]
    log("$ " + " ".join(cmd))
    for attempt in range(1, attempts + 1):
        tail = collections.deque(maxlen=40)
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                log(line.rstrip())
                tail.append(line)
        if proc.returncode == 0:
            return
        if attempt < attempts:
            log(f"torchrun exited with status {proc.returncode}; starting it again ({attempt + 1}/{attempts}), "
                f"it resumes where it stopped")
    raise RuntimeError(f"torchrun {module} failed {attempts} time(s), last with status {proc.returncode}; "
                       f"a rerun resumes where it stopped. Its last lines:\n{''.join(tail)}")
