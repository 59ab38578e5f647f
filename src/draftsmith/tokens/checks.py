"""Per-sample checks: the rebuilt ids against what the provider billed, structural issues, a first cause.

A cause a sample cannot settle alone (`count_mismatch`) is settled per provider by `analysis`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..templates import Layout
from .rebuild import Rebuilt
from .responses import Response

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
