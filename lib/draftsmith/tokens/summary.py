"""What the notebook prints and tabulates from tokens/report.json."""

from __future__ import annotations

from .. import sources


def provider_table(report: dict):
    """One row per provider: samples, exact-match and clean rates, relative error, cause, flag."""
    import pandas as pd

    cols = ["samples", "exact_match_rate", "prompt_exact_match_rate", "clean_rate", "billed_completion_tokens",
            "reconstructed_completion_tokens", "relative_error", "cause", "flagged"]
    df = pd.DataFrame([{**{c: s[c] for c in cols}, "reasons": "; ".join(s["reasons"])}
                       for s in report["providers"].values()], index=list(report["providers"]))
    df.index.name = "provider"
    return df


def summary(report: dict) -> str:
    """A few lines: what was kept, the aggregate billed-vs-rebuilt error, each flagged provider."""
    t = report["totals"]
    rel, exact = t["relative_error"], t["exact_match_rate"]
    lines = [f"{t['samples']} samples, {t['kept']} kept ({t['tokens_kept']:,} tokens, {t['response_tokens_kept']:,} "
             f"response tokens), {t['flagged']} flagged, {t['excluded']} excluded",
             f"billed vs reconstructed completion tokens: {t['billed_completion_tokens']:,} vs "
             f"{t['reconstructed_completion_tokens']:,}, relative error "
             + (f"{rel:+.4%}" if rel is not None else "n/a")
             + (f"; exact count match on {exact:.1%} of samples" if exact is not None else "")
             if exact is not None else "billed vs reconstructed: no sample carries billed token counts"]
    u = report["totals_unflagged_providers"]
    if report["flagged_providers"] and u["relative_error"] is not None:
        lines.append(f"providers not flagged: relative error {u['relative_error']:+.4%} over "
                     f"{u['billed_completion_tokens']:,} billed tokens, exact count match on {u['exact_match_rate']:.1%}")
    if len(report["sources"]) > 1 or any(s["billing"] is None for s in report["sources"].values()):
        lines += sources.summary_lines(report)
    for p, f in report["flagged_providers"].items():
        lines.append(f"FLAGGED {p}: cause {f['cause']}; " + "; ".join(f["reasons"]))
    for name, d in report["datasets"].items():
        if d["malformed_lines"]:
            lines.append(f"{name}: {d['malformed_lines']} malformed lines skipped, e.g. {d['problems'][0]}")
    return "\n".join(lines)
