"""Foundation: datasets, API key handling, progress lines, the tiny target and its chat template."""

import json
import os
import pickle
import subprocess

import pytest

from draftsmith.openrouter import apikey
from draftsmith import datasets, progress
from draftsmith.datasets import DatasetReader, DatasetSpec
from draftsmith.paths import REPO_ROOT as REPO
from draftsmith.targets import tiny
from draftsmith.targets.checkpoint import resolve_target

from conftest import wait_until

pytestmark = pytest.mark.unit


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return path


def test_dataset_reader_accepts_both_formats_and_cuts_at_last_user_turn(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "a", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
                                 {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                                 {"role": "assistant", "content": "old answer"}]},
        {"id": 7, "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    ])
    got = list(DatasetReader(DatasetSpec("d", str(p))))
    assert [g.sample_id for g in got] == ["a", "7"]
    assert got[0].messages[-1] == {"role": "user", "content": "q2"} and len(got[0].messages) == 4
    assert got[1].messages == [{"role": "user", "content": "hi"}]


def test_dataset_reader_reports_malformed_rows_with_file_and_line_and_skips_them(tmp_path):
    p = write_jsonl(tmp_path / "bad.jsonl", [
        {"id": "ok", "messages": [{"role": "user", "content": "fine"}]},
        "{not json",
        {"id": "x", "messages": [{"role": "robot", "content": "?"}]},
        {"id": "y", "messages": [{"role": "assistant", "content": "no user"}]},
        {"id": "ok", "messages": [{"role": "user", "content": "dup"}]},
        {"conversations": [{"from": "alien", "value": "?"}]},
    ])
    r = DatasetReader(DatasetSpec("bad", str(p)))
    assert [g.sample_id for g in r] == ["ok"]
    lines = {pr.line: pr.reason for pr in r.problems}
    assert sorted(lines) == [2, 3, 4, 5, 6]
    assert "messages[0].role" in lines[3] and "no user turn" in lines[4] and "same id as line 1" in lines[5]
    assert str(r.problems[0]).startswith(f"{p}:2:")
    assert "5 rows skipped" in r.summary()


def test_non_utf8_rows_and_repeated_prompts_are_skipped_and_named_by_the_users_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "caf\u00e9"}]}, ensure_ascii=False)
    p.write_bytes(good.encode() + b"\n" + b'{"id": "z", "messages": [{"role": "user", "content": "caf\xe9"}]}\n'
                  + good.encode() + b"\n" + b'{"id": "k", "messages": [{"role": "user", "content": "caf\xc3\xa9"}]}\n')
    r = DatasetReader(DatasetSpec("d", str(p)))
    assert [g.line for g in r] == [1, 4]  # distinct ids keep an equal prompt
    assert [str(x) for x in r.problems] == [f"{p}:2: not UTF-8 text: byte 0xe9 at column 58",
                                            f"{p}:3: duplicate: same prompt as line 1, skipped"]


def test_rows_without_id_get_a_stable_content_hash(tmp_path):
    row = {"messages": [{"role": "user", "content": "same"}]}
    a = list(DatasetReader(DatasetSpec("d", str(write_jsonl(tmp_path / "a.jsonl", [row])))))
    b = list(DatasetReader(DatasetSpec("d", str(write_jsonl(tmp_path / "b.jsonl", [row])))))
    assert a[0].sample_id == b[0].sample_id == datasets.stable_id(row["messages"])


def test_relative_dataset_paths_are_taken_from_the_repository_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Jupyter starts a kernel in the notebook's folder, not the repo root
    spec, = datasets.parse_datasets([{"name": "code", "path": "data/demo/code.jsonl"}])
    assert spec.path == str(REPO / "data/demo/code.jsonl") and next(iter(DatasetReader(spec))).line == 1


def test_dataset_spec_errors_name_the_field():
    with pytest.raises(ValueError, match=r"datasets\[1\].*output_token_budget"):
        datasets.parse_datasets([{"name": "a", "path": "x"}, {"name": "b", "path": "y", "output_token_budget": -1}])
    with pytest.raises(ValueError, match="unknown keys"):
        datasets.parse_datasets([{"name": "a", "path": "x", "budget": 3}])


def test_api_key_comes_from_file_or_env_and_never_shows(tmp_path, monkeypatch, api_key_file):
    path, key = api_key_file
    k = apikey.read_api_key(path)
    assert k.reveal() == key and k.header()["Authorization"] == f"Bearer {key}"
    for shown in (repr(k), str(k), f"{k}", f"{k!r}", str([k]), str({"k": k})):
        assert key not in shown
    with pytest.raises(TypeError):
        pickle.dumps(k)
    monkeypatch.setenv(apikey.ENV_VAR, key)
    assert apikey.read_api_key(None).reveal() == key
    monkeypatch.delenv(apikey.ENV_VAR)
    with pytest.raises(RuntimeError, match=apikey.ENV_VAR):
        apikey.read_api_key(None)
    with pytest.raises(FileNotFoundError, match="missing.key"):
        apikey.read_api_key(tmp_path / "missing.key")


