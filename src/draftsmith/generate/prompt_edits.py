"""The prompt files as they are now, against the answers a run already holds.

A sample is known by its id and the hash of its prompt messages (`datasets.prompt_hash`).
`compare` sorts a dataset's saved answers against its prompt file; `apply` then makes
raw_responses.jsonl hold exactly the answers passed on to stage 03 and moves the others to
superseded.jsonl. An answer paid for is never deleted and never paid twice, and a kill at any
moment loses nothing."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from ..datasets import DatasetReader, DatasetSpec, prompt_hash
from ..files import read_jsonl, repair_tail, replacing
from ..paths import Run
from .outputs import RESPONSES, SUPERSEDED

Key = tuple[str, str]       # (sample id, prompt hash): one paid answer


class SetAside(str, Enum):
    """Why an answer left raw_responses.jsonl for superseded.jsonl."""
    REWORDED = "reworded"
    REMOVED = "removed"


@dataclass
class PromptEdits:
    """One dataset's prompt file against its saved answers (counts of sample ids)."""
    dataset: str
    prompts: int = 0        # usable prompts in the file now
    answers: int = 0        # answers in raw_responses.jsonl before
    unchanged: int = 0
    reworded: int = 0
    removed: int = 0        # answers (passed on before, or set aside as removed) whose prompt is no longer in the file
    kept_removed: int = 0   # of those, passed on (keep_removed_prompts)
    added: int = 0          # prompts without an answer: to ask
    restored: int = 0       # answers set aside earlier whose prompt the file holds again: passed on, not paid again
    set_aside: int = 0      # answers in superseded.jsonl once applied

    @property
    def passed_on(self) -> int:
        return self.unchanged + self.kept_removed + self.restored

    def summary(self) -> str:
        """One line: what a re-run does with this dataset's saved answers."""
        removed = (f"{self.removed} removed (answers kept and passed on: keep_removed_prompts)" if self.kept_removed
                   else f"{self.removed} removed (answers set aside, not passed on; keep_removed_prompts keeps them)")
        parts = [f"{self.unchanged} unchanged",
                 f"{self.reworded} reworded (asked again in their new words, old answers set aside)", removed,
                 f"{self.added} added or not asked yet"]
        if self.restored:
            parts.append(f"{self.restored} set aside earlier and back in the file as they were (passed on, "
                         f"not paid again)")
        return (f"{self.dataset}: {self.prompts} prompts against {self.answers} saved answers: {', '.join(parts)}; "
                f"{self.passed_on} answers passed on, {self.set_aside} kept aside in {SUPERSEDED}")


@dataclass
class _Plan:
    aside: dict[int, SetAside] = field(default_factory=dict)     # raw line number -> why it leaves
    restore: dict[int, Key] = field(default_factory=dict)        # superseded line number -> its key
    drop: set[int] = field(default_factory=set)                  # superseded lines raw holds, or second copies
    appended: set[Key] = field(default_factory=set)              # keys superseded.jsonl holds already


def identity(row: dict, where: str) -> Key:
    """(sample id, prompt hash) of a saved line; the hash from its messages when not recorded."""
    sid, h = row.get("sample_id"), row.get("prompt_hash")
    if not isinstance(sid, str):
        raise ValueError(f"{where}: no sample_id")
    if not isinstance(h, str):
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise ValueError(f"{where}: neither prompt_hash nor messages, so the prompt it answers is unknown")
        h = prompt_hash([{"role": m.get("role"), "content": m.get("content")} for m in msgs])
    return sid, h


