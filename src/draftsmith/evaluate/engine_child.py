"""The vLLM engine process of stage 06: serves the target with each method in turn and decodes the prompts.

Started by `engine.engine_process` (`python -m draftsmith.evaluate.engine_child --job-on-stdin`;
`main` lists the other ways). It appends one row per prompt and method to the job's output, counted
by vLLM itself per request and held to vLLM's spec-decode counters. A method whose engine vLLM's
CPU build cannot start gets one `gpu_only` row instead; a drafter engine that does not capture
the layers the drafter was trained on stops the stage."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .. import events
from ..targets.vllm_capture import engine_record, gpu_only_line
from ..targets.vllm_fixes import apply_fixes
from . import engine_batch
from .engine import EngineMethod
from .estimate import Workload, duration, job_line
from .outputs import append_row
from .prompts import prompt_seed


def _engine_aux_layers(worker):
    """In the worker: the target layers the live engine captures for the drafter (held by the
    decoder stack: `model.model` of a text model, `language_model.model` of Kimi-K2.5's wrapper)."""
    ids = next((m.aux_hidden_state_layers for m in worker.model_runner.model.modules()
                if hasattr(m, "aux_hidden_state_layers")), ())
    return [int(i) for i in ids]


def gpu_runner_layer_ids(spec_config) -> list[int] | None:
    """The ids vLLM's Model Runner V2 (what GPUs run) reads from a parsed speculative config;
    None: it falls back to the model's default (2, N//2, N-3)."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    ids = get_eagle3_aux_layers_from_config(spec_config)
    return [int(i) for i in ids] if ids else None


def _say(msg: str) -> None:
    print(f"[draftsmith] {msg}", flush=True)


def prepare() -> bool:
    """Import vLLM and apply `target.vllm_fixes` (tens of seconds on a small CPU, done before the job
    arrives when the stage starts this process early: `engine.engine_process`), then freeze what is
    alive; True when the CPU expand kernel was replaced (recorded on every row)."""
    import gc

    import vllm  # noqa: F401

    fixed = "fix_cpu_expand_kernel" in apply_fixes(log=_say)
    # vLLM collects garbage about ten times while an engine starts, and a full collection walks every
    # object the process tracks: vLLM's, torch's and transformers' own are most of them, and live as
    # long as the process. Frozen, the collections walk only what the engine made
    # (bench/bench_engine_restart.py).
    gc.freeze()
    return fixed


def engine_eager() -> bool:
    """`enforce_eager` of stage 06's engines. Nothing here needs a hook in the model's forward (the
    aux layers are read as an attribute, the counts come from vLLM's scheduler), so on GPUs the
    engine runs as `vllm serve` does, compiled with CUDA graphs. vLLM's CPU build has no CUDA graphs
    and, not eager, compiles the model with inductor at every engine start: eager there."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _workload(job: dict, m: EngineMethod, done: set) -> list[tuple[float, dict]]:
    """The (temperature, prompt) pairs method `m` still decodes."""
    return [(t, p) for t in job["eval_temperatures"] for p in job["prompts"]
            if (m.fingerprint, t, p["dataset"], p["sample_id"]) not in done and p["dataset"] not in m.skip_datasets]


def _passes(job: dict, todo: list[tuple[float, dict]]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """`todo` as `estimate.Workload` passes: per temperature, each prompt's max_new_tokens per turn."""
    return tuple(tuple((p.get("max_new_tokens", job["eval_max_new_tokens"]),) * (1 + len(p.get("followups", [])))
                       for u, p in todo if u == t) for t in job["eval_temperatures"])


def _decode(llm, job: dict, m: EngineMethod, todo: list[tuple[float, dict]], follow, fields: dict) -> None:
    """Decode method `m`'s `todo` on its live engine, one temperature after the other, appending a
    row per prompt as it ends (`fields` added to each), then hold the rows' counts to vLLM's counters.
    Up to `eval_engine_concurrency` requests are in flight (`engine_batch.decode_all`). Counting is
    vLLM's own, per request: its verify steps one by one (`per_request_spec_decode_metrics=
    "detailed"`), summed the way vLLM sums its spec-decode counters, and held to those counters'
    increase over the decodes (they need `disable_log_stats=False`)."""
    from vllm import SamplingParams

    k, out, rows = m.drafts(job["draft_tokens"]), Path(job["out"]), []

    def write(c: engine_batch.Conversation, t: float) -> None:
        p = c.prompt
        row = {"settings": job["settings"], "method": m.name, "method_fingerprint": m.fingerprint,
               "kind": m.kind, "dataset": p["dataset"], "sample_id": p["sample_id"], "temperature": t,
               **c.fields(), **fields}
        append_row(out, row)
        rows.append(row)

    before = engine_batch.global_counters(llm)
    for t in job["eval_temperatures"]:
        mine = [p for u, p in todo if u == t]
        t1 = time.perf_counter()
        engine_batch.decode_all(llm, [engine_batch.Conversation(p, SamplingParams(
            max_tokens=p.get("max_new_tokens", job["eval_max_new_tokens"]), temperature=t,
            seed=prompt_seed(job["seed"], p["dataset"], p["sample_id"], 4) if t > 0 else None), k)
            for p in mine], job["eval_engine_concurrency"], lambda c, t=t: write(c, t), follow)
        _say(f"{m.name}: T={t:g}, {len(mine)} prompts decoded in {time.perf_counter() - t1:.1f}s, "
             f"up to {min(job['eval_engine_concurrency'], max(len(mine), 1))} in flight")
    engine_batch.check_counters(m.name, before, engine_batch.global_counters(llm), rows, k)


def run_job(job: dict, fixed: bool) -> None:
    """Every method of `job` in turn, one engine each (`prepare` has run). Before an engine's decodes
    a timed probe (`engine_batch.probe`) tells how long they will take (`estimate`; at the first
    engine, every engine of the job)."""
    import gc

    from vllm import LLM, SamplingParams

    done = {tuple(key) for key in job["done"]}
    methods = [EngineMethod(**m) for m in job["methods"]]
    concurrency = job["eval_engine_concurrency"]
    eager = engine_eager()
    # language_model_only: a multimodal wrapper (Kimi-K2.5) builds no vision tower. skip_tokenizer_init:
    # token ids in, token ids out, so an engine neither loads nor deep-copies the tokenizer (vLLM's
    # renderer keeps two copies), and it stops at the generation config's end ids (or the config's),
    # the ones our decoder stops at, not also at the tokenizer's eos
    common = dict(model=job["target"], dtype=job["eval_engine_dtype"], max_model_len=job["max_model_len"],
                  seed=job["seed"], tensor_parallel_size=job["eval_tensor_parallel"],
                  trust_remote_code=job["trust_remote_code"], enable_prefix_caching=False,
                  enforce_eager=eager, disable_log_stats=False, language_model_only=True, skip_tokenizer_init=True)
    if job["eval_tensor_parallel"] == 1:
        common["distributed_executor_backend"] = "uni"
    if job.get("disable_custom_all_reduce"):
        common["disable_custom_all_reduce"] = True
    if job.get("kv_cache_dtype", "auto") != "auto":
        common["kv_cache_dtype"] = job["kv_cache_dtype"]
    out = Path(job["out"])
    workloads = {m.name: Workload(_passes(job, _workload(job, m, done)), concurrency) for m in methods}
    estimated = False
    follow = None
    if any(p.get("followups") for p in job["prompts"]):
        from .benchmarks import load_turns

        follow = load_turns(job["target"], job["trust_remote_code"]).follow
    # an engine vLLM's CPU build cannot start (`vllm_capture.CPU_BUILD_LIMITS`: EAGLE-3 beside an MLA target)
    # gets one row with its `gpu_only` line and no decodes; the other methods of its kind get the
    # same line without another start
    gpu_only: dict[str, str] = {}   # method kind -> vLLM's line: one failed start stands for its kind
    for m in methods:
        t0 = time.perf_counter()
        spec = m.speculative_config
        line = gpu_only.get(m.kind)
        if line is None:
            try:
                events.note("engine start")
                llm = LLM(**common, **({"speculative_config": spec, "per_request_spec_decode_metrics": "detailed"}
                                       if spec else {}))
            except Exception as e:
                line = gpu_only_line(e)
                if line is None:
                    raise
                gpu_only[m.kind] = line
                gc.collect()
                gc.freeze()
        if line is not None:
            append_row(out, {"settings": job["settings"], "method": m.name, "method_fingerprint": m.fingerprint,
                             "kind": m.kind, "gpu_only": line, "temperature": None, "dataset": None,
                             "sample_id": None, "engine": {"model_runner": job.get("vllm_model_runner", "v1"),
                                                           "model_runner_class": None}})
            _say(f"engine {m.name!r}: {line}")
            continue
        startup = time.perf_counter() - t0
        ran = engine_record(llm, env_keys=job.get("engine_env_keys", []))  # the runner that runs, the settings held
        live = gpu = None
        if m.kind in ("eagle3", "dflash"):
            # the layers the live engine captures, and the ids vLLM's GPU model runner (Model Runner
            # V2) reads from the same parsed config (unlike the CPU build's V1 runner, it ignores
            # `eagle_config.eagle_aux_hidden_state_layer_ids`): both must be the drafter's
            live = llm.collective_rpc(_engine_aux_layers)[0]
            gpu = gpu_runner_layer_ids(llm.llm_engine.vllm_config.speculative_config)
            for runner, ids in (("the live engine", live), ("vLLM's GPU model runner", gpu)):
                if ids != m.expect_layers:
                    raise RuntimeError(f"{m.name}: {runner} captures target layers {ids} (input ids) but the "
                                       f"drafter was trained on {m.expect_layers}: the export's "
                                       f"eagle_aux_hidden_state_layer_ids are not where vLLM reads them")
        _say(f"engine {m.name!r} up in {startup:.0f}s, model runner {ran['model_runner']} "
             f"({ran['model_runner_class']})" + (f", captures layers {live}" if live else "")
             + (", eager" if eager else ", compiled with CUDA graphs"))
        first = job["prompts"][0]["ids"]
        llm.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        probe = engine_batch.probe(llm, job["prompts"], min(concurrency, len(job["prompts"])),
                                   max(2, min([32] + [p.get("max_new_tokens", job["eval_max_new_tokens"])
                                                      for p in job["prompts"]])))
        if not estimated:
            _say(job_line(workloads, probe, startup, m.name))
            estimated = True
        w = workloads[m.name]
        _say(f"{m.name}: {w.turns} decodes, up to {w.tokens} tokens, {concurrency} in flight: estimated "
             f"{duration(w.seconds(probe))} ({probe.tokens_per_s:.0f} tok/s over {probe.requests} in the probe)")
        _decode(llm, job, m, _workload(job, m, done), follow,
                {"aux_layers_engine": live, "aux_layers_gpu_runner": gpu, "startup_s": startup,
                 "cpu_expand_kernel_replaced": fixed, "concurrency": concurrency, "enforce_eager": eager,
                 "engine": ran})
        del llm
        gc.collect()
        gc.freeze()     # vLLM unfroze everything at its shutdown; what is left lives on


def layer_ids_vllm_reads(job: dict) -> dict:
    """In the child: for each export, the aux layer ids vLLM parses from it (both model runners'
    readers on vLLM's own parsed config; no engine is started)."""
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    out = {}
    for d in job["exports"]:
        spec = EngineArgs(model=job["target"], dtype="float32", max_model_len=512, enforce_eager=True,
                          speculative_config={"method": "eagle3", "model": d, "num_speculative_tokens": 3}
                          ).create_engine_config().speculative_config
        v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
        out[d] = {"gpu_runner": gpu_runner_layer_ids(spec), "cpu_runner": [int(i) for i in v1] if v1 else None}
    return out


def main() -> int:
    """`JOB` (a job file), `--job-on-stdin` (vLLM imported first, then the path of the job file
    `engine.measure` wrote read from stdin; nothing read: exit) or `-` (a job on stdin: report the
    aux layer ids vLLM parses from the exports, `layer_ids_vllm_reads`)."""
    if sys.argv[1] == "-":
        job = json.loads(sys.stdin.read())
        apply_fixes(log=_say)
        print("[draftsmith-result] " + json.dumps(layer_ids_vllm_reads(job)), flush=True)
        return 0
    fixed = prepare()
    path = sys.stdin.readline().strip() if sys.argv[1] == "--job-on-stdin" else sys.argv[1]
    if path:
        run_job(json.loads(Path(path).read_text()), fixed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
