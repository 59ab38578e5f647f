"""The GPU node's preflight: what must hold on the machine before stages 04-06 spend hours on it.

`no_gpu` says in one line why this machine has no usable GPU (a CPU build of torch, no NVIDIA
driver, a driver too old for the CUDA that torch was built with, no GPU visible), or None. Then
`node_checks` gives one `Finding` per check, each failure one line ending in its fix:
  driver      the loaded NVIDIA driver against the CUDA that torch was built with
  GPUs        how many, their memory, and memory already in use (against gpu_memory_utilization)
  peer access which GPU pairs can reach each other directly (the matrix below the line)
  all-reduce  one all-reduce over every visible GPU, NCCL, in processes of its own, with a time-out:
              checked sums, time, bus bandwidth (NCCL over PCIe can hang or crawl)
  disk        free space where outputs_dir points against stage 04's features for the run
`bench/gpu_smoke.py --preflight` prints them; its GPU run checks them first.
`python -m draftsmith.node_preflight RANK WORLD BACKEND MIB OUT` is one rank of the all-reduce.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

DRIVER_FILE = Path("/proc/driver/nvidia/version")
# the oldest Linux driver branch that runs each CUDA major version a torch wheel is built with
MIN_DRIVER = {13: 580, 12: 525}
ALL_REDUCE_MIB = 256
ALL_REDUCE_ITERS = 5
SLOW_BUS_GBPS = 5.0  # a fifth of one PCIe 4.0 x16 link: an all-reduce slower than this crawls
P2P_FIX = ("run again with NCCL_P2P_DISABLE=1 and, if that passes, set it for stages 04-06 too "
           "(or turn IOMMU and PCIe ACS off in the BIOS)")


class Status(Enum):
    OK = "ok"
    FAILED = "FAILED"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Finding:
    """One check's outcome: `line` says what was found and, when FAILED, ends in the fix."""
    check: str
    status: Status
    line: str
    detail: list[str] = field(default_factory=list)  # lines printed under it (the peer matrix)


def driver_version(path: Path | None = None) -> str | None:
    """The loaded NVIDIA kernel module's version (`580.95.05`) as `path` (default DRIVER_FILE) says,
    or None without one."""
    try:
        text = (path or DRIVER_FILE).read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return found.group(1) if found else None


def needed_driver(cuda: str) -> int | None:
    """The oldest driver branch for torch's CUDA version (`13.0` -> 580); None if not known."""
    return MIN_DRIVER.get(int(cuda.split(".")[0]))


def no_gpu(driver_file: Path | None = None) -> str | None:
    """Why this machine has no GPU torch can use, in one line naming the fix; None when it has."""
    import torch

    driver, cuda = driver_version(driver_file), torch.version.cuda
    if cuda is None:
        return (f"no GPU: torch {torch.__version__} is a CPU build" +
                (" and no NVIDIA driver is loaded" if driver is None else f" (NVIDIA driver {driver} is loaded)") +
                "; on a GPU node run this with the GPU environment, .venv-gpu/bin/python (`make gpu-venv`)")
    need = needed_driver(cuda)
    fix = f"install NVIDIA driver {need} or newer" if need else f"install an NVIDIA driver for CUDA {cuda}"
    with warnings.catch_warnings():  # torch warns of an old driver itself, in many lines
        warnings.simplefilter("ignore")
        visible = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if driver is None and not visible:
        return (f"no GPU: no NVIDIA driver is loaded ({driver_file or DRIVER_FILE} is missing) for torch "
                f"{torch.__version__}, built for CUDA {cuda}: {fix}")
    if driver and need and int(driver.split(".")[0]) < need:
        return f"no GPU: NVIDIA driver {driver} is too old for torch {torch.__version__}, built for CUDA {cuda}: {fix}"
    if not visible:
        devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"no GPU visible to torch {torch.__version__} (CUDA {cuda}, NVIDIA driver {driver}): "
                f"CUDA_VISIBLE_DEVICES is {'not set' if devices is None else repr(devices)}; check that "
                f"`nvidia-smi` lists the GPUs")
    return None


def driver_finding(driver_file: Path | None = None) -> Finding:
    import torch

    cuda = torch.version.cuda
    driver = driver_version(driver_file) or f"driver of unknown version ({driver_file or DRIVER_FILE} unread)"
    return Finding("driver", Status.OK, f"NVIDIA {driver}; torch {torch.__version__}, "
                                       f"built for CUDA {cuda}, needs {needed_driver(cuda) or '?'} or newer")


