"""This process's place among several started by torchrun (or alone): rank, world size, device,
and the few collective operations stages 04 and 05 use.

`init_dist()` reads torchrun's environment (WORLD_SIZE, LOCAL_RANK); with more than one process it
joins the process group (NCCL on GPUs, gloo on CPU) and pins the process to its local GPU. Alone,
nothing is initialised and every operation is a no-op, so the same code runs with and without
torchrun. Both stages hand their torchrun children one JSON file of settings (stage 04:
`hidden.stage.write_config`, stage 05: `drafter.train.launch`), started by `draftsmith.torchrun`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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

    def close(self) -> None:
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
            self.owned = False


def init_dist() -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if world == 1:  # alone: no process group, and no CUDA context made here (a vLLM child may need the GPU)
        return Dist(0, 1, torch.device("cuda:0" if cuda else "cpu"))
    if cuda:
        torch.cuda.set_device(local)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if cuda else "gloo")
    return Dist(dist.get_rank(), world, torch.device(f"cuda:{local}" if cuda else "cpu"), owned)
