"""bench/gpu_smoke.py's CPU path: the plan it would run on GPUs, checked by the CLI, and its refusal
to run without them; its node preflight (`draftsmith.node_preflight`), each message with torch made
to read as a GPU node, the all-reduce in real processes. (The GPU run itself is never part of CI:
docs/gpu-runbook.md.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from draftsmith import node_preflight as npf

pytestmark = pytest.mark.unit

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
    commands = [line.split(": ", 1)[1] for line in lines if line.startswith("  ") and "draftsmith run" in line]
    assert [c.split()[2] for c in commands] == ["01,02,03", "04", "04", "05", "06"]
    for i, c in enumerate(commands):
        assert c.startswith("draftsmith run ") and " -f params/kimi-mini.yaml " in c
        other = i == 2   # stage 04 again on the other model runner, in a run of its own
        for setting in ("-p target_model_path kimi-mini ", "-p target_backend vllm ", "-p tensor_parallel_size 2 ",
                        "-p eval_backend vllm ", "-p eval_tensor_parallel 2 ", f"-p outputs_dir {tmp_path}",
                        f"-p verify_with_hf {'false' if other else 'true'} ",
                        f"-p vllm_model_runner {'v2' if other else 'v1'} ", f"-p run_name {'plan-v2' if other else 'plan'} "):
            assert setting in c + " ", f"{setting!r} missing from {c}"
    env_at = lines.index("each engine's environment at tensor parallel 2, beyond this shell's:")
    engines = lines[lines.index("vLLM engines it starts:") + 1:env_at]
    assert engines == ["  04: capture, model runner v1", "  04 v2: capture, model runner v2 (the comparison)",
                       *(f"  06: {m}, model runner v1" for m in ("none", "ngram", "eagle3 50%", "eagle3", "dflash"))]
    # what the node's engines get without the user exporting anything: the RPC permission, the engine
    # core in its own process (and on this CPU box a core a rank)
    env = lines[env_at + 1:]
    assert any(line.startswith("  VLLM_ALLOW_INSECURE_SERIALIZATION=1") for line in env), env
    assert env[-1] == "  engine core in its own process, 2 worker rank(s)", env
    assert lines[lines.index("vLLM engines it starts:") - 1] == (
        "parameters of 01_providers, 02_generate, 03_validate_tokens, 04_hidden_states, 05_train_drafter, "
        "06_evaluate: ok")


def test_the_runner_comparison_reads_two_stores_sample_by_sample(tmp_path):
    """`compare_runners` on two real stage 04 stores of the same samples (transformers backend, one
    with a sample's features perturbed): agreement within the bound, then a sample over it."""
    import importlib.util

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from draftsmith.config import HiddenConfig
    from draftsmith.hidden.stage import extract
    from draftsmith.targets.checkpoint import resolve_target
    from test_hidden import write_tokens

    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    gpu_smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_smoke)

    target = resolve_target("tiny-test")
    tokens = tmp_path / "code.jsonl"
    write_tokens(tokens, AutoTokenizer.from_pretrained(target), 6, 3, "code")
    stores = []
    for name in ("a", "b"):
        extract(target, [tokens], tmp_path / name, HiddenConfig(target_backend="hf", check_samples=0),
                log=lambda m: None)
        stores.append(tmp_path / name)
    same = gpu_smoke.compare_runners(*stores)
    assert same["agree"] and same["samples"] == 6 and same["missing"] == 0 and same["aux"] < 1e-6
    shard = sorted(stores[1].glob("*.safetensors"))[0]
    with safe_open(str(shard), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(shard)
    tensors["last"] = tensors["last"] * 1.1
    save_file(tensors, shard, metadata=meta)
    off = gpu_smoke.compare_runners(*stores)
    assert not off["agree"] and 0.08 < off["last"] < 0.12


def test_the_smoke_plan_captures_both_drafters_layers_although_its_params_file_names_eagle3s():
    """params/kimi-mini.yaml sets layer_ids (EAGLE-3's three); the plan's overrides clear them, so
    `layer_set: both` decides and DFlash trains on its own five layers."""
    import importlib.util

    from draftsmith import parameters

    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    values = parameters.effective_params(parameters.discover(), str(module.PARAMS),
                                         module.settings("kimi-mini", 1, "plan", None))
    assert values["layer_set"] == "both" and values["layer_ids"] == []


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


# ---- the node preflight (`--preflight`, draftsmith.node_preflight) ------------------------------

def test_on_this_machine_the_preflight_says_in_one_line_that_there_is_no_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = smoke("--preflight", "--params", "params/kimi-k2.5.yaml")
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stdout.strip().splitlines()) == 1 and not done.stderr.strip()
    assert done.stdout.startswith("gpu_smoke: no GPU: torch ") and ".venv-gpu/bin/python" in done.stdout


