"""Stage 06 in the serving engine: acceptance length and speed measured inside vLLM serving the export.

What a user buys the drafter for is what their engine achieves with it, with the engine's own
kernels, draft-vocab mapping and layer-id handling; our decoder over transformers (`decode`) is the
cross-check. `measure` decodes every held-out prompt with each method (`none`, `ngram`, each export)
in a vLLM engine in a child process (`engine_child`), one row per prompt in the engine's rounds
file, keyed by the settings, so a re-run starts no engine whose rows are all there. On GPUs with
the real target: docs/design/gpu.md, "Stage 06 on GPUs"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from ..paths import Run
from ..targets.vllm import die_with_parent, engine_settings, vllm_env
from . import outputs

VLLM_VERSION = "0.32.0"
CHILD = "draftsmith.evaluate.engine_child"


@dataclass(frozen=True)
class EngineMethod:
    """One method as a vLLM engine (`methods.engine_methods_for`): its `speculative_config` (None: no
    drafting), the layers the engine must capture for its drafter (`expect_layers`, vLLM ids), the
    same method's fingerprint in our decoder, its own `draft_tokens` (a DFlash block; None: the
    stage's) and the prompt sets it does not decode. The engine process gets it as `asdict`'s JSON."""

    name: str
    kind: str                                   # none | ngram | eagle3 | dflash
    fingerprint: str
    speculative_config: dict | None = None
    expect_layers: list[int] | None = None
    info: dict = field(default_factory=dict)    # the report's fields of the method
    hf_fingerprint: str | None = None
    draft_tokens: int | None = None
    skip_datasets: list[str] = field(default_factory=list)

    def drafts(self, draft_tokens: int) -> int:
        """Tokens it drafts a step, where the stage's setting is `draft_tokens`."""
        return draft_tokens if self.draft_tokens is None else self.draft_tokens


def speculative_config(kind: str, draft_tokens: int, export_dir: str | None = None, *,
                       lookup_min_ngram: int | None = None, lookup_max_ngram: int | None = None) -> dict | None:
    """vLLM's `speculative_config` for a method: none, ngram (prompt lookup: both lookup settings
    given) or an eagle3 export."""
    if kind == "none":
        return None
    if kind == "ngram":
        if lookup_min_ngram is None or lookup_max_ngram is None:
            raise ValueError("vLLM's ngram needs lookup_min_ngram and lookup_max_ngram")
        return {"method": "ngram", "num_speculative_tokens": draft_tokens, "prompt_lookup_min": lookup_min_ngram,
                "prompt_lookup_max": lookup_max_ngram}
    if kind in ("eagle3", "dflash"):
        return {"method": kind, "model": str(export_dir), "num_speculative_tokens": draft_tokens}
    raise ValueError(f"unknown method kind {kind!r}")


