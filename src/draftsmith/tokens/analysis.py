"""Across samples: every provider against the others (which disagree with their billing, and why),
duplicate samples, and the totals report.json gives per dataset.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from .checks import RESPONSE_ISSUES, Thresholds


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
