"""This process's place among several started by torchrun (or alone): rank, world size, device,
and the few collective operations stages 04 and 05 use.

`init_dist()` reads torchrun's environment (WORLD_SIZE, LOCAL_RANK); with more than one process it
joins the process group (NCCL on GPUs, gloo on CPU) and pins the process to its local GPU. Alone,
nothing is initialised and every operation is a no-op, so the same code runs with and without
torchrun. On several nodes `check_together` refuses, before any work, an output folder the nodes do
not share and nodes started with different settings. Both stages hand their torchrun children one
JSON file of settings (stage 04: `hidden.stage.write_config`, stage 05: `drafter.train.launch`),
started by `draftsmith.torchrun`.
"""

from __future__ import annotations

import gc
import os
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


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
    """This process's `Dist`; `gpu` False keeps it off the GPUs (gloo, CPU tensors) for a process
    whose GPUs belong to an engine it starts (stage 04's vLLM)."""
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