def gpu_findings(tensor_parallel: int, memory_utilization: float) -> list[Finding]:
    """The visible GPUs and their memory: enough of them for `tensor_parallel`, and on each at
    least `memory_utilization` of its memory free (what vLLM asks for at start)."""
    import torch

    n = torch.cuda.device_count()
    kinds: dict[str, int] = {}
    busy = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        kind = f"{p.name}, {total / 2**30:.1f} GiB, compute capability {p.major}.{p.minor}"
        kinds[kind] = kinds.get(kind, 0) + 1
        if free < memory_utilization * total:
            busy.append(f"GPU {i} has {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use")
    out = [Finding("GPUs", Status.OK, "; ".join(f"{c} x {k}" for k, c in kinds.items()))]
    if n < tensor_parallel:
        out.append(Finding("GPUs", Status.FAILED, f"{n} GPUs visible, tensor parallel {tensor_parallel} needs "
                                                  f"{tensor_parallel}: make them visible (CUDA_VISIBLE_DEVICES) or "
                                                  f"lower tensor_parallel_size and eval_tensor_parallel to {n}"))
    if busy:
        out.append(Finding("GPUs", Status.FAILED, f"{'; '.join(busy)} before any engine starts, and vLLM takes "
                                                  f"{memory_utilization:.0%} of each (gpu_memory_utilization): "
                                                  f"stop what holds it (`nvidia-smi` names the processes)"))
    return out


def peer_finding() -> Finding:
    """Which ordered GPU pairs report peer access (direct PCIe transfers), with the matrix."""
    import torch

    n = torch.cuda.device_count()
    can = {(i, j): torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j}
    matrix = ["     " + " ".join(f"{j:>3}" for j in range(n))] + \
             [f"{i:>4} " + " ".join("  -" if i == j else "  Y" if can[i, j] else "  N" for j in range(n))
              for i in range(n)]
    yes = sum(can.values())
    if not can:
        line = "one GPU: no pairs"
    elif yes == len(can):
        line = (f"all {len(can)} ordered pairs: NCCL may send directly between GPUs; where the all-reduce "
                f"then hangs or crawls, {P2P_FIX}")
    elif yes == 0:
        line = "no pair: NCCL goes through host memory (slower than direct transfers, but it works)"
    else:
        line = (f"{yes} of {len(can)} ordered pairs (matrix: Y = row can reach column): NCCL mixes direct and "
                f"host-memory paths; where the all-reduce hangs or crawls, {P2P_FIX}")
    return Finding("peer access", Status.OK, line, matrix)


@dataclass(frozen=True)
class AllReduceResult:
    """Rank 0's record of the timed all-reduce (`rank_main`)."""
    ranks: int
    backend: str
    mib: int
    seconds: float   # per all-reduce, the mean of ALL_REDUCE_ITERS
    correct: bool    # every rank's sums were right

    @property
    def bus_gbps(self) -> float:
        """nccl-tests' bus bandwidth: bytes x 2(n-1)/n per second, in GB/s."""
        return self.mib * 2**20 * 2 * (self.ranks - 1) / self.ranks / self.seconds / 1e9


