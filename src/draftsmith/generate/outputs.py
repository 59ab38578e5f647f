"""What stage 02 writes, so that a crash or a kill never loses paid work and never repeats it.

`<run>/generate/<dataset>/raw_responses.jsonl` holds one whole line per completed sample, appended
and flushed as it is written (a kill -9 keeps every line handed to the OS), fsynced at intervals
and on close (a power cut loses at most the last interval). On open, a torn last line is cut off
(or, if it is whole JSON that only lacks its newline, completed) and the ids already there are
loaded: those samples are never requested again. `errors.jsonl` next to it records samples that
failed for good in a session (permanent failures are skipped on resume, exhausted retries are
tried again). `superseded.jsonl` next to it keeps the answers set aside because their prompt was
reworded or removed from the prompt file (prompt_edits.py moves them): paid for, so never deleted,
and counted in the run's spend, but not passed on. `<run>/generate/manifest.json` is rewritten
atomically: the run's config without secrets, totals, and one entry per session (start, resume,
how it ended). `<run>/generate/timeline.jsonl` gets a line every second of every session (money,
slots, tokens).

One process writes a run's stage 02 at a time: `writer_lock` holds an exclusive OS lock on
`<run>/generate/writer.lock` (it dies with its process, so there is never a stale lock to clear),
and a second writer is refused at once, naming the holder's pid and host. A line the disk cannot
take whole (full, or any write error) is cut off again at once and the error raised, so the files
never hold a torn line; `room_problem` checks the free space against what a run expects to write.

This module is the only one that knows these files' names: other stages, the report and the
benches read them through `read_responses`, `read_superseded`, `read_errors`, `read_manifest` and
`read_timeline` (a torn last line is left out, any other damage is an error naming file:line).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..files import read_jsonl, repair_tail, write_json_atomic
from ..paths import Run

RESPONSES, ERRORS = "raw_responses.jsonl", "errors.jsonl"        # per dataset
SUPERSEDED = "superseded.jsonl"                                  # per dataset: answers set aside
MANIFEST, TIMELINE = "manifest.json", "timeline.jsonl"           # per run
LOCK = "writer.lock"                                             # per run: who writes it now


def responses_file(run: Run, dataset: str) -> Path:
    """Where stage 02 saves the responses of `dataset` (it may not exist yet)."""
    return run.root / "generate" / dataset / RESPONSES


def read_responses(run: Run, dataset: str):
    """(line number, response) for every saved response of `dataset`; nothing if none was saved."""
    return read_jsonl(responses_file(run, dataset))


def superseded_file(run: Run, dataset: str) -> Path:
    """Where stage 02 keeps the answers of `dataset` set aside (reworded or removed prompts)."""
    return run.root / "generate" / dataset / SUPERSEDED


def read_superseded(run: Run, dataset: str):
    """(line number, response) for every answer of `dataset` set aside: a raw_responses line with
    `set_aside` {reason: reworded | removed, time} added."""
    return read_jsonl(superseded_file(run, dataset))


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


class RunBusy(RuntimeError):
    """Another process is writing this run's stage 02."""


_held: set[str] = set()    # the lock files this process holds


@contextmanager
def writer_lock(run: Run):
    """Hold the run's writer lock for the block: an exclusive `flock` on `generate/writer.lock`,
    released when the block ends or the process dies. Raises RunBusy at once, naming the holder,
    if another process holds it; this process may take it again inside the block (the notebook
    takes it before starting the local emulator, stage.run_at takes it again)."""
    path = run.dir("generate") / LOCK
    key = str(path)
    if key in _held:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 1024, 0).decode("utf-8", "replace")
        os.close(fd)
        try:
            h = json.loads(holder)
            who = f"pid {h['pid']} on host {h['host']} (since {h['since']})"
        except (ValueError, KeyError, TypeError):
            who = "another process (it has not written its pid yet)"
        raise RunBusy(f"run {run.name!r} is being generated by {who}: one process writes a run at a time "
                      f"(lock {path}); wait for it to end or stop it, or give another run_name") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode(), 0)
    except OSError:
        pass            # a full disk: the lock holds all the same, only its holder goes unnamed
    _held.add(key)
    try:
        yield
    finally:
        _held.discard(key)
        os.close(fd)    # releases the lock


# What one saved response takes besides its prompt and its text: the usage, the request settings,
# ids and times (about 800 bytes as written; rounded up). Its text as JSON: about 4.6 bytes a
# token measured, more with escapes and CJK. (A bare vLLM server's lines also hold the token ids,
# about twice that; the estimate leaves them out.)
LINE_FIELDS_BYTES = 1024
BYTES_PER_TOKEN = 6


def expected_bytes(prompt_bytes: float, responses: float, tokens: float) -> int:
    """About what `responses` saved responses with `tokens` output tokens in all take, each line
    holding its prompt (`prompt_bytes` on average)."""
    return int(responses * (prompt_bytes + LINE_FIELDS_BYTES) + tokens * BYTES_PER_TOKEN)


