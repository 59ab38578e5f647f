"""The emulator's persistent state: the account and the request ledger, in one state folder.

    <state_dir>/account.jsonl   one line per credit event: {"time", "type": "credits", "amount", "note"}
    <state_dir>/ledger.jsonl    one line per request that reached a provider (see LEDGER_FIELDS)

Balance = sum of credit events - sum of ledger costs, so it survives a restart and two emulators
started one after the other on the same folder (stage 01, then stage 02) see the same account.
Every line is written with one `write` on an O_APPEND descriptor; a line cut short by a crash is
dropped when the folder is next opened. `top_up(state_dir, usd)` adds credits while the server is
stopped or running (a running server notices the new line at its next balance check).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

LEDGER_FIELDS = ("generation_id", "time", "status", "provider", "endpoint", "provider_name", "model",
                 "prompt_key", "prompt_tokens", "completion_tokens", "reasoning_tokens", "cost",
                 "output_ids", "finish_reason", "cancelled", "billed", "stream", "attempts", "quirks", "error")


def _append(path: Path, record: dict) -> None:
    line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _read_lines(path: Path, offsets: list[int] | None = None) -> list[dict]:
    """Whole JSON lines of `path` (and, into `offsets`, where each starts); a torn last line
    (crash mid-write) is cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    out, at = [], 0
    for i, line in enumerate(data.split(b"\n")[:-1], 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: corrupt line: {e}") from None
            if offsets is not None:
                offsets.append(at)
        at += len(line) + 1
    return out


def top_up(state_dir: str | os.PathLike, usd: float, note: str = "top-up") -> None:
    """Add `usd` of credits to the account in `state_dir` (server running or not)."""
    if not (isinstance(usd, (int, float)) and usd > 0):
        raise ValueError(f"top-up amount must be a positive number of USD, got {usd!r}")
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    _append(d / "account.jsonl", {"time": time.time(), "type": "credits", "amount": float(usd), "note": note})


def read_ledger(state_dir: str | os.PathLike) -> list[dict]:
    """Every ledger line of `state_dir` (for tests and for checking what was billed)."""
    return _read_lines(Path(state_dir) / "ledger.jsonl")


class Ledger:
    """Account totals and ledger of one state folder, held open by one server at a time."""

    def __init__(self, state_dir: str | os.PathLike, initial_credits: float):
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.dir / "emulator.lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(f"emulator state dir {self.dir} is in use by another running emulator") from None
        self._ledger_fd = None
        self.account_path = self.dir / "account.jsonl"
        self.ledger_path = self.dir / "ledger.jsonl"
        if not self.account_path.exists():
            self.account_path.touch()
            if initial_credits > 0:
                top_up(self.dir, initial_credits, "initial credits")
        self.total_credits = 0.0
        self._account_size = 0
        self._refresh_credits()
        self.total_usage = 0.0
        self.usage_daily = 0.0
        self.byok_usage = 0.0  # upstream cost paid with the user's own provider keys
        self.byok_usage_daily = 0.0
        self.count = 0
        # id -> (byte offset of its ledger line, visible from this monotonic time): /generation reads
        # the line back, so memory stays an int per request however long the run
        self.generations: dict[str, tuple[int, float]] = {}
        day0, offsets = _day_start(), []
        for rec, at in zip(_read_lines(self.ledger_path, offsets), offsets):
            self._account(rec, day0)
            self.generations[rec["generation_id"]] = (at, 0.0)
        self._ledger_fd = os.open(self.ledger_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._ledger_fd).st_size

    def _refresh_credits(self) -> None:
        size = self.account_path.stat().st_size
        if size != self._account_size:
            self.total_credits = sum(e["amount"] for e in _read_lines(self.account_path) if e.get("type") == "credits")
            self._account_size = self.account_path.stat().st_size

    def _account(self, rec: dict, day0: float) -> None:
        self.count += 1
        cost = rec.get("cost") or 0.0
        byok = (rec.get("upstream_inference_cost") or 0.0) if rec.get("is_byok") else 0.0
        self.total_usage += cost
        self.byok_usage += byok
        if rec.get("time", 0) >= day0:
            self.usage_daily += cost
            self.byok_usage_daily += byok

    @property
    def balance(self) -> float:
        self._refresh_credits()
        return self.total_credits - self.total_usage

    def top_up(self, usd: float, note: str = "top-up (admin endpoint)") -> None:
        top_up(self.dir, usd, note)
        self._refresh_credits()

    def record(self, rec: dict, visible_after_s: float = 0.0) -> None:
        missing = [f for f in LEDGER_FIELDS if f not in rec]
        if missing:
            raise ValueError(f"ledger record lacks {missing}")
        line = (json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        os.write(self._ledger_fd, line)
        self._account(rec, _day_start())
        self.generations[rec["generation_id"]] = (self._size, time.monotonic() + visible_after_s)
        self._size += len(line)

    def generation(self, gen_id: str) -> dict | None:
        """The ledger line of `gen_id`, or None while it is unknown or not yet visible."""
        hit = self.generations.get(gen_id)
        if hit is None or time.monotonic() < hit[1]:
            return None
        with open(self.ledger_path, "rb") as f:
            f.seek(hit[0])
            return json.loads(f.readline())

    def close(self) -> None:
        if self._ledger_fd is not None:
            os.close(self._ledger_fd)
            self._ledger_fd = None
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()


def _day_start() -> float:
    t = time.gmtime()
    return time.time() - (t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec)
