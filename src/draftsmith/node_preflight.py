"""The GPU node's preflight: what must hold on the machine before stages 04-06 spend hours on it.

`no_gpu` says in one line why this machine has no usable GPU (a CPU build of torch, no NVIDIA
driver, a driver too old for the CUDA that torch was built with, no GPU visible), or None. Then
`node_checks` gives one `Finding` per check, each failure one line ending in its fix:
  driver      the loaded NVIDIA driver against the CUDA that torch was built with
  GPUs        how many, their memory, and memory already in use (against gpu_memory_utilization)
  peer access which GPU pairs can reach each other directly (the matrix below the line)
  GPU health  processes already on the GPUs, uncorrectable ECC errors and rows or pages waiting for a
              reset (`nvidia-smi -q`), a GPU nvidia-smi cannot reach, fatal Xid errors in the kernel log
  NCCL        the NCCL torch loads against the one vLLM loads (VLLM_NCCL_SO_PATH, else libnccl.so.2)
  IOMMU, ACS  an IOMMU translating GPU traffic (`/proc/cmdline`) and PCIe bridges redirecting
              peer traffic (ACSCtl in `lspci -vvv`): the usual cause of broken P2P on workstation boards
  peer access which GPU pairs can reach each other directly (the matrix below the line)
  all-reduce  one all-reduce over every visible GPU, NCCL, in processes of its own, with a time-out:
              checked sums, time, bus bandwidth (NCCL over PCIe can hang or crawl); then the
              latency of decode-sized ones (16 KiB to 2 MiB), which 256 MiB does not show
  /dev/shm    its free space, which NCCL's shared-memory transport needs once P2P is off
  disk        free space where outputs_dir points against stage 04's features for the run
The all-reduce runs in the run's `engine_env`, so the preflight tests what the engines will get. A
failure whose fix is a setting says which (`Finding.settings`); `render` ends with them, as the lines
to put in the params file. `bench/gpu_smoke.py --preflight` prints them; its GPU run checks them first.
`python -m draftsmith.node_preflight RANK WORLD BACKEND MIB OUT [KIB,...]` is one rank of the all-reduce.
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
# decode's all-reduces: one token's hidden state of Kimi-K2.5 (7168 x bf16, 14 KiB) to a batch of them
LATENCY_KIB = (16, 256, 2048)
LATENCY_ITERS = 50
# two all-reduces a layer each decode step: at 500 us, a 61-layer target waits 61 ms a step on them alone
SLOW_SMALL_US = 500.0
MIN_SHM_GIB = 1.0  # NCCL's troubleshooting guide: containers need --shm-size=1g or more
SHM = Path("/dev/shm")
CMDLINE = Path("/proc/cmdline")
IOMMU_CLASS = Path("/sys/class/iommu")
# the Xids after which a GPU needs a reset or a reboot (NVIDIA's Xid catalogue): double-bit ECC,
# row remapping, fallen off the bus, contained/uncontained ECC, GSP timeout/error
FATAL_XIDS = {48: "double-bit ECC error", 63: "row remapping recorded", 64: "row remapping failed",
              79: "GPU fell off the bus", 92: "high single-bit ECC rate", 94: "contained ECC error",
              95: "uncontained ECC error", 119: "GSP timeout", 120: "GSP error"}
P2P_OFF = {"engine_env": {"NCCL_P2P_DISABLE": "1"}}
P2P_FIX = ("set engine_env: {NCCL_P2P_DISABLE: \"1\"} in the params file (every engine of stages 04 and 06 "
           "gets it, and this all-reduce runs in it) and run the preflight again; or turn IOMMU and PCIe ACS "
           "off in the BIOS")


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
    settings: dict = field(default_factory=dict)     # params-file settings its fix calls for


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


def tool_output(cmd: list[str], timeout_s: float = 30.0) -> tuple[int | None, str]:
    """(exit status, stdout + stderr) of a node tool; status None when it is not installed or did
    not answer within `timeout_s` (the text says which). The one way the checks below read the node."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return None, f"{cmd[0]} is not installed"
    except subprocess.TimeoutExpired:
        return None, f"`{' '.join(cmd)}` did not answer in {timeout_s:.0f} s"
    return done.returncode, done.stdout + done.stderr