def compare(folder: Path, spec: DatasetSpec, keep_removed_prompts: bool) -> tuple[PromptEdits, _Plan]:
    """Sort the answers saved in `folder` (a dataset's stage-02 folder) against `spec`'s prompt
    file; reads only. Memory grows with the answers, not with the prompt file.

      unchanged  same id, same messages: passed on, never asked again
      reworded   same id, other messages: the answer is set aside and the prompt asked in its new words
      removed    the id is no longer in the file: the answer is set aside, or still passed on with
                 `keep_removed_prompts`
      added      a prompt of the file without an answer (new, or not reached by an earlier session)

    One set aside earlier goes back when the file holds its prompt again in the same words (a
    removed one: also when keep_removed_prompts is set), so it is never paid twice."""
    edits, plan = PromptEdits(spec.name), _Plan()
    saved: dict[str, list[tuple[int, str]]] = {}
    for lineno, row in read_jsonl(folder / RESPONSES):
        sid, h = identity(row, f"{folder / RESPONSES}:{lineno}")
        saved.setdefault(sid, []).append((lineno, h))
    edits.answers = len(saved)
    aside: dict[Key, int] = {}                      # key -> its (first) superseded line
    removed_aside: dict[str, tuple[int, Key]] = {}  # sample id -> its last answer set aside as removed
    for lineno, row in read_jsonl(folder / SUPERSEDED):
        key = identity(row, f"{folder / SUPERSEDED}:{lineno}")
        if key in aside:
            plan.drop.add(lineno)                   # a second copy of one answer
            continue
        aside[key] = lineno
        if (row.get("set_aside") or {}).get("reason") == SetAside.REMOVED:
            removed_aside[key[0]] = (lineno, key)
    in_file: set[str] = set()
    for p in DatasetReader(spec):
        edits.prompts += 1
        lines = saved.get(p.sample_id)
        if lines is not None or p.sample_id in removed_aside:
            in_file.add(p.sample_id)
        if lines:
            stays = False
            for lineno, h in lines:
                if h == p.prompt_hash:
                    stays = True
                else:
                    plan.aside[lineno] = SetAside.REWORDED
            if stays:
                edits.unchanged += 1
                continue
            edits.reworded += 1
        back = aside.get((p.sample_id, p.prompt_hash))
        if back is not None:
            plan.restore[back] = (p.sample_id, p.prompt_hash)
            edits.restored += 1
        elif not lines:
            edits.added += 1
    for sid, lines in saved.items():
        if sid not in in_file:
            edits.removed += 1
            if keep_removed_prompts:
                edits.kept_removed += 1
            else:
                plan.aside.update((lineno, SetAside.REMOVED) for lineno, _ in lines)
    if keep_removed_prompts:
        for sid, (lineno, key) in removed_aside.items():
            if sid not in in_file and sid not in saved:
                plan.restore[lineno] = key
                edits.removed += 1
                edits.kept_removed += 1
    staying = {(sid, h) for sid, lines in saved.items() for lineno, h in lines if lineno not in plan.aside}
    leaving = {(sid, h) for sid, lines in saved.items() for lineno, h in lines if lineno in plan.aside}
    copies = {key for key in aside if key in staying}     # a kill cut a move short: raw holds it
    plan.drop.update(aside[key] for key in copies)
    plan.appended = set(aside)
    edits.set_aside = len(aside) - len(copies) - len(plan.restore) + len(leaving - set(aside))
    return edits, plan


def preview(run: Run, specs: list[DatasetSpec], keep_removed_prompts: bool) -> list[PromptEdits]:
    """What `apply` would do, without changing a file (`draftsmith run 02 --check`): the datasets
    that hold answers, set aside or not."""
    out = []
    for spec in specs:
        folder = run.root / "generate" / spec.name
        if (folder / RESPONSES).exists() or (folder / SUPERSEDED).exists():
            out.append(compare(folder, spec, keep_removed_prompts)[0])
    return out


def apply(run: Run, specs: list[DatasetSpec], keep_removed_prompts: bool) -> list[PromptEdits]:
    """Compare each dataset that holds answers with its prompt file and move what must move
    (`compare`, `_move`), before a session opens the files; the caller holds the run's writer lock.
    An answer set aside goes to superseded.jsonl with `set_aside` {reason, time} added: it was paid
    for, so it is never deleted and its cost stays in the run's spend. Returns what was found."""
    out = []
    for spec in specs:
        folder = run.root / "generate" / spec.name
        raw, sup = folder / RESPONSES, folder / SUPERSEDED
        if not (raw.exists() or sup.exists()):
            continue
        repair_tail(raw)
        repair_tail(sup)
        edits, plan = compare(folder, spec, keep_removed_prompts)
        if plan.aside or plan.restore or plan.drop:
            _move(raw, sup, plan)
        out.append(edits)
    return out


def _move(raw: Path, sup: Path, plan: _Plan) -> None:
    """Lines are first appended to superseded.jsonl and fsynced, then raw_responses.jsonl is
    replaced whole (a temporary file, fsynced, renamed), then superseded.jsonl is replaced without
    the lines that went back. Between two steps a line is in both files, never in neither, and the
    next `apply` finishes the move."""
    now = round(time.time(), 3)
    if plan.aside:
        written = set(plan.appended)
        with open(sup, "a", encoding="utf-8") as f:
            for lineno, row in read_jsonl(raw):
                key = identity(row, f"{raw}:{lineno}")
                if lineno in plan.aside and key not in written:
                    written.add(key)
                    f.write(json.dumps({**row, "set_aside": {"reason": plan.aside[lineno].value, "time": now}},
                                       ensure_ascii=False, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        _sync_dir(sup.parent)
    if plan.aside or plan.restore:
        with replacing(raw) as tmp, open(tmp, "wb") as out:
            if raw.exists():
                with open(raw, "rb") as f:
                    for lineno, line in enumerate(f, 1):
                        if lineno not in plan.aside:
                            out.write(line)
            for lineno, row in read_jsonl(sup):
                if lineno in plan.restore:
                    row.pop("set_aside", None)
                    out.write((json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8"))
        _sync_dir(raw.parent)
    if plan.restore or plan.drop:
        gone = set(plan.restore) | plan.drop
        with replacing(sup) as tmp, open(tmp, "wb") as out, open(sup, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if lineno not in gone:
                    out.write(line)
        _sync_dir(sup.parent)


def _sync_dir(folder: Path) -> None:
    """Make a rename or a new file in `folder` survive a power cut."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def as_record(edits: list[PromptEdits]) -> dict:
    """The manifest's record of a session's comparison: counts per dataset."""
    return {e.dataset: asdict(e) for e in edits}
