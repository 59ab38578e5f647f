"""`draftsmith compare RUN_A RUN_B ...`: runs side by side, from their files as data.

Each run's headline comes from its `summary.json`, its results from `eval/results.csv` (stage 06).
The table has one row per temperature x prompt set x method, each run's acceptance length with its
standard error over prompts, and for every run after the first its difference from the first,
marked `*` where it is beyond noise: more than two standard errors of the difference
(`results.versus`, the rule stage 06's verdict uses).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .evaluate.outputs import RESULTS_CSV
from .evaluate.results import MARGIN_SE, Versus, versus
from .summary import SUMMARY

KEY = ["temperature", "prompt_set", "method"]


class CompareError(ValueError):
    """A run folder that cannot be compared: the message names the folder or file."""


@dataclass
class Compared:
    names: list[str]                    # each run's folder name (its path where two names are the same)
    headlines: list[str]                # each run's headline line ("no headline: ..." where it has none)
    table: pd.DataFrame                 # one row per KEY, a column per run, a difference column per later run
    beyond_noise: int                   # differences marked *


def read_run(folder: Path) -> tuple[str, pd.DataFrame]:
    """(the run's headline line, its results.csv); CompareError naming what is missing."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CompareError(f"{folder}: no such run folder")
    summary_path, csv = folder / SUMMARY, folder / "eval" / RESULTS_CSV
    if not csv.is_file():
        raise CompareError(f"{csv}: no results (run stage 06 on {folder.name} with this version first)")
    try:
        headline = (json.loads(summary_path.read_text(encoding="utf-8")).get("headline") or {}).get("text")
    except FileNotFoundError:
        headline = None
    except ValueError as e:
        raise CompareError(f"{summary_path}: not valid JSON ({e})") from None
    df = pd.read_csv(csv)
    missing = [c for c in KEY + ["acceptance_length", "acceptance_length_se"] if c not in df.columns]
    if missing:
        raise CompareError(f"{csv}: no column {', '.join(missing)} (written by another version: re-run stage 06)")
    return headline or f"no headline ({summary_path.name} has none)", df


def _cell(x, se) -> str:
    if pd.isna(x):
        return "-"
    return f"{x:.2f}" + ("" if pd.isna(se) else f" ± {se:.2f}")


def compare(folders: list[Path]) -> Compared:
    """The runs in `folders` side by side (at least two)."""
    if len(folders) < 2:
        raise CompareError("give at least two run folders")
    paths = [Path(f) for f in folders]
    names = [p.name for p in paths]
    if len(set(names)) < len(names):
        names = [str(p) for p in paths]
    read = [read_run(p) for p in paths]
    merged = None
    for name, (_, df) in zip(names, read):
        part = df[KEY + ["acceptance_length", "acceptance_length_se"]].rename(
            columns={"acceptance_length": f"{name}", "acceptance_length_se": f"{name} se"})
        merged = part if merged is None else merged.merge(part, on=KEY, how="outer")
    merged = merged.sort_values(KEY, kind="stable").reset_index(drop=True)
    out = merged[KEY].rename(columns={"temperature": "T", "prompt_set": "prompt set"})
    first, marked = names[0], 0
    for name in names:
        out[name] = [_cell(x, se) for x, se in zip(merged[name], merged[f"{name} se"])]
    for name in names[1:]:
        cells = []
        for a, a_se, b, b_se in zip(merged[name], merged[f"{name} se"], merged[first], merged[f"{first} se"]):
            if pd.isna(a) or pd.isna(b):
                cells.append("-")
                continue
            v, gap, _ = versus(a, None if pd.isna(a_se) else a_se, b, None if pd.isna(b_se) else b_se)
            beyond = v != Versus.WITHIN_NOISE
            marked += beyond
            cells.append(f"{gap:+.2f}" + (" *" if beyond else ""))
        out[f"Δ {name} - {first}"] = cells
    return Compared(names, [h for h, _ in read], out, marked)


def lines(c: Compared) -> list[str]:
    """What `draftsmith compare` prints: the verdict, each run's headline, the table."""
    width = max(len(n) for n in c.names)
    return ([f"compare {len(c.names)} runs: {c.beyond_noise} difference{'s' * (c.beyond_noise != 1)} beyond noise "
             f"(marked *: more than {MARGIN_SE:g} standard errors of the difference)"]
            + [f"  {n:<{width}}  {h}" for n, h in zip(c.names, c.headlines)]
            + ["", "acceptance length ± its standard error over prompts; Δ: against the first run"]
            + c.table.to_string(index=False).splitlines())
