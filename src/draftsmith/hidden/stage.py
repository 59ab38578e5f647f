"""Stage 04 as notebook 04 runs it: in this process, or as torchrun ranks fed one JSON config.

`run` takes the notebook's parameters under its names and picks the way: `nproc_per_node` > 1
(`hf` on several GPUs, or gloo processes on a CPU) or `nnodes` > 1 (this node's part of a run over
several, joined by torchrun's rendezvous; `vllm`: one engine per node) runs `launch`, anything else
`extract` here, which first proves its features in the engine itself (`check`, on by default, at
any scale); then, with `verify_with_hf`, the stored features are also checked against the target
run alone in transformers (`verify`), where transformers can hold the target. `launch` writes every setting into `extract_config.json` in the output folder
and starts `python -m draftsmith.hidden CONFIG.json` as torchrun ranks (`draftsmith.distributed`),
as stage 05's training does with its config: the settings are declared once (`extract.Settings`,
notebook 04's names and defaults). A failed torchrun is started again; it resumes from the whole
shards. Where vLLM's CPU build cannot run the target (`vllm` on INT4 MoE experts), the stage says
so in one line and records it (`record_gpu_only`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from .. import parameters
from . import outputs, verify
from ..files import write_json_atomic
from ..paths import Run
from ..tokens.outputs import token_files
from ..targets.checkpoint import resolve_target
from ..targets.identity import target_identity
from ..targets.vllm_limits import GpuOnly
from ..distributed import done_launching, launch_dir, torchrun
from .extract import Settings, extract

CONFIG = "extract_config.json"


def run(run: Run, *, target_model_path: str, datasets: list, hidden_dtype: str, layer_set: str, layer_ids: list,
        layer_convention: str, max_tokens_per_batch: int, shard_mb: float, nproc_per_node: int, nnodes: int,
        rdzv_endpoint: str, device: str, target_backend: str, trust_remote_code: bool, tensor_parallel_size: int,
        gpu_memory_utilization: float | None, max_num_batched_tokens: int | None, vllm_model_runner: str,
        check_samples: int, check_answers: bool, verify_with_hf: bool, log=print) -> dict:
    """Stage 04 with notebook 04's parameters under its names: extract the run's stage-03 tokens
    (of `datasets`, or all) into its hidden-state folder and return the summary, with `check` (stage
    04's own check in the engine, `draftsmith.hidden.check`; None when `check_samples` is 0) and
    `hf_check` (`verify.check_stored`; None when not `verify_with_hf`). The vLLM settings reach the engine only
    when `target_backend` is vllm. `nnodes` > 1: this node's part of a run over that many nodes
    joined at `rdzv_endpoint` (`draftsmith.distributed`)."""
    parameters.check_bounds({name: value for name, value in locals().items() if name not in ("run", "log")})
    target = resolve_target(target_model_path, log=log)
    files = token_files(run, datasets)
    out_dir = outputs.hidden_dir(run)
    settings = dict(layer_ids=layer_ids, layer_set=layer_set, layer_convention=layer_convention, hidden_dtype=hidden_dtype,
                    max_tokens_per_batch=max_tokens_per_batch, shard_mb=shard_mb, device=device,
                    target_backend=target_backend, check_samples=check_samples, check_answers=check_answers)
    if target_backend == "vllm":
        settings["engine_options"] = dict(
            tensor_parallel_size=tensor_parallel_size, trust_remote_code=trust_remote_code,
            gpu_memory_utilization=gpu_memory_utilization, max_num_batched_tokens=max_num_batched_tokens,
            vllm_model_runner=vllm_model_runner)
    if nproc_per_node > 1 or nnodes > 1:
        summary = launch(nproc_per_node, target, files, out_dir, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
                         log=log, **settings)
    else:
        try:
            summary = extract(target, files, out_dir, log=log, **settings)
        except GpuOnly as e:
            summary = record_gpu_only(out_dir, target, e.line, log=log, **settings)
    hf_check = verify.check_stored(target, out_dir, device, verify_with_hf=verify_with_hf,
                                   trust_remote_code=trust_remote_code)
    return {"check": None, **summary, "hf_check": hf_check}


def record_gpu_only(out_dir: Path, target, line: str, *, log=print, **settings) -> dict:
    """vLLM's CPU build cannot run this target (`target.vllm_limits`): say so in one line and write
    it as the index and summary of a folder without shards (stages after this one have no features)."""
    s = Settings(**settings)
    identity = target_identity(target, bool(s.engine_options.get("trust_remote_code")))
    record = {"backend": s.target_backend, "gpu_only": line, "layer_ids": s.layer_ids_of(identity["num_hidden_layers"]),
              "dtype": s.hidden_dtype, "target": identity, "samples": 0, "tokens": 0, "shards": 0,
              "hidden_dir": str(out_dir)}
    log(f"stage 04 on {Path(target).name} with target_backend {s.target_backend}: {line}")
    outputs.write_index(out_dir, {**record, "hidden_size": identity["hidden_size"], "layer_convention": "output",
                                 "num_samples": 0, "num_tokens": 0, "bytes": 0, "shards": []})
    outputs.write_summary(out_dir, record)
    return record


def write_config(target, files, out_dir, into: Path | None = None, **settings) -> Path:
    """The one file a torchrun child reads (in `into`, by default `out_dir`): where, what, and every
    `Settings` field."""
    out_dir = Path(out_dir)
    path = Path(into or out_dir) / CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"target": str(target), "token_files": [str(f) for f in files], "out_dir": str(out_dir),
                             "settings": asdict(Settings(**settings))})
    return path


def launch(nproc: int, target, files, out_dir, *, nnodes: int = 1, rdzv_endpoint: str = "", attempts: int = 2,
           log=print, **settings) -> dict:
    """Run `extract` as `nproc` torchrun ranks on this machine (one per GPU, or gloo on CPU), of
    `nnodes` machines in all; returns rank 0's summary. A failed torchrun is started again
    (`attempts` in all); whole shards are kept."""
    here = launch_dir(out_dir, nnodes)
    config = write_config(target, files, out_dir, here, **settings)
    outputs.remove_summary(out_dir)
    try:
        torchrun(nproc, "draftsmith.hidden", [str(config)], nnodes=nnodes, rdzv_endpoint=rdzv_endpoint,
                 attempts=attempts, log=log)
    finally:
        done_launching(here, nnodes)
    return outputs.read_summary(out_dir)


def main(argv: list[str] | None = None) -> int:
    """`[torchrun ...] python -m draftsmith.hidden CONFIG.json` (a config `write_config` wrote)."""
    from ..targets.checkpoint import resolve_target

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc-per-node N -m draftsmith.hidden CONFIG.json", file=sys.stderr)
        return 2
    cfg = json.loads(Path(argv[0]).read_text())
    extract(resolve_target(cfg["target"], log=lambda *m: None), cfg["token_files"], cfg["out_dir"],
            log=lambda m: print(m, flush=True), **cfg["settings"])
    return 0
