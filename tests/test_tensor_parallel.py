"""Stages 04 and 06 in the shape the user's node runs them: tensor parallel 2 on vLLM's CPU build
(one core a rank, as the GPU node gives each rank its GPU), so the engine core runs in its own
process and every request crosses processes, as it does at tensor parallel 8.

The user exports nothing: the commands run with the variables vLLM needs for it removed from the
environment (`targets.vllm.vllm_env` sets them). Stage 04 runs its check (a step-crossing sample
split as the scheduler in the engine's own process reports it) and captures every sample once;
stage 06 serves the trained export and the baselines at tensor parallel 2.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.hidden import outputs as shards
from draftsmith.hidden.outputs import HiddenShards
from draftsmith.targets.vllm import cpu_binding, vllm_env
from draftsmith.tokens.outputs import read_tokens

from conftest import copy_run

REPO = Path(__file__).resolve().parents[1]
# what a user would otherwise have to export for tensor parallel > 1 on a CPU
USER_EXPORTS = ("VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING")
STEP = 128  # tokens a step: the smoke run's samples are a few hundred tokens, so the check's sample crosses

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(1200)]


def draftsmith(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in USER_EXPORTS}
    return subprocess.run([str(Path(sys.executable).with_name("draftsmith")), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_vllm_env_binds_one_core_group_a_rank_on_a_cpu_and_allows_the_rpc():
    assert cpu_binding(2, [0, 1]) == "0|1" and cpu_binding(2, list(range(16))) == "0-7|8-15"
    assert cpu_binding(3, [0, 2, 4, 6, 8, 10]) == "0,2|4,6|8,10"
    with pytest.raises(ValueError, match="tensor_parallel_size 4 on vLLM's CPU build needs a core per rank"):
        cpu_binding(4, [0, 1])
    env = vllm_env(tensor_parallel_size=2)
    assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in {
        k for k in env if k not in os.environ}
    assert vllm_env(tensor_parallel_size=1)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


@pytest.fixture(scope="module")
def stage_04_tp2(shared_run, tmp_path_factory):
    """`draftsmith run 04 -p tensor_parallel_size 2` on a copy of the shared run's tokens."""
    run = copy_run(shared_run, tmp_path_factory.mktemp("outputs") / "tp2", parts=("tokens",))
    done = draftsmith("run", "04", "-f", str(REPO / "params/smoke.yaml"), "-p", "outputs_dir", str(run.parent),
                      "-p", "run_name", run.name, "-p", "target_backend", "vllm", "-p", "tensor_parallel_size", "2",
                      "-p", "max_num_batched_tokens", str(STEP), "-p", "verify_with_hf", "false")
    return run, done


def test_stage_04_at_tensor_parallel_2_checks_then_captures_every_sample_once_without_user_exports(stage_04_tp2):
    run, done = stage_04_tp2
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    out = run / "hidden"
    check = json.loads((out / shards.CHECK).read_text())
    assert check["passed"] and check["tensor_parallel_size"] == 2 and check["engine_core"] == "own process", check
    crossing = check["step_crossing"]
    # the scheduler, in the engine core's own process, reports the sample split across steps (where
    # the fillers end depends on when each request reached the engine core: the record is its word)
    assert crossing["split_confirmed"] and crossing["step_tokens"] == STEP and len(crossing["chunks"]) >= 2, crossing
    assert [c["tokens"][1] - c["tokens"][0] for c in crossing["chunks"]] == crossing["scheduled"][:len(crossing["chunks"])]
    # every sample once, none left behind in scratch (blocks freed: only rank 0 reports a request finished)
    hs = HiddenShards(out)
    keys = [(s["dataset"], s["sample_id"]) for e in hs.index["shards"] for s in e["samples"]]
    want = {s.key for s in read_tokens(sorted((run / "tokens").glob("*.jsonl")))}
    assert len(keys) == len(set(keys)) and set(keys) == want
    assert not list(out.glob("**/*.safetensors.tmp")) and not (out / ".vllm-scratch").exists()
    print(f"| stage 04, tensor parallel 2 | rc {done.returncode} | {last_line(done)} |")


@pytest.fixture(scope="module")
def stage_06_tp2(shared_run, tmp_path_factory):
    """`draftsmith run 06 -p eval_tensor_parallel 2` on a copy of the shared run, its final EAGLE-3
    export only (three engines: none, ngram, the drafter)."""
    run = copy_run(shared_run, tmp_path_factory.mktemp("outputs") / "tp2-eval")
    shutil.rmtree(run / "drafter-dflash", ignore_errors=True)
    exports = json.loads((run / "drafter" / "exports.json").read_text())
    (run / "drafter" / "exports.json").write_text(json.dumps(exports[-1:] if isinstance(exports, list) else exports))
    done = draftsmith("run", "06", "-f", str(REPO / "params/smoke.yaml"), "-p", "outputs_dir", str(run.parent),
                      "-p", "run_name", run.name, "-p", "eval_backend", "vllm", "-p", "eval_hf_crosscheck", "false",
                      "-p", "eval_tensor_parallel", "2", "-p", "eval_prompts_per_dataset", "1",
                      "-p", "eval_max_new_tokens", "12", "-p", "eval_temperatures", "[0.0]")
    return run, done


def test_stage_06_at_tensor_parallel_2_serves_the_export_and_the_baselines(stage_06_tp2):
    run, done = stage_06_tp2
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    engine = json.loads((run / "eval" / "report.json").read_text())["engine"]
    assert engine["eval_tensor_parallel"] == 2, engine
    methods = engine["temperatures"]["0"]["methods"]
    assert set(methods) == {"none", "ngram", "eagle3"}, methods
    # greedy speculative decoding at tensor parallel 2 gives the same tokens as without a drafter
    assert all(m["prompts"] >= 2 and m["lossless"] for m in methods.values()), methods
    assert methods["eagle3"]["acceptance_length"] > 1.0, methods["eagle3"]
    print(f"| stage 06, tensor parallel 2 | rc {done.returncode} | {last_line(done)} |")


def last_line(done: subprocess.CompletedProcess) -> str:
    return (done.stdout + done.stderr).strip().splitlines()[-1]
