"""The vLLM side of stage 04: every vLLM internal draftsmith relies on lives in this file.

Runs inside the engine's process (`python -m draftsmith.targets.vllm_capture`, started by
`targets.vllm.VllmCapture`, which sets the environment vLLM needs); pinned to vLLM 0.32.0. Each
request is a prefill of one sample's token ids; the residual stream at the asked layers comes back
as one safetensors file per request, whole or absent, at the path the request names. Each function
lists the vLLM internals it uses ("vLLM internals:"); one that moves fails loudly at engine start
or at the first finished request. An engine start that fails on what vLLM's CPU build cannot
run (`CPU_BUILD_LIMITS`, told from vLLM's own error) is answered as one `GPU-only:` line."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

VLLM_VERSION = "0.32.0"
CONNECTOR = "HiddenStatesToFiles"
# a request's `kv_transfer_params` key asking for its prefill's tokens per engine step, written
# beside its features (`<path>` + STEPS_SUFFIX) as the scheduler ran them
STEPS_KEY = "record_steps"
STEPS_SUFFIX = ".steps.json"


# (exception type name, start of vLLM 0.32.0's message)
CPU_BUILD_LIMITS = (
    # INT4 compressed-tensors MoE (Kimi-K2.5's routed experts): CPU kernels need AMX or zentorch
    ("NotImplementedError", "No WNA16 MoE backend supports the deployment configuration"),
    # EAGLE-3 with a Llama-style drafter over an MLA target: CPU MLA pages by 16, CPU attention by 32
    ("ValueError", "No common block size for"),
)


def error_line(exc: BaseException) -> str:
    """vLLM's error as one line: `Type: first line of the message`."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def gpu_only_line(exc: BaseException, device_type: str | None = None) -> str | None:
    """`GPU-only: <vLLM's error line>` when `exc`, raised by an engine start on vLLM's CPU build
    (`device_type`, default the running platform's), is one of `CPU_BUILD_LIMITS`; else None."""
    if device_type is None:
        from vllm.platforms import current_platform

        device_type = current_platform.device_type
    if device_type != "cpu":
        return None
    seen = set()
    while exc is not None and id(exc) not in seen:  # vLLM may re-raise it wrapped: look at the causes
        seen.add(id(exc))
        message = str(exc).strip()
        for name, start in CPU_BUILD_LIMITS:
            if type(exc).__name__ == name and message.startswith(start):
                return f"GPU-only: {error_line(exc)}"
        exc = exc.__cause__ or exc.__context__
    return None


