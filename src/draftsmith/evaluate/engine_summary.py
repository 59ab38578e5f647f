"""vLLM's numbers summed up: acceptance from its spec-decode counters, per method and temperature,
and where the engine and our decoder part.

Counting, vLLM's own: per request, its verify steps summed as vLLM sums its counters
(`engine_batch`); acceptance length = 1 + accepted / drafts; per position j: accepted at j / drafts.
"""

from __future__ import annotations

from .engine import VLLM_VERSION, EngineMethod
from .metrics import acceptance_se


def acceptance(rows: list[dict], k: int) -> dict:
    """vLLM's acceptance over a set of decodes (one per prompt), from its counters: 1 + accepted /
    drafts and its standard error over the prompts (`metrics.acceptance_se`), per
    position j = 1..k accepted at j / drafts; output tokens per second per request (its tokens over
    the seconds from its request's add to its end, summed: at the rows' `concurrency`)."""
    drafts = sum(r["counters"]["drafts"] for r in rows)
    accepted = sum(r["counters"]["accepted"] for r in rows)
    draft_tokens = sum(r["counters"]["draft_tokens"] for r in rows)
    per_pos = [sum(r["counters"]["per_pos"][j] for r in rows) if drafts else 0 for j in range(k)]
    tokens, seconds = sum(len(r["output"]) for r in rows), sum(r["seconds"] for r in rows)
    return {"prompts": len(rows), "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_length_se": acceptance_se([r["counters"]["accepted"] for r in rows],
                                                  [r["counters"]["drafts"] for r in rows],
                                                  [a for r in rows for a in r.get("accepted") or []]),
            "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "position_acceptance": [a / drafts for a in per_pos] if drafts else [None] * k,
            "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else None}


def method_of(row: dict, methods: list[EngineMethod]) -> str:
    """A row's method name: its own, or (a row that does not carry it) its method's by fingerprint."""
    return row.get("method") or next((m.name for m in methods if m.fingerprint == row["method_fingerprint"]),
                                     row["method_fingerprint"])


def runner_of(row: dict) -> dict:
    """The model runner a row's engine ran (v1/v2) and its class (None: the engine did not start,
    or a row of a version that did not record it)."""
    ran = row.get("engine") or {}
    return {"model_runner": ran.get("model_runner"), "model_runner_class": ran.get("model_runner_class")}


def summarize(rows: list[dict], methods: list[EngineMethod], draft_tokens: int, temperature: float) -> dict:
    """Per method at one temperature: acceptance overall and per dataset, tok/s per request beside its
    load (`in_flight`; no ratio between methods: each is decoded at its own load), and (greedy)
    whether the outputs equal the no-drafter engine's token for token."""
    mine = [r for r in rows if r["temperature"] == temperature]
    by_fp: dict[str, list[dict]] = {}
    for r in mine:
        by_fp.setdefault(r["method_fingerprint"], []).append(r)
    none = next((m for m in methods if m.kind == "none"), None)
    ref = {(r["dataset"], r["sample_id"]): r["output"] for r in by_fp.get(none.fingerprint, [])} if none else {}
    out = {}
    for m in methods:
        rs = by_fp.get(m.fingerprint, [])
        if not rs:
            continue
        k = m.drafts(draft_tokens)   # a DFlash block drafts its own number
        s = {"kind": m.kind, **m.info, **acceptance(rs, k), "k": k,
             "per_dataset": {ds: acceptance([r for r in rs if r["dataset"] == ds], k)
                             for ds in sorted({r["dataset"] for r in rs})},
             "aux_layers_engine": rs[0].get("aux_layers_engine"), "aux_layers_gpu_runner": rs[0].get("aux_layers_gpu_runner"),
             "startup_s": rs[0].get("startup_s"), **runner_of(rs[0]),
             # its load: the method's requests at this temperature went in together, up to `concurrency` at once
             "in_flight": min(max(r.get("concurrency", 1) for r in rs), len(rs))}
        mismatched = [r["sample_id"] for r in rs if temperature <= 0 and (r["dataset"], r["sample_id"]) in ref
                      and r["output"] != ref[(r["dataset"], r["sample_id"])]]
        s["lossless"] = (not mismatched) if temperature <= 0 and ref else None
        s["mismatched_samples"] = mismatched
        out[m.name] = s
    return out


def compare(engine_rows: list[dict], hf_rows: list[dict], methods: list[EngineMethod], temperature: float) -> dict:
    """Where the engine and our decoder part, per drafter method at one temperature: on how many
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
    measured = {fp for fp, _, _ in eng}
    for m in methods:
        if m.kind not in ("eagle3", "dflash") or m.fingerprint not in measured:
            continue
        steps_equal = outputs_equal = 0
        for ds, sid in none_e:
            e, o = eng.get((m.fingerprint, ds, sid)), ours.get((m.hf_fingerprint, ds, sid))
            if e is None or o is None:
                continue
            outputs_equal += e["output"] == o["output"]
            steps_equal += e["accepted"] == [a for a, d in zip(o["rounds"]["accepted"], o["rounds"]["drafted"]) if d]
        out["methods"][m.name] = {"same_output": outputs_equal, "same_accepted_per_step": steps_equal}
    return out


def engine_report(rows: list[dict], methods: list[EngineMethod], hf_rows: list[dict] | None, draft_tokens: int,
                  eval_temperatures: list[float], eval_engine_dtype: str, eval_tensor_parallel: int) -> dict:
    """The report's `engine` part: per temperature the summary of every method and, at the
    temperatures our decoder measured beside it (`hf_rows`), where the two part (`vs_ours`, else
    None); `gpu_only`: method name -> the line of vLLM's CPU build that could not start it (those
    methods have no summary); `concurrency`, `enforce_eager`: the values the rows were decoded with
    (one each, unless rows of other runs are summed: tok/s is per request at that load)."""
    ours_at = {r["temperature"] for r in hf_rows or []}
    measured = [r for r in rows if not r.get("gpu_only")]
    return {"backend": "vllm", "version": VLLM_VERSION, "eval_engine_dtype": eval_engine_dtype,
            "eval_tensor_parallel": eval_tensor_parallel,
            # requests in flight and eager or not, as the rows were decoded (rows of earlier versions: 1, eager)
            "concurrency": sorted({r.get("concurrency", 1) for r in measured}),
            "enforce_eager": sorted({r.get("enforce_eager", True) for r in measured}),
            "cpu_expand_kernel_replaced": any(r.get("cpu_expand_kernel_replaced") for r in rows),
            "gpu_only": {r["method"]: r["gpu_only"] for r in rows if r.get("gpu_only")},
            # every engine the rows came from: the runner that ran (the one asked for, where it did not start)
            "engines": {method_of(r, methods): {**runner_of(r), "started": not r.get("gpu_only")} for r in rows},
            # the job's engine settings as the engines held them (one each, unless rows of other runs are summed)
            "engine_env": _distinct(measured, "engine_env", {}),
            "disable_custom_all_reduce": _distinct(measured, "disable_custom_all_reduce", None),
            "kv_cache_dtype": _distinct(measured, "kv_cache_dtype", None),
            "temperatures": {
                f"{float(t):g}": {"temperature": float(t), "methods": summarize(rows, methods, draft_tokens, float(t)),
                                  "vs_ours": compare(rows, hf_rows, methods, float(t)) if float(t) in ours_at else None}
                for t in eval_temperatures}}


def _distinct(rows: list[dict], key: str, default):
    """The one value of `key` in the rows' engine records, or the distinct ones in order when they differ."""
    seen = []
    for r in rows:
        v = (r.get("engine") or {}).get(key, default)
        if v not in seen:
            seen.append(v)
    return seen[0] if len(seen) == 1 else default if not seen else seen