def driver_file(tmp_path: Path, version: str | None) -> Path:
    """/proc/driver/nvidia/version as the open kernel module writes it (absent for None)."""
    path = tmp_path / "nvidia-version"
    if version:
        path.write_text(f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  "
                        f"(dvs-builder@U22-I3-AF03-09-1)  Thu Oct 16 2025\nGCC version:  gcc version 13.3.0\n")
    return path


@pytest.fixture
def node(monkeypatch):
    """torch made to read as a CUDA build on a node the test describes (nothing else of torch changes)."""
    import torch

    def install(n=8, cuda="13.0", free_gib=94.0, total_gib=95.6, peer=lambda i, j: True):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        props = types.SimpleNamespace(name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
                                      total_memory=int(total_gib * 2**30), major=12, minor=0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
        free = free_gib if isinstance(free_gib, list) else [free_gib] * n
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (int(free[i] * 2**30), int(total_gib * 2**30)))
        monkeypatch.setattr(torch.cuda, "can_device_access_peer", peer)
    return install


def test_without_a_usable_gpu_the_line_names_the_driver_or_the_build_to_fix(node, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    line = npf.no_gpu(driver_file(tmp_path, None))
    assert "is a CPU build and no NVIDIA driver is loaded" in line and "make gpu-venv" in line
    node(n=0, cuda="13.0")
    assert "install NVIDIA driver 580 or newer" in npf.no_gpu(driver_file(tmp_path, None))
    node(n=8, cuda="13.0")
    assert npf.no_gpu(driver_file(tmp_path, None)) is None               # GPUs work; the version is unread
    line = npf.no_gpu(driver_file(tmp_path, "575.57.08"))
    assert line.startswith("no GPU: NVIDIA driver 575.57.08 is too old for torch ")
    assert line.endswith("built for CUDA 13.0: install NVIDIA driver 580 or newer")
    assert npf.no_gpu(driver_file(tmp_path, "580.95.05")) is None
    node(n=8, cuda="12.8")
    assert npf.no_gpu(driver_file(tmp_path, "575.57.08")) is None        # CUDA 12 runs on 525 and newer
    node(n=0, cuda="13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    line = npf.no_gpu(driver_file(tmp_path, "580.95.05"))
    assert "no GPU visible" in line and "CUDA_VISIBLE_DEVICES is ''" in line and "nvidia-smi" in line


def test_the_gpus_their_memory_and_the_peer_matrix(node):
    node(n=8)
    [gpus] = npf.gpu_findings(8, 0.9)
    assert gpus.status is npf.Status.OK
    assert gpus.line == "8 x NVIDIA RTX PRO 6000 Blackwell Server Edition, 95.6 GiB, compute capability 12.0"
    node(n=4)
    short = npf.gpu_findings(8, 0.9)[1]
    assert short.status is npf.Status.FAILED
    assert "lower tensor_parallel_size and eval_tensor_parallel to 4" in short.line
    node(n=8, free_gib=[94.0] * 3 + [65.6] + [94.0] * 4)
    busy = npf.gpu_findings(8, 0.9)[1]
    assert busy.status is npf.Status.FAILED and busy.line.startswith("GPU 3 has 30.0 of 95.6 GiB in use")
    assert "gpu_memory_utilization" in busy.line and "nvidia-smi" in busy.line

    peer = npf.peer_finding()
    assert peer.line.startswith("all 56 ordered pairs") and "NCCL_P2P_DISABLE: \"1\"" in peer.line
    assert len(peer.detail) == 9 and peer.detail[1].split() == ["0", "-"] + ["Y"] * 7
    node(n=8, peer=lambda i, j: (i < 4) == (j < 4))                    # two switches, no path between
    peer = npf.peer_finding()
    assert peer.line.startswith("24 of 56 ordered pairs") and "NCCL_P2P_DISABLE: \"1\"" in peer.line
    assert peer.detail[1].split() == ["0", "-", "Y", "Y", "Y", "N", "N", "N", "N"]
    node(n=8, peer=lambda i, j: False)
    assert "host memory" in npf.peer_finding().line


def test_a_real_all_reduce_over_gloo_processes_passes_with_checked_sums():
    found, latency = npf.all_reduce(2, timeout_s=240, backend="gloo", mib=4, slow_gbps=None, slow_us=None)
    assert found.status is npf.Status.OK, found.line
    assert found.line.startswith("2-rank gloo all-reduce of 4 MiB: ") and found.line.endswith("sums right")
    assert latency.status is npf.Status.OK
    assert latency.line.startswith("decode-sized all-reduces over 2 ranks: 16 KiB ") and ", 2 MiB " in latency.line


def test_a_hung_all_reduce_is_killed_at_its_time_out_and_names_nccl_p2p_disable(tmp_path, monkeypatch):
    pids = tmp_path / "pids"
    pids.mkdir()
    hang = f"import os, time; open({str(pids)!r} + f'/{{os.getpid()}}', 'w'); time.sleep(600)"
    monkeypatch.setattr(npf, "rank_command", lambda *a: [sys.executable, "-c", hang])
    [found] = npf.all_reduce(8, timeout_s=3, backend="gloo")
    assert found.status is npf.Status.FAILED
    assert found.line.startswith("the 8-rank gloo all-reduce of 256 MiB did not finish in 3 s")
    assert "NCCL_P2P_DISABLE: \"1\"" in found.line
    for pid in pids.iterdir():  # every rank that started was killed (and reaped)
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid.name), 0)