def _connector_class():
    """Defined lazily: importing vLLM is slow and only the engine's process needs it.

    vLLM's `ExampleHiddenStatesConnector` reads a finished request's slots of the capture buffer
    through CUDA pinned memory and CUDA events, so it dies on a CPU. `HiddenStatesToFiles` keeps its
    scheduler side and replaces the worker side: gather the slots, copy them to the host, write the
    file (`_write`). The caller reads each file, checks its token ids, and deletes it.

    vLLM internals: `ExampleHiddenStatesConnector` (vllm.distributed.kv_transfer.kv_connector.v1.
    example_hidden_states_connector): its scheduler side (`build_connector_meta`, `request_finished`
    with `PendingSave(req_id, filename, token_ids, block_ids)`, the `allow_custom_save_path` /
    `use_synchronization_lock` extra config, per-request `kv_transfer_params.hidden_states_path`),
    its worker state (`_kv_cache`, `_block_size`, `_is_tp_rank_zero`, `_executor`,
    `_get_connector_metadata`, `has_connector_metadata`), `ExampleHiddenStatesConnectorMetadata`
    and `extract_from_kv_cache`; `get_finished_count` (the finished notices vLLM waits for a
    request), `SchedulerOutput.num_scheduled_tokens` and `Request.kv_transfer_params`."""
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector, ExampleHiddenStatesConnectorMetadata, extract_from_kv_cache)

    class HiddenStatesToFiles(ExampleHiddenStatesConnector):
        """Writes each finished request's captured hidden states [T, layers, H] and its token ids to
        the file the request names; works on CPU and GPU (no pinned memory, no CUDA events)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._copied: set[str] = set()    # requests whose hidden states are on the host
            self._finished: set[str] = set()  # requests vLLM reported finished to this worker
            self._scheduled: dict[str, list[int]] = {}  # scheduler side: tokens of each request, step by step

        def get_finished_count(self) -> int:
            """One "finished sending" a request: only tensor-parallel rank 0 copies and writes
            (`_submit_async_write`), so ranks 1.. never report one. Stated here, not inherited: were
            vLLM to wait for every rank, no request would finish, its KV blocks would never be freed,
            and the scheduler would stall once the cache filled (minutes into a real run)."""
            return 1

        def build_connector_meta(self, scheduler_output):
            """The parent's, and each request's tokens scheduled this step (`request_finished`
            writes them for a request that asks, `STEPS_KEY`)."""
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                self._scheduled.setdefault(req_id, []).append(int(n))
            return super().build_connector_meta(scheduler_output)

        def request_finished(self, request, block_ids):
            scheduled = self._scheduled.pop(request.request_id, [])
            params = request.kv_transfer_params or {}
            if params.get(STEPS_KEY) and params.get("hidden_states_path"):
                # the prefill's chunks as the scheduler ran them (the last step decodes nothing: max_tokens 1)
                _write_json(params["hidden_states_path"] + STEPS_SUFFIX, {"scheduled": scheduled})
            return super().request_finished(request, block_ids)

        def _submit_async_write(self, pending) -> None:
            if not self._is_tp_rank_zero:
                return
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
            n = pending.token_ids.shape[0]
            hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n).to("cpu")
            # the copy is done: the request's cache blocks may be freed now; the disk write overlaps
            # the next forward passes
            self._copied.add(pending.req_id)
            self._executor.submit(_write, save_file, pending.filename, hidden.contiguous(),
                                  pending.token_ids.to(torch.int64).clone())

        def get_finished(self, finished_req_ids: set[str]):
            if self.has_connector_metadata():
                meta = self._get_connector_metadata()
                if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                    for pending in meta.pending_saves:
                        self._submit_async_write(pending)
            self._finished |= finished_req_ids
            done = self._finished & self._copied
            self._finished -= done
            self._copied -= done
            return done or None, None

    HiddenStatesToFiles.__module__ = __name__
    return HiddenStatesToFiles


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    Path(tmp).write_text(json.dumps(obj))
    os.replace(tmp, path)


def _write(save_file, path: str, hidden: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Whole or absent: a temporary name, then a rename. A failure leaves `<path>.error` saying why,
    so the caller stops waiting instead of hanging."""
    tmp = path + ".tmp"
    try:
        save_file({"hidden_states": hidden, "token_ids": token_ids}, tmp)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 (reported to the caller through the file system)
        Path(path + ".error").write_text(f"{type(e).__name__}: {e}")


def __getattr__(name: str):
    # vLLM imports the connector by name from this module (`kv_connector_module_path`)
    if name == CONNECTOR:
        cls = _connector_class()
        globals()[CONNECTOR] = cls
        return cls
    raise AttributeError(name)


def engine_kwargs(target: str, vllm_layer_ids: list[int], *, dtype: str = "bfloat16",
                  tensor_parallel_size: int = 1, trust_remote_code: bool = False, max_model_len: int = 4096,
                  max_num_batched_tokens: int | None = None, gpu_memory_utilization: float | None = None,
                  enforce_eager: bool = True, disable_custom_all_reduce: bool = False,
                  kv_cache_dtype: str = "auto") -> dict:
    """Arguments of `vllm.LLM` for a capture engine on `target` keeping `vllm_layer_ids`.

    The `extract_hidden_states` speculative method makes the target keep, for every prompt token,
    the residual stream at the layer ids of the draft config (`hidden_states + residual` on entering
    layer k; id N = the last layer's output, before the final norm) in a buffer shaped like a KV
    cache, one "head" per layer id; the connector (`_connector_class`) reads it out.

    vLLM internals: the method name `extract_hidden_states`, `num_speculative_tokens: 1`,
    `draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids` (input-of-layer ids, collected
    in ascending layer order), `kv_connector_module_path` (a connector class from outside vLLM's
    tree), and `language_model_only` (a multimodal wrapper such as Kimi-K2.5's
    `KimiK25ForConditionalGeneration` builds its language model only; its aux-layer calls reach
    that model, DeepSeek-V2/V3 style)."""
    kw = {"model": str(target), "dtype": dtype, "tensor_parallel_size": tensor_parallel_size,
          "trust_remote_code": trust_remote_code, "max_model_len": max_model_len, "enforce_eager": enforce_eager,
          # a multimodal wrapper (Kimi-K2.5) runs its language model only: no vision tower, no
          # multimodal warm-up (ignored by a text-only model)
          "language_model_only": True,
          # a reused prefix would skip the forward pass that fills the capture buffer
          "enable_prefix_caching": False,
          "disable_log_stats": True,
          # token ids in, hidden states out: the engine neither loads nor copies the tokenizer
          "skip_tokenizer_init": True,
          "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                 "draft_model_config": {"hf_config": {
                                     "eagle_aux_hidden_state_layer_ids": sorted(vllm_layer_ids)}}},
          "kv_transfer_config": {"kv_connector": CONNECTOR, "kv_connector_module_path": __name__,
                                 "kv_role": "kv_producer",
                                 "kv_connector_extra_config": {"allow_custom_save_path": True,
                                                               "use_synchronization_lock": False,
                                                               "num_writer_threads": 2}}}
    if tensor_parallel_size == 1:
        kw["distributed_executor_backend"] = "uni"  # no worker process: one fewer start-up
    if max_num_batched_tokens:
        kw["max_num_batched_tokens"] = int(max_num_batched_tokens)
    if gpu_memory_utilization:
        kw["gpu_memory_utilization"] = float(gpu_memory_utilization)
    if disable_custom_all_reduce:
        kw["disable_custom_all_reduce"] = True
    if kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = kv_cache_dtype
    return kw


