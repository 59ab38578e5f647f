"""Stage 02 re-run after the prompt file was edited: prompts removed, added, reworded under the same
id, the order shuffled. A sample is its id and the hash of its messages; the re-run says what
changed (and `draftsmith run 02 --check` says it before anything is paid), asks the reworded
prompts in their new words, passes on to stage 03 only answers to the prompts the file holds, keeps
every answer it paid for on disk, and never pays twice for a prompt it answered in the same words.
The emulator's ledger (every bill, keyed by the prompt's messages) is the referee."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from draftsmith import cli
from draftsmith.datasets import DatasetReader, DatasetSpec, prompt_hash
from draftsmith.emulator import running
from draftsmith.generate import outputs, prompt_edits
from draftsmith.paths import Run
from draftsmith.tokens.stage import read_responses as stage_03_reads

from conftest import stage_02_at

pytestmark = pytest.mark.emulator

MODEL = "moonshotai/kimi-k2.5"
FAST = dict(balance_poll_s=0.2, backoff_base_s=0.02, backoff_cap_s=0.3, request_timeout_s=5.0, stop_grace_s=5.0)
SMOKE = str(Path(__file__).resolve().parents[1] / "params" / "smoke.yaml")


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    cfg = {"backend": "synthetic", "time_scale": 0.0, "synthetic_tokens": 12, "fault_scale": 0, "credits": 100.0}
    with running(cfg, state_dir=tmp_path_factory.mktemp("emu")) as e:
        yield e


def rows_of(tag: str, n: int) -> list[dict]:
    return [{"id": f"{tag}-{i}", "messages": [{"role": "user", "content": f"[{tag}] Say something about item {i}."}]}
            for i in range(n)]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def generate(emu, root: Path, path: Path, **kw):
    logs: list[str] = []
    args = dict(model=MODEL, max_tokens=24, concurrency=8, spend_limit_usd=5.0, log=logs.append,
                native_precision="int4", **FAST)
    args.update(kw)
    r = stage_02_at(emu.base_url, emu.key, Run(root, "r"), [{"name": "e", "path": str(path)}], **args)
    assert r.complete, r.message
    r.logs = logs
    return r


def lines(root: Path, name: str) -> list[dict]:
    path = root / "r" / "generate" / "e" / name
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def current(path: Path) -> dict[str, str]:
    """sample id -> prompt hash, of the prompt file as it is now."""
    return {p.sample_id: p.prompt_hash for p in DatasetReader(DatasetSpec("e", str(path)))}


def bills(emu, keys: set[str]) -> Counter:
    return Counter(x["prompt_key"] for x in emu.ledger_lines() if x["billed"] and x["prompt_key"] in keys)


def edit(rows: list[dict], tag: str, seed: int = 7) -> tuple[list[dict], set, set, set]:
    """10% removed, 10% added, 5% reworded under the same id, the order shuffled."""
    rng = random.Random(seed)
    n = len(rows)
    picked = rng.sample(range(n), n // 10 + n // 20)
    removed, reworded = set(picked[:n // 10]), set(picked[n // 10:])
    out = []
    for i, r in enumerate(rows):
        if i in removed:
            continue
        if i in reworded:
            r = {"id": r["id"], "messages": [{"role": "user", "content": r["messages"][0]["content"] + " (fixed typo)"}]}
        out.append(r)
    added = rows_of(f"{tag}-new", n // 10)
    out += added
    rng.shuffle(out)
    ids = lambda idx: {rows[i]["id"] for i in idx}  # noqa: E731
    return out, ids(removed), ids(reworded), {r["id"] for r in added}


def test_an_edited_prompt_file_is_said_asked_in_its_words_and_only_its_answers_are_passed_on(emu, tmp_path, capsys):
    first = rows_of("ed", 60)
    path = write(tmp_path / "e.jsonl", first)
    r1 = generate(emu, tmp_path, path)
    assert not any("reworded" in f.text for f in outputs.verdict(Run(tmp_path, "r"), "02_generate")[2])
    before = {x["sample_id"]: x for x in lines(tmp_path, outputs.RESPONSES)}
    assert len(before) == 60 and all(x["prompt_hash"] == prompt_hash(x["messages"]) for x in before.values())

    edited, removed, reworded, added = edit(first, "ed")
    write(path, edited)
    now = current(path)
    keys = {prompt_hash(r["messages"]) for r in first + edited}
    billed_before = bills(emu, keys)

    # --check says it before anything is paid, and changes no file
    datasets = json.dumps([{"name": "e", "path": str(path)}])
    assert cli.main(["run", "02", "-f", SMOKE, "--check", "-p", "outputs_dir", str(tmp_path), "-p", "run_name", "r",
                     "-p", "datasets", datasets]) == 0
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("e: 60 prompts against")]
    expected = (f"e: 60 prompts against 60 saved answers: 51 unchanged, 3 reworded (asked again in their new "
                f"words, old answers set aside), 6 removed (answers set aside, not passed on; keep_removed_prompts "
                f"keeps them), 6 added or not asked yet; 51 answers passed on, 9 kept aside in superseded.jsonl")
    assert said == [expected]
    assert bills(emu, keys) == billed_before and not lines(tmp_path, outputs.SUPERSEDED)
    assert {x["sample_id"] for x in lines(tmp_path, outputs.RESPONSES)} == set(before)

    r2 = generate(emu, tmp_path, path)
    assert expected in r2.logs
    assert "e: 3 reworded (asked again), 6 removed (not passed on), 9 answers set aside in superseded.jsonl" in r2.message

    # exactly one line per id of the file, each answering the prompt in its current words
    after = lines(tmp_path, outputs.RESPONSES)
    assert sorted(x["sample_id"] for x in after) == sorted(now)
    assert all(x["prompt_hash"] == now[x["sample_id"]] == prompt_hash(x["messages"]) for x in after)
    # stage 03 reads exactly those
    got = [resp.sample_id for _, resp in stage_03_reads(Run(tmp_path, "r"), "e", "generate", None)]
    assert sorted(got) == sorted(now)
    # the old answers are kept on disk, whole, and say why they were set aside
    aside = {x["sample_id"]: x for x in lines(tmp_path, outputs.SUPERSEDED)}
    assert set(aside) == removed | reworded
    assert all(x["set_aside"]["reason"] == ("removed" if sid in removed else "reworded") for sid, x in aside.items())
    assert all({k: v for k, v in x.items() if k != "set_aside"} == before[sid] for sid, x in aside.items())
    # paid once for each new or reworded prompt, never again for an unchanged one
    new_bills = bills(emu, keys) - billed_before
    assert sorted(new_bills.elements()) == sorted(now[sid] for sid in reworded | added)
    assert all(n == 1 for n in bills(emu, keys).values())
    # what was set aside was paid for: the run's spend is still the ledger's
    assert r2.spent_usd == pytest.approx(sum(x["cost"] for x in emu.ledger_lines() if x["prompt_key"] in keys),
                                         abs=1e-9)
    manifest = outputs.read_manifest(Run(tmp_path, "r"))
    assert manifest["sessions"][-1]["prompt_edits"]["e"]["reworded"] == 3
    # the stage line and the run summary say it too (generate.outputs.verdict reads the manifest)
    figures = [f.text for f in outputs.verdict(Run(tmp_path, "r"), "02_generate")[2]]
    assert "3 reworded (asked again), 6 removed, 6 added; 9 answers set aside" in figures
    assert r1.spent_usd < r2.spent_usd == pytest.approx(manifest["spent_usd"], abs=1e-8)

    # a third run: nothing changed since, nothing asked, nothing moved
    r3 = generate(emu, tmp_path, path)
    assert r3.reason == "nothing_to_do" and bills(emu, keys) == billed_before + new_bills
    assert (f"e: 60 prompts against 60 saved answers: 60 unchanged, 0 reworded (asked again in their new words, "
            f"old answers set aside), 0 removed (answers set aside, not passed on; keep_removed_prompts keeps them), "
            f"0 added or not asked yet; 60 answers passed on, 9 kept aside in superseded.jsonl") in r3.logs
    assert len(lines(tmp_path, outputs.SUPERSEDED)) == 9 and r3.spent_usd == pytest.approx(r2.spent_usd, abs=1e-12)


def test_removed_answers_pass_on_with_the_setting_and_prompts_put_back_are_not_paid_again(emu, tmp_path):
    first = rows_of("kr", 20)
    path = write(tmp_path / "e.jsonl", first)
    generate(emu, tmp_path, path)
    keys = {prompt_hash(r["messages"]) for r in first}
    edited, removed, reworded, added = edit(first, "kr", seed=3)
    keys |= {prompt_hash(r["messages"]) for r in edited}
    write(path, edited)

    # the setting keeps the answers to removed prompts in what stage 03 reads; the summary says so
    r = generate(emu, tmp_path, path, keep_removed_prompts=True)
    assert "2 removed (answers kept and passed on: keep_removed_prompts)" in r.logs[0], r.logs
    assert "2 removed (passed on: keep_removed_prompts)" in r.message
    passed = {x["sample_id"] for x in lines(tmp_path, outputs.RESPONSES)}
    assert passed == set(current(path)) | removed
    assert {x["sample_id"] for x in lines(tmp_path, outputs.SUPERSEDED)} == reworded

    # without it, they are set aside; with it again, they come back without a request
    paid = bills(emu, keys)
    generate(emu, tmp_path, path)
    assert {x["sample_id"] for x in lines(tmp_path, outputs.RESPONSES)} == set(current(path))
    r = generate(emu, tmp_path, path, keep_removed_prompts=True)
    assert "2 removed (answers kept and passed on: keep_removed_prompts)" in r.logs[0] and not bills(emu, keys) - paid
    assert {x["sample_id"] for x in lines(tmp_path, outputs.RESPONSES)} == set(current(path)) | removed

    # the original file back: the first answers to the reworded prompts return, nothing is asked
    write(path, first)
    r = generate(emu, tmp_path, path)
    assert r.reason == "nothing_to_do" and bills(emu, keys) == paid
    after = lines(tmp_path, outputs.RESPONSES)
    assert sorted(x["sample_id"] for x in after) == sorted(x["id"] for x in first)
    assert all(x["prompt_hash"] == prompt_hash(x["messages"]) == prompt_hash(f["messages"])
               for x, f in zip(sorted(after, key=lambda x: x["sample_id"]), sorted(first, key=lambda x: x["id"])))
    # the answers to the new wording and to the prompts added, paid for, stay aside
    aside = lines(tmp_path, outputs.SUPERSEDED)
    assert sorted(x["sample_id"] for x in aside) == sorted(reworded | added)
    assert r.spent_usd == pytest.approx(sum(x["cost"] for x in emu.ledger_lines() if x["prompt_key"] in keys), abs=1e-9)


@pytest.mark.parametrize("dies_after", [1, 2, 3])
def test_a_kill_between_the_steps_of_a_move_loses_no_answer_and_the_next_run_finishes_it(emu, tmp_path, monkeypatch,
                                                                                         dies_after):
    """A move appends to superseded.jsonl, replaces raw_responses.jsonl, then replaces
    superseded.jsonl: killed after any step (each made durable by a directory sync), every answer
    is in one file or both, and the next run ends with each in exactly one place."""
    first = rows_of(f"k{dies_after}", 20)
    path = write(tmp_path / "e.jsonl", first)
    generate(emu, tmp_path, path)
    keys = {prompt_hash(r["messages"]) for r in first}
    edited, removed, reworded, _ = edit(first, f"k{dies_after}", seed=5)
    write(path, [r for r in edited if r["id"] in {x["id"] for x in first}])   # reworded and removed, none added
    generate(emu, tmp_path, path)
    keys |= {prompt_hash(r["messages"]) for r in edited}
    paid = bills(emu, keys)
    # back to the first words (their answers come back), and two more removed: all three steps run
    gone = {first[i]["id"] for i in range(20) if first[i]["id"] not in removed | reworded}
    gone = set(sorted(gone)[:2])
    write(path, [r for r in first if r["id"] not in gone])
    everything = {(x["sample_id"], x["prompt_hash"]) for name in (outputs.RESPONSES, outputs.SUPERSEDED)
                  for x in lines(tmp_path, name)}
    assert len(everything) == 20 + 1     # the first answers, and one to the new wording

    class Killed(BaseException):
        pass

    calls = {"n": 0}
    real = prompt_edits._sync_dir

    def sync_then_die(folder):
        real(folder)
        calls["n"] += 1
        if calls["n"] == dies_after:
            raise Killed

    monkeypatch.setattr(prompt_edits, "_sync_dir", sync_then_die)
    with pytest.raises(Killed):
        prompt_edits.apply(Run(tmp_path, "r"), [DatasetSpec("e", str(path))], False)
    monkeypatch.setattr(prompt_edits, "_sync_dir", real)
    held = [(x["sample_id"], x["prompt_hash"]) for name in (outputs.RESPONSES, outputs.SUPERSEDED)
            for x in lines(tmp_path, name)]
    assert set(held) == everything          # nothing lost at the kill

    r = generate(emu, tmp_path, path)
    assert r.reason == "nothing_to_do" and bills(emu, keys) == paid
    raw, aside = lines(tmp_path, outputs.RESPONSES), lines(tmp_path, outputs.SUPERSEDED)
    now = current(path)
    assert sorted((x["sample_id"], x["prompt_hash"]) for x in raw) == sorted(now.items())
    assert sorted((x["sample_id"], x["prompt_hash"]) for x in raw + aside) == sorted(everything)
    assert r.spent_usd == pytest.approx(sum(x["cost"] for x in emu.ledger_lines() if x["prompt_key"] in keys), abs=1e-9)


def test_a_line_written_before_the_hash_was_recorded_is_known_by_its_messages(emu, tmp_path):
    first = rows_of("old", 10)
    path = write(tmp_path / "e.jsonl", first)
    generate(emu, tmp_path, path)
    raw = tmp_path / "r" / "generate" / "e" / outputs.RESPONSES
    old = [{k: v for k, v in x.items() if k != "prompt_hash"} for x in lines(tmp_path, outputs.RESPONSES)]
    raw.write_text("".join(json.dumps(x) + "\n" for x in old))
    first[4] = {"id": "old-4", "messages": [{"role": "user", "content": "Say something else entirely."}]}
    write(path, first)
    r = generate(emu, tmp_path, path)
    assert "9 unchanged, 1 reworded" in r.logs[0]
    after = {x["sample_id"]: x for x in lines(tmp_path, outputs.RESPONSES)}
    assert after["old-4"]["messages"] == first[4]["messages"] and len(after) == 10
    assert [x["sample_id"] for x in lines(tmp_path, outputs.SUPERSEDED)] == ["old-4"]


def test_a_prompt_that_failed_for_good_is_asked_again_once_reworded(tmp_path):
    """A 400 (here: too long for the only provider's context) is final for those words; the user
    shortens the prompt under the same id, and the re-run asks it."""
    providers = [{"slug": "small", "name": "Small", "quantization": "int4", "prompt_price": 0.5,
                  "completion_price": 2.0, "context_length": 400}]
    cfg = {"backend": "synthetic", "time_scale": 0.0, "synthetic_tokens": 12, "fault_scale": 0, "credits": 10.0,
           "providers": providers}
    rows = [{"id": "ok", "messages": [{"role": "user", "content": "short"}]},
            {"id": "long", "messages": [{"role": "user", "content": "word " * 2000}]}]
    path = write(tmp_path / "e.jsonl", rows)
    with running(cfg, state_dir=tmp_path / "emu") as emu:
        generate(emu, tmp_path, path)
        err = lines(tmp_path, outputs.ERRORS)
        assert [(e["sample_id"], e["action"], e["prompt_hash"]) for e in err] == \
            [("long", "permanent", prompt_hash(rows[1]["messages"]))]
        asked = len(emu.ledger_lines())
        assert generate(emu, tmp_path, path).reason == "nothing_to_do" and len(emu.ledger_lines()) == asked
        rows[1] = {"id": "long", "messages": [{"role": "user", "content": "word " * 20}]}
        write(path, rows)
        r = generate(emu, tmp_path, path)
    assert r.reason == "finished" and "1 unchanged, 0 reworded" in r.logs[0]
    after = {x["sample_id"]: x for x in lines(tmp_path, outputs.RESPONSES)}
    assert set(after) == {"ok", "long"} and after["long"]["messages"] == rows[1]["messages"]
