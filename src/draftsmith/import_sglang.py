"""`draftsmith import-sglang IN OUT`: answers saved from SGLang's native `/generate` as an import file
(imports.py, docs/sources.md), so an earlier run on your own server joins the training set unpaid.

IN is JSONL, one answered prompt a line: the prompt (`messages`, or ShareGPT `conversations`; an
optional `id`; optional `input_ids`, the prompt's ids as sent) with SGLang's `/generate` answer
either at the top level or under `response`: `text`, `output_ids`, `meta_info.finish_reason.type`.
The text is split into reasoning and answer at the first `</think>` (Kimi-K2.5's end of thinking;
when the server stripped it, the whole text is the answer). The ids are kept as sampled, and
stage 03 trains on them. Each written line goes through the import checks (`imports.to_raw`); a
line that fails them is named as `file:line: reason` and skipped; OUT is written whole or not at
all (not at all when no line converts).
"""

from __future__ import annotations

import json
from pathlib import Path

from .datasets import row_messages
from .files import replacing
from .imports import to_raw

END_OF_THINKING = "</think>"
FINISH = {"stop": "stop", "length": "length"}   # SGLang's `abort` is no answer


def import_line(row, source: str) -> dict:
    """One SGLang record as an import line; raises ValueError naming the field."""
    if not isinstance(row, dict):
        raise ValueError("line is not a JSON object")
    answer = row.get("response", row)
    if not isinstance(answer, dict) or not isinstance(answer.get("text"), str):
        raise ValueError("no SGLang answer: expected `text` (and `output_ids`, `meta_info`) at the top level "
                         "or under `response`")
    meta = answer.get("meta_info") if isinstance(answer.get("meta_info"), dict) else {}
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in FINISH:
        raise ValueError(f"meta_info.finish_reason {finish!r}: only stop or length answers can be imported")
    text = answer["text"]
    reasoning, sep, rest = text.partition(END_OF_THINKING)
    line = {"messages": row_messages(row), "reasoning": reasoning.removeprefix("<think>") if sep else None,
            "answer": rest.lstrip("\n") if sep else text, "finish_reason": FINISH[kind], "source": source}
    if "id" in row:
        line["id"] = row["id"]
    if answer.get("output_ids") is not None:
        line["output_ids"] = answer["output_ids"]
        if row.get("input_ids") is not None:
            line["prompt_ids"] = row["input_ids"]
    to_raw(line, "import")      # the checks stage 03 will make, now
    return line


def convert(src: Path, dst: Path, source: str = "sglang") -> tuple[int, list[str]]:
    """Write the import file `dst` from the SGLang records in `src`: (lines written, problems)."""
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise FileNotFoundError(f"import-sglang: {src} not found")
    if src.resolve() == dst.resolve():
        raise ValueError(f"import-sglang: OUT must be another file than IN ({src})")
    written, problems = 0, []
    with replacing(dst) as tmp, open(src, "rb") as f, open(tmp, "w", encoding="utf-8") as out:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                line = import_line(json.loads(raw), source)
            except ValueError as e:        # json.JSONDecodeError included
                problems.append(f"{src}:{n}: {e}")
                continue
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            written += 1
        if not written:     # nothing is written then
            raise ValueError(f"import-sglang: no line of {src} could be converted; first: "
                             f"{'; '.join(problems[:3]) or 'the file is empty'}")
    return written, problems
