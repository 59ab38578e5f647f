"""Stage 02 against a real bare OpenAI-compatible server: vLLM (CPU build) serving the tiny-test
target in a child process, started once for this module (~1.5-2 min on 2 busy cores). Stage 02
switches off OpenRouter's parts and says so, survives kill -9 without duplicates, and saves the ids
the engine sampled (replayed against the engine itself). Then the whole merge: one dataset from the
engine, one through the emulator, one imported from a file; stage 03 as `draftsmith run 03`, then
hidden states and training report every source."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from draftsmith import cli, generate, tokens
from draftsmith.config import HiddenConfig
from draftsmith.hidden.stage import extract
from draftsmith.openrouter.apikey import ApiKey
from draftsmith.config import DrafterConfig
from draftsmith.drafter import stage
from draftsmith.drafter.stage import TrainJob
from draftsmith.emulator import running
from draftsmith.paths import Run
from draftsmith.hidden.outputs import HiddenShards
from draftsmith.targets.vllm import vllm_env

from conftest import free_port, get_json, stage_02_at

pytestmark = pytest.mark.engine

pytest.importorskip("vllm")

SERVED = "tiny-test"
FAST = dict(backoff_base_s=0.05, backoff_cap_s=0.5, request_timeout_s=60.0, stop_grace_s=5.0)
SETTINGS = dict(max_tokens=40, temperature=1.0, top_p=1.0, seed=0)


def post_json(url: str, body: dict):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def engine(tiny_target, tmp_path_factory):
    """`vllm serve` (its OpenAI server) on the tiny-test target; yields its /v1 base URL."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("vllm") / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_target),
         "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--max-model-len", "1024", "--reasoning-parser", "deepseek_r1"],
        env=vllm_env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({proc.returncode}): {Path(log.name).read_text()[-3000:]}")
            try:
                get_json(base + "/models")
                break
            except OSError:
                if time.time() - t0 > 400:
                    raise TimeoutError(f"vLLM not up after 400 s: {Path(log.name).read_text()[-3000:]}")
                time.sleep(1)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def prompts(path: Path, n: int, tag: str) -> Path:
    path.write_text("".join(json.dumps({"id": f"{tag}-{i}", "messages": [
        {"role": "user", "content": f"Tell me about item {i} of the {tag} list, briefly."}]}) + "\n" for i in range(n)))
    return path


CHILD = """
import json, sys
from draftsmith.openrouter.apikey import ApiKey
from draftsmith.config import GenerateConfig, split
from draftsmith.generate.stage import run_at
from draftsmith.paths import Run
a = json.loads(sys.argv[1])
settings, knobs = split(GenerateConfig, {**a["settings"], **a["fast"]})
cfg = GenerateConfig(datasets=a["datasets"], model=a["model"], concurrency=2, spend_limit_usd=1.0,
                     native_precision="int4", target_model_path=None, **settings)
r = run_at(a["base"], ApiKey("EMPTY", "none: a local server"), Run(a["root"], "mixed"), cfg, **knobs)
print("RESULT", r.reason, flush=True)
"""


