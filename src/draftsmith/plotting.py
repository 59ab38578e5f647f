"""What every figure of the stages shares: a panel with nothing to show is switched off and says
"none" in its title, rather than drawing empty axes or a flat line."""

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
