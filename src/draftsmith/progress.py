"""Progress that reads well both live and in a saved log.

Interactively (a terminal, or Jupyter opened by a person) this is a tqdm bar. Under papermill a
bar either freezes or floods the log, so there it prints one plain line every `interval` seconds
and one at the end. `draftsmith run` sets DRAFTSMITH_PROGRESS=log for the notebooks it executes;
DRAFTSMITH_PROGRESS=bar|log|off overrides the choice anywhere. `wait_for_lock` is the same idea for
a wait on another process (e.g. one building the shared tiny target): it says what it waits for.

A tally of the expensive steps a process tree takes (engine starts, papermill runs, torchrun
launches, target builds), for the test suite's closing report: when `DRAFTSMITH_EVENTS` names a
file, `note(kind)` appends one line to it, `kind` and the test file that caused it (pytest's
PYTEST_CURRENT_TEST; child processes inherit both variables); otherwise it does nothing
(`tally`, `by_file` read it back).
"""

from __future__ import annotations

import os
import sys
import time


def mode() -> str:
    m = os.environ.get("DRAFTSMITH_PROGRESS")
    if m in ("bar", "log", "off"):
        return m
    return "bar" if sys.stderr.isatty() or "ipykernel" in sys.modules else "log"


def _fmt(x: float) -> str:
    if isinstance(x, float) and not x.is_integer():
        return f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"
    return f"{int(x):,}"


def wait_for_lock(f, what: str, log=print, interval: float = 10.0) -> None:
    """Take an exclusive flock on open file `f`; while another process holds it, print what we are
    waiting for at once and every `interval` seconds, so a wait is never silent."""
    import fcntl

    t0, last = time.monotonic(), None
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass  # held elsewhere; wait outside the handler, so Ctrl-C is one clean KeyboardInterrupt
        now = time.monotonic()
        if last is None or now - last >= interval:
            log(f"waiting for {what} ({now - t0:.0f}s so far; lock {f.name})")
            last = now
        time.sleep(min(0.5, interval))
    if last is not None:
        log(f"done waiting for {what} after {time.monotonic() - t0:.0f}s")


class Progress:
    """`update(n)` adds to the count, `set(**fields)` replaces the fields shown after it."""

    def __init__(self, total: float | None = None, desc: str = "", unit: str = "it",
                 interval: float | None = None):
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0
        self.fields: dict = {}
        self.mode = mode()
        self.interval = interval if interval is not None else float(os.environ.get("DRAFTSMITH_PROGRESS_INTERVAL", 10))
        self.t0 = self._last = time.monotonic()
        self._bar = None
        if self.mode == "bar":
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True)

    def update(self, n: float = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == "log" and time.monotonic() - self._last >= self.interval:
            self._emit()

    def set(self, **fields) -> None:
        self.fields = fields
        if self._bar is not None:
            self._bar.set_postfix({k: _fmt(v) if isinstance(v, (int, float)) else v for k, v in fields.items()},
                                  refresh=False)

    def line(self) -> str:
        el = time.monotonic() - self.t0
        rate = self.n / el if el > 0 else 0.0
        done = f"{_fmt(self.n)}" + (f"/{_fmt(self.total)}" if self.total else "")
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        eta = ""
        if self.total and rate > 0 and self.n < self.total:
            eta = f", eta {(self.total - self.n) / rate:.0f}s"
        extra = "".join(f" {k}={_fmt(v) if isinstance(v, (int, float)) else v}" for k, v in self.fields.items())
        return f"[{self.desc}] {done} {self.unit}{pct} in {el:.0f}s, {rate:,.1f} {self.unit}/s{eta}{extra}"

    def _emit(self) -> None:
        self._last = time.monotonic()
        print(self.line(), flush=True)

    def close(self, ended: bool = False) -> None:
        """`ended`: the work is complete even if it stopped short of `total` (a dataset that ran out
        of prompts below its budget). A notebook bar then ends neutral (blue) instead of the red
        tqdm gives any bar closed short of its total, which reads as a failure."""
        if self._bar is not None:
            self._bar.close()
            if ended and self.total and self.n < self.total and hasattr(self._bar, "container"):
                self._bar.display(bar_style="info", check_delay=False)
            self._bar = None
        elif self.mode == "log":
            self._emit()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- the tally of expensive steps ----

EVENTS_ENV = "DRAFTSMITH_EVENTS"


def note(kind: str) -> None:
    path = os.environ.get(EVENTS_ENV)
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
