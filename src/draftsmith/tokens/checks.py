"""Stage 03's checks: each sample's rebuilt ids against what its provider billed (`check`: structural
issues, a first cause), then across samples (`analyse`): every provider against the others, settling
the causes a sample cannot settle alone (`count_mismatch`), duplicates, and the totals report.json
gives per dataset.

Several sources in one training set: a sample's source says where its answer came from, `openrouter`
(stage 02 through OpenRouter or the local emulator), the engine a bare OpenAI-compatible server named
(stage 02 against a local vLLM or SGLang), or the `source` field of an import line. Within a dataset
a prompt (its messages, compared by hash) is answered by one source only: the first in this order
keeps its answers, stage 02's own responses, then the imports in the order `imports` lists them
(`drop_answered_elsewhere`; `duplicate_of` names the source kept, the checks stay in
`tokens/checks/<dataset>.jsonl`). Answers of one source to equal prompts under distinct ids are all
kept, as stage 02 keeps them (see `datasets`). `source_report` is what report.json says per source.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass

from ..templates import Layout
from ..targets.rebuild import Rebuilt, Response

# What the model did rather than what its provider did: flags the sample, does not count against
# the provider (a provider that dropped the answer also shows a count mismatch).
RESPONSE_ISSUES = ("empty_content", "tool_calls_not_rendered")


@dataclass(frozen=True)
class Thresholds:
    """When a sample or a provider is flagged (notebook 03's parameters of the same names)."""

    sample_tolerance: float    # sample: |billed - rebuilt| > max(1, this x billed), prompt or completion
    min_clean_rate: float      # provider: share of its samples with exact counts and no issue
    max_relative_error: float  # provider: |sum billed - sum rebuilt| / sum billed

    def sample_ok(self, delta: int | None, billed: int | None) -> bool:
        return delta is None or abs(delta) <= max(1, self.sample_tolerance * (billed or 0))


def check(r: Response, b: Rebuilt, layout: Layout, thresholds: Thresholds) -> dict:
    """What one sample shows on its own: counts vs billing, structural issues, a first cause."""
    issues = []
    rebuilt_c, rebuilt_p = len(b.output_ids), len(b.prompt_ids)
    dc = None if r.billed_completion is None else r.billed_completion - rebuilt_c
    dp = None if r.billed_prompt is None else r.billed_prompt - rebuilt_p
    if not b.output_ids:
        issues.append("no_output")  # nothing to train on: always left out
    if r.billed_completion is None and r.expects_usage:
        issues.append("no_usage")
    if r.finish_reason not in ("stop", "length", "tool_calls"):
        issues.append(f"finish_reason:{r.finish_reason}")
    if not r.content and not r.tool_calls and r.finish_reason == "stop":
        issues.append("empty_content")
    if layout.thinking and not r.reasoning and not r.reasoning_disabled:
        if r.reasoning_excluded:
            issues.append("reasoning_excluded")
        elif (r.billed_reasoning or 0) > 0 or not thresholds.sample_ok(dc, r.billed_completion):
            issues.append("reasoning_missing")
    if (not layout.thinking or r.reasoning_disabled) and r.reasoning:
        issues.append("unexpected_reasoning")
    if any(m in r.content for m in layout.think_markers):
        issues.append("think_marker_in_content")
    if any(m in r.reasoning for m in layout.think_markers):
        issues.append("think_marker_in_reasoning")
    if b.tool_calls_dropped:  # the ids lack the calls: the chat template (chat_template_file) renders none
        issues.append("tool_calls_not_rendered")
    dr = None if r.billed_reasoning is None or not r.reasoning else r.billed_reasoning - b.reasoning_tokens
    return {
        "completion_delta": dc,
        "prompt_delta": dp,
        "reasoning_tokens": b.reasoning_tokens,
        "billed_reasoning_tokens": r.billed_reasoning,
        "reasoning_delta": dr,
        "issues": issues,
        "cause": _local_cause(issues, dc, dp, dr, r.billed_reasoning, thresholds),
        "edges": _edges(r),
        "layout": b.layout,
        "layout_by": b.layout_by,
        "saved_ids": _agreement(b) if r.output_ids is not None else None,
    }


def _agreement(b: Rebuilt) -> dict:
    """Saved engine ids vs the ids rebuilt from the text: whether they agree, and the length gaps
    (saved - rebuilt). A disagreement is no fault of the sample (its ids are the engine's); the
    rate says how far text-only data of the same engine could be trusted."""
    return {"output_agree": b.output_ids == b.text_output_ids,
            "output_delta": len(b.output_ids) - len(b.text_output_ids),
            "prompt_agree": b.prompt_ids == b.text_prompt_ids,
            "prompt_delta": len(b.prompt_ids) - len(b.text_prompt_ids)}


def _local_cause(issues, dc, dp, dr, billed_r, th: Thresholds) -> str | None:
    """The cause a sample shows on its own; `count_mismatch` is settled per provider (`analyse`)."""
    if "tool_calls_not_rendered" in issues:
        return "tool_calls_not_rendered"
    if dp:
        return "other_tokenizer" if dc else "prompt_template"
    if "reasoning_missing" in issues or "reasoning_excluded" in issues:
        return "dropped_reasoning"
    if dr is not None and dr > max(2, 0.05 * billed_r):
        return "truncated_reasoning"
    if dc:
        return "count_mismatch"
    return None


def _edges(r: Response) -> dict:
    """Whether each text starts/ends with whitespace (None when empty): a provider that strips
    whitespace shows none where the others show some."""
    out = {}
    for key in ("content", "reasoning"):
        t = getattr(r, key)
        out[f"{key}_lead"] = t[:1].isspace() if t else None
        out[f"{key}_trail"] = t[-1:].isspace() if t else None
    return out


# ---- across samples: providers, duplicates, totals ----

def _never_seen(k: int, n: int, rate: float) -> bool:
    """True when a provider shows an edge whitespace 0 times in n texts although the others show it
    at `rate`: the chance of that is (1 - rate)^n, taken as significant below 1e-3."""
    return k == 0 and rate > 0 and n * -math.log1p(-min(rate, 0.999999)) > math.log(1e3)


def analyse(rows: list[dict], thresholds: Thresholds) -> dict:
    """Per-provider statistics, flags and causes; settles each row's `cause`, `flagged`.

    `rows` are check rows (see `check`) with `provider`, `billed_completion_tokens`,
    `reconstructed_completion_tokens`. Returns the `providers` part of the report."""
    by = defaultdict(list)
    for row in rows:
        by[row["provider"]].append(row)
    edge_keys = ("content_lead", "content_trail", "reasoning_lead", "reasoning_trail")
    edge_counts = {p: {e: (sum(1 for r in rs if r["checks"]["edges"][e]),
                           sum(1 for r in rs if r["checks"]["edges"][e] is not None)) for e in edge_keys}
                   for p, rs in by.items()}
    out = {}
    for p, rs in sorted(by.items()):
        stripped = []
        for e in edge_keys:
            k, n = edge_counts[p][e]
            ok = sum(edge_counts[q][e][0] for q in by if q != p)
            on = sum(edge_counts[q][e][1] for q in by if q != p)
            if on and _never_seen(k, n, ok / on):
                stripped.append(e)
        deltas = [r["checks"]["completion_delta"] for r in rs if r["checks"]["completion_delta"] is not None]
        common = Counter(d for d in deltas if d).most_common(1)
        offset = common[0][0] if common and common[0][1] >= 0.9 * len(deltas) and len(deltas) >= 5 else None
        for r in rs:
            c = r["checks"]
            if c["cause"] == "count_mismatch":
                c["cause"] = _settle(c, stripped, offset, r["billed_completion_tokens"])
            r["flagged"] = bool(c["issues"]) or not (
                thresholds.sample_ok(c["completion_delta"], r["billed_completion_tokens"])
                and thresholds.sample_ok(c["prompt_delta"], r["billed_prompt_tokens"]))
        out[p] = _provider_stats(rs, stripped, thresholds)
    return out


def _settle(c: dict, stripped: list[str], offset: int | None, billed: int | None) -> str:
    d = c["completion_delta"]
    if offset is not None and d == offset:
        return "billing_offset"
    if stripped and 0 < d <= 4 and any(c["edges"][e] is False for e in stripped):
        return "stripped_whitespace"
    if 0 < d <= max(3, 0.05 * (billed or 0)):
        return "non_canonical_split"
    return "unexplained"


def _provider_stats(rs: list[dict], stripped: list[str], th: Thresholds) -> dict:
    n = len(rs)
    billed = sum(r["billed_completion_tokens"] for r in rs if r["billed_completion_tokens"] is not None)
    rebuilt = sum(r["reconstructed_completion_tokens"] for r in rs if r["billed_completion_tokens"] is not None)
    deltas = sorted(r["checks"]["completion_delta"] for r in rs if r["checks"]["completion_delta"] is not None)
    exact = sum(1 for d in deltas if d == 0)
    prompt_counted = [r for r in rs if r["checks"]["prompt_delta"] is not None]  # rows with billed counts
    prompt_exact = sum(1 for r in prompt_counted if r["checks"]["prompt_delta"] == 0)
    clean = sum(1 for r in rs if r["checks"]["completion_delta"] in (0, None) and r["checks"]["prompt_delta"] in (0, None)
                and not set(r["checks"]["issues"]) - set(RESPONSE_ISSUES))
    rel = (billed - rebuilt) / billed if billed else None
    causes = Counter(r["checks"]["cause"] for r in rs if r["checks"]["cause"])
    reasons = []
    if n and clean / n < th.min_clean_rate:
        reasons.append(f"{clean}/{n} samples clean (< {th.min_clean_rate:.0%})")
    if rel is not None and abs(rel) > th.max_relative_error:
        reasons.append(f"relative error {rel:+.2%} (> {th.max_relative_error:.2%})")
    if stripped:
        reasons.append("strips whitespace: never shows " + ", ".join(e.replace("_", " ") + "ing" for e in stripped)
                       + " whitespace that the other providers show")
    ranked = [c for c, _ in causes.most_common()]
    cause = ranked[0] if ranked else None
    if stripped and cause in (None, "non_canonical_split", "billing_offset", "unexplained"):
        cause = "stripped_whitespace"  # the counts only move when a whole whitespace token went
    q = (lambda f: deltas[min(len(deltas) - 1, int(f * len(deltas)))] if deltas else None)
    return {
        "samples": n,
        "billed_completion_tokens": billed,
        "reconstructed_completion_tokens": rebuilt,
        "relative_error": rel,
        "exact_match_rate": exact / len(deltas) if deltas else None,
        "prompt_exact_match_rate": prompt_exact / len(prompt_counted) if prompt_counted else None,
        "clean_rate": clean / n if n else None,
        "delta": {"min": deltas[0] if deltas else None, "p50": q(0.5), "p99": q(0.99),
                  "max": deltas[-1] if deltas else None},
        "issues": dict(Counter(i for r in rs for i in r["checks"]["issues"])),
        "causes": dict(causes),
        "cause": cause,
        "stripped_edges": stripped,
        "flagged": bool(reasons),
        "reasons": reasons,
    }


def mark_duplicates(rows: list[dict]) -> None:
    """A sample id seen before in its dataset is dropped from the output (it would be trained on
    twice); a generation id seen before (any dataset) is an issue: one billed response, two samples."""
    seen_samples, seen_generations = set(), set()
    for r in rows:
        key = (r["dataset"], r["sample_id"])
        if key in seen_samples:
            r["checks"]["issues"].append("duplicate_sample_id")
            r["excluded"] = True
        seen_samples.add(key)
        g = r["generation_id"]
        if g is not None:
            if g in seen_generations:
                r["checks"]["issues"].append("duplicate_generation_id")
            seen_generations.add(g)


def totals(rows: list[dict]) -> dict:
    counted = [r for r in rows if r["billed_completion_tokens"] is not None]
    billed = sum(r["billed_completion_tokens"] for r in counted)
    rebuilt = sum(r["reconstructed_completion_tokens"] for r in counted)
    kept = [r for r in rows if not r["excluded"]]
    return {
        "samples": len(rows),
        "kept": len(kept),
        "excluded": len(rows) - len(kept),
        "flagged": sum(1 for r in rows if r["flagged"]),
        "billed_completion_tokens": billed,
        "reconstructed_completion_tokens": rebuilt,
        "relative_error": (billed - rebuilt) / billed if billed else None,
        "exact_match_rate": (sum(1 for r in counted if r["checks"]["completion_delta"] == 0) / len(counted)
                             if counted else None),
        "prompt_exact_match_rate": (sum(1 for r in rows if r["checks"]["prompt_delta"] == 0)
                                    / max(1, sum(1 for r in rows if r["checks"]["prompt_delta"] is not None))
                                    if any(r["checks"]["prompt_delta"] is not None for r in rows) else None),
        "tokens_kept": sum(r["reconstructed_prompt_tokens"] + r["reconstructed_completion_tokens"] for r in kept),
        "response_tokens_kept": sum(r["reconstructed_completion_tokens"] for r in kept),
        "issues": dict(Counter(i for r in rows for i in r["checks"]["issues"])),
        "causes": dict(Counter(r["checks"]["cause"] for r in rows if r["checks"]["cause"])),
        "layouts": dict(Counter(r["checks"]["layout"] for r in rows)),
        "layout_decided_by": dict(Counter(r["checks"]["layout_by"] for r in rows)),
    }


# ---- across sources ----

def drop_answered_elsewhere(rows: list[dict]) -> None:
    """Apply the one rule for a prompt two sources answered (the module doc) to check rows given in
    source order."""
    first: dict[tuple[str, str], str] = {}
    for r in rows:
        kept = first.setdefault((r["dataset"], r["prompt_hash"]), r["source"])
        if kept != r["source"]:
            r["duplicate_of"] = kept
            r["excluded"] = True


def source_report(rows: list[dict]) -> dict:
    """Per source: samples, kept, left out as answered by another source; `billing` (billed vs
    rebuilt completion tokens) only over samples that carry counts, `saved_ids` (how often the
    engine's ids and the text's rebuild agree) only over samples with ids; None where none has."""
    by = defaultdict(list)
    for r in rows:
        by[r["source"]].append(r)
    out = {}
    for src, rs in sorted(by.items()):
        counted = [r for r in rs if r["billed_completion_tokens"] is not None]
        saved = [r["checks"]["saved_ids"] for r in rs if r["checks"]["saved_ids"] is not None]
        billed = sum(r["billed_completion_tokens"] for r in counted)
        rebuilt = sum(r["reconstructed_completion_tokens"] for r in counted)
        kept = [r for r in rs if not r["excluded"]]
        out[src] = {
            "samples": len(rs),
            "kept": len(kept),
            "duplicates_left_out": sum(1 for r in rs if r.get("duplicate_of")),
            "datasets": sorted({r["dataset"] for r in rs}),
            "response_tokens_kept": sum(r["reconstructed_completion_tokens"] for r in kept),
            "billing": {
                "samples": len(counted),
                "billed_completion_tokens": billed,
                "reconstructed_completion_tokens": rebuilt,
                "relative_error": (billed - rebuilt) / billed if billed else None,
                "exact_match_rate": sum(1 for r in counted if r["checks"]["completion_delta"] == 0) / len(counted),
            } if counted else None,
            "saved_ids": {
                "samples": len(saved),
                "output_agreement_rate": sum(s["output_agree"] for s in saved) / len(saved),
                "prompt_agreement_rate": sum(s["prompt_agree"] for s in saved) / len(saved),
            } if saved else None,
        }
    return out
