"""A tally of the expensive things a process tree does (engine starts, papermill runs, torchrun
launches, target builds), for the test suite's closing report: when `DRAFTSMITH_EVENTS` names a
file, `note(kind)` appends one line `kind` to it (child processes inherit the variable); otherwise
it does nothing."""

from __future__ import annotations

import os

ENV = "DRAFTSMITH_EVENTS"


def note(kind: str) -> None:
    path = os.environ.get(ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:   # one short append: whole lines across processes
            f.write(kind + "\n")


def tally(path) -> dict[str, int]:
    """{kind: count} of the lines in `path` (empty when it does not exist)."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except FileNotFoundError:
        return {}
    return {k: lines.count(k) for k in sorted(set(lines))}
