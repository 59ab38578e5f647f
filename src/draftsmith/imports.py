"""Responses generated elsewhere (the user's own SGLang or vLLM, another pipeline): the import shape
stage 03 reads beside stage 02's files, so such data joins the training set without being paid for
twice.

An import file is JSONL, one answered prompt a line (fields at `to_raw`; docs/sources.md). Each
line is translated into the shape of stage 02's `raw_responses.jsonl` lines, so both are read and
checked by one parser (`tokens.Response.parse`); any unknown key is an error.

`draftsmith import-sglang IN OUT` (`convert_sglang`) writes such a file from answers saved from
SGLang's native `/generate`: per line the prompt (`messages` or ShareGPT `conversations`; optional
`id` and `input_ids`) and the answer at the top level or under `response` (`text`, `output_ids`,
`meta_info.finish_reason.type`). The text splits into reasoning and answer at the first `</think>`;
the ids are kept as sampled. A line that fails the import checks is named `file:line: reason` and
skipped; OUT is written whole, or not at all when no line converts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .datasets import row_messages, stable_id
from .files import replacing
from .paths import resolve

FIELDS = {"id", "messages", "reasoning", "answer", "finish_reason", "output_ids", "prompt_ids", "source", "meta"}
FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class ImportSpec:
    """One entry of the `imports` parameter: a file of answers to prompts of dataset `name`."""

    name: str
    path: str
    index: int  # position in `imports`: the order in which sources are preferred

    @property
    def unit(self) -> str:
        return f"import-{self.index}"


def parse_imports(entries: list, dataset_names: list[str]) -> list[ImportSpec]:
    """Check the `imports` parameter: a list of {name, path}, each naming one of `dataset_names`."""
    if not isinstance(entries, list):
        raise ValueError(f"imports: must be a list of {{name, path}}, got {type(entries).__name__}")
    specs = []
    for i, e in enumerate(entries):
        where = f"imports[{i}]"
        if not isinstance(e, dict):
            raise ValueError(f"{where}: must be a mapping with name and path, got {e!r}")
        unknown = set(e) - {"name", "path"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; an import is {{name, path}}")
        for key in ("name", "path"):
            if not isinstance(e.get(key), str) or not e[key]:
                raise ValueError(f"{where}: field {key!r} must be a non-empty string, got {e.get(key)!r}")
        if e["name"] not in dataset_names:
            raise ValueError(f"{where}: dataset {e['name']!r} is not one of datasets {dataset_names}; add it there "
                             f"(its path may be this import file: its messages are the prompts)")
        path = resolve(e["path"])
        if not path.is_file():
            raise FileNotFoundError(f"{where}: import file of dataset {e['name']!r} not found: {path}")
        specs.append(ImportSpec(e["name"], str(path), i))
    paths = [s.path for s in specs]
    if len(set(paths)) != len(paths):
        raise ValueError(f"imports: a file is listed twice: {sorted(p for p in paths if paths.count(p) > 1)}")
    return specs


def _ids(row: dict, key: str) -> list[int] | None:
    v = row.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(type(t) is int and t >= 0 for t in v):
        raise ValueError(f"field {key!r} must be a non-empty list of non-negative token ids")
    return v


def to_raw(row, dataset: str) -> dict:
    """An import line as a stage-02 line; raises ValueError naming the field. The fields:

      id             optional  the sample id; without it a hash of the prompt, as for prompt datasets
      messages       required  the prompt, [{role, content}], ending with the user turn that was answered
      reasoning      optional  the reasoning text (null or "" when there is none)
      answer         required  the answer text
      finish_reason  optional  "stop" (default) or "length" (cut off: no end-of-turn token)
      output_ids     optional  the token ids the engine sampled; when present they are the truth
      prompt_ids     optional  the token ids of the prompt as the engine read it
      source         required  where the answers came from, e.g. "sglang-h100"
      meta           optional  anything else; not read

    Any other key is an error (a misspelt "reasonning" would otherwise lose the reasoning silently)."""
    if not isinstance(row, dict):
        raise ValueError("line is not a JSON object")
    unknown = set(row) - FIELDS
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}; an import line has {sorted(FIELDS)}")
    messages = row_messages(row) if "messages" in row else None
    if not messages:
        raise ValueError("field 'messages' must be a non-empty list of {role, content}: the prompt")
    if messages[-1]["role"] != "user":
        raise ValueError("field 'messages' must end with the user turn that was answered (the reply goes in 'answer')")
    source = row.get("source")
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"field 'source' must be a non-empty string naming where the answer came from, got {source!r}")
    if not isinstance(row.get("answer"), str):
        raise ValueError(f"field 'answer' must be a string, got {type(row.get('answer')).__name__}")
    reasoning = row.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"field 'reasoning' must be a string or null, got {type(reasoning).__name__}")
    finish = row.get("finish_reason", "stop")
    if finish not in FINISH_REASONS:
        raise ValueError(f"field 'finish_reason' must be one of {FINISH_REASONS}, got {finish!r}")
    sid = row.get("id")
    if sid is None:
        sid = stable_id(messages)
    elif not isinstance(sid, (str, int)) or isinstance(sid, bool) or str(sid) == "":
        raise ValueError(f"field 'id' must be a non-empty string or int, got {sid!r}")
    return {"sample_id": str(sid), "dataset": dataset, "messages": messages, "reasoning": reasoning,
            "content": row["answer"], "finish_reason": finish, "provider": source.strip(), "source": source.strip(),
            "output_ids": _ids(row, "output_ids"), "prompt_ids": _ids(row, "prompt_ids")}


def source_files(raw: Path, name: str, imports: list[ImportSpec]) -> list[tuple[str, Path]]:
    """(unit, file) of every source of dataset `name`, in the order sources are preferred: stage
    02's own responses (`raw`, its raw_responses file of `name`) first, then the imports in the order listed."""
    units = []
    if raw.is_file():
        units.append(("generate", raw))
    units += [(s.unit, Path(s.path)) for s in imports if s.name == name]
    if not units:
        raise FileNotFoundError(f"dataset {name!r}: {raw} not found and no import names it; run stage 02 "
                                f"(generate) first, or list a file of its answers in imports")
    return units


