"""What the notebook prints and tabulates from tokens/report.json."""

from __future__ import annotations

from .. import sources

# Causes that leave the text as the target wrote it: the provider only counts (bills) it otherwise,
# or sampled a token split the rebuilt ids spell canonically. Training ids are rebuilt from the
# text with the target's own template, so samples flagged only for these are fit to train on.
BILLING_ONLY = ("other_tokenizer", "billing_offset", "non_canonical_split")


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
    lines.append(verdict(report))
    for name, d in report["datasets"].items():
        if d["malformed_lines"]:
            lines.append(f"{name}: {d['malformed_lines']} malformed lines skipped, e.g. {d['problems'][0]}")
    return "\n".join(lines)


def verdict(report: dict) -> str:
    """One line: is the data as kept fit to train on, why, and what to do when it is not."""
    t, flagged = report["totals"], report["flagged_providers"]
    if not t["flagged"] and not flagged:
        return "verdict: fit to train on: no sample and no provider is flagged"
    if report["exclude_flagged"]:
        return (f"verdict: fit to train on: exclude_flagged leaves the {t['flagged']} flagged samples and every "
                f"sample of a flagged provider out ({t['excluded']} excluded, {t['kept']} kept)")
    harmful = {p: f["cause"] or f["reasons"][0] for p, f in flagged.items() if f["cause"] not in BILLING_ONLY}
    if harmful:
        kept = sum(report["providers"][p]["samples"] for p in harmful)
        return ("verdict: NOT fit to train on as kept: " + ", ".join(f"{p} ({c})" for p, c in harmful.items())
                + f" returned text unlike the target's, and their {kept} samples are kept because exclude_flagged "
                f"is off; re-run stage 03 with -p exclude_flagged true (or leave them out of stage 02's routing)")
    if flagged:
        causes = sorted({f["cause"] for f in flagged.values()})
        return (f"verdict: fit to train on as kept: the flagged providers differ from the target only in how "
                f"they count tokens ({', '.join(causes)}); the text is the target's, and the training ids are "
                f"rebuilt from it with the target's own template")
    return (f"verdict: fit to train on as kept: no provider is flagged; {t['flagged']} samples "
            f"({t['flagged'] / t['samples']:.1%}) are flagged one by one (a count off by more than the "
            f"tolerance, or an issue) and kept because exclude_flagged is off; set it to leave them out")
