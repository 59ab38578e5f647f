"""Run a draftsmith module as torchrun processes: `nproc` on this machine (one per GPU, or gloo on
CPU), alone (`--standalone`) or as one of `nnodes` machines joined by torchrun's own c10d
rendezvous at `rdzv_endpoint` (host:port of one of them), streaming their output into `log`.

Several machines run the same command each; torchrun's rendezvous admits them, numbers them and
picks the master; nothing of ours takes part in discovery or membership. The rendezvous id is the
module's name: one endpoint serves one stage of one run at a time. Which node gets rank 0 is
torchrun's choice; the ranks meet again in the run folder, which all nodes must share.

Stages 04 and 05 resume where they stopped (whole shards, the last checkpoint), so a failed
torchrun is simply started again, up to `attempts` times in all. A fresh torchrun gets a fresh
rendezvous; with torchrun's own `--max-restarts` instead, gloo's connectFullMesh of the restarted
ranks was refused in 4 of the 5 restarts tried here (torch 2.13, CPU). On several nodes the
surviving nodes' fresh torchrun waits at the rendezvous (`join_timeout`, torchrun's default 600 s)
for the lost node to be started again.
"""

from __future__ import annotations

import collections
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

LAUNCHES = ".launches"


def rendezvous_args(nnodes: int, rdzv_endpoint: str, module: str) -> list[str]:
    """torchrun's arguments for one machine (`--standalone`) or `nnodes` joined at the endpoint."""
    if nnodes < 1:
        raise ValueError(f"nnodes must be at least 1, got {nnodes}")
    if nnodes == 1:
        return ["--standalone"]
    host, _, port = rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rdzv_endpoint must be host:port of one of the {nnodes} nodes (the same on every node), "
                         f"got {rdzv_endpoint!r}")
    rdzv_id = module.replace(".", "-")
    return [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]


def launch_dir(out_dir: Path, nnodes: int) -> Path:
    """Where this node's launcher writes the settings file it hands its ranks: `out_dir` on one
    node; on several, a folder of this node's own (host and process) inside it, so no node's file
    replaces another's in the shared folder and a node started with other settings is caught
    (`Dist.check_together`), not silently overruled. `done_launching` removes it."""
    if nnodes == 1:
        return Path(out_dir)
    return Path(out_dir) / LAUNCHES / f"{socket.gethostname()}-{os.getpid()}"


def done_launching(folder: Path, nnodes: int) -> None:
    if nnodes > 1:
        shutil.rmtree(folder, ignore_errors=True)


def torchrun(nproc: int, module: str, args: list[str], *, nnodes: int = 1, rdzv_endpoint: str = "", attempts: int = 2,
             log=print) -> None:
    """Run `python -m module *args` as `nproc` ranks here, of `nnodes` machines in all."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous_args(nnodes, rdzv_endpoint, module),
           f"--nproc-per-node={nproc}", "-m", module, *args]
    log("$ " + " ".join(cmd))
    for attempt in range(1, attempts + 1):
        tail = collections.deque(maxlen=400)
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                log(line.rstrip())
                tail.append(line)
        if proc.returncode == 0:
            return
        if attempt < attempts:
            log(f"torchrun exited with status {proc.returncode}; starting it again ({attempt + 1}/{attempts}), "
                f"it resumes where it stopped" + (f" once all {nnodes} nodes have joined" if nnodes > 1 else ""))
    raise RuntimeError(f"torchrun {module} failed {attempts} time(s), last with status {proc.returncode}; "
                       f"a rerun resumes where it stopped. Its last lines:\n{''.join(last_words(list(tail)))}")


def last_words(lines: list[str], keep: int = 30) -> list[str]:
    """What the ranks said last before torchrun's agent reported the failure, and the agent's
    'Root Cause' block: the agent's own traceback (30 lines of its launcher) says nothing."""
    agent = next((i for i, x in enumerate(lines) if "] failed (exitcode" in x), len(lines))
    cause = next((i for i, x in enumerate(lines) if x.startswith("Root Cause")), len(lines))
    return lines[max(0, agent - keep):agent + 1] + lines[cause:]