def answered(specs: list[ImportSpec], name: str) -> set[str]:
    """Sample ids and prompt hashes that the import files of dataset `name` answer: stage 02 does
    not ask for them again. Lines stage 03 would reject are not counted as answers."""
    import json

    out: set[str] = set()
    for spec in specs:
        if spec.name != name:
            continue
        with open(spec.path, "rb") as f:
            for raw in f:
                try:
                    row = to_raw(json.loads(raw), name)
                except ValueError:
                    continue
                out.add(row["sample_id"])
                out.add(stable_id(row["messages"]))
    return out


# ---- SGLang's /generate records as an import file -----------------------------------------------
END_OF_THINKING = "</think>"
SGLANG_FINISH = {"stop": "stop", "length": "length"}   # SGLang's `abort` is no answer


def sglang_import_line(row, source: str) -> dict:
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
    if kind not in SGLANG_FINISH:
        raise ValueError(f"meta_info.finish_reason {finish!r}: only stop or length answers can be imported")
    text = answer["text"]
    reasoning, sep, rest = text.partition(END_OF_THINKING)
    line = {"messages": row_messages(row), "reasoning": reasoning.removeprefix("<think>") if sep else None,
            "answer": rest.lstrip("\n") if sep else text, "finish_reason": SGLANG_FINISH[kind], "source": source}
    if "id" in row:
        line["id"] = row["id"]
    if answer.get("output_ids") is not None:
        line["output_ids"] = answer["output_ids"]
        if row.get("input_ids") is not None:
            line["prompt_ids"] = row["input_ids"]
    to_raw(line, "import")      # the checks stage 03 will make, now
    return line


def convert_sglang(src: Path, dst: Path, source: str = "sglang") -> tuple[int, list[str]]:
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
                line = sglang_import_line(json.loads(raw), source)
            except ValueError as e:        # json.JSONDecodeError included
                problems.append(f"{src}:{n}: {e}")
                continue
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            written += 1
        if not written:     # nothing is written then
            raise ValueError(f"import-sglang: no line of {src} could be converted; first: "
                             f"{'; '.join(problems[:3]) or 'the file is empty'}")
    return written, problems
