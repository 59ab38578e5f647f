"""Tables and figures of stage 02, read back from what it wrote (so they also work on a run
generated elsewhere, or resumed several times): tokens over time, spend against the limit,
latency and length distributions, the providers that served, and the errors met."""

from __future__ import annotations

import pandas as pd

from . import outputs
from ..paths import Run
from ..tables import dataset_color, none_panel

COLUMNS = ["dataset", "sample_id", "provider", "finish_reason", "prompt_tokens", "completion_tokens",
           "reasoning_tokens", "cost", "attempts", "latency_s", "started_at", "completed_at"]


def load_responses(run: Run) -> pd.DataFrame:
    """One row per saved sample (text left out), every dataset."""
    rows = []
    for name in outputs.saved_datasets(run):
        for _, r in outputs.read_responses(run, name):
            u = r.get("usage") or {}
            rows.append((r["dataset"], r["sample_id"], r.get("provider") or "unknown", r.get("finish_reason"),
                         u.get("prompt_tokens"), u.get("completion_tokens"), u.get("reasoning_tokens"),
                         u.get("cost"), r.get("attempts"), r.get("latency_s"), r.get("started_at"),
                         r.get("completed_at")))
    df = pd.DataFrame(rows, columns=COLUMNS)
    if len(df):
        df["completed"] = pd.to_datetime(df["completed_at"], unit="s")
    return df


def load_errors(run: Run) -> pd.DataFrame:
    """One row per sample that failed for good or ran out of attempts, every dataset."""
    rows = []
    for name in outputs.saved_datasets(run):
        rows.extend(e for _, e in outputs.read_errors(run, name))
    return pd.DataFrame(rows, columns=["dataset", "sample_id", "action", "kind", "status", "message", "attempts"])


def load_timeline(run: Run) -> pd.DataFrame:
    """One row per second of every session (time, session, in flight and the concurrency limit,
    spent, reserved, balance left, output tokens per dataset as `tokens.<name>`)."""
    rows = outputs.read_timeline(run)
    return pd.json_normalize(rows) if rows else pd.DataFrame()


def dataset_table(manifest: dict) -> pd.DataFrame:
    rows = []
    for name, t in (manifest.get("datasets") or {}).items():
        b = t.get("budget")
        rows.append({"dataset": name, "samples": t["samples"], "output tokens": t["completion_tokens"],
                     "budget": b, "of budget %": round(100 * t["completion_tokens"] / b, 2) if b else None,
                     "reasoning tokens": t["reasoning_tokens"], "prompt tokens": t["prompt_tokens"],
                     "cost $": round(t["cost"], 4), "finish=length": t["length_finishes"],
                     "failed for good": t.get("failed_for_good", 0)})
    return pd.DataFrame(rows).set_index("dataset") if rows else pd.DataFrame()


def provider_table(df: pd.DataFrame) -> pd.DataFrame:
    if not len(df):
        return pd.DataFrame()
    g = df.groupby("provider").agg(samples=("sample_id", "size"), output_tokens=("completion_tokens", "sum"),
                                   cost=("cost", "sum"), p50_latency_s=("latency_s", "median"))
    g["share %"] = (100 * g["output_tokens"] / g["output_tokens"].sum()).round(1)
    g["$ per M out"] = (1e6 * g["cost"] / g["output_tokens"].clip(lower=1)).round(3)
    return g.sort_values("output_tokens", ascending=False)


def errors_table(manifest: dict, errors: pd.DataFrame) -> pd.DataFrame:
    """Every failed attempt by kind (most were retried and then succeeded), and how many samples
    ended failed for good or out of attempts."""
    out = pd.Series(manifest.get("errors_by_kind") or {}, dtype="int64", name="failed attempts").to_frame()
    if len(errors):
        final = errors.groupby(["kind", "action"]).size().unstack(fill_value=0)
        final.columns = [f"samples {c}" for c in final.columns]
        out = out.join(final, how="outer")
    out = out.fillna(0).astype(int)
    out.index.name = "kind"
    return out.sort_values("failed attempts", ascending=False)


def sessions_table(manifest: dict) -> pd.DataFrame:
    keep = ["started", "ended", "status", "samples", "completion_tokens", "cost", "failed_attempts_cost",
            "abandoned_reserved_usd", "lost_answers", "attempts", "peak_in_flight", "concurrency_limit",
            "exhausted_samples", "message"]
    return pd.DataFrame([{k: s.get(k) for k in keep} for s in manifest.get("sessions", [])])


