"""bench/gpu_smoke.py's CPU path: the plan it would run on GPUs, checked by the CLI, and its refusal
to run without them. (The GPU run itself is never part of CI: docs/gpu.md.)"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_smoke.py"


def cuda_vllm() -> bool:
    try:
        return bool(version("vllm"))
    except PackageNotFoundError:
        return False


def smoke(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_dry_run_plans_every_stage_on_the_int4_target_in_vllm_with_tensor_parallel_and_the_cli_accepts_it(tmp_path):
    done = smoke("--dry-run", "--tp", "2", "--run-name", "plan", "--outputs-dir", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    commands = [line.split(": ", 1)[1] for line in lines if line.startswith("  ")]
    assert [c.split()[2] for c in commands] == ["01,02,03", "04", "05", "06"]
    for c in commands:
        assert c.startswith("draftsmith run ") and " -f params/kimi-mini.yaml " in c
        for setting in ("-p target_model_path kimi-mini ", "-p target_backend vllm ", "-p tensor_parallel_size 2 ",
                        "-p eval_backend vllm ", "-p eval_tensor_parallel 2 ", "-p verify_with_hf true ",
                        "-p run_name plan ", f"-p outputs_dir {tmp_path}"):
            assert setting in c + " ", f"{setting!r} missing from {c}"
    assert lines[-1] == ("parameters of 01_providers, 02_generate, 03_validate_tokens, 04_hidden_states, "
                         "05_train_drafter, 06_evaluate: ok")


def test_dry_run_reports_the_cli_refusing_a_setting(tmp_path):
    done = smoke("--dry-run", "--target", "no-such-target", "--run-name", "plan", "--outputs-dir", str(tmp_path))
    assert done.returncode == 2
    assert "target_model_path" in done.stdout and "no-such-target" in done.stdout
    assert "built-in targets" in done.stdout


@pytest.mark.skipif(cuda_vllm(), reason="the CUDA vLLM is installed here: the script would run the whole chain")
def test_without_the_cuda_vllm_it_refuses_in_one_line_and_runs_nothing(tmp_path):
    done = smoke("--run-name", "refused", "--outputs-dir", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpu_smoke: no CUDA vLLM in this environment (`make gpu-venv`, then .venv-gpu/bin/python "
        "bench/gpu_smoke.py); --dry-run prints the plan without a GPU"]
    assert not any(tmp_path.iterdir())


def test_the_gpu_check_without_vllm_plans_transformers_on_the_gpu_and_its_own_decoder_and_the_cli_accepts_it(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--run-name", "plan",
                           "--outputs-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    commands = [line.split(": ", 1)[1] for line in lines if line.startswith("  ")]
    assert [c.split()[2] for c in commands] == ["01,02,03", "04", "05", "06"]
    for c in commands:
        for setting in ("-p target_model_path kimi-mini ", "-p target_backend hf ", "-p device cuda ",
                        "-p eval_backend hf ", "-p verify_with_hf true "):
            assert setting in c + " ", f"{setting!r} missing from {c}"
    assert lines[-1] == ("parameters of 01_providers, 02_generate, 03_validate_tokens, 04_hidden_states, "
                         "05_train_drafter, 06_evaluate: ok")
