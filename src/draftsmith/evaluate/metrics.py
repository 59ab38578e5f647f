"""Acceptance, counted two ways: from the rounds of our decoder's decodes (a round = one target
verification), and from vLLM's own counters of its engines' decodes (`engine_report`).

    acceptance length, the field's (vLLM's and SGLang's counters) = 1 + accepted drafts / rounds
        that drafted (rounds where the proposer had nothing to offer do not count; no drafter: 1);
    tokens per round = tokens emitted by rounds / rounds, every round counted (the first token,
        which the prefill emits, is not): what a speed-up estimate divides;
    per draft position j: P(accepted), and P(accepted | j-1 accepted).

Our decoder's (`acceptance`, `summarize`): each decode is also split where the output starts
repeating itself (its first repeated `LOOP_NGRAM`-gram): copying from the context wins there, a
drafter has to earn its keep before it. vLLM's (`engine_acceptance`, `summarize_engine`): per
request, its verify steps summed as vLLM sums its counters (`engine.step_counters`); per position
j: accepted at j / drafts; and where the engine and our decoder part (`compare`).
"""

from __future__ import annotations

from .engine import VLLM_VERSION
from .methods import EngineMethod

LOOP_NGRAM = 4   # a token whose preceding 4-gram already occurred starts "repeating" text


def acceptance_se(accepted: list[float], drafts: list[float], steps: list[float] | None = None) -> float | None:
    """Standard error of an acceptance length 1 + sum(accepted) / sum(drafts): over prompts, from
    each prompt's accepted and drafts (the ratio estimator's, delta method; prompts are the sample,
    the steps within one prompt are not independent), and never below the steps' own spread
    (`steps`: accepted at every drafting step; their standard deviation / sqrt(steps)), which a few
    prompts that happen to agree (three prompts can read ± 0.00) would otherwise hide. 0 where
    nothing drafted (the length is 1 exactly); None with fewer than two prompts and no steps."""
    n, total = len(drafts), sum(drafts)
    if not total:
        return 0.0 if n else None
    r = sum(accepted) / total
    over_prompts = (n / (n - 1) * sum((a - r * d) ** 2 for a, d in zip(accepted, drafts))) ** 0.5 / total \
        if n >= 2 else None
    within = None
    if steps and len(steps) >= 2:
        mean = sum(steps) / len(steps)
        within = (sum((x - mean) ** 2 for x in steps) / (len(steps) - 1) / len(steps)) ** 0.5
    known = [x for x in (over_prompts, within) if x is not None]
    return max(known) if known else None


def repeat_start(context: list[int], output: list[int], n: int = LOOP_NGRAM) -> int:
    """Index of the first output token whose n-gram (ending at it) already occurred earlier in
    prompt + output; len(output) when none does. From there on the text repeats itself."""
    seq = list(context) + list(output)
    seen: set[tuple[int, ...]] = set()
    for j in range(n, len(seq) + 1):   # n-gram seq[j-n:j] ends at index j-1
        g = tuple(seq[j - n:j])
        if j - 1 >= len(context) and g in seen:
            return j - 1 - len(context)
        seen.add(g)
    return len(output)


def acceptance(rounds: list[dict], k: int) -> dict:
    """Acceptance of a set of decodes (their `Decoded.rounds()`, one per prompt): the field's acceptance
    length (1 + accepted / drafts, as vLLM and SGLang count it) and its standard error over the
    prompts (`acceptance_se`), tokens per verification round, and per
    draft position j = 1..k the unconditional and conditional acceptance rate."""
    n_rounds = produced = drafting = acc = drafted_tokens = 0
    top = 0.0
    pos_drafted = [0] * k
    pos_reached = [0] * k
    pos_accepted = [0] * k
    for r in rounds:
        top += sum(r["top_prob"])
        for d, a, p in zip(r["drafted"], r["accepted"], r["produced"]):
            n_rounds += 1
            produced += p
            drafted_tokens += d
            acc += a
            drafting += d > 0
            for j in range(min(d, k)):
                pos_drafted[j] += 1
                pos_reached[j] += j <= a   # drafts 1..j-1 were accepted
                pos_accepted[j] += j < a

    def ratio(x, y):
        return x / y if y else float("nan")

    return {
        "rounds": n_rounds, "tokens": produced, "draft_tokens": drafted_tokens, "accepted_tokens": acc,
        "drafts": drafting, "prompts": len(rounds),
        "acceptance_length": 1 + ratio(acc, drafting) if drafting else 1.0,
        "acceptance_length_se": acceptance_se([sum(r["accepted"]) for r in rounds],
                                              [sum(d > 0 for d in r["drafted"]) for r in rounds],
                                              [a for r in rounds for a, d in zip(r["accepted"], r["drafted"]) if d]),
        "tokens_per_round": ratio(produced, n_rounds),
        "draft_acceptance_rate": ratio(acc, drafted_tokens),
        "position_acceptance": [ratio(pos_accepted[j], pos_drafted[j]) for j in range(k)],
        "position_acceptance_conditional": [ratio(pos_accepted[j], pos_reached[j]) for j in range(k)],
        "position1_ceiling": ratio(top, n_rounds),
    }