def smi_gpus(text: str) -> list[tuple[str, str]]:
    """`nvidia-smi -q` as (GPU's bus id, its block of lines), one per GPU."""
    blocks = re.split(r"^GPU (\S+)\s*$", text, flags=re.M)
    return list(zip(blocks[1::2], blocks[2::2]))


def smi_processes(block: str) -> list[dict]:
    """The processes one GPU's `nvidia-smi -q` block lists: each its `Process ID`, `Name`, `Used GPU Memory`."""
    procs: list[dict] = []
    for line in block.splitlines():
        key, _, value = (x.strip() for x in line.partition(":"))
        if key == "Process ID":
            procs.append({key: value})
        elif procs and key in ("Name", "Used GPU Memory", "Type"):
            procs[-1].setdefault(key, value)
    return procs


def gpu_health_findings() -> list[Finding]:
    """What an earlier job left on the GPUs: processes holding them, uncorrectable ECC errors since
    the driver loaded, remapped rows or retired pages waiting for a reset, a GPU nvidia-smi cannot
    reach (wedged), and fatal Xid errors (FATAL_XIDS) in the kernel log since boot."""
    rc, text = tool_output(["nvidia-smi", "-q"])
    if rc is None and "not installed" in text:
        return [Finding("GPU health", Status.SKIPPED, f"{text}: processes, ECC and reset state unread")]
    if rc != 0 or re.search(r"GPU is lost|Unable to determine the device handle|Unknown Error", text):
        said = next((x.strip() for x in text.splitlines() if re.search(r"lost|Unable|Unknown|did not", x)),
                    (text.strip().splitlines() or ["nothing said"])[-1])
        return [Finding("GPU health", Status.FAILED, f"nvidia-smi cannot read every GPU ({said}): a GPU is wedged; "
                                                     f"stop what uses it, then `nvidia-smi -r -i <GPU>`, "
                                                     f"or reboot the node")]
    out = []
    held, ecc, pending = [], [], []
    for bus, block in smi_gpus(text):
        held += [f"PID {p['Process ID']} ({p.get('Name', '?')}, {p.get('Used GPU Memory', '?')}) on GPU {bus}"
                 for p in smi_processes(block)]
        volatile = re.search(r"^\s*Volatile\s*$(.*?)^\s*Aggregate\s*$", block, flags=re.M | re.S)
        errors = sum(int(n) for n in re.findall(r"(?:Uncorrectable|Double Bit)[^:\n]*:\s*(\d+)",
                                                volatile.group(1))) if volatile else 0
        if errors:
            ecc.append(f"GPU {bus}: {errors} uncorrectable")
        if re.search(r"^\s*(?:Pending|Pending Page Blacklist|Pending Page Retirement)\s*:\s*Yes", block, flags=re.M):
            pending.append(f"GPU {bus}")
    if held:
        out.append(Finding("GPU health", Status.FAILED, f"{'; '.join(held)}: the GPUs are already in use; stop "
                                                        f"{'it' if len(held) == 1 else 'them'} (`kill <PID>`, "
                                                        f"then `nvidia-smi` should list no process)"))
    if ecc:
        out.append(Finding("GPU health", Status.FAILED, f"ECC errors since the driver loaded ({'; '.join(ecc)}): "
                                                        f"a failing GPU; reset it (`nvidia-smi -r -i <GPU>`) or "
                                                        f"leave it out (CUDA_VISIBLE_DEVICES), and report it to "
                                                        f"the node's owner"))
    if pending:
        out.append(Finding("GPU health", Status.FAILED, f"{', '.join(pending)}: memory rows or pages wait for a "
                                                        f"reset to be remapped; `nvidia-smi -r -i <GPU>` with "
                                                        f"nothing running, or reboot"))
    rc, log = tool_output(["dmesg"])
    xids = [] if rc != 0 else [(int(x), where) for where, x in
                               re.findall(r"NVRM: Xid \((PCI:[^)]*)\): (\d+)", log)]
    fatal = sorted({f"Xid {x} ({FATAL_XIDS[x]}) on {where}" for x, where in xids if x in FATAL_XIDS})
    if fatal:
        out.append(Finding("GPU health", Status.FAILED, f"{'; '.join(fatal)} in the kernel log since boot: "
                                                        f"reboot the node before a long run (`dmesg | grep Xid`)"))
    if not out:
        n = len(smi_gpus(text))
        kernel = (f"kernel log unread ({log.strip().splitlines()[-1] if log.strip() else 'dmesg failed'})" if rc != 0
                  else f"{len(xids)} other Xid(s) in the kernel log" if xids else "no Xid in the kernel log")
        out.append(Finding("GPU health", Status.OK, f"{n} GPU(s): no process on them, no uncorrectable ECC error, "
                                                    f"no reset pending; {kernel}"))
    return out