def test_a_failing_rank_wrong_sums_and_a_crawl_each_get_their_line(monkeypatch):
    def ranks(script):
        monkeypatch.setattr(npf, "rank_command", lambda rank, world, backend, mib, out:
                            [sys.executable, "-c", script.format(rank=rank, out=str(out))])

    ranks("import sys, time\nif {rank} == 1: sys.exit('NCCL error: unhandled system error')\ntime.sleep(600)")
    [found] = npf.all_reduce(2, timeout_s=120, backend="nccl")
    assert found.status is npf.Status.FAILED
    assert "failed on rank 1 (exit 1: NCCL error: unhandled system error)" in found.line
    assert "NCCL_DEBUG=INFO" in found.line

    record = "import json, pathlib\nif {rank} == 0: pathlib.Path('{out}', 'rank0.json').write_text(json.dumps(" \
             "dict(ranks=8, backend='nccl', mib=256, seconds=%s, correct=%s)))"
    ranks(record % (0.5, True))                  # 256 MiB in 0.5 s over 8 ranks: 0.94 GB/s of bus bandwidth
    found = npf.all_reduce(8, timeout_s=120)[0]
    assert found.status is npf.Status.FAILED and "crawls: 500.0 ms each, bus bandwidth 0.9 GB/s" in found.line
    assert "NCCL_P2P_DISABLE: \"1\"" in found.line
    ranks(record % (0.02, False))
    [found] = npf.all_reduce(8, timeout_s=120)
    assert found.status is npf.Status.FAILED and "returned wrong sums" in found.line
    ranks(record % (0.02, True))
    found = npf.all_reduce(8, timeout_s=120)[0]
    assert found.status is npf.Status.OK and "bus bandwidth 23.5 GB/s, sums right" in found.line
    assert npf.all_reduce(1, timeout_s=120)[0].status is npf.Status.SKIPPED


def run_values(tmp_path: Path, **more) -> dict:
    values = {"outputs_dir": str(tmp_path), "run_name": "job", "target_model_path": "tiny-test",
              "hidden_dtype": "bf16", "layer_set": "eagle3", "layer_ids": [],
              "datasets": [{"name": "a", "path": "a.jsonl", "output_token_budget": 1_000_000},
                           {"name": "b", "path": "b.jsonl", "output_token_budget": 2_000_000}]}
    return values | more


