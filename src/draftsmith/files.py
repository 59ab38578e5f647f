"""Writing and reading the files stages hand each other: whole or not at all, and damage named by file:line.

A JSON file is written to a temporary name, fsynced and renamed over the old one, so a reader sees
the old file or the new one, never half. A JSONL file is appended one whole line at a time; a kill
can leave only its last line torn, which readers leave out (and writers cut off before appending).
Any other bad line was edited or damaged by hand: the error names it.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path


def repair_tail(path: Path) -> str | None:
    """Make the file end with a whole line; returns what was done (None: nothing to do)."""
    if not path.exists():
        return None
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return None
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return None
        keep, pos = 0, size
        while pos > 0:
            start = max(0, pos - 65536)
            f.seek(start)
            i = f.read(pos - start).rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        f.seek(keep)
        tail = f.read()
        try:
            whole = isinstance(json.loads(tail), dict)
        except ValueError:
            whole = False
        if whole:
            f.seek(size)
            f.write(b"\n")
            return f"{path}: completed a last line that lacked its newline"
        f.truncate(keep)
        return f"{path}: cut a torn last line ({size - keep} bytes)"


def read_jsonl(path: Path):
    """(line number, object) for every line of a JSONL file draftsmith writes. A last line without its
    newline is torn (a run still writing, or killed) and left out; any other bad line is an error."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith("\n"):
                return
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e}); this file is written only by "
                                 f"draftsmith, so it was edited or damaged: fix or remove that line") from None
            yield lineno, obj


def write_json_atomic(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1, ensure_ascii=False))


def write_text_atomic(path: Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def replacing(path: Path):
    """Write `path` whole or not at all, with any writer: yields a temporary path next to it, which
    is fsynced and renamed over `path` if the block succeeds, and removed if it fails."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