def test_progress_under_papermill_prints_plain_lines(monkeypatch, capsys):
    monkeypatch.setenv("DRAFTSMITH_PROGRESS", "log")
    with progress.Progress(total=100, desc="gen", unit="tok", interval=0) as p:
        p.set(spend=0.5)
        p.update(40)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("[gen] 40/100 tok (40%)") and "spend=0.50" in out[0]
    assert "\r" not in "".join(out)


def test_tiny_target_round_trips_through_from_pretrained(tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    tok = AutoTokenizer.from_pretrained(tiny_target)
    assert model.config.vocab_size == len(tok) == 129280
    assert model.config.num_hidden_layers == 8
    assert tok.chat_template == tiny.CHAT_TEMPLATE
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    meta = json.loads((tiny_target / "draftsmith_target.json").read_text())
    assert meta["variant"] == "tiny-test"


def test_chat_template_renders_multi_turn_with_thinking_exactly(target_tokenizer):
    tok = target_tokenizer
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "dropped in history"},
        {"role": "user", "content": "2+2?"},
    ]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert text == ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜><think></think>Hello!"
                    "<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜><think>")
    ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False)
    special = {0: "bos", 1: "eos", 128803: "user", 128804: "assistant", 128821: "think", 128822: "/think"}
    assert [special[i] for i in ids if i in special] == [
        "bos", "user", "assistant", "think", "/think", "eos", "user", "assistant", "think"]
    assert ids == tok.encode(text, add_special_tokens=False)
    # the final assistant turn keeps its reasoning; no system message -> the default one
    full = tok.apply_chat_template([{"role": "user", "content": "Q"},
                                    {"role": "assistant", "content": "A", "reasoning_content": "R"}],
                                   tokenize=False)
    assert full == (f"<｜begin▁of▁sentence｜>{tiny.DEFAULT_SYSTEM}<｜User｜>Q<｜Assistant｜>"
                    "<think>R</think>A<｜end▁of▁sentence｜>")


@pytest.mark.engine
def test_target_build_is_deterministic_for_a_seed(tmp_path, monkeypatch):
    import dataclasses

    from safetensors.torch import load_file

    monkeypatch.setitem(tiny.VARIANTS, "tiny-test",
                        dataclasses.replace(tiny.VARIANTS["tiny-test"], steps=2, seq_len=32))
    a = tiny.build_tiny_target("tiny-test", root=tmp_path / "a", log=lambda *x: None)
    b = tiny.build_tiny_target("tiny-test", root=tmp_path / "b", log=lambda *x: None)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    monkeypatch.undo()  # the cache holds the real tiny-test, never this 2-step one
    assert resolve_target("tiny-test") != a  # the cache is separate from explicit roots
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_target(tmp_path / "nowhere")


