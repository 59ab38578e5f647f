"""A tally of the expensive things a process tree does (engine starts, papermill runs, torchrun
launches, target builds), for the test suite's closing report: when `DRAFTSMITH_EVENTS` names a
file, `note(kind)` appends one line to it, `kind` and the test file that caused it (pytest's
PYTEST_CURRENT_TEST; child processes inherit both variables); otherwise it does nothing."""

from __future__ import annotations

import os

ENV = "DRAFTSMITH_EVENTS"


def note(kind: str) -> None:
    path = os.environ.get(ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:   # one short append: whole lines across processes
            f.write(f"{kind}\t{os.environ.get('PYTEST_CURRENT_TEST', '').split('::')[0]}\n")


def _lines(path) -> list[tuple[str, str]]:
    try:
        text = open(path, encoding="utf-8").read()
    except FileNotFoundError:
        return []
    return [tuple((line.split("\t") + [""])[:2]) for line in text.splitlines()]


def tally(path) -> dict[str, int]:
    """{kind: count} of the lines in `path` (empty when it does not exist)."""
    kinds = [k for k, _ in _lines(path)]
    return {k: kinds.count(k) for k in sorted(set(kinds))}


def by_file(path) -> dict[str, dict[str, int]]:
    """{test file: {kind: count}}, the files with the most steps first."""
    out: dict[str, dict[str, int]] = {}
    for kind, where in _lines(path):
        counts = out.setdefault(where or "(outside a test)", {})
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -sum(kv[1].values())))
