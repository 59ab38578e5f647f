"""Stage 04: hidden-state extraction (`draftsmith.hidden`) on the tiny target."""

import ast
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftsmith import layers
from draftsmith.hidden import outputs as shards
from draftsmith.hidden import stage, verify
from draftsmith.config import HiddenConfig
from draftsmith.hidden.stage import extract as extract_hidden
from draftsmith.paths import Run
from draftsmith.hidden.outputs import INDEX, HiddenShards
from draftsmith.targets.checkpoint import load_target

from conftest import stage_config, wait_until


pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_thread")]


def write_tokens(path: Path, tokenizer, n: int, seed: int, dataset: str, excluded: int = 0) -> list[dict]:
    """A stage-03-shaped tokens file: chat-templated prompts of varied length + response ids ending
    in `</think>`..EOS. The last `excluded` rows are marked excluded."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": " ".join(rng.choice(["why", "list", "sort", "a", "file"])
                                                  for _ in range(rng.randint(1, 60)))}],
            add_generation_prompt=True, tokenize=True, return_dict=False)
        resp = [rng.randrange(3, 128000) for _ in range(rng.randint(2, 120))] + [128822, 1]
        rows.append({"sample_id": f"{dataset}-{i}", "dataset": dataset, "provider": "p",
                     "input_ids": prompt + resp, "loss_mask": [0] * len(prompt) + [1] * len(resp),
                     "output_ids": resp, "excluded": i >= n - excluded})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r for r in rows if not r["excluded"]]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory, target_tokenizer):
    d = tmp_path_factory.mktemp("tokens")
    rows = write_tokens(d / "chat.jsonl", target_tokenizer, 24, 0, "chat", excluded=2)
    rows += write_tokens(d / "code.jsonl", target_tokenizer, 10, 1, "code")
    return [d / "chat.jsonl", d / "code.jsonl"], rows


def extract(tiny_target, files, out, *, log=lambda m: None, **kw):
    kw = {"target_backend": "hf", "max_tokens_per_batch": 1024, "shard_mb": 0.05, **kw}
    return extract_hidden(tiny_target, files, out, HiddenConfig(**kw), log=log)


def keys_of(hs: HiddenShards) -> list[tuple[str, str]]:
    return [(r.dataset, r.sample_id) for r in hs.samples]


@pytest.fixture(scope="module")
def model(tiny_target):
    return load_target(tiny_target, "cpu")


@pytest.mark.parametrize("ids, convention", [(None, "output"), ([3, 5, 6], "input")])
def test_captured_tensors_equal_output_hidden_states_at_documented_and_engine_indices(
        tiny_target, tokens, model, tmp_path, ids, convention):
    files, rows = tokens
    summary = extract(tiny_target, files, tmp_path, layer_ids=ids, layer_convention=convention)
    hs = HiddenShards(tmp_path)
    want = layers.default_layer_ids(8) if ids is None else [2, 4, 5]
    assert hs.index["layer_ids"] == summary["layer_ids"] == want and hs.index["layer_convention"] == "output"
    assert sorted(keys_of(hs)) == sorted((r["dataset"], r["sample_id"]) for r in rows)  # excluded ones skipped
    # batches really mixed lengths, so padding was there to leak
    lengths = [len(r["input_ids"]) for r in rows]
    assert any(len({lengths[i] for i in b}) > 1 for b in stage.plan_batches(lengths, 1024))

    by_key = {(r["dataset"], r["sample_id"]): r for r in rows}
    H = hs.hidden_size
    for i in range(0, len(hs), 3):
        s, row = hs.sample(i), by_key[keys_of(hs)[i]]
        assert s["input_ids"].tolist() == row["input_ids"] and s["loss_mask"].tolist() == row["loss_mask"]
        with torch.inference_mode():  # the sample alone, unpadded: the model's own view
            out = model.model(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True)
        ref = [h[0] for h in out.hidden_states]
        assert len(ref) == 8 + 1
        chunks = [s["aux"][:, j * H:(j + 1) * H] for j in range(3)]
        readings = {"documented": hs.index["hf_hidden_state_indices"]}
        for engine in layers.ENGINES:
            readings[engine] = layers.engine_capture_indices(layers.engine_layer_ids(hs.index["layer_ids"], engine),
                                                             engine)
        for name, idx in readings.items():
            for j, k in enumerate(idx):
                torch.testing.assert_close(chunks[j], ref[k], rtol=2 ** -7, atol=1e-4, msg=f"{name} layer {j}")
                # and the same check fails on the neighbouring layer: a slip by one layer would show
                assert not torch.allclose(chunks[j], ref[k + 1], rtol=2 ** -7, atol=1e-4), f"{name} layer {j}"
        # last = after the final norm: what the lm_head reads
        torch.testing.assert_close(s["last"], ref[-1], rtol=2 ** -7, atol=1e-4)
    with torch.inference_mode():  # and lm_head(last) is the target's own logits
        row = by_key[keys_of(hs)[0]]
        logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0]
        # bf16 storage of `last` (8 significant bits) moves each logit by ~2^-8 of its scale
        torch.testing.assert_close(model.lm_head(hs.sample(0)["last"]), logits, rtol=0,
                                   atol=2 ** -7 * float(logits.abs().max()))


def test_fp8_storage_reads_back_close_in_about_half_the_bytes(tiny_target, tokens, tmp_path):
    files, _ = tokens
    a = extract(tiny_target, files, tmp_path / "bf16")
    b = extract(tiny_target, files, tmp_path / "fp8", hidden_dtype="fp8")
    x, y = HiddenShards(tmp_path / "bf16"), HiddenShards(tmp_path / "fp8")
    assert y.dtype == "fp8" and keys_of(x) == keys_of(y)
    for i in range(len(x)):
        for name in ("aux", "last"):
            assert verify.rel_err(y.sample(i)[name], x.sample(i)[name]) < 0.05
    assert b["bytes"] < 0.62 * a["bytes"]


@pytest.mark.engine
def test_two_rank_torchrun_gives_the_same_samples_as_one_process(tiny_target, tokens, tmp_path):
    """nproc_per_node 2 (what notebook 04 passes): `stage.run` launches two torchrun ranks that read
    their settings from the one config file it writes."""
    files, _ = tokens
    one = extract(tiny_target, files, tmp_path / "one")
    run = Run(tmp_path, "r")
    for f in files:
        (run.dir("tokens") / f.name).write_bytes(f.read_bytes())
    two = stage.run(run, stage_config("04", target_model_path=str(tiny_target), datasets=[], nproc_per_node=2,
                                      target_backend="hf", max_tokens_per_batch=1024, shard_mb=0.05),
                    log=lambda m: None)
    config = json.loads((run.dir("hidden") / stage.CONFIG).read_text())
    assert config["config"]["max_tokens_per_batch"] == 1024 and config["config"]["shard_mb"] == 0.05
    assert two["ranks"] == 2 and two["shards_written"] == one["shards_written"] >= 2
    a, b = HiddenShards(tmp_path / "one"), HiddenShards(run.dir("hidden"))
    assert len(set(keys_of(b))) == len(keys_of(b)) and sorted(keys_of(a)) == sorted(keys_of(b))
    pos = {k: i for i, k in enumerate(keys_of(b))}
    for i, k in enumerate(keys_of(a)):
        torch.testing.assert_close(a.sample(i)["aux"], b.sample(pos[k])["aux"], rtol=2 ** -7, atol=1e-4)


@pytest.mark.engine
def test_a_rank_killed_mid_run_is_redone_by_a_fresh_torchrun(tiny_target, tokens, tmp_path):
    """kill -9 of one worker: torchrun fails, `launch` starts it again, the second run keeps the whole
    shards and redoes the rest: every sample once, as one process writes them."""
    import psutil

    files, _ = tokens
    extract(tiny_target, files, tmp_path / "one")
    out, lines, killed = tmp_path / "two", [], []

    def kill_rank_1_at_the_first_shard():
        while not killed and not any(out.glob("shard-*.safetensors")):
            time.sleep(0.005)
        for p in psutil.Process().children(recursive=True):
            try:
                if "draftsmith.hidden" in p.cmdline() and p.environ().get("RANK") == "1" and not killed:
                    p.kill()
                    killed.append(p.pid)
            except psutil.Error:
                pass

    killer = threading.Thread(target=kill_rank_1_at_the_first_shard, daemon=True)
    killer.start()
    two = stage.launch(tiny_target, files, out, HiddenConfig(nproc_per_node=2, target_backend="hf",
                                                             max_tokens_per_batch=256, shard_mb=0.01), log=lines.append)
    killed.append(None)  # stops the killer if it never found its rank
    killer.join()
    assert killed[0] is not None, "rank 1 was never killed: the test proved nothing"
    assert any("starting it again (2/2)" in x for x in lines)
    a, b = HiddenShards(tmp_path / "one"), HiddenShards(out)
    assert two["ranks"] == 2 and len(set(keys_of(b))) == len(keys_of(b)) and sorted(keys_of(a)) == sorted(keys_of(b))
    assert not list(out.glob("*.tmp"))


@pytest.mark.engine
def test_a_failed_torchrun_says_what_the_ranks_said_not_only_torchruns_own_traceback(tiny_target, tmp_path):
    missing = tmp_path / "no-such-tokens.jsonl"
    with pytest.raises(RuntimeError) as e:
        stage.launch(tiny_target, [missing], tmp_path / "out", HiddenConfig(nproc_per_node=2, target_backend="hf"),
                     attempts=1, log=lambda m: None)
    said = str(e.value)
    assert "failed 1 time(s)" in said and str(missing) in said and "Root Cause" in said
    assert "elastic_launch(" not in said  # the agent's launcher frames are left out


def shard_files(d: Path) -> list[Path]:
    return sorted(d.glob("shard-*.safetensors"))


@pytest.mark.crash
@pytest.mark.timeout(1800)  # an extraction, killed, then a whole one with its check: slow on a loaded box
def test_kill_mid_run_then_rerun_has_every_sample_once_and_no_torn_shard(tiny_target, target_tokenizer, tmp_path):
    files = [tmp_path / "many.jsonl"]
    rows = write_tokens(files[0], target_tokenizer, 160, 7, "many")
    out = tmp_path / "hidden"
    config = stage.write_config(tiny_target, files, out, HiddenConfig(target_backend="hf", max_tokens_per_batch=512,
                                                                  shard_mb=0.02))
    cmd = [sys.executable, "-m", "draftsmith.hidden", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    # polled often: the kill must come while the extraction still runs
    wait_until(lambda: shard_files(out), lambda files: len(files) >= 2, what=f"two shards in {out}", timeout_s=300,
               proc=proc, interval_s=0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"finished before the kill: {proc.stderr.read().decode()[-500:]}"
    assert not (out / INDEX).exists()
    survivors = {}
    for p in shard_files(out):  # every shard on disk is whole
        with safe_open(str(p), framework="pt") as f:
            n = len(json.loads(f.metadata()["samples"]))
            assert f.get_tensor("offsets")[-1] == f.get_tensor("aux").shape[0] and len(f.get_tensor("offsets")) == n + 1
        survivors[p.name] = p.stat().st_mtime_ns
    (out / "shard-00999.safetensors.tmp").write_bytes(b"torn")  # what a kill during a write leaves

    summary = extract(tiny_target, files, out, max_tokens_per_batch=512, shard_mb=0.02)
    hs = HiddenShards(out)
    assert sorted(keys_of(hs)) == sorted(("many", r["sample_id"]) for r in rows)  # none missing, none twice
    assert summary["shards_kept"] == len(survivors) >= 2 and summary["shards_written"] > 0
    assert all((out / n).stat().st_mtime_ns == t for n, t in survivors.items())  # whole shards skipped
    assert not list(out.glob("*.tmp"))
    for i in range(len(hs)):
        assert len(hs.sample(i)["aux"]) == len(hs.sample(i)["input_ids"])


def test_changed_or_newly_excluded_sample_reextracts_only_its_shard(tiny_target, target_tokenizer, tmp_path):
    f = tmp_path / "chat.jsonl"
    write_tokens(f, target_tokenizer, 12, 3, "chat")
    out = tmp_path / "hidden"
    extract(tiny_target, [f], out)
    before = {p.name: p.stat().st_mtime_ns for p in shard_files(out)}
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    lines[0]["excluded"] = True
    lines[5]["input_ids"][-3] = 777
    f.write_text("".join(json.dumps(r) + "\n" for r in lines))

    summary = extract(tiny_target, [f], out)
    hs = HiddenShards(out)
    assert sorted(keys_of(hs)) == sorted(("chat", r["sample_id"]) for r in lines[1:])
    i = keys_of(hs).index(("chat", "chat-5"))
    assert hs.sample(i)["input_ids"].tolist() == lines[5]["input_ids"]
    kept = [n for n, t in before.items() if (out / n).exists() and (out / n).stat().st_mtime_ns == t]
    assert summary["shards_kept"] == len(kept) >= len(before) - 2 and summary["shards_written"] >= 1


def test_shards_made_with_other_settings_are_an_error_naming_the_difference(tiny_target, tokens, tmp_path):
    files, _ = tokens
    extract(tiny_target, files[1:], tmp_path)
    with pytest.raises(ValueError, match=r"dtype 'bf16' -> 'fp8'.*another run_name"):
        extract(tiny_target, files[1:], tmp_path, hidden_dtype="fp8")
    with pytest.raises(ValueError, match=r"layer_ids \[1, 3, 4\] -> \[2, 3, 4\]"):
        extract(tiny_target, files[1:], tmp_path, layer_ids=[2, 3, 4])


def test_the_check_notebook_04_runs_fails_when_stored_features_are_off(tiny_target, tokens, tmp_path):
    """verify.check_stored passes on what extract stored, and fails loudly (naming the numbers) on
    features off by more than rounding: here `last` stored at three times its scale, as a capture
    that got the final norm wrong would store it (the top-1 token is unchanged, the error is not)."""
    from safetensors.torch import load_file, save_file

    files, _ = tokens
    extract(tiny_target, files[1:], tmp_path)
    check = verify.check_stored(tiny_target, tmp_path, "cpu")
    assert max(check["aux_rel_err"] + [check["last_rel_err"]]) < 0.02 and check["top1_agreement"] >= 0.98
    assert verify.check_stored(tiny_target, tmp_path, "cpu", verify_with_hf=False) is None
    assert "aux_rel_err" in verify.check_table(check).index and verify.check_table(None).empty
    for path in shards.shard_files(tmp_path):
        tensors = load_file(path)
        save_file({**tensors, "last": tensors["last"] * 3}, str(path), metadata=shards.read_header(path))
    with pytest.raises(AssertionError, match=r"beyond bf16 rounding") as failed:
        verify.check_stored(tiny_target, tmp_path, "cpu")
    # the cause named: `last` is off, by what three times its scale gives (a relative error of 2),
    # to within bf16's precision: the stored value and its tripling are each rounded to bf16's 8
    # significant bits (a relative error of at most 2^-8 each), so 3(1 +- 2^-8)^2 - 1 lies within
    # 2 +- 6 * 2^-8 (one box measured 1.9989, another 2.0); the aux
    # layers stay within the check's own tolerance (verify.TOLERANCE)
    figures = {k: ast.literal_eval(v) for k, v in re.findall(r"'(last_rel_err|aux_rel_err)': (\[[^]]*\]|[-\d.e]+)",
                                                             str(failed.value))}
    assert abs(figures["last_rel_err"] - 2.0) <= 6 * 2 ** -8, figures
    assert max(figures["aux_rel_err"]) < verify.TOLERANCE["bf16"][0], figures


def test_a_second_extraction_into_the_same_folder_is_refused(tiny_target, tokens, tmp_path):
    import fcntl

    files, _ = tokens
    with open(tmp_path / stage.LOCK, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(RuntimeError, match="another extraction is writing into this folder"):
            extract(tiny_target, files, tmp_path)


def test_disk_check_refuses_before_writing_anything(tiny_target, tokens, tmp_path, monkeypatch):
    files, rows = tokens
    free = 1000 * 265  # room for 1000 tokens at 8*32+9 bytes each
    monkeypatch.setattr(stage.shutil, "disk_usage", lambda p: type("U", (), {"free": free})())
    with pytest.raises(OSError, match=rf"{tmp_path}: hidden states need about .* GiB .* 265 bytes, dtype bf16"):
        extract(tiny_target, files, tmp_path)
    assert not shard_files(tmp_path)


def test_batches_are_longest_first_under_the_token_limit_and_shards_cover_each_once():
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(500)] + [900]
    batches = stage.plan_batches(lengths, 1000)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)
    assert all(len(b) * lengths[b[0]] <= 1000 for b in batches)
    assert all(sum(lengths[i] for i in b) >= 0.9 * len(b) * lengths[b[0]] for b in batches)  # <= 10% padding
    planned = stage.plan_shards(batches, lengths, 5000)
    assert [b for s in planned for b in s] == batches
    assert all(sum(lengths[i] for b in s for i in b) <= 5000 or len(s) == 1 for s in planned)


@pytest.mark.notebook
def test_notebook_04_extracts_checks_and_plots(tiny_target, tokens, tmp_path):
    from draftsmith import cli

    files, rows = tokens
    run_dir = tmp_path / "nb"
    (run_dir / "tokens").mkdir(parents=True)
    for f in files:
        (run_dir / "tokens" / f.name).write_bytes(f.read_bytes())
    rc = cli.main(["run", "04", "--defaults", "-p", "run_name", "nb", "-p", "outputs_dir", str(tmp_path), "-p", "target_model_path",
                   str(tiny_target), "-p", "hidden_dtype", "fp8", "-p", "shard_mb", "0.05",
                   "-p", "datasets", json.dumps([{"name": f.stem, "path": str(f), "output_token_budget": 100}
                                                 for f in files])])
    assert rc == 0
    assert (run_dir / "hidden" / "figures" / "norms.png").stat().st_size > 10_000
    hs = HiddenShards(run_dir / "hidden")
    assert hs.dtype == "fp8" and len(hs) == len(rows)
    assert "top1_agreement" in (run_dir / "notebooks" / "04_hidden_states.ipynb").read_text()




def test_broken_shards_are_found_from_sizes_and_headers_alone(tmp_path):
    """`outputs.broken_shards`: what stage 05 and the preflight check before training. A shard cut
    anywhere (in its header or its data), one deleted and one with a garbled header are named with
    their samples; the whole ones are not; no index, nothing to check."""
    assert shards.broken_shards(tmp_path) == []
    entries = []
    for i in range(6):
        n = 5 + i
        f = shards.shard_name(i)
        size = shards.write_shard(tmp_path / f, torch.randn(n, 6), torch.randn(n, 2), torch.arange(n),
                                  torch.ones(n), torch.tensor([0, 2, n]))
        entries.append({"file": f, "bytes": size, "samples": [{"sample_id": f"s{i}a"}, {"sample_id": f"s{i}b"}]})
    shards.write_index(tmp_path, {"shards": entries})
    assert shards.broken_shards(tmp_path) == []
    data = (tmp_path / entries[0]["file"]).read_bytes()
    (tmp_path / entries[0]["file"]).write_bytes(data[:-7])                   # a copy that did not finish
    (tmp_path / entries[1]["file"]).write_bytes(data[:20])                   # ... in the header
    (tmp_path / entries[2]["file"]).unlink()
    header = int.from_bytes(data[:8], "little")
    (tmp_path / entries[3]["file"]).write_bytes(data[:8] + b"{" * header + data[8 + header:])
    broken = shards.broken_shards(tmp_path)
    assert [(b.file, b.samples) for b in broken] == [(e["file"], 2) for e in entries[:4]]
    assert broken[0].problem == f"cut short: {len(data) - 7:,} bytes, its header says {len(data):,}"
    assert broken[1].problem.startswith("cut short: 20 bytes, too few for its header")
    assert broken[2].problem == "missing"
    assert broken[3].problem.startswith("its header does not parse")
    text = shards.broken_shards_message(tmp_path, broken, "draftsmith run 04 -f p.yaml", shown=2)
    assert f"4 shard(s) listed in {tmp_path / INDEX} are broken (8 samples)" in text
    assert f"{tmp_path / entries[0]['file']}: cut short" in text and "... and 2 more" in text
    assert "repair: draftsmith run 04 -f p.yaml" in text
