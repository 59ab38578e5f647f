"""The words a stage says its verdict in, for the run summary: each stage's `outputs.verdict(run,
anchor)` reads its own files (`read_file`: Unreadable, naming the file, when one is missing or
damaged) and returns its numbers, `Verdict`, `Figure`s and `Note`s (each with its `Reason`);
`draftsmith.summary` assembles them.

Verdicts: ok; warning (the output is usable, something in it needs a look); failed (the stage did
not finish, or its own check says its output is unfit).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .paths import Run


class Verdict(str, Enum):
    OK = "ok"
    WARNING = "warning"
    FAILED = "failed"

    @staticmethod
    def worst(verdicts) -> "Verdict":
        order = [Verdict.OK, Verdict.WARNING, Verdict.FAILED]
        return max(verdicts, key=order.index, default=Verdict.OK)


@dataclass(frozen=True)
class Figure:
    """One figure of a stage's line, as a person reads it, and the anchor of its section in report.html."""

    text: str
    section: str


class Reason(str, Enum):
    """Why a stage's verdict is not ok, as a program reads it (`Note.reason`; summary.json `notes[].reason`)."""
    STOPPED = "stopped"                         # a cell raised, the notebook did not end, its files unreadable
    NO_ENDPOINT = "no_endpoint"
    PLAN_NOT_COVERED = "plan_not_covered"
    SESSION_ENDED_SHORT = "session_ended_short"
    BELOW_BUDGET = "below_budget"
    NO_SAMPLE = "no_sample"
    FLAGGED_KEPT = "flagged_kept"
    NO_SAMPLE_KEPT = "no_sample_kept"
    MALFORMED_LINES = "malformed_lines"
    CHECK_FAILED = "check_failed"
    SHARDS_REJECTED = "shards_rejected"
    TRAINING_UNFINISHED = "training_unfinished"
    LOSS_DID_NOT_FALL = "loss_did_not_fall"
    NOT_LOSSLESS = "not_lossless"
    BELOW_NGRAM = "below_ngram"
    NOTHING_MEASURED = "nothing_measured"


@dataclass(frozen=True)
class Note:
    """One reason a stage is not ok: its machine-readable `reason` and the line a person reads."""

    reason: Reason
    text: str


class Unreadable(Exception):
    """A stage's file is missing or not what the stage writes: the message names it."""


def read_file(run: Run, read, *args):
    """`read(*args)`, a stage's own reader of one of its files in `run`; Unreadable, with the reader's
    words (paths relative to the run), when the file is missing, damaged or empty."""
    try:
        out = read(*args)
    except FileNotFoundError as e:
        raise Unreadable(str(e).replace(f"{run.root}/", "")) from None
    except ValueError as e:
        raise Unreadable(f"not valid JSON: {e}".replace(f"{run.root}/", "")) from None
    if not out:
        raise Unreadable(f"{getattr(read, '__qualname__', read)} found nothing: the stage did not finish")
    return out


def usd(x: float | None) -> str:
    return "n/a" if x is None else f"${x:,.2f}" if abs(x) >= 1 else f"${x:.4f}"
