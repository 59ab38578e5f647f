"""What every figure of the stages shares: a panel with nothing to show is switched off and says
"none" in its title, rather than drawing empty axes or a flat line; a dataset has one colour in
every stage's figures (`dataset_color`)."""

from __future__ import annotations


def none_panel(ax, what: str) -> None:
    """Turn `ax` into a titled blank: "<what>: none"."""
    ax.set_axis_off()
    ax.set_title(f"{what}: none")


def plain_log_ticks(axis) -> None:
    """Label a log `axis` (`ax.yaxis`) in plain numbers, not 4×10⁰ or 6e-01: every power of ten,
    and 2 and 5 times it while the axis spans at most two decades (0.2, 0.5, 1, 2, 5, 10)."""
    import math

    from matplotlib.ticker import FuncFormatter

    def major(value, pos):
        return f"{value:g}"

    def minor(value, pos):
        lo, hi = sorted(axis.get_view_interval())
        if lo <= 0 or math.log10(hi / lo) > 2:
            return ""
        mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
        return f"{value:g}" if round(mantissa, 6) in (2.0, 5.0) else ""
    axis.set_major_formatter(FuncFormatter(major))
    axis.set_minor_formatter(FuncFormatter(minor))


DATASET_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def dataset_color(name: str, names) -> str:
    """The colour of dataset `name` among the run's datasets `names`, the same in every stage: by its
    place in the sorted names, whatever order a stage meets them in."""
    ordered = sorted(set(names) | {name})
    return DATASET_COLORS[ordered.index(name) % len(DATASET_COLORS)]
