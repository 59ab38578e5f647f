"""Stage 01's figures, returned for the notebook to show and save: the planned cost against the
money there is, and each endpoint's price against its throughput."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from ..tables import dataset_color


def cost_vs_balance(plan: pd.DataFrame, balance_usd: float | None, spend_limit: float):
    """Stacked bars: each dataset's planned cost at the cheapest endpoint, the expected mix and the
    most expensive one; lines: the balance and the spend limit (named in the title instead when far
    above the bars, so the bars stay readable)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    cols = ["cost_cheapest", "cost_mix", "cost_most_expensive"]
    bottom = pd.Series(0.0, index=cols)
    for _, r in plan.iterrows():
        vals = r[cols].astype(float)
        ax.bar(["cheapest", "expected mix", "most expensive"], vals.to_numpy(), bottom=bottom.to_numpy(),
               label=r["dataset"], color=dataset_color(r["dataset"], plan["dataset"]))
        bottom += vals.to_numpy()
    for x, total in enumerate(bottom.to_numpy()):
        ax.annotate(f"${total:,.4g}", (x, total), ha="center", xytext=(0, 3), textcoords="offset points", fontsize=8)
    # linear, so stacked segments keep their true share; a line far above the bars is named, not drawn
    top = 1.3 * max(float(bottom.max()), 1e-9)
    lines = [(spend_limit, "red", ":", "spend limit")] + ([] if balance_usd is None else
                                                           [(balance_usd, "black", "--", "balance")])
    above = []
    for value, color, style, name in lines:
        label = f"{name} ${value:,.2f}"
        if value <= 3 * top:
            ax.axhline(value, color=color, linestyle=style, label=label)
            top = max(top, 1.1 * value)
        else:
            above.append(label)
    ax.set_ylim(0, top)
    ax.set_xlabel("endpoint price assumed")
    ax.set_ylabel("planned cost (USD)")
    named = f"\n(far above the bars: {', '.join(above)})".replace("$", r"\$") if above else ""  # not mathtext
    ax.set_title(f"Planned cost of the output budget vs the money available{named}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def price_vs_throughput(policy: pd.DataFrame):
    """Every endpoint's $/M output tokens against its median throughput, by quantization; an `x`
    is excluded."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (q, g) in enumerate(policy.groupby("quantization")):
        color = f"C{i}"
        for allowed, marker in ((True, "o"), (False, "x")):
            part = g[g["allowed"] == allowed]
            if len(part):
                ax.scatter(part["throughput_p50"], part["price_out"], s=60, color=color, marker=marker,
                           label=q if allowed or not g["allowed"].any() else None)
        for _, r in g.iterrows():
            ax.annotate(r["tag"], (r["throughput_p50"], r["price_out"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xlabel("throughput p50 (tokens/s per stream)")
    ax.set_ylabel("$ per million output tokens")
    ax.set_title("Endpoints: price vs throughput (x = excluded)")
    ax.legend(title="quantization", fontsize=8)
    fig.tight_layout()
    return fig