def stage_02_child(base, root, datasets) -> subprocess.Popen:
    arg = json.dumps({"base": base, "root": str(root), "datasets": datasets, "model": SERVED,
                      "settings": SETTINGS, "fast": FAST})
    return subprocess.Popen([sys.executable, "-c", CHILD, arg], env={**os.environ, "DRAFTSMITH_PROGRESS": "off"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def engine_run(engine, tmp_path_factory):
    """Stage 02 of dataset `chat` against the engine: killed with -9 once lines are being written,
    then run again to the end."""
    root = tmp_path_factory.mktemp("mixed")
    datasets = [{"name": "chat", "path": str(prompts(root / "chat.jsonl", 24, "chat"))}]
    raw = root / "mixed" / "generate" / "chat" / "raw_responses.jsonl"
    proc = stage_02_child(engine, root, datasets)
    t0 = time.time()
    while not (raw.exists() and raw.read_bytes().count(b"\n") >= 3):
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() - t0 < 300, "no responses after 300 s"
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    at_kill = raw.read_bytes().count(b"\n")
    logs = []
    result = stage_02_at(engine, ApiKey("EMPTY", "none: a local server"), Run(root, "mixed"), datasets,
                                     model=SERVED, concurrency=4, spend_limit_usd=1.0, native_precision="int4",
                                     log=logs.append, **SETTINGS, **FAST)
    return root, datasets, result, at_kill, logs


def test_stage_02_against_a_bare_server_resumes_after_kill_9_without_duplicates(engine_run):
    root, datasets, result, at_kill, logs = engine_run
    assert result.complete, result.message
    assert 3 <= at_kill < 24, "the kill did not land mid-run: the test proved nothing"
    lines = [json.loads(x) for x in (root / "mixed" / "generate" / "chat" / "raw_responses.jsonl").open()]
    ids = [ln["sample_id"] for ln in lines]
    assert sorted(ids) == sorted(f"chat-{i}" for i in range(24)) and len(ids) == len(set(ids))
    manifest = json.loads((root / "mixed" / "generate" / "manifest.json").read_text())
    assert [s["status"] for s in manifest["sessions"]] == ["killed", "finished"]
    assert manifest["config"]["server"] == "vllm" and manifest["spent_usd"] == 0
    # OpenRouter's parts are off, and the run says so
    assert any("bare OpenAI-compatible server (vllm)" in m and "no balance, no endpoint catalogue, no cost" in m
               for m in logs), logs
    for ln in lines:
        assert ln["source"] == "vllm" and ln["provider"] == "vllm" and ln["usage"]["cost"] is None
        assert "provider" not in ln["request"] and ln["request"]["return_token_ids"] is True
        assert len(ln["output_ids"]) == ln["usage"]["completion_tokens"]
        assert len(ln["prompt_ids"]) == ln["usage"]["prompt_tokens"]


def test_saved_output_ids_are_the_ids_the_engine_sampled(engine, engine_run, target_tokenizer):
    """Replayed against the engine: the same request (same per-request seed) samples the same ids,
    which are the ids saved; and they decode to the saved text."""
    root, datasets, _, _, _ = engine_run
    lines = [json.loads(x) for x in (root / "mixed" / "generate" / "chat" / "raw_responses.jsonl").open()]
    for ln in lines[:4]:
        reply = post_json(engine + "/chat/completions", {**ln["request"], "stream": False, "messages": ln["messages"]})
        assert reply["choices"][0]["token_ids"] == ln["output_ids"]
        assert reply["prompt_token_ids"] == ln["prompt_ids"]
        text = target_tokenizer.decode(ln["output_ids"], skip_special_tokens=True)
        assert ln["content"].strip() in text and (ln["reasoning"] or "").strip() in text


def test_a_merge_of_engine_emulator_and_import_trains_and_reports_every_source(
        engine_run, tiny_target, target_tokenizer, tmp_path, one_thread):
    root, chat, _, _, _ = engine_run
    run = Run(root, "mixed")
    code = [{"name": "code", "path": str(prompts(root / "code.jsonl", 16, "code"))}]
    cfg = {"fault_scale": 0, "credits": 50.0, "backend": "synthetic", "target_model_path": "tiny-test",
           "synthetic_tokens": 20, "time_scale": 0.0}
    with running(cfg, state_dir=tmp_path / "emulator") as emu:
        res = stage_02_at(emu.base_url, emu.key, run, code, model="moonshotai/kimi-k2.5",
                                      max_tokens=40, concurrency=8, spend_limit_usd=5.0, native_precision="int4",
                                      log=lambda *a: None)
        assert res.complete, res.message
    # `legacy`: answers generated elsewhere, with the ids that engine sampled for half of them
    legacy = root / "legacy.jsonl"
    rows = []
    for i in range(12):
        messages = [{"role": "user", "content": f"Old question {i}: what is a tuple?"}]
        reasoning, answer = f"The user asks question {i}.", f"A tuple is an immutable sequence ({i})."
        line = {"id": f"old-{i}", "messages": messages, "reasoning": reasoning, "answer": answer, "source": "sglang-h100"}
        if i % 2 == 0:
            prompt = target_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)
            full = target_tokenizer.apply_chat_template(
                messages + [{"role": "assistant", "reasoning_content": reasoning, "content": answer}],
                tokenize=True, return_dict=False)
            line["output_ids"] = full[len(prompt):]
        rows.append(line)
    legacy.write_text("".join(json.dumps(r) + "\n" for r in rows))

    params = tmp_path / "params.yaml"
    datasets = code + chat + [{"name": "legacy", "path": str(legacy)}]
    params.write_text(yaml.safe_dump({"run_name": "mixed", "outputs_dir": str(root), "target_model_path": "tiny-test",
                                      "datasets": datasets, "imports": [{"name": "legacy", "path": str(legacy)}]}))
    # exit 3: the verdict is failed, as it should be: this test's hand-written import texts never
    # start with the whitespace the emulator's providers show, so stage 03 flags both import
    # sources (stripped_whitespace) and, with exclude_flagged off, keeps their samples
    assert cli.main(["run", "03", "-f", str(params)]) == 3
    report = json.loads((run.root / "tokens" / "report.json").read_text())
    assert {p: f["cause"] for p, f in report["flagged_providers"].items() if p in ("vllm", "sglang-h100")} == {
        "vllm": "stripped_whitespace", "sglang-h100": "stripped_whitespace"}
    src = report["sources"]
    assert set(src) == {"openrouter", "vllm", "sglang-h100"}
    assert src["openrouter"]["billing"]["samples"] == src["openrouter"]["samples"] > 0
    assert src["vllm"]["billing"] is None and src["vllm"]["saved_ids"]["samples"] == 24
    assert src["vllm"]["saved_ids"]["prompt_agreement_rate"] == 1.0   # our template = the engine's
    assert src["sglang-h100"] == {**src["sglang-h100"], "samples": 12, "kept": 12, "billing": None}
    log = (run.root / "logs" / "03_validate_tokens.log").read_text()
    assert "source vllm: 24 samples (chat), 24 kept; engine ids = text rebuild on" in log
    chat_lines = [json.loads(x) for x in (run.root / "tokens" / "chat.jsonl").open()]
    raw = {json.loads(x)["sample_id"]: json.loads(x) for x in (run.root / "generate" / "chat" / "raw_responses.jsonl").open()}
    for ln in chat_lines:  # trained on: exactly the engine's ids
        r = raw[ln["sample_id"]]
        assert ln["input_ids"] == r["prompt_ids"] + ln["output_ids"]
        assert ln["output_ids"][:len(r["output_ids"])] == r["output_ids"]

    files = tokens.token_files(run, [d["name"] for d in datasets])
    extract(tiny_target, files, run.dir("hidden"), HiddenConfig(target_backend="hf"),
            log=lambda *a: None)
    assert {s.source for s in HiddenShards(run.dir("hidden")).samples} == set(src)
    s = stage.train(DrafterConfig(draft_vocab_size=512, ttt_steps=2, train_epochs=1.0, train_batch_size=4,
                                  train_micro_batch_size=2, train_max_len=128, train_lr=1e-4,
                                  train_warmup_fraction=0.015, train_weight_decay=0.0, train_grad_clip=0.5,
                                  train_holdout_fraction=0.1, seed=0, train_fsdp=False, train_eval_every=0,
                                  train_checkpoint_every=100, export_fractions=[1.0], export_engine="sglang",
                                  export_dtype="float32", train_resume=True),
                    TrainJob(hidden_dir=str(run.dir("hidden")), target_path=str(tiny_target),
                             out_dir=str(run.dir("drafter"))), log=lambda *a: None)
    assert set(s["sources"]) == set(src) and set(s["heldout"]["by_source"]) == set(src)
    assert all(v["heldout_samples"] >= 1 and v["heldout"]["count_i"][0] > 0 for v in s["sources"].values())