def test_the_disk_is_checked_against_stage_04s_features_with_stage_04s_arithmetic(tmp_path, monkeypatch):
    import shutil

    from draftsmith.hidden.stage import bytes_per_token
    from draftsmith.targets.checkpoint import resolve_target, target_config

    hidden = target_config(resolve_target("tiny-test"))["hidden_size"]
    per_token = bytes_per_token(hidden, "bf16", 3)
    found = npf.disk_finding(run_values(tmp_path))                     # before stage 03: the budgets
    assert found.status is npf.Status.OK
    assert f"(3,000,000 tokens x {per_token:,} B, bf16; counted: the datasets' output_token_budget" in found.line
    tokens = tmp_path / "job" / "tokens"
    tokens.mkdir(parents=True)
    (tokens / "report.json").write_text(json.dumps({"datasets": {"a": {"tokens_kept": 1_500_000},
                                                                 "b": {"tokens_kept": 2_500_000},
                                                                 "c": {"tokens_kept": 9_000_000}}}))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=4_000_000 * per_token))
    found = npf.disk_finding(run_values(tmp_path))                     # a and b: stage 03's counts
    assert found.status is npf.Status.FAILED
    assert f"(4,000,000 tokens x {per_token:,} bytes, dtype bf16)" in found.line
    assert "point outputs_dir at a bigger disk or hidden_dtype fp8" in found.line
    assert "counted: stage 03's kept tokens" in found.line
    assert npf.disk_finding(run_values(tmp_path, hidden_dtype="fp8")).status is npf.Status.OK
    found = npf.disk_finding(run_values(tmp_path, target_model_path=str(tmp_path / "nowhere")))
    assert found.status is npf.Status.FAILED and found.line.endswith("set target_model_path")


def test_the_preflight_prints_one_line_per_check_and_fails_on_a_busy_gpu(node, tmp_path, monkeypatch, capsys):
    """The report as `--preflight` prints it, on a 2-GPU node torch is made to describe, whose
    all-reduce runs as real gloo processes (a CPU has no NCCL)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    gpu_smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_smoke)
    real = npf.all_reduce
    monkeypatch.setattr(npf, "all_reduce", lambda ranks, timeout_s, env: real(ranks, timeout_s, backend="gloo", mib=4,
                                                                             slow_us=None, env=env))
    monkeypatch.setattr(npf, "DRIVER_FILE", driver_file(tmp_path, "580.95.05"))
    monkeypatch.setattr(npf, "torch_nccl_version", lambda: "2.27.7")
    monkeypatch.setattr(npf, "library_nccl_version", lambda name: "2.27.7")
    monkeypatch.setattr(npf, "IOMMU_CLASS", tmp_path / "no-iommu")
    monkeypatch.setattr(npf, "tool_output", lambda cmd, timeout_s=30.0: {
        "nvidia-smi": (0, "GPU 00000000:41:00.0\n    Processes : None\nGPU 00000000:42:00.0\n    Processes : None\n"),
        "dmesg": (0, ""), "lspci": (0, "41:00.0 VGA compatible controller: NVIDIA Corporation Device 2bb5\n")}[cmd[0]])
    monkeypatch.setattr(npf, "SHM", tmp_path)
    overrides = [("run_name", "job"), ("outputs_dir", str(tmp_path)), ("target_model_path", "tiny-test"),
                 ("tensor_parallel_size", "2")]
    node(n=2)
    assert gpu_smoke.preflight(gpu_smoke.PARAMS, overrides, 240) == 1    # gloo over 4 MiB crawls: below 5 GB/s
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("node preflight, params/kimi-mini.yaml -p run_name job")
    checks = [(line[2:10].strip(), line[10:22].strip()) for line in lines[1:]
              if line[2:10].strip() in ("ok", "FAILED", "skipped")]
    assert [c for _, c in checks] == ["driver", "GPUs", "GPU health", "NCCL", "IOMMU, ACS", "peer access",
                                      "all-reduce", "latency", "/dev/shm", "disk"]
    assert dict((c, s) for s, c in checks) == {"driver": "ok", "GPUs": "ok", "GPU health": "ok", "NCCL": "ok",
                                               "IOMMU, ACS": "ok", "peer access": "ok", "all-reduce": "FAILED",
                                               "latency": "ok", "/dev/shm": "ok", "disk": "ok"}
    # the failure's fix as the params file's lines
    assert lines[-2:] == ["  the params file's settings for the failures above (stages 04 and 06 pass them to "
                          "every engine; run the preflight again with them):", '    engine_env: {"NCCL_P2P_DISABLE": "1"}']
    assert "NVIDIA 580.95.05; torch " in lines[1] and "needs 580 or newer" in lines[1]
    node(n=2, free_gib=[94.0, 40.0])
    assert gpu_smoke.preflight(gpu_smoke.PARAMS, overrides, 240) == 1
    out = capsys.readouterr().out
    assert "  FAILED  GPUs        GPU 1 has 55.6 of 95.6 GiB in use before any engine starts" in out