def torch_nccl_version() -> str:
    import torch

    v = torch.cuda.nccl.version()
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def library_nccl_version(name: str) -> str:
    """The version of the NCCL library `name` as dlopen finds it, the way vLLM's pynccl loads it;
    raises OSError when it cannot be loaded."""
    import ctypes

    lib = ctypes.CDLL(name)
    raw = ctypes.c_int()
    if lib.ncclGetVersion(ctypes.byref(raw)):
        raise OSError(f"{name}: ncclGetVersion failed")
    v = raw.value  # 22703 -> 2.27.3
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def nccl_finding(env: dict | None = None) -> Finding:
    """The NCCL torch loads against the one vLLM's own NCCL calls (pynccl) load: VLLM_NCCL_SO_PATH
    (in the run's engine_env or here), else libnccl.so.2. Two versions in one engine: FAILED."""
    ours = torch_nccl_version()
    name = {**os.environ, **(env or {})}.get("VLLM_NCCL_SO_PATH") or "libnccl.so.2"
    try:
        theirs = library_nccl_version(name)
    except OSError as e:
        return Finding("NCCL", Status.FAILED, f"torch has NCCL {ours}; vLLM's pynccl cannot load {name} ({e}): "
                                              f"point VLLM_NCCL_SO_PATH (engine_env) at torch's libnccl.so.2 "
                                              f"(`pip show -f nvidia-nccl-cu13`), or unset it")
    if theirs != ours:
        return Finding("NCCL", Status.FAILED, f"torch has NCCL {ours} but vLLM's pynccl loads {theirs} from {name}: "
                                              f"two NCCLs in one engine; unset VLLM_NCCL_SO_PATH or point it at "
                                              f"torch's libnccl.so.2 (`pip show -f nvidia-nccl-cu13`)")
    return Finding("NCCL", Status.OK, f"{ours}, the same in torch and in vLLM's pynccl ({name})")


