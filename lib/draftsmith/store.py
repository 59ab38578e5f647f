"""What stage 02 writes, so that a crash or a kill never loses paid work and never repeats it.

`<run>/generate/<dataset>/raw_responses.jsonl` holds one whole line per completed sample, appended
and flushed as it is written (a kill -9 keeps every line handed to the OS), fsynced at intervals
and on close (a power cut loses at most the last interval). On open, a torn last line is cut off
(or, if it is whole JSON that only lacks its newline, completed) and the ids already there are
loaded: those samples are never requested again. `errors.jsonl` next to it records samples that
failed for good in a session (permanent failures are skipped on resume, exhausted retries are
tried again). `<run>/generate/manifest.json` is rewritten atomically: the run's config without
secrets, totals, and one entry per session (start, resume, how it ended). `<run>/generate/timeline.jsonl`
gets a line every second of every session (money, slots, tokens).

This module is the only one that knows these files' names: other stages, the report and the
benches read them through `read_responses`, `read_errors`, `read_manifest` and `read_timeline`
(a torn last line is left out, any other damage is an error naming file:line).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .files import read_jsonl, repair_tail, write_json_atomic
from .paths import Run

RESPONSES, ERRORS = "raw_responses.jsonl", "errors.jsonl"        # per dataset
MANIFEST, TIMELINE = "manifest.json", "timeline.jsonl"           # per run


def responses_file(run: Run, dataset: str) -> Path:
    """Where stage 02 saves the responses of `dataset` (it may not exist yet)."""
    return run.root / "generate" / dataset / RESPONSES


def read_responses(run: Run, dataset: str):
    """(line number, response) for every saved response of `dataset`; nothing if none was saved."""
    return read_jsonl(responses_file(run, dataset))


def read_errors(run: Run, dataset: str):
    """(line number, entry) for every sample of `dataset` that failed for good or ran out of attempts."""
    return read_jsonl(run.root / "generate" / dataset / ERRORS)


def saved_datasets(run: Run) -> list[str]:
    """The datasets that have a responses file, by name."""
    return sorted(p.parent.name for p in (run.root / "generate").glob(f"*/{RESPONSES}"))


def read_manifest(run: Run) -> dict:
    """The run's `manifest.json`; {} before stage 02 first ran."""
    path = run.root / "generate" / MANIFEST
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); it is written whole by stage 02, so it was edited "
                         f"or damaged by hand: fix it, or remove it and re-run stage 02 (totals are rebuilt)") from None


def read_timeline(run: Run) -> list[dict]:
    """Every line of `timeline.jsonl`, all sessions, in order."""
    return [r for _, r in read_jsonl(run.root / "generate" / TIMELINE)]


def open_dataset(run: Run, dataset: str, fsync_s: float = 5.0) -> "DatasetStore":
    """The response and error files of `dataset`, opened for appending (what is there is loaded)."""
    return DatasetStore(run.dir("generate") / dataset, fsync_s)


def open_manifest(run: Run) -> "Manifest":
    return Manifest.open(run.dir("generate") / MANIFEST)


def open_timeline(run: Run) -> "Timeline":
    return Timeline(run.dir("generate") / TIMELINE)


@dataclass
class Totals:
    samples: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cost: float = 0.0
    length_finishes: int = 0

    def add(self, usage: dict, finish_reason: str | None) -> None:
        self.samples += 1
        self.prompt_tokens += usage.get("prompt_tokens") or 0
        self.completion_tokens += usage.get("completion_tokens") or 0
        self.reasoning_tokens += usage.get("reasoning_tokens") or 0
        self.cost += usage.get("cost") or 0.0
        self.length_finishes += finish_reason == "length"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["cost"] = round(self.cost, 8)
        return d


