"""draftsmith.files: files handed between stages are written whole or not at all, and read back
leaving out only a torn last line."""

import json

import pytest

from draftsmith.files import read_jsonl, replacing, write_json_atomic

pytestmark = pytest.mark.unit


def test_replacing_keeps_the_old_file_when_the_writer_fails(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"x": 1}\n')
    with pytest.raises(RuntimeError):
        with replacing(p) as tmp:
            tmp.write_text('{"x": 2}\n{"x"')
            raise RuntimeError("killed")
    assert [o for _, o in read_jsonl(p)] == [{"x": 1}] and not list(tmp_path.glob("*.tmp"))
    with replacing(p) as tmp:
        with open(tmp, "w") as f:
            f.write('{"x": 3}\n')
    assert [o for _, o in read_jsonl(p)] == [{"x": 3}]
    write_json_atomic(tmp_path / "b.json", {"é": [1]})
    assert json.loads((tmp_path / "b.json").read_text(encoding="utf-8")) == {"é": [1]}


def test_a_torn_last_line_is_left_out_and_other_damage_is_named_by_file_and_line(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3')
    assert [(n, o) for n, o in read_jsonl(p)] == [(1, {"a": 1}), (3, {"a": 2})]
    p.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(ValueError, match=r"r\.jsonl:2: not valid JSON"):
        list(read_jsonl(p))