def iommu_findings(n_gpus: int, env: dict | None = None, cmdline: Path | None = None,
                   iommu_class: Path | None = None) -> list[Finding]:
    """An IOMMU that translates device traffic (on, per /sys/class/iommu, and not in passthrough on
    the kernel command line) and PCIe bridges whose ACS redirects peer requests up to the root
    complex (ACSCtl SrcValid+/ReqRedir+/CmpltRedir+ in `lspci -vvv`, read as root): either breaks or
    slows GPU-to-GPU transfers. Not failed where the run's engine_env already turns P2P off."""
    if n_gpus < 2:
        return [Finding("IOMMU, ACS", Status.SKIPPED, f"{n_gpus} GPU: no peer traffic")]
    p2p_off = {**os.environ, **(env or {})}.get("NCCL_P2P_DISABLE") == "1"
    status = Status.OK if p2p_off else Status.FAILED
    until = ("; NCCL_P2P_DISABLE=1 is set, so NCCL does not use P2P (slower, but safe)" if p2p_off else
             "; until then set engine_env: {NCCL_P2P_DISABLE: \"1\"} and disable_custom_all_reduce: true")
    fix_settings = {} if p2p_off else {**P2P_OFF, "disable_custom_all_reduce": True}
    out = []
    try:
        args = (cmdline or CMDLINE).read_text().split()
    except OSError:
        args = []
    iommu_dir = iommu_class or IOMMU_CLASS
    active = iommu_dir.is_dir() and any(iommu_dir.iterdir())
    passthrough = any(a in ("iommu=pt", "iommu.passthrough=1", "amd_iommu=off", "intel_iommu=off") for a in args)
    if active and not passthrough:
        out.append(Finding("IOMMU, ACS", status, f"the IOMMU is on and translates GPU traffic (kernel command line: "
                                                 f"{' '.join(a for a in args if 'iommu' in a) or 'no iommu='}): add "
                                                 f"iommu=pt to GRUB_CMDLINE_LINUX (/etc/default/grub, update-grub, "
                                                 f"reboot) or turn VT-d / AMD-Vi off in the BIOS{until}",
                           settings=fix_settings))
    rc, text = tool_output(["lspci", "-vvv"])
    redirecting = []
    for block in re.split(r"\n(?=[0-9a-f]{2,4}:[0-9a-f]{2}[:.])", text if rc == 0 else ""):
        ctl = re.search(r"ACSCtl:\s*(.*)", block)
        if ctl and re.search(r"\b(SrcValid|ReqRedir|CmpltRedir)\+", ctl.group(1)):
            redirecting.append(block.split()[0])
    if rc != 0:
        said = text.strip().splitlines()[-1] if text.strip() else "lspci failed"
        out.append(Finding("IOMMU, ACS", Status.SKIPPED, f"PCIe ACS unread: {said} (apt-get install pciutils)"))
    elif redirecting:
        shown = ", ".join(redirecting[:4]) + (f" and {len(redirecting) - 4} more" if len(redirecting) > 4 else "")
        out.append(Finding("IOMMU, ACS", status, f"PCIe ACS redirects peer traffic on {len(redirecting)} bridge(s) "
                                                 f"({shown}): turn ACS off in the BIOS, or per bridge as root "
                                                 f"`setpci -s <bridge> ECAP_ACS+0x6.w=0000` (until reboot){until}",
                           settings=fix_settings))
    elif "ACSCtl" not in text and "access denied" in text:
        out.append(Finding("IOMMU, ACS", Status.SKIPPED, "PCIe ACS unread: `lspci -vvv` hides it without root "
                                                         "(run the preflight as root to see it)"))
    if not any(f.status is not Status.SKIPPED for f in out):
        out.insert(0, Finding("IOMMU, ACS", Status.OK, "no IOMMU translating GPU traffic" +
                              ("" if any(f.status is Status.SKIPPED for f in out) else
                               ", no PCIe bridge redirecting peer traffic")))
    return out


def shm_finding(path: Path | None = None) -> Finding:
    """Free space in /dev/shm: NCCL's shared-memory transport (what carries an all-reduce once P2P
    is off) and vLLM's broadcast queue live there; a container's default 64 MiB fails them."""
    path = path or SHM
    try:
        free = shutil.disk_usage(path).free
    except OSError as e:
        return Finding("/dev/shm", Status.FAILED, f"{path} cannot be read ({e}): mount it "
                                                  f"(`mount -t tmpfs -o size=16g tmpfs {path}`)")
    if free < MIN_SHM_GIB * 2**30:
        return Finding("/dev/shm", Status.FAILED, f"{size(free)} free in {path}, under the {MIN_SHM_GIB:g} GiB "
                                                  f"NCCL needs once P2P is off: `mount -o remount,size=16g {path}` "
                                                  f"(a container: run it with --ipc=host or --shm-size=16g)")
    return Finding("/dev/shm", Status.OK, f"{size(free)} free in {path}")


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
    """Rank 0's record of the timed all-reduces (`rank_main`)."""
    ranks: int
    backend: str
    mib: int
    seconds: float   # per all-reduce of `mib`, the mean of ALL_REDUCE_ITERS
    correct: bool    # every rank's sums were right
    latency_s: dict[str, float] = field(default_factory=dict)  # KiB -> seconds per all-reduce of that size

    @property
    def bus_gbps(self) -> float:
        """nccl-tests' bus bandwidth: bytes x 2(n-1)/n per second, in GB/s."""
        return self.mib * 2**20 * 2 * (self.ranks - 1) / self.ranks / self.seconds / 1e9


