"""`draftsmith import-sglang IN OUT`: answers saved from SGLang's /generate become an import file that
stage 02 skips and stage 03 reads (its output_ids kept as sampled); bad lines are named and skipped."""

from __future__ import annotations

import json

from draftsmith import cli
from draftsmith.imports import answered, parse_imports, to_raw

import pytest

pytestmark = pytest.mark.unit

PROMPT = [{"role": "user", "content": "What is 2+2?"}]


def sglang(text, ids, finish="stop"):
    return {"text": text, "output_ids": ids,
            "meta_info": {"id": "abc", "finish_reason": {"type": finish, "matched": 163586}, "prompt_tokens": 9,
                          "completion_tokens": len(ids)}}


def test_sglang_answers_become_an_import_file_and_bad_lines_are_named(tmp_path, capsys):
    src, dst = tmp_path / "b1.generate.jsonl", tmp_path / "b1.import.jsonl"
    lines = [
        {"id": "q1", "messages": PROMPT, "input_ids": [5, 6, 7], "response": sglang("Easy.</think>\n4", [11, 12, 13])},
        {"id": "q2", "messages": PROMPT + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "x2?"}],
         **sglang("8", [14, 15], "length")},
        {"id": "q3", "messages": PROMPT, "response": sglang("", [1], "abort")},
        {"id": "q4", "messages": PROMPT},
    ]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n{not json\n")
    assert cli.main(["import-sglang", str(src), str(dst), "--source", "sglang-h100"]) == 0
    err = capsys.readouterr().err
    assert f"{src}:3: meta_info.finish_reason" in err and f"{src}:4: no SGLang answer" in err and f"{src}:5:" in err
    assert "wrote 2 answers" in err and "skipped 3 lines" in err
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert out[0] == {"messages": PROMPT, "reasoning": "Easy.", "answer": "4", "finish_reason": "stop",
                      "source": "sglang-h100", "id": "q1", "output_ids": [11, 12, 13], "prompt_ids": [5, 6, 7]}
    assert (out[1]["reasoning"], out[1]["answer"], out[1]["finish_reason"]) == (None, "8", "length")
    assert "prompt_ids" not in out[1]
    # what stage 03 reads, and what stage 02 skips
    raws = [to_raw(x, "B1") for x in out]
    assert [r["output_ids"] for r in raws] == [[11, 12, 13], [14, 15]]
    specs = parse_imports([{"name": "B1", "path": str(dst)}], ["B1"])
    assert {"q1", "q2"} <= answered(specs, "B1")


def test_nothing_convertible_fails_and_in_place_is_refused(tmp_path, capsys):
    src = tmp_path / "x.jsonl"
    src.write_text(json.dumps({"messages": PROMPT}) + "\n")
    assert cli.main(["import-sglang", str(src), str(tmp_path / "y.jsonl")]) == 1
    assert "no line of" in capsys.readouterr().err and not (tmp_path / "y.jsonl").exists()
    assert cli.main(["import-sglang", str(src), str(src)]) == 1
    assert "another file than IN" in capsys.readouterr().err
    assert json.loads(src.read_text()) == {"messages": PROMPT}       # the input is never touched
    assert cli.main(["import-sglang", str(tmp_path / "missing.jsonl"), str(tmp_path / "z.jsonl")]) == 1