def room_problem(folder: Path, need: int) -> str | None:
    """Why `folder` (a run's stage 02 folder) cannot hold `need` more bytes (None: it can)."""
    free = shutil.disk_usage(folder).free
    if free >= need:
        return None
    return (f"not enough free space in {folder}: the plan expects about {_mb(need)} more of responses, "
            f"and the disk has {_mb(free)} free; free some space or point outputs_dir elsewhere, then re-run")


def _mb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.2f} MB"


class _Lines:
    """A file appended one whole line at a time, each handed to the OS as it comes (a kill -9 keeps
    it). A line the OS takes only in part (a full disk, any write error) is cut off again at once
    and the error raised: the file never holds a torn line, and a later line never joins one."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = open(self.path, "ab", buffering=0)
        self._size = os.fstat(self._f.fileno()).st_size

    @property
    def closed(self) -> bool:
        return self._f.closed

    def append(self, text: str) -> None:
        line = (text + "\n").encode("utf-8")
        data = memoryview(line)
        try:
            while data:
                data = data[self._f.write(data):]
        except OSError:
            try:
                os.ftruncate(self._f.fileno(), self._size)
            except OSError:
                pass
            raise
        self._size += len(line)

    def sync(self) -> None:
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


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
    """The response and error files of one dataset. `totals` count the answers passed on,
    `set_aside` those kept in superseded.jsonl (their cost is part of the run's spend)."""

    def __init__(self, folder: Path, fsync_s: float = 5.0):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.raw_path = self.folder / RESPONSES
        self.err_path = self.folder / ERRORS
        self.fsync_s = fsync_s
        self.notes = [n for n in (repair_tail(self.raw_path), repair_tail(self.err_path)) if n]
        self.done: set[str] = set()
        self.permanent: dict[str, str | None] = {}   # sample id -> the prompt hash it failed for good under
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
                self.permanent[e["sample_id"]] = e.get("prompt_hash")
        self.set_aside = Totals()
        for _, r in read_jsonl(self.folder / SUPERSEDED):
            self.set_aside.add(r.get("usage") or {}, r.get("finish_reason"))
        self._raw = _Lines(self.raw_path)
        self._err = _Lines(self.err_path)
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
        self._raw.append(line)
        self.done.add(sample_id)
        self.permanent.pop(sample_id, None)
        try:
            self._maybe_sync()
        except OSError:
            pass        # the line is written; the next periodic sync raises it again, as the session's error

    def write_error(self, entry: dict) -> None:
        self._err.append(json.dumps(entry, ensure_ascii=False))
        if entry.get("action") == "permanent":
            self.permanent[entry["sample_id"]] = entry.get("prompt_hash")

    def failed_for_good(self, sample_id: str, prompt_hash: str) -> bool:
        """Did this sample fail for good (a 400, too long for the context) in the words it has now?
        One that failed under other words (reworded since) is asked again; a failure recorded
        without its prompt's hash counts whatever the words."""
        if sample_id not in self.permanent:
            return False
        failed_under = self.permanent[sample_id]
        return failed_under is None or failed_under == prompt_hash

    def _maybe_sync(self) -> None:
        if time.monotonic() - self._last_sync >= self.fsync_s:
            self.sync()

    def sync(self) -> None:
        for f in (self._raw, self._err):
            f.sync()
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if not self._raw.closed:
            try:
                self.sync()
            finally:
                self._raw.close()
                self._err.close()


@dataclass
class Manifest:
    """`manifest.json`: config, totals, and the list of sessions (a session = one start or resume)."""

    path: Path
    sessions: list[dict] = field(default_factory=list)
    settings: dict | None = None    # per dataset, what shapes its saved answers (generate/run_settings.py)

    @classmethod
    def open(cls, path: Path) -> "Manifest":
        m = cls(Path(path))
        if m.path.exists():
            try:
                old = json.loads(m.path.read_text(encoding="utf-8"))
                m.sessions, m.settings = old.get("sessions", []), old.get("settings")
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
        """Dollars billed that no saved response accounts for: failed attempts' costs, requests
        abandoned in flight (counted at their worst case, since their bill is unknown), and answers
        that came back and could not be written (a full disk)."""
        return sum(s.get("failed_attempts_cost", 0.0) + s.get("abandoned_reserved_usd", 0.0)
                   + s.get("unsaved_cost", 0.0) for s in self.sessions)

    def write(self, config: dict, datasets: dict, providers: dict, spent_usd: float) -> None:
        errors: dict[str, int] = {}
        for s in self.sessions:
            for k, v in s.get("errors_by_kind", {}).items():
                errors[k] = errors.get(k, 0) + v
        write_json_atomic(self.path, {
            "config": config, "settings": self.settings, "spent_usd": round(spent_usd, 8), "datasets": datasets,
            "providers": providers, "errors_by_kind": errors, "sessions": self.sessions})


class Timeline:
    """`timeline.jsonl`, appended a line at a time; opened at the first line (a session that never
    started writes none), a killed session's torn last line cut off first."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = None

    def append(self, point: dict) -> None:
        if self._f is None:
            repair_tail(self.path)
            self._f = _Lines(self.path)
        self._f.append(json.dumps(point))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