def split_rounds(rounds: dict, cut: int) -> tuple[dict, dict]:
    """The rounds starting before output index `cut`, and the others."""
    keys = ("drafted", "accepted", "produced", "start", "top_prob")
    before = {key: [v for v, s in zip(rounds[key], rounds["start"]) if s < cut] for key in keys}
    after = {key: [v for v, s in zip(rounds[key], rounds["start"]) if s >= cut] for key in keys}
    return before, after


def speedup(tokens_per_round: float, draft_steps: float, cost_ratio: float) -> float:
    """Decoding speed-up over the target alone when one round costs a target forward (the verify
    of k+1 tokens costs about one decode step while decoding is memory-bound) plus `draft_steps`
    drafter forwards, each `cost_ratio` of a target forward."""
    return tokens_per_round / (1 + draft_steps * cost_ratio)


def summarize(rows: list[dict], methods: list, draft_tokens: int, draft_cost_ratio: float) -> dict:
    """Per method (`methods.Method`): acceptance overall, per dataset, per position, on text
    before/after the output starts repeating itself, the speed-up estimate; and whether its greedy
    outputs equal the target's (the `none` method's) token for token."""
    by_method: dict[str, list[dict]] = {}
    for r in rows:
        by_method.setdefault(r["method"], []).append(r)
    reference = {(r["dataset"], r["sample_id"]): r["output"] for r in by_method.get("none", [])}
    out = {}
    for m in methods:
        mine = by_method.get(m.name, [])
        if not mine:
            continue
        k = m.info.get("draft_tokens", draft_tokens)   # a DFlash block drafts its own number
        total = acceptance([r["rounds"] for r in mine], k)
        datasets = sorted({r["dataset"] for r in mine})
        per_ds = {ds: acceptance([r["rounds"] for r in mine if r["dataset"] == ds], k) for ds in datasets}
        novel = acceptance([split_rounds(r["rounds"], r["repeat_start"])[0] for r in mine], k)
        repeating = acceptance([split_rounds(r["rounds"], r["repeat_start"])[1] for r in mine], k)
        greedy = [r for r in mine if r["temperature"] <= 0 and (r["dataset"], r["sample_id"]) in reference]
        mismatches = [r["sample_id"] for r in greedy if r["output"] != reference[(r["dataset"], r["sample_id"])]]
        # drafter forwards per round: a chain drafts one token a forward, a DFlash block all at once
        draft_steps = {"eagle3": k, "dflash": 1}.get(m.kind, 0)
        out[m.name] = {
            "kind": m.kind, **m.info, **total,
            "per_dataset": per_ds,
            "novel_text": novel, "repeating_text": repeating,
            "speedup_estimate": speedup(total["tokens_per_round"], draft_steps, draft_cost_ratio),
            "draft_forwards_per_round": draft_steps,
            "lossless": None if not greedy else not mismatches, "mismatched_samples": mismatches,
            "seconds": sum(r["seconds"] for r in mine), "prompts": len(mine),
        }
    return out


def verdict(summary: dict) -> dict:
    """The final drafter against prompt lookup, overall and on novel / repeating text."""
    d, pl = summary["eagle3"], summary["prompt lookup"]
    out = {"drafter": d["acceptance_length"], "prompt_lookup": pl["acceptance_length"], "no_drafter": 1.0,
           "beats_prompt_lookup": d["acceptance_length"] > pl["acceptance_length"]}
    for part in ("novel_text", "repeating_text"):
        a, b = d[part]["acceptance_length"], pl[part]["acceptance_length"]
        out[part] = {"drafter": a, "prompt_lookup": b, "rounds": d[part]["rounds"],
                     "beats_prompt_lookup": a > b if a == a and b == b else None}
    return out


DEFINITIONS = {   # written into the report beside the numbers
    "acceptance_length": "1 + accepted draft tokens / verification steps that drafted (vLLM's and SGLang's "
                         "counters); no drafter: 1",
    "tokens_per_round": "tokens emitted / verification rounds, rounds that drafted nothing included (the "
                        "prefill's first token not counted)",
    "position_acceptance": "P(draft j accepted) over rounds that drafted position j",
    "position_acceptance_conditional": "P(draft j accepted | drafts 1..j-1 accepted)",
    "position1_ceiling": "mean over rounds of the target's probability of its own top token: "
                         "P(draft 1 accepted) for a perfect drafter (1 when greedy)",
    "novel_text": f"rounds starting before the output's first repeated {LOOP_NGRAM}-gram",
    "repeating_text": "rounds starting at or after it",
    "speedup_estimate": "tokens_per_round / (1 + draft_forwards_per_round * draft_cost_ratio)",
}


# ---- vLLM's numbers: acceptance from its spec-decode counters, per method and temperature ----


def engine_acceptance(rows: list[dict], k: int) -> dict:
    """vLLM's acceptance over a set of decodes (one per prompt), from its counters: 1 + accepted /
    drafts and its standard error over the prompts (`acceptance_se`), per
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


def summarize_engine(rows: list[dict], methods: list[EngineMethod], draft_tokens: int, temperature: float) -> dict:
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
        s = {"kind": m.kind, **m.info, **engine_acceptance(rs, k), "k": k,
             "per_dataset": {ds: engine_acceptance([r for r in rs if r["dataset"] == ds], k)
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
                f"{float(t):g}": {"temperature": float(t), "methods": summarize_engine(rows, methods, draft_tokens, float(t)),
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
