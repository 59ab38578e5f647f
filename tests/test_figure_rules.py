"""Every figure a stage writes, built from hand-made inputs (the ordinary case and the degenerate
ones: nothing spent, no NaN/inf, a balance far above the plan), meets the plot rules: a title, both
axes labelled, a legend that lists exactly the labelled artists that are drawn, and no empty panel
(a panel with nothing to show is switched off and says "none" in its title)."""

import importlib
import re

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.collections import Collection
from matplotlib.container import BarContainer
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from draftsmith.drafter import figures as drafter_figures
from draftsmith.drafter.vocab import DraftVocab
from draftsmith.evaluate import figures as eval_figures
from draftsmith.generate import figures as generate_figures
from draftsmith.hidden import figures as hidden_figures
from draftsmith.providers import figures as provider_figures

pytestmark = pytest.mark.unit

tokens_figures = importlib.import_module("draftsmith.tokens.figures")

matplotlib.use("Agg")


def drawn(artist) -> bool:
    """Whether a labelled artist shows anything: a line with a finite point, bars, markers, a patch."""
    if isinstance(artist, Line2D):
        x, y = (np.asarray(v, dtype=float) for v in artist.get_data())
        return bool(len(x)) and bool(np.isfinite(x).any() and np.isfinite(y).any())
    if isinstance(artist, BarContainer):
        return any(np.isfinite(p.get_height()) and np.isfinite(p.get_width()) for p in artist.patches)
    if isinstance(artist, Collection):
        return len(artist.get_offsets()) > 0 or len(artist.get_paths()) > 0
    if isinstance(artist, Patch):
        return artist.get_visible()
    raise AssertionError(f"unknown legend artist {artist!r}")


def has_content(ax) -> bool:
    """Data drawn in data coordinates (reference lines such as axhline do not count)."""
    lines = [ln for ln in ax.lines if ln.get_transform() == ax.transData and drawn(ln)]
    bars = [p for p in ax.patches if p.get_visible() and not (hasattr(p, "get_height") and p.get_height() == 0)]
    return bool(lines or bars or [c for c in ax.collections if drawn(c)])


def problems(name: str, fig) -> list[str]:
    """What in `fig` breaks the rules, in words (empty: none)."""
    out = []
    suptitle = fig._suptitle.get_text() if fig._suptitle else ""
    legends = {t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()}
    for i, ax in enumerate(fig.axes):
        where = f"{name} panel {i} ({ax.get_title()!r})"
        if not ax.axison:
            if "none" not in ax.get_title():
                out.append(f"{where}: switched off without saying 'none' in its title")
            continue
        if not (ax.get_title() or suptitle):
            out.append(f"{where}: no title")
        if not ax.get_xlabel():
            out.append(f"{where}: no x label")
        if not ax.get_ylabel() and not any(o.get_ylabel() for o in ax.get_shared_y_axes().get_siblings(ax)):
            out.append(f"{where}: no y label")
        texts = [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()] + ([t.get_text() for t in ax.get_legend().get_texts()]
                                                                      if ax.get_legend() else [])
        out += [f"{where}: {t!r} reads as mathtext (escape $)" for t in texts if len(re.findall(r"(?<!\\)\$", t)) > 1]
        if not has_content(ax):
            out.append(f"{where}: empty panel")
        handles, labels = ax.get_legend_handles_labels()
        shown = [lab for h, lab in zip(handles, labels) if drawn(h)]
        legend = ax.get_legend()
        if legend:
            listed = [t.get_text() for t in legend.get_texts()]
            if listed != shown:
                out.append(f"{where}: legend {listed} but drawn {shown}")
        elif len(shown) > 1 and not set(shown) <= legends:  # one legend may serve panels alike
            out.append(f"{where}: draws {shown} with no legend naming them")
    return out


def assert_rules(figs: dict):
    assert figs
    found = [p for name, fig in figs.items() for p in problems(name, fig)]
    assert not found, "\n".join(found)


# --- stage 01 ---------------------------------------------------------------------------------

PLAN = pd.DataFrame([{"dataset": "code", "cost_cheapest": 0.2, "cost_mix": 0.3, "cost_most_expensive": 0.5},
                     {"dataset": "chat", "cost_cheapest": 0.1, "cost_mix": 0.2, "cost_most_expensive": 0.4}])


@pytest.mark.parametrize("balance,limit", [(1.5, 1.0), (250.0, 100.0), (None, 1.0)])
def test_stage_01_figures_follow_the_rules(balance, limit):
    policy = pd.DataFrame([{"quantization": q, "allowed": ok, "throughput_p50": tp, "price_out": price, "tag": tag}
                           for q, ok, tp, price, tag in (("fp8", True, 40, 2.5, "a"), ("fp8", False, 20, 3.0, "b"),
                                                         ("int4", False, 60, 1.0, "c"))])
    assert_rules({"cost_vs_balance.png": provider_figures.cost_vs_balance(PLAN, balance, limit),
                  "price_vs_throughput.png": provider_figures.price_vs_throughput(policy)})


