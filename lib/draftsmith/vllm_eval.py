"""Stage 06 in the serving engine: acceptance length and speed measured inside vLLM serving the export.

What a user buys the drafter for is what their engine achieves with it, with the engine's own
kernels, draft-vocab mapping and layer-id handling; `evaluate.py`'s decoder over transformers is the
cross-check. Here every method is a vLLM engine serving the target: `none` (no speculation),
`ngram` (vLLM's prompt lookup) and each export of the drafter (`eagle3`, chain of k). Every held-out
prompt is decoded alone (concurrency 1, the latency setting speculative decoding is for) at every
temperature, as token ids, with the same k and max_new_tokens as the `hf` evaluator.

Counting, vLLM's own: per request, the spec-decode counters' increase over its `generate` call
(`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos`; they need `disable_log_stats=False`), and its verify steps one by
one (`per_request_spec_decode_metrics="detailed"`), which the report uses to show where the engine
and our evaluator part. Acceptance length = 1 + accepted / drafts; per position j:
accepted at j / drafts.

Layer ids: with each eagle3 engine the child records the auxiliary layers the live engine captures,
and the ids vLLM's GPU model runner (Model Runner V2) reads from the same parsed config, which,
unlike the CPU build's V1 runner, ignores `eagle_config.eagle_aux_hidden_state_layer_ids`.
Both must be the ids the drafter was trained on, or the stage stops.

Engines run in a child process (`python -m draftsmith.vllm_eval JOB`, started like stage 04's engine:
`target.vllm.vllm_env`), one after the other in that process. Each decoded
prompt is one line of `<run>/eval/engine_rounds.jsonl`, keyed by the settings, so a re-run starts no
engine whose lines are all there. On GPUs with the real target: docs/gpu.md, "Stage 06 on GPUs".
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .files import read_jsonl
from .target.vllm import die_with_parent, vllm_env

VLLM_VERSION = "0.32.0"
COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted", "vllm:spec_decode_num_accepted_tokens_per_pos": "per_pos"}


# ---- the parent: what to measure, and the child that measures it ----------------------------------

# lets `collective_rpc` carry a function to the workers (reading the layers they capture); the
# engine's processes talk only to each other
RPC_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def speculative_config(kind: str, k: int, export_dir: str | None = None, lookup_min: int = 1,
                       lookup_max: int = 3) -> dict | None:
    """vLLM's `speculative_config` for a method: none, ngram (prompt lookup) or an eagle3 export."""
    if kind == "none":
        return None
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup_min,
                "prompt_lookup_max": lookup_max}
    if kind == "eagle3":
        return {"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": k}
    raise ValueError(f"unknown method kind {kind!r}")


def settings_key(target_fingerprint: str, k: int, max_new_tokens: int, seed: int, dtype: str) -> str:
    return json.dumps({"engine": f"vllm {VLLM_VERSION}", "target": target_fingerprint, "k": k,
                       "max_new_tokens": max_new_tokens, "seed": seed, "dtype": dtype}, sort_keys=True)


def prompt_seed(seed: int, dataset: str, sample_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{dataset}/{sample_id}".encode()).digest()[:4], "big")


def read_rows(path: Path, settings: str) -> dict[tuple, dict]:
    """Rows of `engine_rounds.jsonl` measured with these settings, by (method fingerprint,
    temperature, dataset, sample id)."""
    rows = {}
    for _, r in read_jsonl(path):
        if r.get("settings") == settings:
            rows[(r["method_fingerprint"], r["temperature"], r["dataset"], r["sample_id"])] = r
    return rows


def measure(target: str | os.PathLike, methods: list[dict], prompts: list, *, k: int, max_new_tokens: int,
            temperatures: list[float], seed: int, out: Path, settings: str, dtype: str = "float32",
            tensor_parallel_size: int = 1, trust_remote_code: bool = False, log=print) -> list[dict]:
    """Decode every prompt (`evaluate.Prompt`) with every method ({name, kind, fingerprint,
    speculative_config, expect_layers (vLLM ids) or None, info}) at every temperature in vLLM,
    appending to `out`; returns the rows of these settings, measured now or before."""
    done = read_rows(out, settings)
    todo = [m for m in methods if any((m["fingerprint"], float(t), p.dataset, p.sample_id) not in done
                                       for t in temperatures for p in prompts)]
    if todo:
        job = {"target": str(target), "dtype": dtype, "tensor_parallel_size": tensor_parallel_size,
               "trust_remote_code": trust_remote_code, "k": k, "max_new_tokens": max_new_tokens,
               "seed": seed, "settings": settings, "out": str(out), "temperatures": [float(t) for t in temperatures],
               "max_model_len": max(len(p.ids) for p in prompts) + max_new_tokens + k + 16,
               "prompts": [{"dataset": p.dataset, "sample_id": p.sample_id, "ids": list(p.ids)} for p in prompts],
               "methods": todo, "done": [list(key) for key in done]}
        job_file = out.with_name("engine_job.json")
        job_file.write_text(json.dumps(job))
        log(f"vLLM {VLLM_VERSION}: {len(todo)} engine(s) to start ({', '.join(m['name'] for m in todo)}), "
            f"{len(prompts)} prompts x {len(temperatures)} temperatures each")
        env = {**vllm_env(in_process=tensor_parallel_size == 1), **RPC_ENV}
        cmd = [sys.executable, "-m", "draftsmith.vllm_eval", str(job_file)]
        tail: list[str] = []
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=die_with_parent) as proc:
            for line in proc.stdout:
                tail = (tail + [line.rstrip()])[-40:]
                if line.startswith("[draftsmith] "):
                    log(line[len("[draftsmith] "):].rstrip())
        if proc.returncode:
            raise RuntimeError(f"the vLLM engine process failed (exit {proc.returncode}); its last lines:\n"
                               + "\n".join(tail))
        done = read_rows(out, settings)
    keys = {m["fingerprint"] for m in methods}
    return [r for key, r in done.items() if key[0] in keys]


