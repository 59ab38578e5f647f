"""Stage 06's figures, one panel per temperature, built and returned (notebook 06 saves and shows them).

The three acceptance figures show the engine's numbers when stage 06 measured in vLLM, else our
decoder's (`primary`); the speed-up estimate is our decoder's only.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from .metrics import speedup


def stage_figures(report: dict) -> dict[str, Figure]:
    """File name -> figure, for every figure this report has numbers for."""
    view = primary(report)
    figs = {"acceptance_by_dataset.png": by_dataset(view), "acceptance_vs_training.png": training(view),
            "per_position.png": positions(view)} if view["temperatures"] else {}
    if report["temperatures"]:
        figs["speedup.png"] = speedup_estimate(report)
    if report.get("benchmarks"):
        figs["benchmarks.png"] = benchmarks(report)
    return figs


def primary(report: dict) -> dict:
    """The report as the figures read it: the engine's numbers when stage 06 measured the drafter in
    vLLM, else our decoder's (also where the drafter's engine was GPU-only: `engine.gpu_only`)."""
    engine = report.get("engine")
    if engine and any(s["kind"] == "eagle3" for t in engine["temperatures"].values() for s in t["methods"].values()):
        return {**report, "temperatures": engine["temperatures"]}
    return report


def _panels(report: dict, width: float, height: float = 3.6):
    temps = list(report["temperatures"].values())
    fig, axes = plt.subplots(1, len(temps), figsize=(width * len(temps), height), squeeze=False)
    return fig, list(zip(axes[0], temps))


def _label(t: dict) -> str:
    return "greedy (T = 0)" if t["temperature"] <= 0 else f"sampling (T = {t['temperature']:g})"


# vLLM's ngram and our prompt lookup are two implementations measured apart, so two colours.
KIND_COLORS = {"none": "#7f7f7f", "ngram": "#ff7f0e", "prompt_lookup": "#9467bd"}


def _color(t: dict, name: str):
    """The same colour for a method in every figure, in the engine's view and in our decoder's:
    one per baseline, and blues for the drafter's exports, darker as training goes on."""
    s = t["methods"][name]
    if s["kind"] in KIND_COLORS:
        return KIND_COLORS[s["kind"]]
    return plt.cm.Blues(0.3 + 0.7 * (s.get("fraction") or 1.0))


def by_dataset(report: dict) -> Figure:
    """Grouped bars: acceptance length per dataset and over all prompts, every method."""
    fig, panels = _panels(report, 6.0)
    for ax, t in panels:
        summary = t["methods"]
        groups = sorted({ds for s in summary.values() for ds in s["per_dataset"]}) + ["all"]
        x = np.arange(len(groups))
        w = 0.8 / len(summary)
        for i, (name, s) in enumerate(summary.items()):
            vals = [s["per_dataset"].get(g, {}).get("acceptance_length", float("nan")) for g in groups[:-1]]
            bars = ax.bar(x + (i - (len(summary) - 1) / 2) * w, vals + [s["acceptance_length"]], w,
                          color=_color(t, name), label=name)
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xticks(x, groups)
        ax.set_ylabel("tokens per verification")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # headroom so the legend sits above the bars
        ax.set_title(f"acceptance length, {_label(t)}, k = {report['k']}", fontsize=10)
    panels[0][0].legend(fontsize=7, ncols=len(panels[0][1]["methods"]), loc="upper center")
    fig.tight_layout()
    return fig


