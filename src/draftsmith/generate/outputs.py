"""What stage 02 writes, so that a crash or a kill never loses paid work and never repeats it.

Per dataset: `raw_responses.jsonl`, one whole line per completed sample, never requested again;
`errors.jsonl`, the samples that failed for good; `superseded.jsonl`, answers set aside for a
reworded or removed prompt (prompt_edits.py; paid for, so kept and counted in the spend, but not
passed on). Per run: `manifest.json` and `timeline.jsonl`. One writer at a time (`writer_lock`).
Only this module knows these names; the `read_*` functions read them back (a torn last line left
out, any other damage named by file:line)."""

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
from ..verdicts import Figure, Note, Reason, Verdict, read_file, usd

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
    released when the block ends or the process dies (never a stale lock to clear). Raises RunBusy
    at once, naming the holder's pid and host, if another process holds it; this process may take
    it again inside the block (the notebook takes it before starting the local emulator,
    stage.run_at takes it again)."""
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
    `set_aside` those kept in superseded.jsonl (their cost is part of the run's spend). Lines are
    fsynced every `fsync_s` and on close (a power cut loses at most the last interval). On open a
    torn last line is cut off (or, whole JSON lacking only its newline, completed) and the ids
    already there are loaded; permanent failures are skipped on resume, exhausted retries tried again."""

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
    """`manifest.json`, rewritten atomically: the run's config without secrets, totals, and the list
    of sessions (a session = one start or resume, and how it ended)."""

    path: Path
    sessions: list[dict] = field(default_factory=list)
    settings: dict | None = None    # per dataset, what shapes its saved answers (generate/stage.py)

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
    """`timeline.jsonl`, a line every second of every session (money, slots, tokens), appended a
    line at a time; opened at the first line (a session that never started writes none), a killed
    session's torn last line cut off first."""

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


# ---- the stage's verdict, for the run summary (`draftsmith.summary` assembles the stages') ----

@dataclass
class DatasetTokens:
    name: str
    output_tokens: int                  # completion tokens saved
    budget: int | None                  # output_token_budget
    samples: int
    failed_for_good: int


@dataclass
class GenerateNumbers:
    spent_usd: float
    spend_limit_usd: float | None
    balance_usd: float | None           # the last balance stage 02 saw
    status: str                         # how its last session ended
    message: str
    datasets: list[DatasetTokens]


_GENERATE_OK = ("finished", "nothing_to_do")
_GENERATE_FAILED = ("fatal", "write_error", "no_room", "killed")


def prompt_edits_line(record: dict | None) -> str | None:
    """What the prompt files changed, from a session's record of its comparison (`prompt_edits.as_record`:
    counts per dataset), as stage 02's line says it: "N reworded (asked again), M removed, K added; J
    answers set aside"; None when no answer was set aside or is to be (nothing reworded or removed)."""
    edits = list((record or {}).values())
    if not any(e.get("reworded") or e.get("removed") or e.get("set_aside") for e in edits):
        return None
    total = lambda f: sum(e.get(f, 0) for e in edits)  # noqa: E731
    return (f"{total('reworded')} reworded (asked again), {total('removed')} removed, {total('added')} added; "
            f"{total('set_aside')} answers set aside")


def verdict(run: Run, anchor: str):
    """Stage 02's line of the run summary from manifest.json and the timeline: (GenerateNumbers,
    verdict, figures, notes); failed when its last session ended in an error or nothing was saved."""
    m = read_file(run, read_manifest, run)
    timeline = read_timeline(run)
    last = (m.get("sessions") or [{}])[-1]
    n = GenerateNumbers(
        spent_usd=m["spent_usd"], spend_limit_usd=(m.get("config") or {}).get("spend_limit_usd"),
        balance_usd=next((p["balance"] for p in reversed(timeline) if p.get("balance") is not None), None),
        status=last.get("status", "none"), message=last.get("message") or "",
        datasets=[DatasetTokens(name, d["completion_tokens"], d.get("budget"), d["samples"], d.get("failed_for_good", 0))
                  for name, d in (m.get("datasets") or {}).items()])
    short = [d for d in n.datasets if d.budget and d.output_tokens < d.budget]
    ran_out = n.status in _GENERATE_OK   # a session that finished below a budget asked every prompt it has
    figures = [Figure(f"spent {usd(n.spent_usd)} of {usd(n.spend_limit_usd)} limit, balance {usd(n.balance_usd)}",
                      anchor)]
    figures += [Figure(f"{d.name} {d.output_tokens:,}" + (f" / {d.budget:,}" if d.budget else "") + " tokens"
                       + (" (its prompts ran out)" if ran_out and d in short else ""), anchor) for d in n.datasets]
    edits = prompt_edits_line(last.get("prompt_edits"))
    if edits:   # the prompt files changed since the answers were saved (its last session's comparison)
        figures.append(Figure(edits, anchor))
    notes = []
    if not ran_out:
        notes.append(Note(Reason.SESSION_ENDED_SHORT, f"its last session ended {n.status}"
                          + (f": {n.message}" if n.message else "")
                          + ("" if n.status in _GENERATE_FAILED else "; re-run stage 02 to go on")))
        if short:
            notes.append(Note(Reason.BELOW_BUDGET, "below budget: " + ", ".join(
                f"{d.name} {d.output_tokens:,} of {d.budget:,} tokens" for d in short)))
    if not sum(d.samples for d in n.datasets):
        notes.append(Note(Reason.NO_SAMPLE, "no sample was saved"))
    outcome = (Verdict.FAILED if n.status in _GENERATE_FAILED or not sum(d.samples for d in n.datasets)
               else Verdict.WARNING if notes else Verdict.OK)
    return n, outcome, figures, notes
