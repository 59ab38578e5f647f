"""The figures and tables report.html shows, readable: a one-sample bin of stage 03's log-scale
histogram shows as a bar, stage 05's vocabulary table prints whole numbers as such, its TTT curves
are told apart by colour and line style (none pale on white), and stage 06 gives vLLM's ngram and
our prompt lookup two colours, each method one colour in every figure."""

import matplotlib
import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex, to_rgb
from test_tokens_stage import SPECS, stage_03, synthetic_run  # noqa: F401 (fixture)

from draftsmith import tokens
from draftsmith.drafter import figures as drafter_figures
from draftsmith.evaluate import figures

pytestmark = pytest.mark.unit

matplotlib.use("Agg")


def luminance(color) -> float:
    r, g, b = to_rgb(color)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_a_one_sample_bin_of_the_billed_vs_rebuilt_histogram_shows_as_a_bar(synthetic_run, tiny_target):
    report = stage_03(synthetic_run, SPECS, tiny_target)
    ax = tokens.figures(synthetic_run, report)["delta_hist.png"].axes[0]
    ones = [p for p in ax.patches if p.get_height() == 1]
    assert ones, [p.get_height() for p in ax.patches]
    axes_px = ax.get_window_extent().height
    for p in ones:
        (_, y0), (_, y1) = ax.transData.transform([(0, max(p.get_y(), ax.get_ylim()[0])), (0, 1)])
        assert y1 - y0 > 0.05 * axes_px  # a visible bar, not a line on the axis


def test_the_vocabulary_table_prints_sizes_as_whole_numbers_and_shares_as_percentages():
    html = drafter_figures.vocab_table({"vocab": {"draft_vocab_size": 1024, "distinct_tokens": 742, "train_coverage": 1.0,
                                         "supervised_fraction": 0.98765, "heldout_coverage": None}}).to_html()
    for shown in (">1024<", ">742<", ">100.0%<", ">98.8%<", ">n/a<"):
        assert shown in html, html
    assert "1024.0" not in html


def test_the_ttt_curves_differ_in_colour_and_line_style_and_none_is_pale():
    metrics = [{"split": split, "step": s, "loss_i": [3.0 - 0.1 * s] * 3, "kl_i": [1.0 / s] * 3,
                "acc_i": [0.1 * s] * 3} for s in range(1, 6) for split in ("train", "heldout")]
    fig = drafter_figures.curves_figure(metrics, {"acc": 0.1})
    for ax in fig.axes:
        steps = [ln for ln in ax.get_lines() if ln.get_label().startswith("TTT step")]
        assert len(steps) == 3
        assert len({to_hex(ln.get_color()) for ln in steps}) == 3
        assert len({ln.get_linestyle() for ln in steps}) == 3
        assert all(luminance(ln.get_color()) < 0.6 for ln in steps), [ln.get_color() for ln in steps]


def method(kind: str, al: float, fraction: float | None = None) -> dict:
    return {"kind": kind, "fraction": fraction, "acceptance_length": al, "tokens_per_round": al,
            "per_dataset": {"code": {"acceptance_length": al}}, "drafts": 10, "position_acceptance": [0.5, 0.3, 0.1],
            "draft_forwards_per_round": 3 if kind == "eagle3" else 0}


def temperature(lookup: str, lookup_kind: str) -> dict:
    return {"temperature": 0.0, "methods": {"none": method("none", 1.0), lookup: method(lookup_kind, 1.3),
                                            "eagle3 50%": method("eagle3", 1.5, 0.5),
                                            "eagle3": method("eagle3", 1.8, 1.0)}}


def method_colours(figs) -> dict[str, set[str]]:
    """Legend label -> the colours it is drawn in, over every figure."""
    seen: dict[str, set[str]] = {}
    for fig in figs:
        for ax in fig.axes:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                c = handle.get_color() if hasattr(handle, "get_color") else handle.patches[0].get_facecolor()
                seen.setdefault(label, set()).add(to_hex(c))
    return seen


def test_vllm_ngram_and_our_prompt_lookup_have_two_colours_and_each_method_one_everywhere():
    report = {"draft_tokens": 3, "draft_cost_ratio": 0.05, "temperatures": {"0": temperature("prompt lookup", "prompt_lookup")},
              "engine": {"temperatures": {"0": temperature("ngram", "ngram")}}}
    seen = method_colours(figures.stage_figures(report).values())
    assert {"ngram", "prompt lookup", "eagle3", "eagle3 50%"} <= set(seen), seen
    for name in ("ngram", "prompt lookup", "eagle3", "eagle3 50%"):
        assert len(seen[name]) == 1, (name, seen[name])
    assert seen["ngram"] != seen["prompt lookup"]
    assert len({c for name in ("ngram", "prompt lookup", "eagle3", "eagle3 50%") for c in seen[name]}) == 4


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")