class DatasetStore:
    """The response and error files of one dataset."""

    def __init__(self, folder: Path, fsync_s: float = 5.0):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.raw_path = self.folder / RESPONSES
        self.err_path = self.folder / ERRORS
        self.fsync_s = fsync_s
        self.notes = [n for n in (repair_tail(self.raw_path), repair_tail(self.err_path)) if n]
        self.done: set[str] = set()
        self.permanent: set[str] = set()
        self.totals = Totals()
        self.providers: dict[str, Totals] = {}
        self.lengths: list[tuple[float, int]] = []   # (seconds, completion tokens) of each saved sample
        for lineno, r in read_jsonl(self.raw_path):
            sid = r.get("sample_id")
            if not isinstance(sid, str):
                raise ValueError(f"{self.raw_path}:{lineno}: no sample_id")
            if sid in self.done:
                self.notes.append(f"{self.raw_path}:{lineno}: sample {sid!r} repeats an earlier line (kept the first)")
                continue
            self.done.add(sid)
            self.count(r)
        for _, e in read_jsonl(self.err_path):
            if e.get("action") == "permanent" and e.get("sample_id") not in self.done:
                self.permanent.add(e["sample_id"])
        self._raw = open(self.raw_path, "a", encoding="utf-8")
        self._err = open(self.err_path, "a", encoding="utf-8")
        self._last_sync = time.monotonic()

    def count(self, r: dict) -> None:
        usage = r.get("usage") or {}
        self.count_reply(usage, r.get("finish_reason"), r.get("provider"))
        duration = (r.get("completed_at") or 0) - (r.get("started_at") or 0)
        self.lengths.append((max(0.0, duration), usage.get("completion_tokens") or 0))

    def count_reply(self, usage: dict, finish_reason: str | None, provider: str | None) -> None:
        self.totals.add(usage, finish_reason)
        self.providers.setdefault(provider or "unknown", Totals()).add(usage, finish_reason)

    def write(self, sample_id: str, line: str) -> None:
        """Append one response line (JSON text without the newline)."""
        if sample_id in self.done:
            raise RuntimeError(f"sample {sample_id!r} is already in {self.raw_path}")
        self._raw.write(line + "\n")
        self._raw.flush()
        self.done.add(sample_id)
        self._maybe_sync()

    def write_error(self, entry: dict) -> None:
        self._err.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._err.flush()
        if entry.get("action") == "permanent":
            self.permanent.add(entry["sample_id"])

    def _maybe_sync(self) -> None:
        if time.monotonic() - self._last_sync >= self.fsync_s:
            self.sync()

    def sync(self) -> None:
        for f in (self._raw, self._err):
            f.flush()
            os.fsync(f.fileno())
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if not self._raw.closed:
            self.sync()
            self._raw.close()
            self._err.close()


@dataclass
class Manifest:
    """`manifest.json`: config, totals, and the list of sessions (a session = one start or resume)."""

    path: Path
    sessions: list[dict] = field(default_factory=list)

    @classmethod
    def open(cls, path: Path) -> "Manifest":
        m = cls(Path(path))
        if m.path.exists():
            try:
                m.sessions = json.loads(m.path.read_text(encoding="utf-8")).get("sessions", [])
            except ValueError:
                m.sessions = []   # rewritten atomically, so only a hand edit gets here; totals are rebuilt anyway
        for s in m.sessions:
            if s.get("status") == "running":
                s["status"] = "killed"
                s["abandoned_reserved_usd"] = s.get("abandoned_reserved_usd", 0.0) + s.get("reserved_usd", 0.0)
                s["message"] = ("the process ended without a clean exit (kill -9, crash, power); "
                                "samples in flight then were not saved and are requested again")
        return m

    @property
    def spent_outside_responses(self) -> float:
        """Dollars billed that no saved response accounts for: failed attempts' costs, and requests
        abandoned in flight (counted at their worst case, since their bill is unknown)."""
        return sum(s.get("failed_attempts_cost", 0.0) + s.get("abandoned_reserved_usd", 0.0) for s in self.sessions)

    def write(self, config: dict, datasets: dict, providers: dict, spent_usd: float) -> None:
        errors: dict[str, int] = {}
        for s in self.sessions:
            for k, v in s.get("errors_by_kind", {}).items():
                errors[k] = errors.get(k, 0) + v
        write_json_atomic(self.path, {
            "config": config, "spent_usd": round(spent_usd, 8), "datasets": datasets, "providers": providers,
            "errors_by_kind": errors, "sessions": self.sessions})


class Timeline:
    """`timeline.jsonl`, appended a line at a time; opened at the first line (a session that never
    started writes none), a killed session's torn last line cut off first."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = None

    def append(self, point: dict) -> None:
        if self._f is None:
            repair_tail(self.path)
            self._f = open(self.path, "a", encoding="utf-8")
        self._f.write(json.dumps(point) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
