"""Stage 04 as notebook 04 runs it: `run(run, cfg)` with its settings (`HiddenConfig`).

`nproc_per_node` > 1 or `nnodes` > 1 runs `launch` (torchrun ranks reading one `extract_config.json`,
restarted once on failure, resuming from whole shards); anything else runs `extract` here. Either
first proves its features in the engine (`check`); with `verify_with_hf` the stored features are
also checked in transformers (`verify`). A target vLLM's CPU build cannot run is recorded as
GPU-only (`record_gpu_only`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from .. import parameters
from . import outputs, verify
from ..files import write_json_atomic
from ..config import HiddenConfig, split
from ..paths import Run
from ..providers.outputs import logprobs_file
from ..tokens.outputs import token_files
from ..targets.checkpoint import resolve_target
from ..targets.checkpoint import target_identity
from ..targets.vllm import GpuOnly
from ..distributed import done_launching, launch_dir, torchrun
from .extract import Settings, extract

CONFIG = "extract_config.json"


def run(run: Run, cfg: HiddenConfig, *, log=print) -> dict:
    """Stage 04: extract the run's stage-03 tokens (of `cfg.datasets`, or all) into its hidden-state
    folder and return the summary, with `check` (stage 04's own check in the engine,
    `draftsmith.hidden.check`; None when `check_samples` is 0) and `hf_check` (`verify.check_stored`;
    None when not `verify_with_hf`). The vLLM settings reach the engine only when `target_backend` is
    vllm. `nnodes` > 1: this node's part of a run over that many nodes (`draftsmith.distributed`)."""
    parameters.check(cfg)
    target = resolve_target(cfg.target_model_path, log=log)
    files = token_files(run, cfg.datasets)
    out_dir = outputs.hidden_dir(run)
    settings = split(Settings, vars(cfg))[0]      # the vLLM ones travel as `engine_options`
    reference = logprobs_file(run)                # stage 01's logprob probe: the check's independent reference
    settings["reference_logprobs"] = str(reference) if reference.is_file() else None
    if cfg.target_backend == "vllm":
        settings["engine_options"] = dict(
            tensor_parallel_size=cfg.tensor_parallel_size, trust_remote_code=cfg.trust_remote_code,
            gpu_memory_utilization=cfg.gpu_memory_utilization, max_num_batched_tokens=cfg.max_num_batched_tokens,
            vllm_model_runner=cfg.vllm_model_runner, engine_env=cfg.engine_env,
            disable_custom_all_reduce=cfg.disable_custom_all_reduce, kv_cache_dtype=cfg.kv_cache_dtype)
    if cfg.nproc_per_node > 1 or cfg.nnodes > 1:
        summary = launch(cfg.nproc_per_node, target, files, out_dir, nnodes=cfg.nnodes,
                         rdzv_endpoint=cfg.rdzv_endpoint, log=log, **settings)
    else:
        try:
            summary = extract(target, files, out_dir, log=log, **settings)
        except GpuOnly as e:
            summary = record_gpu_only(out_dir, target, e.line, log=log, **settings)
    hf_check = verify.check_stored(target, out_dir, cfg.device, verify_with_hf=cfg.verify_with_hf,
                                   trust_remote_code=cfg.trust_remote_code)
    return {"check": None, **summary, "hf_check": hf_check}


def record_gpu_only(out_dir: Path, target, line: str, *, log=print, **settings) -> dict:
    """vLLM's CPU build cannot run this target (`targets.vllm.CPU_BUILD_LIMITS`): say so in one line and write
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
