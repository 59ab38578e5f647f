"""Stage 03's outputs read back the way stage 04 reads them: one reader, damage named by file:line."""

import json

import pytest

from draftsmith.paths import Run
from draftsmith.tokens import read_report, read_tokens, token_files

pytestmark = pytest.mark.unit


def test_bad_token_lines_are_errors_naming_file_and_line(tmp_path):
    ok = {"sample_id": "a", "dataset": "d", "input_ids": [0, 5, 1], "loss_mask": [0, 1, 1]}
    cases = {
        "{not json": "not valid JSON",
        json.dumps({**ok, "loss_mask": [0, 1]}): "'loss_mask' must be",
        json.dumps({**ok, "input_ids": []}): "'input_ids' must be",
        json.dumps({**ok, "sample_id": ""}): "'sample_id'",
        json.dumps({**ok, "input_ids": [0, 5, 10**6]}): "outside the target's vocabulary",
        json.dumps(ok): "sample 'a' of dataset 'd' already appeared at .*:1",
    }
    for bad, msg in cases.items():
        f = tmp_path / "d.jsonl"
        f.write_text(json.dumps(ok) + "\n" + json.dumps({**ok, "sample_id": "x", "excluded": True, "input_ids": []})
                     + "\n" + bad + "\n")
        with pytest.raises(ValueError, match=rf"{f}:3: .*{msg}"):
            read_tokens([f], vocab_size=1000)
    f.write_text(json.dumps(ok) + "\n\n" + json.dumps({**ok, "sample_id": "x", "excluded": True}) + "\n")
    assert [s.sample_id for s in read_tokens([f], 1000)] == ["a"]


def test_token_files_name_the_missing_dataset_and_the_stage_to_run(tmp_path):
    run = Run(tmp_path, "r")
    with pytest.raises(FileNotFoundError, match=r"tokens/missing\.jsonl: not found \(run stage 03"):
        token_files(run, [{"name": "missing"}])
    with pytest.raises(FileNotFoundError, match="no tokens/<dataset>.jsonl files"):
        token_files(run)
    (run.dir("tokens") / "b.jsonl").write_text("")
    (run.dir("tokens") / "a.jsonl").write_text("")
    assert [f.name for f in token_files(run)] == ["a.jsonl", "b.jsonl"]
    assert [f.name for f in token_files(run, ["b"])] == ["b.jsonl"]


def test_a_missing_report_names_the_file_and_the_stage_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokens/report\.json: not found \(run stage 03"):
        read_report(Run(tmp_path, "r"))
