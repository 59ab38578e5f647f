"""This process's place among several started by torchrun (or alone): rank, world size, device,
and the few collective operations stages 04 and 05 use.

`init_dist()` reads torchrun's environment and joins the process group (NCCL on GPUs, gloo on CPU);
alone, nothing is initialised and every operation is a no-op, so the same code runs with and
without torchrun. `torchrun` starts a draftsmith module as ranks on this machine or on several
joined by torchrun's own rendezvous, and starts it again when it fails (the stages resume). The
ranks meet in the run folder, which all nodes must share (`Dist.check_together`)."""

from __future__ import annotations

import gc
import os
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import collections
import subprocess
import sys
import torch
import torch.distributed as dist

from . import progress


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device
    owned: bool = False  # `init_dist` started the process group: `close` ends it

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over ranks of `t` (on the CPU)."""
        if self.world > 1:
            t = t.to(self.device)
            dist.all_reduce(t)
        return t.cpu()

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (a picklable object)."""
        if self.world == 1:
            return obj
        box = [obj if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list | None:
        """On rank 0 every rank's `obj`, in rank order; None on the others."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_gather(self, obj) -> list:
        """On every rank every rank's `obj`, in rank order."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def check_together(self, folder: Path, settings: dict) -> None:
        """Before any work of several processes (possibly on several nodes): every rank must have
        been started with the same `settings` (a JSON-able dict), and every rank writes a token
        file into `folder` and must see every other rank's there (one filesystem they all share).
        Raises the same error on every rank otherwise."""
        if self.world == 1:
            return
        everyone = self.all_gather({"host": socket.gethostname(), "settings": settings})
        first = everyone[0]["settings"]
        for r, e in enumerate(everyone[1:], 1):
            if e["settings"] != first:
                keys = sorted(k for k in set(first) | set(e["settings"]) if first.get(k) != e["settings"].get(k))
                diff = "; ".join(f"{k}: {first.get(k)!r} on rank 0 ({everyone[0]['host']}), "
                                 f"{e['settings'].get(k)!r} on rank {r} ({e['host']})" for k in keys)
                raise ValueError(f"the nodes were started with different settings ({diff}): run the same "
                                 f"command with the same params file on every node")
        tokens = Path(folder) / f".ranks-{self.broadcast(secrets.token_hex(6))}"
        tokens.mkdir(parents=True, exist_ok=True)
        (tokens / str(self.rank)).write_text(socket.gethostname())
        self.barrier()
        seen = self.all_gather(_visible(tokens, self.world))
        shutil.rmtree(tokens, ignore_errors=True)  # every rank has looked (all_gather)
        blind = [f"rank {r} on {e['host']} sees the token files of ranks {s} only"
                 for r, (e, s) in enumerate(zip(everyone, seen)) if len(s) != self.world]
        if blind:
            raise RuntimeError(f"{folder}: not one folder shared by all {self.world} ranks ({'; '.join(blind)}): "
                               f"put the run folder (outputs_dir) on a filesystem every node mounts at the same path")

    def close(self) -> None:
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
            self.owned = False
            # The gloo group can sit in a reference cycle; left to the interpreter's last collection,
            # its worker threads wake while Python is finalizing and abort the process (SIGABRT,
            # "terminate called without an active exception") after the work is done. Collected
            # now, its destructor joins them while the interpreter is whole.
            gc.collect()


def _visible(tokens: Path, world: int, tries: int = 5) -> list[int]:
    """The ranks whose token file this process can open; opening by name (not listing the folder)
    is what a network filesystem keeps consistent between clients, and a few tries allow for lag."""
    for _ in range(tries):
        seen = [r for r in range(world) if (tokens / str(r)).is_file()]
        if len(seen) == world:
            break
        time.sleep(0.2)
    return seen


def init_dist(gpu: bool = True) -> Dist:
    """This process's `Dist`, from torchrun's WORLD_SIZE and LOCAL_RANK: with more than one process
    it joins the process group and pins the process to its local GPU. `gpu` False keeps it off the
    GPUs (gloo, CPU tensors) for a process whose GPUs belong to an engine it starts (stage 04's vLLM)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = gpu and torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if world == 1:  # alone: no process group, and no CUDA context made here (a vLLM child may need the GPU)
        return Dist(0, 1, torch.device("cuda:0" if cuda else "cpu"))
    if cuda:
        torch.cuda.set_device(local)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if cuda else "gloo")
    return Dist(dist.get_rank(), world, torch.device(f"cuda:{local}" if cuda else "cpu"), owned)


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
    """Run `python -m module *args` as `nproc` ranks here (one per GPU, or gloo on CPU), alone
    (`--standalone`) or as one of `nnodes` machines joined by torchrun's c10d rendezvous at
    `rdzv_endpoint` (host:port of one of them), streaming their output into `log`. The stages hand
    their ranks one JSON file of settings (`hidden.stage.write_config`, `drafter.stage.launch`).

    Each machine runs the same command; torchrun's rendezvous admits them, numbers them and picks
    the master (nothing of ours takes part in membership). The rendezvous id is the module's name:
    one endpoint serves one stage of one run at a time. Stages 04 and 05 resume where they stopped,
    so a failed torchrun is started again, up to `attempts` times in all, each with a fresh
    rendezvous: torchrun's own `--max-restarts` is not used, as gloo does not reliably reconnect
    restarted ranks. On several nodes the survivors' fresh torchrun waits at the rendezvous
    (`join_timeout`, 600 s by default) for the lost node to be started again."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous_args(nnodes, rdzv_endpoint, module),
           f"--nproc-per-node={nproc}", "-m", module, *args]
    log("$ " + " ".join(cmd))
    for attempt in range(1, attempts + 1):
        progress.note("torchrun launch")
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