def test_a_line_far_above_the_plan_is_named_in_the_title_not_the_legend():
    fig = provider_figures.cost_vs_balance(PLAN, 250.0, 100.0)
    ax = fig.axes[0]
    assert "$250.00" in ax.get_title() and "$100.00" in ax.get_title()
    assert not [t.get_text() for t in ax.get_legend().get_texts() if "$" in t.get_text()]


# --- stage 02 ---------------------------------------------------------------------------------

def responses(cost: float) -> pd.DataFrame:
    rows = [{"dataset": ds, "sample_id": f"{ds}{i}", "provider": p, "finish_reason": "stop", "prompt_tokens": 20,
             "completion_tokens": 100 + 7 * i, "reasoning_tokens": 0, "cost": cost, "attempts": 1,
             "latency_s": 1.0 + i / 10, "started_at": 1000.0 + i, "completed_at": 1001.0 + 2 * i}
            for ds in ("code", "chat") for i in range(12) for p in (("A", "B")[i % 2],)]
    return pd.DataFrame(rows)


def timeline(cost: float) -> pd.DataFrame:
    return pd.DataFrame([{"t": 1000.0 + s * 20 + i, "session": s + 1, "spent": cost * (s * 10 + i),
                          "reserved": 0.01, "balance": 5.0 - cost * (s * 10 + i), "in_flight": i % 4, "limit": 4}
                         for s in range(2) for i in range(10)])


@pytest.mark.parametrize("cost,errors", [(0.002, {"timeout": 3, "rate_limited": 1}), (0.0, {})])
def test_stage_02_figures_follow_the_rules(cost, errors):
    manifest = {"datasets": {"code": {"budget": 1500}, "chat": {"budget": 1500}}, "spent_usd": 24 * cost,
                "errors_by_kind": errors, "sessions": [{"status": "done"}, {"status": "stopped"}]}
    assert_rules({"overview.png": generate_figures.plot_overview(responses(cost), manifest, 1.0),
                  "timeline.png": generate_figures.plot_timeline(timeline(cost), manifest, 1.0)})


def test_nothing_spent_is_said_in_the_title_not_drawn_as_a_flat_line_on_the_limits_axis():
    manifest = {"datasets": {}, "spent_usd": 0.0, "errors_by_kind": {}, "sessions": []}
    spend = generate_figures.plot_overview(responses(0.0), manifest, 1.0).axes[1]
    assert not spend.axison and "none" in spend.get_title() and "$1" in spend.get_title()


# --- stage 03 ---------------------------------------------------------------------------------

def test_stage_03_figures_follow_the_rules(monkeypatch):
    rows = [{"dataset": ds, "checks": {"completion_delta": d}, "reconstructed_prompt_tokens": 30 + 3 * i,
             "reconstructed_completion_tokens": 200 + 11 * i}
            for ds in ("code", "chat") for i, d in enumerate([0, 0, 0, 1, -2, 0, 40, None])]
    monkeypatch.setattr(tokens_figures, "read_checks", lambda run, datasets: rows)
    providers = {"A": {"flagged": False, "relative_error": 0.0, "clean_rate": 1.0, "cause": None},
                 "B": {"flagged": True, "relative_error": 0.12, "clean_rate": 0.4, "cause": "billed > rebuilt"}}
    assert_rules(tokens_figures.figures(None, {"datasets": {"code": {}, "chat": {}}, "providers": providers}))


# --- stage 04 ---------------------------------------------------------------------------------

def shard(i: int, nonfinite: int = 0, problems: list | None = None) -> dict:
    return {"file": f"hidden-{i:05d}.safetensors", "problems": problems or [],
            "health": {"rms": {"aux": 1.2 + 0.01 * i, "last": 1.3 + 0.02 * i}, "nonfinite": {"aux": nonfinite}}}


@pytest.mark.parametrize("entries", [[shard(0), shard(1)], [shard(0), shard(1, 3, ["nan"]), shard(2)], [shard(0)]])
def test_stage_04_figures_follow_the_rules(entries):
    check = {"layer_norms": [1.0, 2.0, 3.5, 5.0, 8.0], "layer_ids": [0, 2], "stored_aux_norms": [2.0, 5.0],
             "sample_id": "code/0"}
    norms = pd.DataFrame({"aux layer 0": np.linspace(1, 3, 50), "aux layer 2": np.linspace(4, 6, 50),
                          "last (normed)": np.linspace(0.5, 1.5, 50)})
    assert_rules({"norms.png": hidden_figures.plot_norms(check, norms),
                  "health.png": hidden_figures.plot_health(entries)})


