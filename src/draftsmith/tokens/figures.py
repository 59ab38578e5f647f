"""Stage 03's figures, from the checks of every sample and the report's provider statistics.

`figures` returns them by file name; the notebook saves them under tokens/figures/ and shows them.
"""

from __future__ import annotations

from collections import defaultdict

from ..paths import Run
from ..tables import dataset_color, none_panel
from .outputs import read_checks


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
