"""What notebook 03 shows from tokens/report.json and the checks of every sample: a few lines
(`summary`, ending in the stage's verdict), a table per provider (`provider_table`) and per source
(`source_table`), and the figures (`figures`, by file name; the notebook saves them under
tokens/figures/ and shows them).
"""

from __future__ import annotations

from collections import defaultdict

from ..paths import Run
from ..tables import dataset_color, none_panel
from .outputs import read_checks, verdict_line


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
        lines += _source_lines(report)
    for p, f in report["flagged_providers"].items():
        lines.append(f"FLAGGED {p}: cause {f['cause']}; " + "; ".join(f["reasons"]))
    lines.append(verdict_line(report))
    for name, d in report["datasets"].items():
        if d["malformed_lines"]:
            lines.append(f"{name}: {d['malformed_lines']} malformed lines skipped, e.g. {d['problems'][0]}")
    return "\n".join(lines)


def source_table(report_: dict):
    """One row per source, for the notebook."""
    import pandas as pd

    rows = {}
    for src, s in report_["sources"].items():
        b, ids = s["billing"] or {}, s["saved_ids"] or {}
        rows[src] = {"samples": s["samples"], "kept": s["kept"], "duplicates_left_out": s["duplicates_left_out"],
                     "datasets": ", ".join(s["datasets"]), "response_tokens_kept": s["response_tokens_kept"],
                     "billed_vs_rebuilt_error": b.get("relative_error"), "billed_exact_match": b.get("exact_match_rate"),
                     "ids_vs_text_agreement": ids.get("output_agreement_rate")}
    df = pd.DataFrame.from_dict(rows, orient="index")
    df.index.name = "source"
    return df


def _source_lines(report_: dict) -> list[str]:
    lines = []
    for src, s in report_["sources"].items():
        parts = [f"source {src}: {s['samples']} samples ({', '.join(s['datasets'])}), {s['kept']} kept"]
        if s["duplicates_left_out"]:
            parts.append(f"{s['duplicates_left_out']} left out (prompt answered by an earlier source)")
        b, ids = s["billing"], s["saved_ids"]
        if b and b["relative_error"] is not None:
            parts.append(f"billed vs rebuilt {b['relative_error']:+.4%}")
        if ids:
            parts.append(f"engine ids = text rebuild on {ids['output_agreement_rate']:.1%}")
        if not b and not ids:
            parts.append("no counts or ids to check against")
        lines.append("; ".join(parts))
    return lines


def figures(run: Run, report: dict) -> dict:
    """delta_hist.png (per-sample completion delta), provider_deltas.png (per provider: relative
    error and clean rate, flagged in red), lengths.png (prompt and response lengths per dataset)."""
    rows = read_checks(run, list(report["datasets"]))
    return {"delta_hist.png": _delta_hist(rows), "provider_deltas.png": _provider_deltas(report["providers"]),
            "lengths.png": _lengths(rows)}


def _delta_hist(rows: list[dict]):
    import matplotlib.pyplot as plt

    deltas = [r["checks"]["completion_delta"] for r in rows if r["checks"]["completion_delta"] is not None]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if not deltas:
        none_panel(ax, "Per-sample completion-token delta")
    else:
        lo, hi = max(min(deltas), -30), min(max(deltas), 30)
        ax.hist([min(max(d, lo), hi) for d in deltas], bins=range(lo, hi + 2), align="left", log=True, color="#4c72b0")
        ax.set_ylim(bottom=0.3)  # the log axis starts below 1, so a bin of one sample shows as a bar
        ax.set_xlabel("billed − reconstructed completion tokens (clipped to ±30)")
        ax.set_ylabel("samples (log scale)")
        ax.set_title("Per-sample completion-token delta (0 = exact)")
    fig.tight_layout()
    return fig


def _provider_deltas(providers: dict):
    import matplotlib.pyplot as plt

    names = list(providers)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.45 * len(names) + 1.5), sharey=True)
    colors = ["#c44e52" if providers[p]["flagged"] else "#55a868" for p in names]
    a1.barh(names, [100 * (providers[p]["relative_error"] or 0) for p in names], color=colors)
    a1.axvline(0, color="k", lw=0.5)
    a1.set_xlabel("(billed − reconstructed) / billed, %")
    a1.set_ylabel("provider")
    a2.barh(names, [100 * (providers[p]["clean_rate"] or 0) for p in names], color=colors)
    a2.set_xlabel("samples with exact counts and no issue, %")
    for i, p in enumerate(names):
        if providers[p]["cause"]:
            a2.text(1, i, providers[p]["cause"], va="center", fontsize=8)
    fig.suptitle("Per provider (red = flagged)")
    fig.tight_layout()
    return fig


def _lengths(rows: list[dict]):
    import matplotlib.pyplot as plt
    import numpy as np

    by_ds = defaultdict(lambda: ([], []))
    for r in rows:
        by_ds[r["dataset"]][0].append(r["reconstructed_prompt_tokens"])
        by_ds[r["dataset"]][1].append(r["reconstructed_completion_tokens"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.5))
    for ax, k in ((a1, 0), (a2, 1)):
        values = [v for d in by_ds.values() for v in d[k]]
        bins = np.histogram_bin_edges(values, bins=30) if values else 30
        ax.hist([d[k] for d in by_ds.values()], bins=bins, label=list(by_ds), histtype="stepfilled", alpha=0.5,
                color=[dataset_color(name, by_ds) for name in by_ds])
    a1.set_xlabel("prompt tokens")
    a2.set_xlabel("response tokens")
    a1.set_ylabel("samples")
    a2.set_ylabel("samples")
    a1.legend()
    fig.suptitle("Length distributions per dataset")
    fig.tight_layout()
    return fig