def _wait_for(llm, paths: list[str], in_process: bool, timeout_s: float) -> None:
    """Until every file is written. An in-process engine runs steps (the one after a request
    finishes hands it to the connector); an engine in its own process steps by itself.

    vLLM internals: `LLM.llm_engine.step()`."""
    deadline = time.monotonic() + timeout_s
    left = list(paths)
    while left:
        left = [p for p in left if not os.path.exists(p)]
        for p in left:
            if os.path.exists(p + ".error"):
                raise RuntimeError(f"{p}: the capture write failed: {Path(p + '.error').read_text()}")
        if not left:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(left)} capture file(s) not written after {timeout_s:.0f}s, e.g. {left[0]}")
        if in_process:
            llm.llm_engine.step()
        else:
            time.sleep(0.005)


def serve(config: dict, requests, replies) -> None:
    """The engine process: start the engine, then for each request line (JSON: `prompts`, lists of
    token ids, and `paths`, one file each) run the prefills (`max_tokens=1`) and answer once every
    file is whole. `target.vllm_fixes` are applied first; an engine start that fails on one of the
    CPU build's limits (`CPU_BUILD_LIMITS`) answers `gpu_only` with vLLM's error line instead."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from .. import progress
    from .vllm_fixes import apply_fixes

    def reply(obj):
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    t0 = time.perf_counter()
    apply_fixes(log=lambda m: print(f"[draftsmith] {m}", flush=True))
    # the engine's start collects garbage about ten times: frozen, what the imports made is not walked
    # each time (evaluate/engine.py)
    gc.freeze()
    try:
        progress.note("engine start")
        llm = LLM(**config["engine"])
    except Exception as e:
        gpu_only = gpu_only_line(e)
        if gpu_only:
            reply({"gpu_only": gpu_only})
            return
        reply({"error": traceback.format_exc(limit=6)})
        raise
    reply({"ready": True, "startup_s": round(time.perf_counter() - t0, 1), "vllm": _vllm_version(),
           "engine": engine_record(llm, env_keys=config.get("env_keys", ()))})
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    for line in requests:
        job = json.loads(line)
        try:
            # `reference`: the same requests also return the engine's own logprob of every prompt
            # token and its top-1 (stage 04's own check), from the forward pass that captured them
            # (true for all, or one flag a prompt: a prompt without them costs no logits beyond its last)
            reference = job.get("reference")
            flags = [bool(f) for f in reference] if isinstance(reference, list) else [bool(reference)] * len(job["paths"])
            # `steps`: each request's tokens per engine step, as the scheduler ran them (the check's
            # step-crossing sample, `hidden.check.run_crossing`)
            steps = bool(job.get("steps"))
            params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                     prompt_logprobs=1 if flag else None,
                                     extra_args={"kv_transfer_params": {"hidden_states_path": p, STEPS_KEY: steps}})
                      for p, flag in zip(job["paths"], flags)]
            outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params, use_tqdm=False)
            written = job["paths"] + ([p + STEPS_SUFFIX for p in job["paths"]] if steps else [])
            _wait_for(llm, written, in_process, float(config.get("write_timeout_s", 600)))
            answer = {"ok": len(job["paths"])}
            if steps:
                answer["scheduled"] = [_pop_json(p + STEPS_SUFFIX)["scheduled"] for p in job["paths"]]
            if any(flags):
                answer["reference"] = [_prompt_logprobs(o.prompt_logprobs, ids) if flag else None
                                       for o, ids, flag in zip(outs, job["prompts"], flags)]
            reply(answer)
        except Exception:
            reply({"error": traceback.format_exc(limit=6)})


def _pop_json(path: str):
    obj = json.loads(Path(path).read_text())
    os.unlink(path)
    return obj


def _prompt_logprobs(entries, ids: list[int]) -> dict:
    """vLLM's `prompt_logprobs` (None, then per position {token: Logprob(logprob, rank)}) as the
    logprob of each next token and the top-1 token, positions 1.. of the prompt."""
    chosen, top1 = [], []
    for pos in range(1, len(ids)):
        entry = entries[pos]
        chosen.append(float(entry[ids[pos]].logprob))
        top1.append(int(next(t for t, lp in entry.items() if lp.rank == 1)))
    return {"chosen": chosen, "top1": top1}


def engine_record(llm, env_keys=()) -> dict:
    """What ran: vLLM's version, its model runner (v1: `v1/worker/gpu_model_runner.py` and the CPU
    runner built on it; v2: `v1/worker/gpu/`, vLLM 0.32's default where Triton is present), the
    runner's class, the attention backend(s) and MoE kernel(s) the model's layers were built with
    (rank 0's; every tensor-parallel rank builds the same), the step's token budget, whether chunked
    prefill splits a prompt across steps (vLLM's CPU build turns it off for MLA), the tensor-parallel
    ranks, whether the engine core runs in its own process, and the platform.

    vLLM internals: `vllm_config.use_v2_model_runner` (set through `VLLM_USE_V2_MODEL_RUNNER` by
    `VllmCapture`), `scheduler_config.max_num_batched_tokens` and `enable_chunked_prefill`,
    `parallel_config.tensor_parallel_size`,
    `LLM.collective_rpc`, `vllm.platforms.current_platform`; on the worker, `_worker_kernels`'."""
    from vllm.platforms import current_platform

    config = llm.llm_engine.vllm_config
    [layers] = llm.collective_rpc(_worker_kernels)[:1]
    return {"vllm": _vllm_version(), "model_runner": "v2" if config.use_v2_model_runner else "v1",
            "model_runner_class": layers["runner"], "attention_backend": layers["attention"],
            "moe_kernel": layers["moe"], "max_num_batched_tokens": int(config.scheduler_config.max_num_batched_tokens),
            "chunked_prefill": bool(config.scheduler_config.enable_chunked_prefill),
            "tensor_parallel_size": int(config.parallel_config.tensor_parallel_size),
            "engine_core": "in process" if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else "own process",
            "platform": str(getattr(current_platform, "device_name", "") or type(current_platform).__name__),
            **engine_settings_record(llm, env_keys)}


def engine_settings_record(llm, env_keys=()) -> dict:
    """The job's engine settings as the engine holds them: `engine_env`'s variables as rank 0's
    worker process sees them (None: unset there), `disable_custom_all_reduce` and the KV cache dtype.

    vLLM internals: `parallel_config.disable_custom_all_reduce`, `cache_config.cache_dtype`,
    `LLM.collective_rpc` with `args`."""
    config = llm.llm_engine.vllm_config
    env = llm.collective_rpc(_worker_env, args=(list(env_keys),))[0] if env_keys else {}
    return {"engine_env": env, "disable_custom_all_reduce": bool(config.parallel_config.disable_custom_all_reduce),
            "kv_cache_dtype": str(config.cache_config.cache_dtype)}


def _worker_env(worker, keys: list[str]) -> dict:
    """On a worker: the values of `keys` in its process's environment."""
    return {k: os.environ.get(k) for k in keys}


def _worker_kernels(worker) -> dict:
    """On a worker (vLLM's `collective_rpc`): the model runner's class and, from the layers the model
    registered for its forward (`static_forward_context`), each attention backend's name and each
    MoE layer's quantisation method with the experts kernel it runs.

    vLLM internals: the worker's `model_runner` and `vllm_config.compilation_config.
    static_forward_context` (layers with an `attn_backend.get_name()`; MoE layers'
    `routed_experts.quant_method` and its `moe_kernel.fused_experts` or `experts_cls`)."""
    worker = getattr(worker, "worker", None) or worker  # vLLM's wrapper around the worker, where present
    runner = worker.model_runner
    attention, moe = set(), set()
    for layer in worker.vllm_config.compilation_config.static_forward_context.values():
        backend = getattr(layer, "attn_backend", None)
        if backend is not None:
            attention.add(backend.get_name())
        method = getattr(getattr(layer, "routed_experts", None), "quant_method", None)
        if method is not None:
            kernel = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
            experts = type(kernel) if kernel is not None else getattr(method, "experts_cls", None)
            moe.add(type(method).__name__ + (f" / {experts.__name__}" if experts is not None else ""))
    return {"runner": f"{type(runner).__module__}.{type(runner).__name__}", "attention": sorted(attention),
            "moe": sorted(moe)}


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def main() -> int:
    """`python -m draftsmith.targets.vllm_capture CONFIG_JSON REPLY_FD`: requests on stdin, replies on the fd."""
    config = json.loads(sys.argv[1])
    with os.fdopen(int(sys.argv[2]), "w") as replies:
        serve(config, sys.stdin, replies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
