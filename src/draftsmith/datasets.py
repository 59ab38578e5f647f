"""Prompt datasets: JSONL in the OpenAI `messages` form or ShareGPT `conversations` form.

`DatasetReader` streams a file's prompts (every message up to and including a row's last user
turn); a relative path is taken from the repository root. A sample is known by its id, the row's
`id` or else `prompt_hash` of its prompt; with its prompt's hash, recorded on its stage-02 line, it
is the sample's identity across runs (the same id with other messages is the same sample reworded:
generate/prompt_edits.py). No row is skipped silently."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .paths import resolve

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
_ROLES = {"system", "user", "assistant"}


@dataclass(frozen=True)
class Prompt:
    sample_id: str
    dataset: str
    messages: list[dict]
    line: int
    prompt_hash: str    # prompt_hash(messages): with sample_id, what the sample is


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass
class DatasetSpec:
    """One entry of the `datasets` parameter."""

    name: str
    path: str
    output_token_budget: int | None = None

    @classmethod
    def parse(cls, entry: dict, where: str = "datasets") -> "DatasetSpec":
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: each dataset must be a mapping with name and path, got {entry!r}")
        unknown = set(entry) - {"name", "path", "output_token_budget"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} in dataset {entry.get('name')!r}")
        for key in ("name", "path"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise ValueError(f"{where}: dataset field {key!r} must be a non-empty string, got {entry.get(key)!r}")
        budget = entry.get("output_token_budget")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0):
            raise ValueError(f"{where}: output_token_budget of {entry['name']!r} must be a positive int, got {budget!r}")
        return cls(entry["name"], str(resolve(entry["path"])), budget)


def parse_datasets(datasets: list[dict]) -> list[DatasetSpec]:
    specs = [DatasetSpec.parse(d, f"datasets[{i}]") for i, d in enumerate(datasets)]
    names = [s.name for s in specs]
    dup = [n for n, c in Counter(names).items() if c > 1]
    if dup:
        raise ValueError(f"datasets: repeated dataset names {dup}")
    return specs


def prompt_hash(messages: list[dict]) -> str:
    """The hash of a prompt's messages ({role, content} each, in order): "h" and 16 hex digits of
    the SHA-256 of their JSON with sorted keys and no spaces. Equal messages, equal hash."""
    blob = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "h" + hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


stable_id = prompt_hash     # the id of a row without one is the hash of its prompt


def row_messages(row: dict) -> list[dict]:
    """The conversation of a row as OpenAI-style messages; raises ValueError naming the field."""
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list):
            raise ValueError("field 'messages' must be a list")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise ValueError(f"messages[{i}] must be an object")
            role, content = m.get("role"), m.get("content")
            if role not in _ROLES:
                raise ValueError(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}")
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be a string")
            out.append({"role": role, "content": content})
        return out
    if "conversations" in row:
        conv = row["conversations"]
        if not isinstance(conv, list):
            raise ValueError("field 'conversations' must be a list")
        out = []
        for i, m in enumerate(conv):
            if not isinstance(m, dict):
                raise ValueError(f"conversations[{i}] must be an object")
            role = _SHAREGPT_ROLES.get(str(m.get("from", "")).lower())
            if role is None:
                raise ValueError(f"conversations[{i}].from must be human, gpt or system, got {m.get('from')!r}")
            if not isinstance(m.get("value"), str):
                raise ValueError(f"conversations[{i}].value must be a string")
            out.append({"role": role, "content": m["value"]})
        return out
    raise ValueError("row has neither 'messages' nor 'conversations'")


def prompt_of(messages: list[dict]) -> list[dict]:
    """Every message up to and including the last user turn."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError("conversation has no user turn")
    prompt = messages[: last_user + 1]
    if any(m["role"] == "system" for m in prompt[1:]):
        raise ValueError("a system message is only allowed as the first message")
    if not prompt[-1]["content"].strip():
        raise ValueError("the last user turn is empty")
    return prompt


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text: byte 0x{raw[e.start]:02x} at column {e.start + 1}") from None


@dataclass
class DatasetReader:
    """Streams the prompts of one dataset file (memory grows only with the set of ids seen). Iterate
    it; afterwards `problems` lists what was skipped and why, `count` how many prompts were yielded.
    A row whose id an earlier row already had is skipped and reported with both line numbers ("same
    id as line 3" / "same prompt as line 3"); rows with distinct ids are all kept, even with equal
    prompts. Malformed rows (bad JSON, bad fields, bytes that are not UTF-8) are reported with file
    and line and skipped."""

    spec: DatasetSpec
    problems: list[Problem] = field(default_factory=list)
    count: int = 0

    def __iter__(self) -> Iterator[Prompt]:
        self.problems.clear()
        self.count = 0
        path = Path(self.spec.path)
        if not path.is_file():
            raise FileNotFoundError(f"dataset {self.spec.name!r}: file not found: {path}")
        seen: dict[str, int] = {}
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = _decode(raw)
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ValueError("row is not a JSON object")
                    messages = prompt_of(row_messages(row))
                    phash = prompt_hash(messages)
                    rid = row.get("id")
                    what = "id"
                    if rid is None:
                        rid, what = phash, "prompt"
                    elif not isinstance(rid, (str, int)) or isinstance(rid, bool) or str(rid) == "":
                        raise ValueError(f"field 'id' must be a non-empty string or int, got {rid!r}")
                    rid = str(rid)
                    if rid in seen:
                        raise ValueError(f"duplicate: same {what} as line {seen[rid]}, skipped")
                except (ValueError, json.JSONDecodeError) as e:
                    self.problems.append(Problem(str(path), lineno, str(e)))
                    continue
                seen[rid] = lineno
                self.count += 1
                yield Prompt(rid, self.spec.name, messages, lineno, phash)

    def summary(self) -> str:
        if not self.problems:
            return f"{self.spec.name}: {self.count} prompts"
        head = "; ".join(str(p) for p in self.problems[:5])
        more = f" (+{len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        return f"{self.spec.name}: {self.count} prompts, {len(self.problems)} rows skipped: {head}{more}"