def training(report: dict) -> Figure:
    """The drafter's exports along training, against prompt lookup (vLLM's ngram) and no drafter;
    our decoder's numbers also split off novel text."""
    fig, panels = _panels(report, 5.0)
    for ax, t in panels:
        summary = t["methods"]
        base = "ngram" if "ngram" in summary else "prompt lookup"
        d, pl = summary["eagle3"], summary[base]
        ck = sorted((s["fraction"], s["acceptance_length"]) for s in summary.values() if s["kind"] == "eagle3")
        ax.plot([c[0] for c in ck], [c[1] for c in ck], marker="o", color=_color(t, "eagle3"),
                label=f"drafter: all text ({d.get('drafts', d.get('rounds'))} verifications)")
        ax.axhline(pl["acceptance_length"], color=_color(t, base), lw=1, label=f"{base}: all text")
        if "novel_text" in d:
            novel = sorted((s["fraction"], s["novel_text"]["acceptance_length"]) for s in summary.values()
                           if s["kind"] == "eagle3")
            ax.plot([c[0] for c in novel], [c[1] for c in novel], marker="s", ls="--", color=_color(t, "eagle3"),
                    label=f"drafter: novel text ({d['novel_text']['rounds']} rounds)")
            ax.axhline(pl["novel_text"]["acceptance_length"], color=_color(t, base), ls="--", lw=1,
                       label=f"{base}: novel text")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":", label="no drafter")
        ax.set_xlim(0, 1.05)
        ax.set_xlabel("fraction of training")
        ax.set_ylabel("acceptance length")
        ax.set_title(f"as the drafter trains, {_label(t)}", fontsize=10)
    for ax, _ in panels:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def positions(report: dict) -> Figure:
    """P(draft position j accepted), unconditional (solid) and given j-1 accepted (dashed)."""
    fig, panels = _panels(report, 5.0)
    for ax, t in panels:
        for name, s in t["methods"].items():
            if s["kind"] == "none":
                continue
            pos = list(range(1, len(s["position_acceptance"]) + 1))
            ax.plot(pos, s["position_acceptance"], marker="o", color=_color(t, name), label=name)
            if "position_acceptance_conditional" in s:
                ax.plot(pos, s["position_acceptance_conditional"], ls="--", color=_color(t, name), alpha=0.6)
        ceiling = t["methods"]["none"].get("position1_ceiling")
        if ceiling is not None:
            ax.plot([1], [ceiling], marker="*", ms=12, color="black", ls="none", label="perfect drafter, j = 1")
        ax.set_xticks(pos)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("draft position j")
        ax.set_ylabel("P(draft j accepted)")
        given = any("position_acceptance_conditional" in s for s in t["methods"].values())
        ax.set_title(f"per position, {_label(t)}" + (" (dashed: given j-1)" if given else ""), fontsize=10)
    panels[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def speedup_estimate(report: dict) -> Figure:
    """Estimated speed-up against the drafter's cost per forward (a fraction of a target forward)."""
    c = np.linspace(0, 0.3, 61)
    fig, panels = _panels(report, 5.0)
    for ax, t in panels:
        for name, s in t["methods"].items():
            if s["kind"] != "none":
                ax.plot(c, [speedup(s["acceptance_length"], s["draft_forwards_per_round"], x) for x in c],
                        color=_color(t, name), label=name)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.axvline(report["draft_cost_ratio"], color="black", lw=0.8, ls="--")
        ax.set_xlabel("drafter forward cost / target forward cost")
        ax.set_ylabel("estimated speed-up")
        ax.set_title(f"speed-up estimate, {_label(t)}, k = {report['k']}", fontsize=10)
    panels[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def benchmarks(report: dict) -> Figure:
    """Acceptance length per benchmark (MT-bench, HumanEval, user files), every method, the
    engine's numbers when measured there; the published Kimi-K2.5 drafters' acceptance lengths as
    hatched grey bars beside ours when the report has them."""
    from .tables import benchmark_view

    source, temps = benchmark_view(report)
    view = {"temperatures": temps}
    names = [s["name"] for s in report["benchmarks"]["sets"]]
    refs = [r for r in report["benchmarks"]["references"] or [] if r["metric"] == "acceptance_length"]
    fig, panels = _panels(view, 1.6 + 1.2 * len(names) * (1 + 0.2 * len(refs)), 4.0)
    for ax, t in panels:
        summary = t["methods"]
        n = len(summary) + len(refs)
        x = np.arange(len(names))
        w = 0.8 / n
        for i, (name, s) in enumerate(summary.items()):
            vals = [s["per_dataset"].get(b, {}).get("acceptance_length", float("nan")) for b in names]
            bars = ax.bar(x + (i - (n - 1) / 2) * w, vals, w, color=_color(t, name), label=name)
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
        for j, r in enumerate(refs):
            vals = [r["benchmarks"].get(b, float("nan")) for b in names]
            bars = ax.bar(x + (len(summary) + j - (n - 1) / 2) * w, vals, w, color=str(0.55 + 0.2 * j), hatch="//",
                          edgecolor="white", label=f"{r['drafter']} (published)")
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xticks(x, names)
        ax.set_ylabel("acceptance length (tokens per verification)")
        ax.set_ylim(0, max(ax.get_ylim()[1], report["k"] + 1) * 1.15)
        ax.set_title(f"benchmarks, {_label(t)}, k = {report['k']} ({source})", fontsize=10)
    panels[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
