"""The responses stage 03 rebuilds: a line of stage 02's saved responses or of an import file,
parsed into the fields reconstruction and checks use. A line that cannot be used becomes a `BadLine`
whose message names the field; the stage skips it and reports it as file:line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..generate import outputs as generate_outputs
from ..imports import to_raw
from ..paths import Run


class BadLine(ValueError):
    """A response line that cannot be used; the message names the field."""


@dataclass
class Response:
    """The fields of a response line that reconstruction and checks use."""

    sample_id: str
    dataset: str
    provider: str
    generation_id: str | None
    messages: list[dict]
    reasoning: str          # "" when absent, null or empty
    content: str            # "" when null
    finish_reason: str | None
    billed_prompt: int | None
    billed_completion: int | None
    billed_reasoning: int | None
    reasoning_excluded: bool  # the request asked the provider to leave the reasoning out of the reply
    reasoning_disabled: bool  # the request turned reasoning off: the prompt closes it, the reply is the answer
    source: str = "openrouter"  # where the answer came from (see `sources`)
    imported: bool = False      # read from an import file, not from stage 02's responses
    output_ids: list[int] | None = None  # the ids the engine sampled, when it returned them: the truth
    prompt_ids: list[int] | None = None  # the prompt ids the engine read, when it returned them
    prompt: str | None = None  # the rendered prompt, once rendered
    tool_calls: list[dict] | None = None  # the message's tool calls (OpenAI shape), when it made any

    @property
    def expects_usage(self) -> bool:
        """Whether the line should carry token counts to check against: stage 02's lines without
        saved ids (an import has no usage; saved ids are checked against the text instead)."""
        return not self.imported and self.output_ids is None

    @classmethod
    def parse(cls, row: dict, imported: bool = False) -> "Response":
        if not isinstance(row, dict):
            raise BadLine("line is not a JSON object")
        sid = row.get("sample_id")
        if not isinstance(sid, (str, int)) or isinstance(sid, bool) or sid == "":
            raise BadLine(f"field 'sample_id' must be a non-empty string, got {sid!r}")
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
            raise BadLine("field 'messages' must be a non-empty list of {role, content} objects with string values")
        texts = {}
        for key in ("reasoning", "content"):
            v = row.get(key)
            if v is not None and not isinstance(v, str):
                raise BadLine(f"field {key!r} must be a string or null, got {type(v).__name__}")
            texts[key] = v or ""
        usage = row.get("usage") or {}
        if not isinstance(usage, dict):
            raise BadLine("field 'usage' must be an object")
        counts = {}
        for key in ("prompt_tokens", "completion_tokens", "reasoning_tokens"):
            v = usage.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise BadLine(f"field 'usage.{key}' must be a non-negative integer, got {v!r}")
            counts[key] = v
        request = row.get("request") if isinstance(row.get("request"), dict) else {}
        opts = request.get("reasoning") if isinstance(request.get("reasoning"), dict) else {}
        excluded = bool(opts.get("exclude")) or request.get("include_reasoning") is False
        disabled = opts.get("enabled") is False or opts.get("effort") == "none"
        ids = {}
        for key in ("output_ids", "prompt_ids"):
            v = row.get(key)
            if v is not None and (not isinstance(v, list) or not v or not all(type(t) is int and t >= 0 for t in v)):
                raise BadLine(f"field {key!r} must be a non-empty list of non-negative token ids")
            ids[key] = v
        if ids["prompt_ids"] is not None and ids["output_ids"] is None:
            raise BadLine("field 'prompt_ids' without 'output_ids': save both or neither")
        if ids["output_ids"] is not None:  # the ids are the truth; the engine's counts are theirs
            counts = dict.fromkeys(counts)
        calls = row.get("tool_calls") or None
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)):
            raise BadLine("field 'tool_calls' must be a list of {id, type, function: {name, arguments}} objects")
        source = row.get("source") or "openrouter"  # stage 02 lines written before sources existed
        if not isinstance(source, str):
            raise BadLine(f"field 'source' must be a string, got {type(source).__name__}")
        return cls(str(sid), str(row.get("dataset") or ""), str(row.get("provider") or source),
                   row.get("generation_id"), msgs, texts["reasoning"], texts["content"],
                   row.get("finish_reason"), counts["prompt_tokens"], counts["completion_tokens"],
                   counts["reasoning_tokens"], excluded, disabled, source, imported,
                   ids["output_ids"], ids["prompt_ids"], tool_calls=calls)


def read_responses(run: Run, dataset: str, unit: str, path: Path):
    """(line number, Response or BadLine) per line of one source of `dataset`. Stage 02's responses
    (`unit` "generate") come through stage 02's own reader: a torn last line (a run still writing,
    or killed) is left out, a line that is not JSON is an error naming file:line. An import file
    (`path`) is the user's: every line that cannot be used, torn last line included, is reported."""
    if unit == "generate":
        for lineno, row in generate_outputs.read_responses(run, dataset):
            yield lineno, _parse(row, None)
        return
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if not raw.endswith(b"\n"):
                yield lineno, BadLine("torn last line (no newline)")
                return
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield lineno, BadLine(f"not valid JSON: {e}")
                continue
            yield lineno, _parse(row, dataset)


def _parse(row, import_of: str | None) -> Response | BadLine:
    try:
        if import_of is not None:
            row = to_raw(row, import_of)
        return Response.parse(row, imported=import_of is not None)
    except BadLine as e:
        return e
    except ValueError as e:  # the import shape
        return BadLine(str(e))