def test_waiting_for_another_process_building_the_target_is_never_silent(tmp_path):
    """A second builder (another notebook, another engineer's run) waits on the build lock and says
    so every interval, then reuses what the first one built."""
    import fcntl
    import threading

    out = tmp_path / tiny.variant_key("tiny-test")
    lines: list[str] = []
    with open(tmp_path / f".{out.name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the other process, mid-build
        waiter = threading.Thread(target=lambda: lines.append(
            tiny.build_tiny_target("tiny-test", root=tmp_path, log=lines.append)))
        waiter.start()
        wait_until(lambda: list(lines), what="the second builder saying it waits")
        out.mkdir()
        (out / "config.json").write_text("{}")  # the other process finishes
    waiter.join(60)
    assert not waiter.is_alive(), f"the second builder still waits after the lock was freed: {lines}"
    assert lines[0].startswith("[target build] waiting for another process building target 'tiny-test' (0s so "
                               "far; lock ")
    assert lines[-1] == out and any(str(x).startswith("[target build] done waiting") for x in lines)


@pytest.mark.engine
def test_an_interrupted_target_build_resumes_from_its_last_checkpoint_to_the_same_weights(tmp_path, monkeypatch):
    """Ctrl-C (here: raised where the build logs its step 4 of 6, just after the checkpoint there) keeps
    the checkpoint in the build's temporary folder; the next build trains only steps 5 and 6 and ends
    with the weights of a build that was never interrupted."""
    import dataclasses

    from safetensors.torch import load_file

    monkeypatch.setitem(tiny.VARIANTS, "tiny-test",
                        dataclasses.replace(tiny.VARIANTS["tiny-test"], steps=6, seq_len=32))
    whole = tiny.build_tiny_target("tiny-test", root=tmp_path / "whole", log=lambda *x: None, checkpoint_every=2)

    def ctrl_c_at_step_4(line):
        if "step 4/6" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tiny.build_tiny_target("tiny-test", root=tmp_path / "cut", log=ctrl_c_at_step_4, checkpoint_every=2)
    partial = tmp_path / "cut" / f".{tiny.variant_key('tiny-test')}.partial"
    assert (partial / tiny.TRAIN_CHECKPOINT).is_file()
    lines: list[str] = []
    resumed = tiny.build_tiny_target("tiny-test", root=tmp_path / "cut", log=lines.append, checkpoint_every=2)
    assert any(line.startswith("[target build]   resuming from the checkpoint at step 4 (") for line in lines), lines
    steps = [line.split()[3] for line in lines if " loss " in line]
    assert steps == ["5/6", "6/6"], lines
    wa, wb = load_file(whole / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    assert not partial.exists() and not (resumed / tiny.TRAIN_CHECKPOINT).exists()


def test_the_library_cites_only_documents_in_the_repository():
    """A user has the repository, not the notes it was written from: every document the library
    cites is under docs/ and exists."""
    import re

    cited = set()
    for path in (REPO / "src").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"reference/\w+\.md|\.\./shared", text), path
        cited |= set(re.findall(r"docs/[\w.-]+\.md", text))
    assert "docs/eagle3.md" in cited
    assert [c for c in sorted(cited) if not (REPO / c).is_file()] == []


def test_a_plain_http_engine_needs_no_key_but_openrouter_does(monkeypatch):
    from draftsmith.openrouter.apikey import ENV_VAR, api_key_for
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert "no key" in api_key_for("http://localhost:8000/v1").source
    with pytest.raises(RuntimeError, match="no API key"):
        api_key_for("https://openrouter.ai/api/v1")
    monkeypatch.setenv(ENV_VAR, "sk-or-v1-x")
    assert api_key_for("http://localhost:8000/v1").reveal() == "sk-or-v1-x"


def test_a_target_path_without_a_checkpoint_is_named_before_any_stage_starts(tmp_path, capsys):
    import yaml

    from draftsmith import cli

    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"outputs_dir": str(tmp_path / "out"), "target_model_path": str(tmp_path / "nowhere")}))
    assert cli.main(["run", "04", "-f", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"{f}: target_model_path '{tmp_path / 'nowhere'}': no config.json there; give a Hugging Face " \
           f"checkpoint folder or one of the built-in targets ['kimi-mini', 'kimi-mini-bf16', 'tiny', 'tiny-test']" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_a_checkpoint_fingerprint_follows_its_config_and_weights(tmp_path):
    """The one fingerprint (the target's identity in stage 04's index, an export's in stage 06)."""
    from draftsmith.targets.checkpoint import fingerprint

    (tmp_path / "config.json").write_text('{"hidden_size": 4}')
    (tmp_path / "model.safetensors").write_bytes(b"w" * 100)
    first = fingerprint(tmp_path)
    assert fingerprint(tmp_path) == first and len(first) == 16
    (tmp_path / "model.safetensors").write_bytes(b"w" * 99 + b"v")
    changed_weights = fingerprint(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 5}')
    assert len({first, changed_weights, fingerprint(tmp_path)}) == 3


def test_the_makefiles_recipes_keep_bytecode_where_the_environment_forbids_it():
    # pip installs the venv with --no-compile: with PYTHONDONTWRITEBYTECODE passed on, every process of
    # `make demo` and `make test` would compile every module it imports from source, every time
    probe = "probe:\n\t@$(PY) -c 'import sys; print(sys.dont_write_bytecode)'"
    r = subprocess.run(["make", "-s", "--eval", probe, "probe"], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", (r.stdout, r.stderr)


def test_the_tally_counts_each_expensive_step_by_kind_and_by_the_test_file_that_caused_it(tmp_path, monkeypatch):
    from draftsmith import progress

    path = tmp_path / "events.txt"
    monkeypatch.setenv(progress.EVENTS_ENV, str(path))
    for test, kinds in (("tests/test_a.py::test_x (setup)", ["engine start", "engine start", "papermill run"]),
                        ("tests/test_b.py::test_y (call)", ["engine start"])):
        monkeypatch.setenv("PYTEST_CURRENT_TEST", test)
        for kind in kinds:
            progress.note(kind)
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    progress.note("target build")
    assert progress.tally(path) == {"engine start": 3, "papermill run": 1, "target build": 1}
    assert progress.by_file(path) == {"tests/test_a.py": {"engine start": 2, "papermill run": 1},
                                    "tests/test_b.py": {"engine start": 1}, "(outside a test)": {"target build": 1}}
    monkeypatch.delenv(progress.EVENTS_ENV)
    progress.note("engine start")             # without the variable: nothing is written
    assert progress.tally(path)["engine start"] == 3