def plot_overview(df: pd.DataFrame, manifest: dict, spend_limit_usd: float):
    """Six panels: tokens over time per dataset, spend (against the limit where both read on one
    axis), latency and length distributions, provider share, errors by kind; a panel with nothing to
    show says "none" in its title."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 3, figsize=(15, 8))
    ax = ax.ravel()
    unit, div = "minutes", 60.0
    if len(df):
        t0 = df["completed_at"].min()
        if df["completed_at"].max() - t0 < 180:
            unit, div = "seconds", 1.0
        d = df.sort_values("completed_at")
        for name, g in d.groupby("dataset"):
            ax[0].plot((g["completed_at"] - t0) / div, g["completion_tokens"].cumsum(), label=name,
                       color=dataset_color(name, df["dataset"]))
            b = (manifest.get("datasets", {}).get(name) or {}).get("budget")
            if b:
                ax[0].axhline(b, ls=":", lw=1, color=ax[0].lines[-1].get_color())
        ax[1].plot((d["completed_at"] - t0) / div, d["cost"].fillna(0).cumsum())
        ax[2].hist(df["latency_s"].dropna(), bins=40)
        for name, g in df.groupby("dataset"):
            ax[3].hist(g["completion_tokens"].dropna(), bins=40, alpha=0.6, label=name,
                       color=dataset_color(name, df["dataset"]))
        share = df.groupby("provider")["completion_tokens"].sum().sort_values()
        ax[4].barh(share.index, share.values)
    if not len(df):
        for a, what in zip(ax[:5], ("output tokens over time", "spend", "latency per response", "response length",
                                    "output tokens per provider")):
            none_panel(a, what)
    else:
        ax[0].set(title="output tokens over time (dotted: budget)", xlabel=f"{unit} since the first response",
                  ylabel="output tokens")
        ax[0].legend()
        spent = float(df["cost"].fillna(0).sum())
        if spent <= 0:
            none_panel(ax[1], rf"spend (limit \${spend_limit_usd:g})")
        else:
            # the limit is drawn only where the spend would still read; else it is named in the title
            near = spend_limit_usd <= 3 * spent
            if near:
                ax[1].axhline(spend_limit_usd, color="red", ls="--", label=f"spend_limit_usd ${spend_limit_usd:g}")
                ax[1].legend()
            ax[1].set(title=rf"spend (run total \${manifest.get('spent_usd', spent):.4f}"
                            + (")" if near else rf", limit \${spend_limit_usd:g} far above)"),
                      xlabel=f"{unit} since the first response", ylabel="USD spent")
        ax[2].set(title="latency per response", xlabel="seconds", ylabel="responses")
        ax[3].set(title="response length", xlabel="completion tokens", ylabel="responses")
        ax[3].legend()
        ax[4].set(title="output tokens per provider", xlabel="output tokens", ylabel="provider")
    errs = pd.Series(manifest.get("errors_by_kind") or {}, dtype="int64").sort_values()
    if len(errs):
        ax[5].barh(errs.index, errs.values)
        ax[5].set(title="failed attempts by kind (retried unless final)", xlabel="attempts", ylabel="error kind")
    else:
        none_panel(ax[5], "failed attempts")
    fig.tight_layout()
    return fig


def plot_timeline(tl: pd.DataFrame, manifest: dict, spend_limit_usd: float):
    """Two panels over the run's sessions: spend against the account balance (each session's end
    marked with how it ended; a top-up between sessions shows as the balance jumping), and requests
    in flight against the concurrency limit."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(15, 4.5))
    if len(tl):
        t0 = tl["t"].min()
        unit, div = ("minutes", 60.0) if tl["t"].max() - t0 >= 180 else ("seconds", 1.0)
        ends = {i + 1: s.get("status") for i, s in enumerate(manifest.get("sessions", []))}
        for n, (session, g) in enumerate(tl.groupby("session")):
            x = (g["t"] - t0) / div
            first = n == 0
            ax[0].plot(x, g["spent"], ".-", color="tab:blue", label="spent (run)" if first else None)
            ax[0].plot(x, g["balance"], ".-", color="black", label="balance left" if first else None)
            ax[0].plot(x, g["spent"] + g["reserved"], color="tab:blue", ls=":", lw=1,
                       label="spent + reserved in flight" if first else None)
            ax[1].plot(x, g["in_flight"], ".-", color="tab:green", label="in flight" if first else None)
            ax[1].plot(x, g["limit"], color="gray", ls="--", lw=1, label="concurrency limit" if first else None)
            for a in ax:
                a.axvline(x.iloc[-1], color="red", ls=":", lw=1)
            ax[0].annotate(f"session {session}: {ends.get(session) or 'running'}", (x.iloc[-1], g["spent"].iloc[-1]),
                           xytext=(-4, 8), textcoords="offset points", ha="right", fontsize=8, color="red")
        ax[0].axhline(spend_limit_usd, color="red", ls="--", lw=1, label=f"spend_limit_usd ${spend_limit_usd:g}")
        ax[0].set(title="spend vs balance (dotted red: a session ends)", xlabel=f"{unit} since the first session",
                  ylabel="USD")
        ax[0].legend(fontsize=8)
        ax[1].set(title="requests in flight", xlabel=f"{unit} since the first session", ylabel="requests")
        ax[1].legend(fontsize=8)
    else:
        none_panel(ax[0], "spend vs balance")
        none_panel(ax[1], "requests in flight")
    fig.tight_layout()
    return fig
