"""Tables for people, as the notebooks show them: no index column, numbers to three significant
figures (whole numbers whole, with thousands separators), row labels as the first column, units
in the headers, yes/no for booleans, every cell whole (a long one wraps between words inside a
bounded column, never inside a word: a table wider than the page scrolls in its box); a column
with one value in every row is dropped and said once above the table; a dict as a small
two-column table.

What every stage's figures share: a panel with nothing to show is switched off and says "none" in
its title (`none_panel`) rather than drawing empty axes or a flat line; a dataset has one colour in
every stage's figures (`dataset_color`); a log axis is labelled in plain numbers (`plain_log_ticks`); a
long shell command is shown one option a line (`shell_lines`)."""

from __future__ import annotations

import html
import numbers
import re

import numpy as np
import pandas as pd
from IPython.display import HTML
from pandas.io.formats.style import Styler

# (column-name pattern, unit, suffix to drop from the name): the first match names the unit
UNIT_RULES = ((r"^price_request$", "$ per request", ""), (r"^price_", "$/M tokens", ""), (r"_usd$", "USD", "_usd"),
              (r"^cost(_|$)", "USD", ""), (r"_s$", "s", "_s"), (r"^throughput", "tokens/s", ""))
# a cell wraps between words rather than widening its column past this; a word is never broken
CELL_STYLE = [{"selector": "td", "props": [("max-width", "36em"), ("white-space", "normal"),
                                           ("overflow-wrap", "normal"), ("word-break", "normal")]},
              {"selector": "caption", "props": [("text-align", "left"), ("caption-side", "top")]}]


def header(column, units: dict | None = None) -> str:
    """`latency_p50_s` -> "latency p50 (s)", `price_out` -> "price out ($/M tokens)"; `units`
    names (or, with None, drops) the unit of a column by its name."""
    name = str(column)
    unit = None
    if units and name in units:
        unit = units[name]
    else:
        for pattern, rule_unit, suffix in UNIT_RULES:
            if re.search(pattern, name):
                unit, name = rule_unit, name[: len(name) - len(suffix)] if suffix else name
                break
    name = name.replace("_", " ")
    return f"{name} ({unit})" if unit else name


def cell_text(value) -> str:
    """A cell as shown: three significant figures, whole numbers whole, n/a for missing."""
    if not isinstance(value, (list, tuple, set, dict)) and pd.isna(value) is True:
        return "n/a"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    if isinstance(value, numbers.Real):
        v = float(value)
        if v.is_integer() or abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.3g}"
    if isinstance(value, (list, tuple, set)):
        return ", ".join(cell_text(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}: {cell_text(v)}" for k, v in value.items())
    return str(value)


def show(df: pd.DataFrame | None, units: dict | None = None, title: str | None = None) -> Styler:
    """`df` styled for people (see the module) under `title`; None or no rows shows one cell, "none".
    With two rows or more, a column (not the first) with one value in every row is dropped and named
    once in the caption: "same in every row: lossless yes"."""
    if df is None or not len(df):
        return pd.DataFrame({"": ["none"]}).style.hide(axis="index")
    # row labels (a named index, or one of labels) become the first column; row numbers are dropped
    numbers = df.index.name is None and pd.api.types.is_integer_dtype(df.index)
    frame = df.reset_index(drop=True) if numbers else df.rename_axis(df.index.name or "").reset_index()
    text = frame.map(cell_text).rename(columns=lambda c: header(c, units))
    constant = [c for c in text.columns[1:] if len(text) > 1 and text[c].nunique() == 1]
    said = "; ".join(f"{c} {text[c].iloc[0]}" for c in constant)
    caption = " · ".join(x for x in (title, f"same in every row: {said}" if said else None) if x)
    styler = text.drop(columns=constant).style.hide(axis="index").format(escape="html").set_table_styles(CELL_STYLE)
    return styler.set_caption(html.escape(caption)) if caption else styler


def dict_table(values: dict, key: str = "setting", value: str = "value") -> Styler:
    """A dict as a two-column table, nested dicts flattened to `outer / inner` keys."""
    def rows(d: dict, prefix: str = ""):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                yield from rows(v, f"{prefix}{k} / ")
            else:
                yield {key: f"{prefix}{k}", value: cell_text(v)}
    return show(pd.DataFrame(list(rows(values)), columns=[key, value]))


def show_all(frames: dict[str, pd.DataFrame], units: dict | None = None) -> HTML:
    """Several tables, each under its title (a caption), as one block."""
    return HTML("".join(show(df, units, title).set_table_styles(
        [{"selector": "caption", "props": [("text-align", "left"), ("font-weight", "bold"), ("padding", "0.8em 0 0.3em")]}],
        overwrite=False).to_html() for title, df in frames.items()) or "none")


# ---- what every stage's figures share ----

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


SHELL_WIDTH = 100   # a longer command is shown one option a line (`\\` continuations): whole on the page


def shell_lines(command: str) -> str:
    """`command` as a user copies it: one option a line with `\\` continuations where it is longer
    than SHELL_WIDTH (the same command to a shell), else as is."""
    if len(command) <= SHELL_WIDTH or "\n" in command:
        return command
    return command.replace(" --", " \\\n    --")