def rank_command(rank: int, world: int, backend: str, mib: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "draftsmith.node_preflight", str(rank), str(world), backend, str(mib), str(out)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce(ranks: int, timeout_s: float, backend: str = "nccl", mib: int = ALL_REDUCE_MIB,
               slow_gbps: float | None = SLOW_BUS_GBPS) -> Finding:
    """One all-reduce of `mib` MiB over `ranks` processes (one per GPU with NCCL), timed after a
    first one that sets NCCL up; every process is killed after `timeout_s`. FAILED on a time-out,
    a rank that fails, wrong sums, or (with `slow_gbps`) a bus bandwidth below it."""
    if ranks < 2:
        return Finding("all-reduce", Status.SKIPPED, f"{ranks} GPU: nothing to all-reduce")
    name = f"{ranks}-rank {backend} all-reduce of {mib} MiB"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with tempfile.TemporaryDirectory(prefix="draftsmith-allreduce-") as tmp:
        out = Path(tmp)
        procs = []
        for r in range(ranks):
            with open(out / f"rank{r}.err", "w") as err:
                procs.append(subprocess.Popen(rank_command(r, ranks, backend, mib, out), env=env,
                                              stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    time.sleep(1.0)  # the others are stuck waiting for it or about to fail too
                    break
                time.sleep(0.05)
        finally:
            hung = [r for r, p in enumerate(procs) if p.poll() is None]
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0 and r not in hung]
        if failed:
            r, rc = failed[0]
            said = [x for x in (out / f"rank{r}.err").read_text(errors="replace").splitlines() if x.strip()]
            return Finding("all-reduce", Status.FAILED, f"the {name} failed on rank {r} (exit {rc}: "
                                                        f"{said[-1].strip() if said else 'nothing said'}): run again "
                                                        f"with NCCL_DEBUG=INFO for NCCL's reason; if it names P2P, "
                                                        f"{P2P_FIX}")
        if hung:
            return Finding("all-reduce", Status.FAILED, f"the {name} did not finish in {timeout_s:.0f} s (NCCL over "
                                                        f"PCIe hangs like this when direct GPU-to-GPU transfers "
                                                        f"stall): {P2P_FIX}")
        r0 = AllReduceResult(**json.loads((out / "rank0.json").read_text()))
    figures = f"{r0.seconds * 1e3:,.1f} ms each, bus bandwidth {r0.bus_gbps:,.1f} GB/s"
    if not r0.correct:
        return Finding("all-reduce", Status.FAILED, f"the {name} returned wrong sums ({figures}): transfers are "
                                                    f"corrupted; {P2P_FIX}")
    if slow_gbps is not None and r0.bus_gbps < slow_gbps:
        return Finding("all-reduce", Status.FAILED, f"the {name} crawls: {figures}, below {slow_gbps:g} GB/s; "
                                                    f"{P2P_FIX}")
    return Finding("all-reduce", Status.OK, f"{name}: {figures}, sums right")


def rank_main(rank: int, world: int, backend: str, mib: int, out: Path) -> None:
    """One rank: each fills the tensor with rank + 1, so every sum is world(world + 1)/2; the first
    all-reduce sets the connections up and is checked, the next ALL_REDUCE_ITERS are timed."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        t = torch.full((mib * 2**20 // 4,), float(rank + 1), device=device)
        dist.all_reduce(t)
        want = world * (world + 1) / 2
        correct = torch.tensor([float(bool((t == want).all()))], device=device)
        dist.all_reduce(correct, op=dist.ReduceOp.MIN)
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(ALL_REDUCE_ITERS):
            dist.all_reduce(t)
        sync()
        seconds = (time.perf_counter() - t0) / ALL_REDUCE_ITERS
        if rank == 0:
            record = {"ranks": world, "backend": backend, "mib": mib, "seconds": seconds,
                      "correct": bool(correct.item())}
            (out / "rank0.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def disk_finding(values: dict) -> Finding:
    """Free space where `outputs_dir` points against stage 04's features for the run (the same
    arithmetic as stage 04's own check, `hidden.plan`): stage 03's kept tokens when it has run, else
    the datasets' output_token_budget (responses only: a lower bound); shards already written
    count as done."""
    from .hidden import outputs
    from .hidden.plan import bytes_per_token, check_disk
    from .layers import capture_layer_ids
    from .paths import Run
    from .targets.checkpoint import resolve_target, target_config

    run = Run(values["outputs_dir"], values["run_name"])
    try:
        cfg = target_config(resolve_target(values["target_model_path"], log=lambda m: None))
    except FileNotFoundError as e:
        return Finding("disk", Status.FAILED, f"stage 04's features cannot be sized: {e}; set target_model_path")
    cfg = cfg.get("text_config") or cfg
    n_layers = len(values.get("layer_ids") or capture_layer_ids(int(cfg["num_hidden_layers"]), values["layer_set"]))
    dtype = values["hidden_dtype"]
    per_token = bytes_per_token(int(cfg["hidden_size"]), dtype, n_layers)
    names = [d["name"] for d in values.get("datasets") or []]
    from .tokens.outputs import read_report

    try:
        per_dataset = read_report(run)["datasets"]
    except FileNotFoundError:
        per_dataset = None
    if per_dataset is not None:
        tokens = sum(d["tokens_kept"] for name, d in per_dataset.items() if not names or name in names)
        counted = "stage 03's kept tokens"
    else:
        tokens = sum(int(d.get("output_token_budget") or 0) for d in values.get("datasets") or [])
        counted = "the datasets' output_token_budget, responses only, as stage 03 has not run: at least this"
    if not tokens:
        return Finding("disk", Status.SKIPPED, f"{run.root}: no token count yet (stage 03 has not run and the "
                                               f"datasets give no output_token_budget)")
    hidden = run.root / "hidden"
    written = sum(p.stat().st_size for p in outputs.shard_files(hidden)) if hidden.is_dir() else 0
    left = max(0, tokens - written // per_token)
    where = next(p for p in (run.root, *run.root.parents) if p.exists())
    try:
        check_disk(where, left, per_token, dtype)
    except OSError as e:
        return Finding("disk", Status.FAILED, f"{e} (counted: {counted})")
    return Finding("disk", Status.OK, f"{where}: {size(shutil.disk_usage(where).free)} free, stage 04 needs "
                                      f"{size(left * per_token)} ({left:,} tokens x {per_token:,} B, {dtype}; "
                                      f"counted: {counted})")


def size(n: int) -> str:
    """Bytes as TiB from one TiB on, else GiB."""
    return f"{n / 2**40:,.2f} TiB" if n >= 2**40 else f"{n / 2**30:,.2f} GiB"


def node_checks(values: dict, timeout_s: float = 180.0, driver_file: Path | None = None) -> list[Finding]:
    """Every check on a machine that has GPUs (`no_gpu` is None), in the order printed. `values`:
    a run's parameters (tensor_parallel_size, gpu_memory_utilization and stage 04's)."""
    import torch

    memory = values.get("gpu_memory_utilization") or 0.9  # None: vLLM's default
    return [driver_finding(driver_file),
            *gpu_findings(int(values.get("tensor_parallel_size") or 1), memory),
            peer_finding(),
            all_reduce(torch.cuda.device_count(), timeout_s),
            disk_finding(values)]


def failed(findings: list[Finding]) -> bool:
    return any(f.status is Status.FAILED for f in findings)


def render(findings: list[Finding]) -> list[str]:
    """The lines printed: status, check, what was found (and the detail lines under it)."""
    lines = []
    for f in findings:
        lines.append(f"  {f.status.value:<8}{f.check:<12}{f.line}")
        lines += [f"{'':<22}{d}" for d in f.detail]
    return lines


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), Path(sys.argv[5]))