# ---- summaries ---------------------------------------------------------------------------------

def acceptance(rows: list[dict], k: int) -> dict:
    """vLLM's acceptance over a set of decodes, from its counters: 1 + accepted / drafts, per
    position accepted at j / drafts; output tokens per second (each prompt alone)."""
    drafts = sum(r["counters"]["drafts"] for r in rows)
    accepted = sum(r["counters"]["accepted"] for r in rows)
    draft_tokens = sum(r["counters"]["draft_tokens"] for r in rows)
    per_pos = [sum(r["counters"]["per_pos"][j] for r in rows) if drafts else 0 for j in range(k)]
    tokens, seconds = sum(len(r["output"]) for r in rows), sum(r["seconds"] for r in rows)
    return {"prompts": len(rows), "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "position_acceptance": [a / drafts for a in per_pos] if drafts else [None] * k,
            "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else None}


def summarize(rows: list[dict], methods: list[dict], k: int, temperature: float) -> dict:
    """Per method at one temperature: acceptance overall and per dataset, tok/s and its ratio to
    no drafter, and (greedy) whether the outputs equal the no-drafter engine's token for token."""
    mine = [r for r in rows if r["temperature"] == temperature]
    by_fp: dict[str, list[dict]] = {}
    for r in mine:
        by_fp.setdefault(r["method_fingerprint"], []).append(r)
    none = next((m for m in methods if m["kind"] == "none"), None)
    ref = {(r["dataset"], r["sample_id"]): r["output"] for r in by_fp.get(none["fingerprint"], [])} if none else {}
    out = {}
    for m in methods:
        rs = by_fp.get(m["fingerprint"], [])
        if not rs:
            continue
        s = {"kind": m["kind"], **m.get("info", {}), **acceptance(rs, k),
             "per_dataset": {ds: acceptance([r for r in rs if r["dataset"] == ds], k)
                             for ds in sorted({r["dataset"] for r in rs})},
             "aux_layers_engine": rs[0].get("aux_layers_engine"), "aux_layers_gpu_runner": rs[0].get("aux_layers_gpu_runner"),
             "startup_s": rs[0].get("startup_s")}
        mismatched = [r["sample_id"] for r in rs if temperature <= 0 and (r["dataset"], r["sample_id"]) in ref
                      and r["output"] != ref[(r["dataset"], r["sample_id"])]]
        s["lossless"] = (not mismatched) if temperature <= 0 and ref else None
        s["mismatched_samples"] = mismatched
        out[m["name"]] = s
    base = out.get(none["name"]) if none else None
    for s in out.values():
        s["speedup_tokens_per_s"] = (s["tokens_per_s"] / base["tokens_per_s"]
                                     if base and base["tokens_per_s"] and s["tokens_per_s"] else None)
    return out


def compare(engine_rows: list[dict], hf_rows: list[dict], methods: list[dict], temperature: float) -> dict:
    """Where the engine and our evaluator part, per eagle3 method at one temperature: on how many
    prompts the two no-drafter outputs are the same, and on those the per-step accepted counts
    (they implement the same rule, so they differ only where the two targets' numbers do)."""
    eng = {(r["method_fingerprint"], r["dataset"], r["sample_id"]): r for r in engine_rows
           if r["temperature"] == temperature}
    ours = {(r["method_fingerprint"], r["dataset"], r["sample_id"]): r for r in hf_rows
            if r["temperature"] == temperature}
    none_e = {(r["dataset"], r["sample_id"]): r["output"] for r in engine_rows
              if r["temperature"] == temperature and r["kind"] == "none"}
    none_o = {(r["dataset"], r["sample_id"]): r["output"] for r in hf_rows
              if r["temperature"] == temperature and r["kind"] == "none"}
    same_target = sorted(key for key in none_e if none_o.get(key) == none_e[key])
    out = {"prompts": len(none_e), "same_no_drafter_output": len(same_target), "methods": {}}
    for m in methods:
        if m["kind"] != "eagle3":
            continue
        steps_equal = outputs_equal = 0
        for ds, sid in none_e:
            e, o = eng.get((m["fingerprint"], ds, sid)), ours.get((m["hf_fingerprint"], ds, sid))
            if e is None or o is None:
                continue
            outputs_equal += e["output"] == o["output"]
            steps_equal += e["accepted"] == [a for a, d in zip(o["rounds"]["accepted"], o["rounds"]["drafted"]) if d]
        out["methods"][m["name"]] = {"same_output": outputs_equal, "same_accepted_per_step": steps_equal}
    return out


# ---- the child: runs inside the engine's process --------------------------------------------------

def _counters(llm) -> dict:
    got = {COUNTERS[m.name]: (list(m.values) if hasattr(m, "values") else m.value)
           for m in llm.get_metrics() if m.name in COUNTERS}
    return {"drafts": got.get("drafts", 0), "draft_tokens": got.get("draft_tokens", 0),
            "accepted": got.get("accepted", 0), "per_pos": got.get("per_pos", [])}


def _delta(after: dict, before: dict, k: int) -> dict:
    pos_a, pos_b = after["per_pos"] or [0] * k, before["per_pos"] or [0] * k
    return {"drafts": after["drafts"] - before["drafts"], "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted": after["accepted"] - before["accepted"], "per_pos": [a - b for a, b in zip(pos_a, pos_b)]}


def _engine_aux_layers(worker):
    """In the worker: the target layers the live engine captures for the drafter."""
    model = worker.model_runner.model
    inner = getattr(model, "model", model)
    return [int(i) for i in getattr(inner, "aux_hidden_state_layers", ())]


def gpu_runner_layer_ids(spec_config) -> list[int] | None:
    """The ids vLLM's Model Runner V2 (what GPUs run) reads from a parsed speculative config;
    None: it falls back to the model's default (2, N//2, N-3)."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    ids = get_eagle3_aux_layers_from_config(spec_config)
    return [int(i) for i in ids] if ids else None


def expand_to_tokens(output, values, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """vLLM's `expand_kernel` in torch, any dtype: request i's value (`replace_from` read as
    `replace_to`) written to its tokens, cu_num_tokens[i-1]..cu_num_tokens[i] of `output`."""
    import torch

    cu = cu_num_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(values == replace_from, torch.full_like(values, replace_to), values)
    output.copy_(torch.repeat_interleave(values, counts, output_size=output.numel()))


def fix_cpu_expand_kernel() -> bool:
    """vLLM 0.32.0's CPU build (no Triton) stands in for the rejection sampler's `expand_kernel` with
    a C++ one over int64 tensors: given the batch's float32 temperatures it writes an int64 copy and
    leaves the real output uninitialised, so at T > 0 the target's logits are divided by whatever
    was in memory and every draft is rejected. Where that stand-in loses a float, it is replaced by
    `expand_to_tokens` before any engine starts (vLLM binds it at each worker's start). True when
    replaced; GPUs (Triton) and a fixed vLLM are left alone."""
    import torch
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or current_platform.device_type != "cpu":
        return False
    from vllm.utils import cpu_triton_utils

    current_platform.import_kernels()
    values, cu = torch.tensor([0.5, 2.0]), torch.tensor([3, 5], dtype=torch.int32)
    out = torch.full((5,), -1.0)
    cpu_triton_utils._expand_kernel_impl(out, values, cu, 0, 1)
    if out.tolist() == [0.5, 0.5, 0.5, 2.0, 2.0]:
        return False
    cpu_triton_utils._expand_kernel_impl = expand_to_tokens
    return True


def _say(msg: str) -> None:
    print(f"[draftsmith] {msg}", flush=True)


def run_job(job: dict) -> None:
    import gc

    from vllm import LLM, SamplingParams

    k, tp = job["k"], job["tensor_parallel_size"]
    done = {tuple(key) for key in job["done"]}
    common = dict(model=job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=job["seed"],
                  tensor_parallel_size=tp, trust_remote_code=job["trust_remote_code"], enable_prefix_caching=False,
                  enforce_eager=True, disable_log_stats=False)
    if tp == 1:
        common["distributed_executor_backend"] = "uni"
    fixed = fix_cpu_expand_kernel()
    if fixed:
        _say("vLLM's CPU expand kernel loses the float temperatures of a batch (vLLM 0.32.0 CPU build); "
             "replaced by a torch one, or no draft is ever accepted at T > 0")
    with open(job["out"], "a", encoding="utf-8") as out:
        # ngram last: its proposer imports numba, whose llvmlite objects break the kernel-override scan
        # of every later engine start in this process on vLLM's CPU build (0.32.0)
        for m in sorted(job["methods"], key=lambda m: m["kind"] == "ngram"):
            t0 = time.perf_counter()
            spec = m["speculative_config"]
            llm = LLM(**common, **({"speculative_config": spec, "per_request_spec_decode_metrics": "detailed"}
                                   if spec else {}))
            startup = time.perf_counter() - t0
            live = gpu = None
            if m["kind"] == "eagle3":
                live = llm.collective_rpc(_engine_aux_layers)[0]
                gpu = gpu_runner_layer_ids(llm.llm_engine.vllm_config.speculative_config)
                for runner, ids in (("the live engine", live), ("vLLM's GPU model runner", gpu)):
                    if ids != m["expect_layers"]:
                        raise RuntimeError(f"{m['name']}: {runner} captures target layers {ids} (input ids) but the "
                                           f"drafter was trained on {m['expect_layers']}: the export's "
                                           f"eagle_aux_hidden_state_layer_ids are not where vLLM reads them")
            _say(f"engine {m['name']!r} up in {startup:.0f}s" + (f", captures layers {live}" if live else ""))
            first = job["prompts"][0]["ids"]
            llm.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
            for t in job["temperatures"]:
                n = 0
                for p in job["prompts"]:
                    if (m["fingerprint"], t, p["dataset"], p["sample_id"]) in done:
                        continue
                    sp = SamplingParams(max_tokens=job["max_new_tokens"], temperature=t,
                                        seed=prompt_seed(job["seed"], p["dataset"], p["sample_id"]) if t > 0 else None)
                    before = _counters(llm)
                    t1 = time.perf_counter()
                    o = llm.generate([{"prompt_token_ids": p["ids"]}], sp, use_tqdm=False)[0].outputs[0]
                    seconds = time.perf_counter() - t1
                    sdm = o.spec_decode_metrics
                    row = {"settings": job["settings"], "method": m["name"], "method_fingerprint": m["fingerprint"],
                           "kind": m["kind"], "dataset": p["dataset"], "sample_id": p["sample_id"], "temperature": t,
                           "output": list(o.token_ids), "seconds": seconds,
                           "counters": _delta(_counters(llm), before, k),
                           "drafted": list(sdm.per_step_drafted) if sdm else [],
                           "accepted": list(sdm.per_step_accepted) if sdm else [],
                           "aux_layers_engine": live, "aux_layers_gpu_runner": gpu, "startup_s": startup,
                           "cpu_expand_kernel_replaced": fixed}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    n += 1
                _say(f"{m['name']}: T={t:g}, {n} prompts decoded")
            del llm
            gc.collect()


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


def read_layer_ids(target: str | os.PathLike, exports: list[str | os.PathLike]) -> dict:
    """What vLLM reads as aux layer ids from each export (None: its default), per model runner."""
    job = {"mode": "layer_ids", "target": str(target), "exports": [str(e) for e in exports]}
    r = subprocess.run([sys.executable, "-m", "draftsmith.vllm_eval", "-"], input=json.dumps(job), text=True,
                       capture_output=True, env={**vllm_env(), **RPC_ENV})
    if r.returncode:
        raise RuntimeError(f"vLLM could not parse the exports: {(r.stdout + r.stderr)[-3000:]}")
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("[draftsmith-result] "))
                      .split(" ", 1)[1])


def main() -> int:
    job = json.loads(sys.stdin.read() if sys.argv[1] == "-" else Path(sys.argv[1]).read_text())
    if job.get("mode") == "layer_ids":
        result = layer_ids_vllm_reads(job)
        print("[draftsmith-result] " + json.dumps(result), flush=True)
        return 0
    run_job(job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