def rank_command(rank: int, world: int, backend: str, mib: int, out: Path,
                 latency_kib: tuple[int, ...] = LATENCY_KIB) -> list[str]:
    return [sys.executable, "-m", "draftsmith.node_preflight", str(rank), str(world), backend, str(mib), str(out),
            ",".join(str(k) for k in latency_kib)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce(ranks: int, timeout_s: float, backend: str = "nccl", mib: int = ALL_REDUCE_MIB,
               slow_gbps: float | None = SLOW_BUS_GBPS, slow_us: float | None = SLOW_SMALL_US,
               env: dict | None = None) -> list[Finding]:
    """One all-reduce of `mib` MiB over `ranks` processes (one per GPU with NCCL), timed after a
    first one that sets NCCL up, then decode-sized ones (LATENCY_KIB); every process is killed after
    `timeout_s`. The processes run in this one's environment with `env` over it (the run's
    engine_env). Two findings, bandwidth and latency; one FAILED on a time-out, a rank that fails
    or wrong sums; (with `slow_gbps` / `slow_us`) FAILED below that bandwidth or above that latency
    of the smallest size."""
    if ranks < 2:
        return [Finding("all-reduce", Status.SKIPPED, f"{ranks} GPU: nothing to all-reduce")]
    name = f"{ranks}-rank {backend} all-reduce of {mib} MiB"
    given = {k: str(v) for k, v in (env or {}).items()}
    name_env = f" (engine_env: {', '.join(f'{k}={v}' for k, v in given.items())})" if given else ""
    env = {**os.environ, **given, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
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
            return [Finding("all-reduce", Status.FAILED, f"the {name}{name_env} failed on rank {r} (exit {rc}: "
                                                         f"{said[-1].strip() if said else 'nothing said'}): run "
                                                         f"again with NCCL_DEBUG=INFO for NCCL's reason; if it "
                                                         f"names P2P, {P2P_FIX}", settings=P2P_OFF)]
        if hung:
            return [Finding("all-reduce", Status.FAILED, f"the {name}{name_env} did not finish in {timeout_s:.0f} s "
                                                         f"(NCCL over PCIe hangs like this when direct GPU-to-GPU "
                                                         f"transfers stall): {P2P_FIX}", settings=P2P_OFF)]
        r0 = AllReduceResult(**json.loads((out / "rank0.json").read_text()))
    figures = f"{r0.seconds * 1e3:,.1f} ms each, bus bandwidth {r0.bus_gbps:,.1f} GB/s"
    if not r0.correct:
        return [Finding("all-reduce", Status.FAILED, f"the {name}{name_env} returned wrong sums ({figures}): "
                                                     f"transfers are corrupted; {P2P_FIX}", settings=P2P_OFF)]
    if slow_gbps is not None and r0.bus_gbps < slow_gbps:
        bandwidth = Finding("all-reduce", Status.FAILED, f"the {name}{name_env} crawls: {figures}, below "
                                                         f"{slow_gbps:g} GB/s; {P2P_FIX}", settings=P2P_OFF)
    else:
        bandwidth = Finding("all-reduce", Status.OK, f"{name}{name_env}: {figures}, sums right")
    return [bandwidth, latency_finding(r0, slow_us)]


def latency_finding(r0: AllReduceResult, slow_us: float | None = SLOW_SMALL_US) -> Finding:
    """The decode-sized all-reduces' time each; FAILED when the smallest takes over `slow_us`."""
    if not r0.latency_s:
        return Finding("latency", Status.SKIPPED, "decode-sized all-reduces not measured")
    sizes = sorted(r0.latency_s, key=int)
    said = ", ".join(f"{int(k) // 1024} MiB {r0.latency_s[k] * 1e6:,.0f} us" if int(k) >= 1024 else
                     f"{k} KiB {r0.latency_s[k] * 1e6:,.0f} us" for k in sizes)
    smallest = r0.latency_s[sizes[0]] * 1e6
    if slow_us is not None and smallest > slow_us:
        return Finding("latency", Status.FAILED,
                       f"decode-sized all-reduces over {r0.ranks} ranks: {said}; {sizes[0]} KiB takes over "
                       f"{slow_us:g} us, and decode does two a layer every step (61 layers: "
                       f"{smallest * 122 / 1e3:,.0f} ms a step): {P2P_FIX}", settings=P2P_OFF)
    return Finding("latency", Status.OK, f"decode-sized all-reduces over {r0.ranks} ranks: {said}")


def rank_main(rank: int, world: int, backend: str, mib: int, out: Path, latency_kib: tuple[int, ...] = ()) -> None:
    """One rank: each fills the tensor with rank + 1, so every sum is world(world + 1)/2; the first
    all-reduce sets the connections up and is checked, the next ALL_REDUCE_ITERS are timed; then
    LATENCY_ITERS of each size in `latency_kib`, after one untimed."""
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
        latency = {}
        for kib in latency_kib:
            small = torch.ones(kib * 1024 // 2, dtype=torch.bfloat16, device=device)
            dist.all_reduce(small)
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(LATENCY_ITERS):
                dist.all_reduce(small)
            sync()
            latency[str(kib)] = (time.perf_counter() - t0) / LATENCY_ITERS
        if rank == 0:
            record = {"ranks": world, "backend": backend, "mib": mib, "seconds": seconds,
                      "correct": bool(correct.item()), "latency_s": latency}
            (out / "rank0.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def disk_finding(values: dict) -> Finding:
    """Free space where `outputs_dir` points against stage 04's features for the run (the same
    arithmetic as stage 04's own check, `hidden.stage`): stage 03's kept tokens when it has run, else
    the datasets' output_token_budget (responses only: a lower bound); shards already written
    count as done."""
    from .hidden import outputs
    from .hidden.stage import bytes_per_token, check_disk
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
    env = values.get("engine_env") or {}
    n = torch.cuda.device_count()
    return [driver_finding(driver_file),
            *gpu_findings(int(values.get("tensor_parallel_size") or 1), memory),
            *gpu_health_findings(),
            nccl_finding(env),
            *iommu_findings(n, env),
            peer_finding(),
            *all_reduce(n, timeout_s, env=env),
            shm_finding(),
            disk_finding(values)]


def failed(findings: list[Finding]) -> bool:
    return any(f.status is Status.FAILED for f in findings)


def suggested(findings: list[Finding]) -> dict:
    """The params-file settings the failed checks call for, merged (engine_env's entries joined)."""
    out: dict = {}
    for f in findings:
        if f.status is Status.FAILED:
            for k, v in f.settings.items():
                out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def render(findings: list[Finding]) -> list[str]:
    """The lines printed: status, check, what was found (and the detail lines under it); then the
    settings the failures call for, as params-file lines."""
    lines = []
    for f in findings:
        lines.append(f"  {f.status.value:<8}{f.check:<12}{f.line}")
        lines += [f"{'':<22}{d}" for d in f.detail]
    wanted = suggested(findings)
    if wanted:
        lines.append("  the params file's settings for the failures above (stages 04 and 06 pass them to every "
                     "engine; run the preflight again with them):")
        lines += [f"    {k}: {json.dumps(v)}" for k, v in wanted.items()]
    return lines


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), Path(sys.argv[5]),
              tuple(int(k) for k in sys.argv[6].split(",") if k) if len(sys.argv) > 6 else ())