def settings_key(target_fingerprint: str, draft_tokens: int, new_tokens: int | dict, seed: int,
                 eval_engine_dtype: str, vllm_model_runner: str = "v1", kv_cache_dtype: str = "auto") -> str:
    """What a row of the engine rounds was measured with (`new_tokens`: `eval_max_new_tokens`, or
    prompt set -> tokens per turn when benchmarks bring their own); the device kind is part of it,
    so what a CPU engine could not start (`gpu_only`) is tried again on GPUs. The key's own field
    names (k, max_new_tokens, dtype) are those the rows of earlier runs were written with: renaming
    them would measure every earlier run again. The model runner and the KV cache dtype join the key
    only where they are not the defaults (v1, auto), for the same reason."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    key = {"engine": f"vllm {VLLM_VERSION}", "device": device, "target": target_fingerprint,
           "k": draft_tokens, "max_new_tokens": new_tokens, "seed": seed, "dtype": eval_engine_dtype}
    if vllm_model_runner != "v1":
        key["model_runner"] = vllm_model_runner
    if kv_cache_dtype != "auto":
        key["kv_cache_dtype"] = kv_cache_dtype
    return json.dumps(key, sort_keys=True)


@contextmanager
def engine_process(eval_tensor_parallel: int, start: bool = True, *, vllm_model_runner: str = "v1",
                   engine_env: dict | None = None) -> Iterator[subprocess.Popen | None]:
    """The engine process (`engine_child`, in the environment stage 04's engine gets:
    `target.vllm.vllm_env`, with the job's `engine_env` and model runner: `target.vllm.engine_settings`),
    started now (None unless `start`): it imports vLLM and applies the fixes,
    tens of seconds on a small CPU, while the stage reads its prompts and loads the drafters, then
    waits for `measure` to hand it its job. On leaving, a process still running (it got no job, or
    the stage failed) is killed."""
    if not start:
        yield None
        return
    env = {**vllm_env(tensor_parallel_size=eval_tensor_parallel), **engine_settings(vllm_model_runner, engine_env)}
    proc = subprocess.Popen([sys.executable, "-m", CHILD, "--job-on-stdin"], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def _run_job(proc: subprocess.Popen, job_file, log) -> None:
    """Hand the engine process its job and relay its `[draftsmith]` lines until it ends."""
    proc.stdin.write(f"{job_file}\n")
    proc.stdin.close()
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-40:]
        if line.startswith("[draftsmith] "):
            log(line[len("[draftsmith] "):].rstrip())
    if proc.wait():
        raise RuntimeError(f"the vLLM engine process failed (exit {proc.returncode}); its last lines:\n"
                           + "\n".join(tail))


def measure(run: Run, target: str | os.PathLike, methods: list[EngineMethod], prompts: list, *, draft_tokens: int,
            eval_max_new_tokens: int, eval_temperatures: list[float], seed: int, settings: str,
            eval_engine_dtype: str, eval_tensor_parallel: int, trust_remote_code: bool, eval_engine_concurrency: int,
            log=print, proc: subprocess.Popen | None = None, vllm_model_runner: str = "v1",
            engine_env: dict | None = None, disable_custom_all_reduce: bool = False,
            kv_cache_dtype: str = "auto") -> list[dict]:
    """Decode every prompt (`prompts.HeldoutPrompt`) with every method (`EngineMethod`) at every
    temperature in vLLM, appending to the run's engine rounds; returns the rows of these settings,
    measured now or before (a method vLLM's CPU build cannot start has one row with its `gpu_only`
    line instead), each engine with up to `eval_engine_concurrency` requests in flight. `proc`: the
    engine process `engine_process` started (default: one started here, with `vllm_model_runner` and
    `engine_env`; a given one was started with them). Every engine gets `disable_custom_all_reduce`
    and `kv_cache_dtype`; each row records what ran (`vllm_capture.engine_record`: the runner and its
    class, and these settings as the engine holds them).
    Prompts go as token ids, with the same `draft_tokens` and `eval_max_new_tokens` as our decoder.
    Acceptance is counted per request and does not depend on what else is in the batch (greedy; in
    distribution when sampling); tok/s is per request at that load (1: each prompt alone, the
    latency setting speculative decoding is for)."""
    out = outputs.engine_rounds_file(run)
    done = outputs.read_engine_rows(out, settings)
    gpu_only = {r["method_fingerprint"] for r in done.values() if r.get("gpu_only")}
    todo = [m for m in methods if m.fingerprint not in gpu_only and any(
        (m.fingerprint, float(t), p.dataset, p.sample_id) not in done for t in eval_temperatures for p in prompts
        if p.dataset not in m.skip_datasets)]
    if todo:
        job = {"target": str(target), "eval_engine_dtype": eval_engine_dtype,
               "eval_tensor_parallel": eval_tensor_parallel, "trust_remote_code": trust_remote_code,
               "draft_tokens": draft_tokens, "eval_max_new_tokens": eval_max_new_tokens, "seed": seed,
               "settings": settings, "out": str(out), "eval_temperatures": [float(t) for t in eval_temperatures],
               "eval_engine_concurrency": eval_engine_concurrency, "vllm_model_runner": vllm_model_runner,
               "engine_env_keys": sorted(engine_env or {}), "disable_custom_all_reduce": disable_custom_all_reduce,
               "kv_cache_dtype": kv_cache_dtype,
               "max_model_len": max(p.context_needed(eval_max_new_tokens) for p in prompts)
               + max([draft_tokens] + [m.drafts(draft_tokens) for m in todo]) + 16,
               "prompts": [p.job() for p in prompts],
               "methods": [asdict(m) for m in todo], "done": [list(key) for key in done]}
        job_file = outputs.write_engine_job(run, job)
        turns = sum(1 + len(p.followups) for m in todo for t in eval_temperatures for p in prompts
                    if p.dataset not in m.skip_datasets
                    and (m.fingerprint, float(t), p.dataset, p.sample_id) not in done)
        log(f"vLLM {VLLM_VERSION}, model runner {vllm_model_runner}: {len(todo)} engine(s) to start "
            f"({', '.join(m.name for m in todo)}), "
            f"{len(prompts)} prompts x {len(eval_temperatures)} temperatures each, {turns} decodes to go, up to "
            f"{eval_engine_concurrency} in flight; the time is estimated once the first engine is up")
        with engine_process(eval_tensor_parallel, start=proc is None, vllm_model_runner=vllm_model_runner,
                            engine_env=engine_env) as started:
            _run_job(proc or started, job_file, log)
        done = outputs.read_engine_rows(out, settings)
    keys = {m.fingerprint for m in methods}
    return [r for key, r in done.items() if key[0] in keys]


def read_layer_ids(target: str | os.PathLike, exports: list[str | os.PathLike]) -> dict:
    """What vLLM reads as aux layer ids from each export (None: its default), per model runner."""
    job = {"mode": "layer_ids", "target": str(target), "exports": [str(e) for e in exports]}
    r = subprocess.run([sys.executable, "-m", CHILD, "-"], input=json.dumps(job), text=True,
                       capture_output=True, env=vllm_env())
    if r.returncode:
        raise RuntimeError(f"vLLM could not parse the exports: {(r.stdout + r.stderr)[-3000:]}")
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("[draftsmith-result] "))
                      .split(" ", 1)[1])
