"""Mistakes caught before stage 01 spends, through `draftsmith run ... -f params/smoke.yaml`: names
that are paths, import files that are missing or hold no usable answer, import paths resolved by
another rule than the datasets', an empty key file with the local emulator, two datasets on one
file. Each message names the true source of the value: the params file, or `-p KEY`."""

import json

import pytest
import yaml

from draftsmith import cli
from draftsmith.paths import REPO_ROOT

pytestmark = pytest.mark.unit

SMOKE = str(REPO_ROOT / "params" / "smoke.yaml")
CODE = REPO_ROOT / "data" / "demo" / "code.jsonl"


@pytest.fixture
def at_repo(monkeypatch):
    """smoke.yaml's dataset paths are relative: run where a user runs it, the repository root."""
    monkeypatch.chdir(REPO_ROOT)


def refused(capsys, *args) -> str:
    """Run `draftsmith run all` with `args`; it must exit 2 (a parameter error, nothing run) in
    one message without a traceback. Returns that message."""
    assert cli.main(["run", "all", "-f", SMOKE, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftsmith: parameter error:") and "nothing was run" in err and "Traceback" not in err
    return err


def test_a_dataset_name_that_is_a_path_stops_the_run_before_anything_is_written(tmp_path, capsys, at_repo):
    out = tmp_path / "out"
    datasets = json.dumps([{"name": "../x", "path": str(CODE)}])
    err = refused(capsys, "-p", "outputs_dir", str(out), "-p", "datasets", datasets)
    assert "-p datasets: datasets[0] name '../x': use letters, digits" in err
    assert not out.exists() and not (tmp_path / "x").exists()
    f = tmp_path / "p.yaml"  # from a params file: the file is named, and every bad name is listed
    f.write_text(yaml.safe_dump({"run_name": "r", "outputs_dir": str(out),
                                 "datasets": [{"name": "team/code", "path": str(CODE)},
                                              {"name": "..", "path": str(CODE)}, {"name": "ok-1.v2", "path": str(CODE)}]}))
    assert cli.main(["run", "02", "-f", str(f), "--check"]) == 2
    err = capsys.readouterr().err
    assert f"{f}: datasets[0] name 'team/code'" in err and f"{f}: datasets[1] name '..'" in err and "ok-1.v2" not in err
    assert not out.exists()


def test_a_run_name_with_a_slash_is_blamed_on_run_name_not_on_outputs_dir(tmp_path, capsys, at_repo):
    out = tmp_path / "out"
    err = refused(capsys, "-p", "outputs_dir", str(out), "-p", "run_name", "a/b")
    assert "-p run_name: run_name 'a/b': use letters, digits" in err and "-p outputs_dir" not in err
    assert not out.exists()


def test_a_missing_import_file_stops_the_run_before_stage_01_pays(tmp_path, capsys, at_repo):
    out = tmp_path / "out"
    imports = json.dumps([{"name": "code", "path": "missing.jsonl"}])
    err = refused(capsys, "-p", "outputs_dir", str(out), "-p", "imports", imports)
    assert f"-p imports: imports[0]: import file of dataset 'code' not found: {REPO_ROOT / 'missing.jsonl'}" in err
    assert not out.exists()  # no providers/, no emulator ledger: nothing was asked for or paid


def test_an_import_file_without_a_usable_answer_is_named_with_its_first_bad_line(tmp_path, capsys, at_repo):
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "answer": "yes"}) + "\n{oops\n")
    err = refused(capsys, "-p", "outputs_dir", str(tmp_path / "out"),
                  "-p", "imports", json.dumps([{"name": "chat", "path": str(answers)}]))
    assert f"-p imports: imports[0] 'chat': no usable answer in {answers}; skipped: {answers}:1: field 'source'" in err
    assert "(+1 more)" in err


def test_relative_import_paths_resolve_from_where_draftsmith_runs_as_dataset_paths_do(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prompt = [{"role": "user", "content": "hi"}]
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"messages": prompt}) + "\n")
    (tmp_path / "answers.jsonl").write_text(json.dumps({"messages": prompt, "answer": "hello", "source": "mine"}) + "\n")
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"run_name": "r", "outputs_dir": "out",
                                 "datasets": [{"name": "d", "path": "prompts.jsonl"}],
                                 "imports": [{"name": "d", "path": "answers.jsonl"}]}))
    assert cli.main(["run", "02,03", "-f", str(f), "--check"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith(("datasets =", "imports ="))]
    assert f"'path': {str(tmp_path / 'prompts.jsonl')!r}" in lines[0]
    assert lines[1] == f"    imports = [{{'name': 'd', 'path': {str(tmp_path / 'answers.jsonl')!r}}}]  # {f}"


def test_two_datasets_reading_one_file_warn_in_one_line_and_still_run(tmp_path, capsys, at_repo):
    datasets = [{"name": "a", "path": "data/demo/code.jsonl"}, {"name": "b", "path": "./data/demo/../demo/code.jsonl"},
                {"name": "c", "path": "data/demo/chat.jsonl"}]
    assert cli.main(["run", "02", "-f", SMOKE, "--check", "-p", "outputs_dir", str(tmp_path),
                     "-p", "datasets", json.dumps(datasets)]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert warnings == [f"draftsmith: warning: -p datasets: datasets ['a', 'b'] read the same file {CODE}: each of "
                        f"its prompts is asked, and paid for, once per dataset"]


def test_an_empty_key_file_with_the_local_emulator_stops_the_run_before_stage_01(tmp_path, capsys, at_repo):
    out, key = tmp_path / "out", tmp_path / "openrouter.key"
    key.write_text("\n")
    err = refused(capsys, "-p", "outputs_dir", str(out), "-p", "api_key_file", str(key))
    assert f"-p api_key_file: api_base is 'local': api_key_file {str(key)!r} must hold exactly one key" in err
    assert not out.exists()
    key.write_text("sk-or-v1-secret and-more\n")  # two words: refused, and neither is shown
    err = refused(capsys, "-p", "outputs_dir", str(out), "-p", "api_key_file", str(key))
    assert "must hold exactly one key" in err and "secret" not in err and "and-more" not in err


def test_a_bad_dataset_given_with_p_is_blamed_on_p_not_on_the_params_file(capsys, at_repo):
    assert cli.main(["run", "02", "-f", SMOKE, "--check", "-p", "datasets", "[{name: a}]"]) == 2
    err = capsys.readouterr().err
    assert "-p datasets: datasets[0]: dataset field 'path'" in err and "smoke.yaml" not in err


def test_several_nodes_without_a_rendezvous_endpoint_stop_before_anything_runs(tmp_path, capsys, at_repo):
    err = refused(capsys, "-p", "outputs_dir", str(tmp_path / "out"), "-p", "nnodes", "2")
    assert "rdzv_endpoint must be host:port" in err and not (tmp_path / "out").exists()
    err = refused(capsys, "-p", "outputs_dir", str(tmp_path / "out"), "-p", "nnodes", "0")
    assert "-p nnodes: nnodes must be at least 1" in err