def plain_labels(ax) -> list[str]:
    """The y tick labels shown, each of which must be a plain number (no 1.25×10⁰, no 6e-01)."""
    ax.figure.canvas.draw()
    shown = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
    assert shown and all(re.fullmatch(r"[\d.,]+", t.replace("\N{MINUS SIGN}", "")) for t in shown), shown
    return shown


def test_the_health_figure_counts_shards_in_whole_numbers_and_writes_rms_plainly():
    fig = hidden_figures.plot_health([shard(0), shard(1)])
    assert len(fig.axes) == 1 and "NaN/inf: none" in fig.axes[0].get_title()
    ax = fig.axes[0]
    plain_labels(ax)
    assert all(float(t).is_integer() for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1])
    wide = [shard(0), shard(1), shard(2)]
    wide[1]["health"]["rms"]["last"] = 40.0  # more than a decade apart: a log axis, still plain numbers
    assert {"1", "10"} <= set(plain_labels(hidden_figures.plot_health(wide).axes[0]))


# --- stage 05 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [3, 7])
def test_stage_05_figures_follow_the_rules(k):
    vocab = DraftVocab.build(torch.tensor([50, 30, 0, 10, 5, 1, 0, 2] * 16), 32)
    metrics = [{"split": split, "step": s, "loss_i": [3.0 - 0.1 * s + j for j in range(k)],
                "kl_i": [1.0 / s + j for j in range(k)], "acc_i": [0.1 * s / (j + 1) for j in range(k)]}
               for s in range(1, 9) for split in ("train", "heldout")]
    assert_rules({"vocab_coverage.png": drafter_figures.coverage_figure(vocab),
                  "training_curves.png": drafter_figures.curves_figure(metrics, {"acc": 0.1})})


def test_the_training_curves_show_at_most_four_ttt_steps_named_apart_from_the_optimizer_step():
    metrics = [{"split": split, "step": s, "loss_i": [1.0] * 7, "kl_i": [1.0] * 7, "acc_i": [0.5] * 7}
               for s in range(1, 5) for split in ("train", "heldout")]
    for ax in drafter_figures.curves_figure(metrics, None).axes:
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == ["TTT step 0", "TTT step 2", "TTT step 4", "TTT step 6"], labels
    metrics = [{"split": split, "step": s, "loss_i": [1.0], "kl_i": [2.0 / s], "acc_i": [0.5]}
               for s in range(1, 30) for split in ("train", "heldout")]
    plain_labels(drafter_figures.curves_figure(metrics, None).axes[1])  # the log KL axis


# --- stage 06 ---------------------------------------------------------------------------------

def method(kind: str, al: float, fraction: float | None = None, final: bool = False) -> dict:
    per = {"code": {"acceptance_length": al}, "chat": {"acceptance_length": al - 0.1},
           "mt-bench": {"acceptance_length": al + 0.1}}
    return {"kind": kind, "fraction": fraction, "final": final, "acceptance_length": al, "tokens_per_round": al - 0.05,
            "per_dataset": per,
            "drafts": 10, "position_acceptance": [0.5, 0.3, 0.1], "position_acceptance_conditional": [0.5, 0.6, 0.3],
            "position1_ceiling": 0.9, "draft_forwards_per_round": 3 if kind == "eagle3" else 0,
            "novel_text": {"acceptance_length": al - 0.2, "rounds": 5}}


def temperatures(lookup: str, kind: str) -> dict:
    return {key: {"temperature": temp, "methods": {"none": method("none", 1.0), lookup: method(kind, 1.3),
                                                   "eagle3 50%": method("eagle3", 1.5, 0.5),
                                                   "eagle3": method("eagle3", 1.8, 1.0, final=True)}}
            for key, temp in (("0", 0.0), ("1", 1.0))}


def no_ceiling_at_t0(temps: dict) -> dict:
    """The perfect drafter's first-position mark only where the report has it (here: T = 1)."""
    temps["0"]["methods"]["none"] = {k: v for k, v in temps["0"]["methods"]["none"].items() if k != "position1_ceiling"}
    return temps


@pytest.mark.parametrize("engine", [True, False])
def test_stage_06_figures_follow_the_rules(engine):
    report = {"draft_tokens": 3, "draft_cost_ratio": 0.05,
              "temperatures": no_ceiling_at_t0(temperatures("prompt lookup", "prompt_lookup")),
              "engine": {"temperatures": temperatures("ngram", "ngram")} if engine else None,
              "benchmarks": {"sets": [{"name": "mt-bench"}], "engine": None,
                             "temperatures": temperatures("prompt lookup", "prompt_lookup"),
                             "references": [{"metric": "acceptance_length", "drafter": "published",
                                             "benchmarks": {"mt-bench": 2.1}}]}}
    figs = eval_figures.stage_figures(report)
    assert set(figs) == {"acceptance_by_dataset.png", "acceptance_vs_training.png", "per_position.png",
                         "speedup.png", "benchmarks.png"}
    assert_rules(figs)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")
