"""Stage 04 as one recipe: `run(run, cfg)` with its one config (`HiddenConfig`), read all the way down.

Setup: `run` resolves the target and the run's stage-03 token files, then extracts here (`extract`)
or as torchrun ranks (`launch`: `nproc_per_node` > 1 or `nnodes` > 1; the ranks read one
`extract_config.json` and are restarted once on failure). Plan: samples cut into batches by length,
batches grouped into shards of about `shard_mb`, the disk checked first. Resume: whole shards of an
earlier run with the same samples and settings are kept. Extract: the target runs behind one seam
(`open_capture`: `hf` in this process, shard i going to rank i mod world size; or `vllm`, one engine
per node in a child process), stage 04's own check (`draftsmith.hidden.check`) proving the engine
before any shard. Outputs and summary: rank 0 merges every rank's shards into the index
(`draftsmith.hidden.outputs`). With `verify_with_hf` the stored features are also checked in
transformers (`verify`); a target vLLM's CPU build cannot run is recorded as GPU-only.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .. import layers
from . import check, outputs, verify
from ..config import HiddenConfig
from ..distributed import done_launching, init_dist, launch_dir, torchrun
from ..files import write_json_atomic
from ..paths import Run
from ..progress import Progress
from ..providers.logprobs import read_reference
from ..providers.outputs import logprobs_file
from ..targets.checkpoint import final_norm, load_target, resolve_target, target_identity
from ..targets.hf import Capture
from ..targets.vllm import GpuOnly, VllmCapture, engine_settings
from ..tokens.outputs import Sample, read_tokens, token_files

CONFIG = "extract_config.json"  # what a torchrun rank reads (`write_config`)
ENGINE_LOG = "vllm.log"  # on several ranks (one engine per node): vllm.rank<N>.log
SCRATCH = ".vllm-scratch"  # vLLM's per-sample feature files, deleted once read
LOCK = ".lock"
BACKENDS = ("hf", "vllm")


# ---- setup: the stage, here or as torchrun ranks ----

def run(run: Run, cfg: HiddenConfig, *, log=print) -> dict:
    """Stage 04: extract the run's stage-03 tokens (of `cfg.datasets`, or all) into its hidden-state
    folder and return the summary, with `check` (stage 04's own check in the engine; None when
    `check_samples` is 0) and `hf_check` (`verify.check_stored`; None when not `verify_with_hf`).
    Stage 01's logprob probe, when there, is the check's independent reference. `nnodes` > 1: this
    node's part of a run over that many nodes (`draftsmith.distributed`)."""
    target = resolve_target(cfg.target_model_path, log=log)
    files = token_files(run, cfg.datasets)
    out_dir = outputs.hidden_dir(run)
    reference = logprobs_file(run)
    reference = str(reference) if reference.is_file() else None
    if cfg.nproc_per_node > 1 or cfg.nnodes > 1:
        summary = launch(target, files, out_dir, cfg, reference_logprobs=reference, log=log)
    else:
        try:
            summary = extract(target, files, out_dir, cfg, reference_logprobs=reference, log=log)
        except GpuOnly as e:
            summary = record_gpu_only(out_dir, target, e.line, cfg, log=log)
    hf_check = verify.check_stored(target, out_dir, cfg.device, verify_with_hf=cfg.verify_with_hf,
                                   trust_remote_code=cfg.trust_remote_code)
    return {"check": None, **summary, "hf_check": hf_check}


def record_gpu_only(out_dir: Path, target, line: str, cfg: HiddenConfig, *, log=print) -> dict:
    """vLLM's CPU build cannot run this target (`targets.vllm.GpuOnly`): say so in one line and write
    it as the index and summary of a folder without shards (stages after this one have no features)."""
    identity = target_identity(target, cfg.trust_remote_code)
    record = {"backend": cfg.target_backend, "gpu_only": line,
              "layer_ids": layer_ids_of(cfg, identity["num_hidden_layers"]),
              "dtype": cfg.hidden_dtype, "target": identity, "samples": 0, "tokens": 0, "shards": 0,
              "hidden_dir": str(out_dir)}
    log(f"stage 04 on {Path(target).name} with target_backend {cfg.target_backend}: {line}")
    outputs.write_index(out_dir, {**record, "hidden_size": identity["hidden_size"], "layer_convention": "output",
                                 "num_samples": 0, "num_tokens": 0, "bytes": 0, "shards": []})
    outputs.write_summary(out_dir, record)
    return record


def write_config(target, files, out_dir, cfg: HiddenConfig, *, reference_logprobs: str | None = None,
                 into: Path | None = None) -> Path:
    """The one file a torchrun rank reads (in `into`, by default `out_dir`): where, what, and `cfg`."""
    out_dir = Path(out_dir)
    path = Path(into or out_dir) / CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"target": str(target), "token_files": [str(f) for f in files], "out_dir": str(out_dir),
                             "reference_logprobs": reference_logprobs, "config": asdict(cfg)})
    return path


def launch(target, files, out_dir, cfg: HiddenConfig, *, reference_logprobs: str | None = None, attempts: int = 2,
           log=print) -> dict:
    """Run `extract` as `cfg.nproc_per_node` torchrun ranks on this machine (one per GPU, or gloo on
    CPU), of `cfg.nnodes` machines in all; returns rank 0's summary. A failed torchrun is started
    again (`attempts` in all); whole shards are kept."""
    here = launch_dir(out_dir, cfg.nnodes)
    config = write_config(target, files, out_dir, cfg, reference_logprobs=reference_logprobs, into=here)
    outputs.remove_summary(out_dir)
    try:
        torchrun(cfg.nproc_per_node, "draftsmith.hidden", [str(config)], nnodes=cfg.nnodes,
                 rdzv_endpoint=cfg.rdzv_endpoint, attempts=attempts, log=log)
    finally:
        done_launching(here, cfg.nnodes)
    return outputs.read_summary(out_dir)


def main(argv: list[str] | None = None) -> int:
    """`[torchrun ...] python -m draftsmith.hidden CONFIG.json` (a config `write_config` wrote)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc-per-node N -m draftsmith.hidden CONFIG.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    extract(resolve_target(job["target"], log=lambda *m: None), job["token_files"], job["out_dir"],
            HiddenConfig(**job["config"]), reference_logprobs=job["reference_logprobs"],
            log=lambda m: print(m, flush=True))
    return 0


# ---- extraction: one rank's work, the same on every rank ----

def open_capture(target_backend: str, target, layer_ids: list[int], *, device: str, log=print, **vllm_options):
    """A capture of layers `layer_ids` (output convention) on `target` through `target_backend`
    (`hf` or `vllm`); `vllm_options` are `VllmCapture`'s keyword arguments (`hf` reads only
    `trust_remote_code`)."""
    if target_backend == "hf":
        return Capture(load_target(target, device, vllm_options.get("trust_remote_code", False)), layer_ids)
    if target_backend == "vllm":
        return VllmCapture(target, layer_ids, log=log, **vllm_options)
    raise ValueError(f"target_backend must be one of {BACKENDS}, got {target_backend!r}")


def engine_options(cfg: HiddenConfig) -> dict:
    """`cfg`'s settings of the vLLM engine, as `VllmCapture`'s keyword arguments."""
    return dict(tensor_parallel_size=cfg.tensor_parallel_size, trust_remote_code=cfg.trust_remote_code,
                gpu_memory_utilization=cfg.gpu_memory_utilization, max_num_batched_tokens=cfg.max_num_batched_tokens,
                vllm_model_runner=cfg.vllm_model_runner, engine_env=cfg.engine_env,
                disable_custom_all_reduce=cfg.disable_custom_all_reduce, kv_cache_dtype=cfg.kv_cache_dtype)


def check_settings(cfg: HiddenConfig) -> None:
    """Raise ValueError naming the first setting of `cfg` that `extract` cannot run with (the
    backend, the engine's settings, the storage dtype; its bounds were checked when it was built)."""
    if cfg.target_backend not in BACKENDS:
        raise ValueError(f"target_backend must be one of {BACKENDS}, got {cfg.target_backend!r}")
    engine_settings(cfg.vllm_model_runner, cfg.engine_env, cfg.kv_cache_dtype)
    if cfg.hidden_dtype not in outputs.DTYPES:
        raise ValueError(f"hidden_dtype must be one of {outputs.DTYPES}, got {cfg.hidden_dtype!r}")


def layer_ids_of(cfg: HiddenConfig, n_layers: int) -> list[int]:
    """The layer ids to capture on a target of `n_layers`, in the output convention, ascending:
    `cfg.layer_ids` when given, else `cfg.layer_set`'s (`layers.capture_layer_ids`)."""
    if not cfg.layer_ids:
        return layers.capture_layer_ids(n_layers, cfg.layer_set)
    ids = layers.in_output_convention(list(cfg.layer_ids), cfg.layer_convention)
    if len(set(ids)) != len(ids) or not all(0 <= k < n_layers for k in ids):
        raise ValueError(f"layer_ids {list(cfg.layer_ids)} ({cfg.layer_convention} convention): need "
                         f"distinct layers of the target's {n_layers} (output ids 0..{n_layers - 1})")
    return sorted(ids)


def extract(target: str | os.PathLike, token_files: list[str | os.PathLike], out_dir: str | os.PathLike,
            cfg: HiddenConfig, *, reference_logprobs: str | None = None, capture=None, log=print) -> dict:
    """Extract hidden states of every sample in `token_files` into `out_dir` (shards + index) as
    `cfg` says, keeping whole shards of an earlier run; `reference_logprobs`, stage 01's
    logprobs.jsonl, is what the check holds the engine to. Runs as one rank of several under
    torchrun (`hf`). `target_backend` `vllm` starts an engine (`engine_options`), unless `capture`,
    an open capture of the same target and layers, is given to reuse. Returns a summary (rank 0: of
    the whole run)."""
    check_settings(cfg)
    if capture is not None and capture.backend != cfg.target_backend:
        raise ValueError(f"capture runs on {capture.backend!r}, not on target_backend {cfg.target_backend!r}")
    if cfg.target_backend == "vllm" and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        raise ValueError("target_backend vllm runs one engine per node (tensor parallel over the node's GPUs): "
                         "nproc_per_node must be 1; set tensor_parallel_size, and nnodes for several nodes")
    d = init_dist(gpu=cfg.target_backend != "vllm")  # vLLM's engine owns the GPUs
    say = log if d.world == 1 else (lambda m: log(f"[rank {d.rank}/{d.world}] {m}"))
    held = None
    try:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        identity = target_identity(target, cfg.trust_remote_code)
        # every rank runs with the same settings; where the checkpoint lies may differ by node: its fingerprint
        d.check_together(out_dir, {**asdict(cfg), "target_model_path": identity["fingerprint"],
                                   "token_files": [str(f) for f in token_files], "out_dir": str(out_dir),
                                   "reference_logprobs": reference_logprobs})
        layer_ids = layer_ids_of(cfg, identity["num_hidden_layers"])
        samples = read_tokens(token_files, identity["vocab_size"])
        reference = read_reference(reference_logprobs, identity["vocab_size"]) \
            if reference_logprobs and cfg.check_samples > 0 else []
        plan = None
        if d.main:
            try:
                held = lock(out_dir)
                plan = prepare(out_dir, samples, identity, layer_ids, cfg, say)
                say(_start_line(out_dir, plan))
            except Exception as e:  # tell the other ranks, so they stop too instead of waiting
                d.broadcast({"error": f"{type(e).__name__}: {e}"})
                raise
        plan = d.broadcast(plan)
        if not isinstance(plan, ExtractionPlan):
            raise RuntimeError(f"rank 0 failed: {plan['error']}")
        if plan.samples != fingerprint_samples(samples):
            raise RuntimeError(f"rank {d.rank} read different samples than rank 0 from {token_files}")
        mine = plan.shards[d.rank::d.world]
        engine_log = out_dir / (ENGINE_LOG if d.world == 1 else ENGINE_LOG.replace(".log", f".rank{d.rank}.log"))
        # every rank checks its own engine on the same first samples, before any shard
        try:
            written, seconds, checked, engine = _capture_shards(
                target, capture, samples, reference, mine, plan.order(), layer_ids, cfg, plan.settings, out_dir,
                engine_log, f"hidden {d.rank}/{d.world}" if d.world > 1 else "hidden", say)
        except check.CheckFailed as e:
            if d.main:
                _record_failed_check(out_dir, e.record, identity, layer_ids, cfg)
            raise
        results = d.gather({"written": written, "seconds": seconds, "check": checked, "engine": engine})
        summary = None
        if d.main:
            try:
                summary = _finish(out_dir, plan, results, identity, layer_ids, cfg, say)
            except Exception as e:
                d.broadcast({"error": f"{type(e).__name__}: {e}"})
                raise
        summary = d.broadcast(summary)  # every node returns once rank 0 has written the index
        if "error" in summary:
            raise RuntimeError(f"rank 0 failed: {summary['error']}")
        return summary
    finally:
        if held is not None:
            held.close()
        d.close()


# ---- plan: samples cut into batches by length (longest first, at most 10% padding on `hf`; vLLM packs
# prefills, so there only the token count matters), batches grouped into shards of about `shard_mb`

@dataclass(frozen=True)
class ExtractionPlan:
    """One extraction, planned by rank 0 and the same on every rank: `keep`, the index entries of the
    whole shards kept from an earlier run; `shards`, (file name, batches of sample indices) to
    extract; `settings`, what each shard records in its header; `samples`, the fingerprint of the
    samples planned (`fingerprint_samples`)."""

    keep: list[dict]
    shards: list[tuple[str, list[list[int]]]]
    settings: dict
    samples: str

    def order(self) -> list[int]:
        """Every sample index to extract, in extraction order."""
        return [i for _, batches in self.shards for b in batches for i in b]


def plan_batches(lengths: list[int], max_tokens_per_batch: int, max_padding: float = 0.1) -> list[list[int]]:
    """Indices into `lengths`, longest first (an out-of-memory shows on the first batch), cut so that
    each padded batch (count x its longest) holds at most `max_tokens_per_batch` and at most
    `max_padding` of it is padding; a sample longer than that goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    real = 0
    for i in order:
        if batches:
            width, n = lengths[batches[-1][0]], len(batches[-1]) + 1
            if n * width <= max_tokens_per_batch and real + lengths[i] >= (1 - max_padding) * n * width:
                batches[-1].append(i)
                real += lengths[i]
                continue
        batches.append([i])
        real = lengths[i]
    return batches


def plan_shards(batches: list[list[int]], lengths: list[int], tokens_per_shard: int) -> list[list[list[int]]]:
    """Consecutive batches grouped into shards of at most `tokens_per_shard` real tokens (a bigger
    batch makes a shard alone)."""
    out: list[list[list[int]]] = []
    size = 0
    for b in batches:
        n = sum(lengths[i] for i in b)
        if out and size + n <= tokens_per_shard:
            out[-1].append(b)
            size += n
        else:
            out.append([b])
            size = n
    return out


def bytes_per_token(hidden_size: int, dtype: str, n_layers: int = 3) -> int:
    """Disk bytes per token: aux (n_layers) + last (+ fp8 scales), input_ids (int64), loss_mask (uint8)."""
    if dtype == "bf16":
        hidden = 2 * (n_layers + 1) * hidden_size
    elif dtype == "fp8":
        hidden = (n_layers + 1) * hidden_size + 4 * (n_layers + 1)
    else:
        raise ValueError(f"dtype must be one of {outputs.DTYPES}, got {dtype!r}")
    return hidden + 8 + 1


def check_disk(directory: Path, tokens: int, per_token: int, dtype: str) -> None:
    need = tokens * per_token + (64 << 20)
    free = shutil.disk_usage(directory).free
    if need > free:
        hint = " or hidden_dtype fp8 (about half the bytes)" if dtype == "bf16" else ""
        raise OSError(f"{directory}: hidden states need about {need / 2**30:,.2f} GiB ({tokens:,} tokens x "
                      f"{per_token:,} bytes, dtype {dtype}) but only {free / 2**30:,.2f} GiB is free; free "
                      f"space, point outputs_dir at a bigger disk{hint}")


# ---- resume: each shard's header records its samples (with a digest of their tokens) and settings; a
# re-run keeps every whole shard whose samples are unchanged and re-plans the rest (a killed run leaves
# at most `*.tmp` files and vLLM's scratch folder; `lock` refuses a second run into the same folder)

def settings_of(identity: dict, layer_ids: list[int], dtype: str, backend: str) -> dict:
    return {"target": identity["fingerprint"], "layer_ids": list(layer_ids), "dtype": dtype, "backend": backend}


def shard_entry(file: str, samples: list[dict], size: int, health: dict | None = None) -> dict:
    """An index entry; `health`: the shard's `check.health` record (None for shards written before it)."""
    return {"file": file, "tokens": sum(s["length"] for s in samples), "bytes": size, "samples": samples,
            "health": health}


def scan_shards(out_dir: Path, settings: dict, by_key: dict[tuple[str, str], Sample]) -> tuple[list[dict], list[tuple[Path, str]]]:
    """(entries of whole shards to keep, stale shard files with why). A shard is stale when it is cut
    short or unreadable, or one of its samples is gone, excluded, changed, or already held by an
    earlier shard. Shards made with other settings are an error: mixing them would give the drafter
    inconsistent features."""
    keep, stale, done = [], [], set()
    for path in outputs.shard_files(out_dir):
        problem = outputs.shard_problem(path)
        try:
            meta = None if problem else outputs.read_header(path)
        except Exception as e:  # unreadable (not one of ours, or a damaged disk): re-extract its samples
            problem = f"unreadable ({type(e).__name__})"
        if problem:
            stale.append((path, problem))
            continue
        old = json.loads(meta.get("settings", "{}"))
        if old != settings:
            diff = ", ".join(f"{k} {old.get(k)!r} -> {v!r}" for k, v in settings.items() if old.get(k) != v)
            raise ValueError(f"{path}: extracted with other settings ({diff}); use another run_name, or "
                             f"delete {out_dir} to re-extract everything")
        rows = json.loads(meta["samples"])  # [dataset, sample_id, length, digest] each
        keys = [(d, s) for d, s, _, _ in rows]
        unchanged = all(k in by_key and by_key[k].digest == row[3] for k, row in zip(keys, rows))
        if not unchanged or done.intersection(keys) or len(set(keys)) != len(keys):
            stale.append((path, "its samples changed since it was written"))
            continue
        done.update(keys)
        samples, off = [], 0
        for d, s, n, _ in rows:
            samples.append({"sample_id": s, "dataset": d, "source": by_key[d, s].source, "offset": off, "length": n})
            off += n
        health = json.loads(meta["health"]) if "health" in meta else None
        keep.append(shard_entry(path.name, samples, path.stat().st_size, health))
    return keep, stale


def prepare(out_dir: Path, samples: list[Sample], identity: dict, layer_ids: list[int], cfg: HiddenConfig,
            log) -> ExtractionPlan:
    """Rank 0: clear leftovers, keep whole shards, check the disk, plan the rest."""
    dtype, backend = cfg.hidden_dtype, cfg.target_backend
    for tmp in out_dir.glob("*.tmp"):
        tmp.unlink()
    for bad in sorted(out_dir.glob(outputs.REJECTED_GLOB)):  # failed their health check last time: extracted again
        log(f"{bad.name}: removed (its health check failed last run); re-extracting its samples")
        bad.unlink()
    shutil.rmtree(out_dir / SCRATCH, ignore_errors=True)
    settings = settings_of(identity, layer_ids, dtype, backend)
    by_key = {s.key: s for s in samples}
    keep, stale = scan_shards(out_dir, settings, by_key)
    numbers = [outputs.shard_number(p) for p in outputs.shard_files(out_dir)]
    for p, why in stale:
        log(f"{p.name}: {why}; re-extracting its samples")
        p.unlink()
    outputs.remove_index(out_dir)  # rewritten when every shard is whole again
    done = {(s["dataset"], s["sample_id"]) for e in keep for s in e["samples"]}
    todo = [i for i, s in enumerate(samples) if s.key not in done]
    lengths = [len(samples[i]) for i in todo]
    per_token = bytes_per_token(identity["hidden_size"], dtype, len(layer_ids))
    log(f"capturing layers {layer_ids} and the final state: {per_token:,} bytes per token ({dtype}), "
        f"{sum(lengths) * per_token / 2**30:,.2f} GiB for the {sum(lengths):,} tokens still to extract")
    check_disk(out_dir, sum(lengths), per_token, dtype)
    per_shard = max(1, int(cfg.shard_mb * 2**20 / per_token))
    # vLLM packs prefills without padding: only the token count of a batch matters
    max_padding = 1.0 if backend == "vllm" else 0.1
    batches = [[todo[j] for j in b] for b in plan_batches(lengths, cfg.max_tokens_per_batch, max_padding)]
    planned = plan_shards(batches, [len(s) for s in samples], per_shard)
    first = max(numbers, default=-1) + 1
    return ExtractionPlan(keep, [(outputs.shard_name(first + n), p) for n, p in enumerate(planned)], settings,
                          fingerprint_samples(samples))


def lock(out_dir: Path):
    """Held by rank 0 for the whole run: two extractions into one folder would plan the same shards."""
    f = open(out_dir / LOCK, "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RuntimeError(f"{out_dir}: another extraction is writing into this folder; wait for it to "
                           f"finish or stop it") from None
    return f


def fingerprint_samples(samples: list[Sample]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for s in samples:
        h.update(f"{s.dataset}\0{s.sample_id}\0{s.digest}\n".encode())
    return h.hexdigest()


# ---- extract: stage 04's own check, then this rank's shards

def _capture_shards(target, capture, samples, reference, mine, order, layer_ids, cfg: HiddenConfig, settings,
                    out_dir, engine_log, desc, log):
    """This rank's shards through `capture`, or through one opened here (and closed) for them, after
    stage 04's own check on the same engine (`check_samples` of the samples in extraction `order`)."""
    if capture is not None and getattr(capture, "ids", layer_ids) != layer_ids:
        raise ValueError(f"capture keeps layers {capture.ids}, this run wants {layer_ids}")
    work = dict(target=target, order=order, reference=reference, layer_ids=layer_ids, settings=settings,
                out_dir=out_dir, desc=desc, log=log)
    if capture is not None or not mine:
        return _run_shards(capture, samples, mine, cfg, **work)
    opts = engine_options(cfg)
    if cfg.target_backend == "vllm":
        # the check may take any sample of the run (the first in `order`, and the longest), not only this rank's
        longest = max(len(samples[i]) for i in ([i for _, p in mine for b in p for i in b] +
                                                 (list(order) if cfg.check_samples > 0 else [])))
        longest = max([longest] + [len(r["prompt_ids"]) + len(r["output_ids"]) for r in reference])
        opts = {"max_model_len": longest + 1, "log_file": engine_log, **opts}
    opened = open_capture(cfg.target_backend, target, layer_ids, device=cfg.device, log=log, **opts)
    try:
        return _run_shards(opened, samples, mine, cfg, **work)
    finally:
        opened.close()


def _run_shards(capture, samples, mine, cfg: HiddenConfig, *, target, order, reference, layer_ids, settings, out_dir,
                desc, log) -> tuple[list, float, outputs.CheckRecord | None, dict | None]:
    """Stage 04's own check, then this rank's shards (writing one overlaps computing the next);
    returns (shard entries, seconds, the check's record, what ran: `check.engine_of`)."""
    if not mine:
        return [], 0.0, None, None
    to_check = check.check_samples_of(samples, order, cfg.check_samples)
    crossing = check.crossing_sample_of(samples, order, getattr(capture, "step_tokens", None)) if to_check else None
    # one scratch folder per process: ranks on several nodes share out_dir, and each engine numbers
    # its feature files from 0 (a shared folder mixed two ranks' files, and one rank's cleanup
    # removed the files another was waiting for)
    # (`scratch_dir`: elsewhere than out_dir, e.g. local NVMe: every feature byte is written there first)
    capture.scratch_dir = Path(cfg.scratch_dir or out_dir) / SCRATCH / f"{socket.gethostname()}-{os.getpid()}"
    norm_weight = final_norm(target)[0]
    total = sum(len(samples[i]) for _, plan in mine for b in plan for i in b)
    written, pending, checked = [], None, None
    t0 = time.perf_counter()
    try:
        if to_check:
            checked = check.run_check(capture, to_check, target=target, layer_ids=layer_ids, dtype=cfg.hidden_dtype,
                                      work_dir=capture.scratch_dir, check_answers=cfg.check_answers,
                                      crossing_sample=crossing, reference=reference, log=log)
            if not checked.passed:
                raise check.CheckFailed(check.failure_line(checked), checked)
            log(check.passed_line(checked))
        else:
            log("stage 04's own check is off (check_samples 0): nothing proves these features")
        log(f"extracting {total:,} tokens into {len(mine)} shard(s), layers {layer_ids} (output convention), "
            f"{cfg.hidden_dtype}, on {capture.device}" + (f"; each batch's features pass through {capture.scratch_dir} "
                                              f"(written twice: there, then in the shard; scratch_dir)"
                                              if capture.backend == "vllm" else ""))
        with ThreadPoolExecutor(max_workers=1) as writer, Progress(total=total, desc=desc, unit="tok") as bar:
            for name, plan in mine:
                aux, last, order = [], [], []
                for b in plan:
                    batch = [samples[i] for i in b]
                    a, l = capture(batch)
                    aux.append(a)
                    last.append(l)
                    order.extend(batch)
                    bar.update(a.shape[0])
                if pending is not None:
                    written.append(pending.result())  # at most one shard waits for the disk
                pending = writer.submit(_write, out_dir / name, torch.cat(aux), torch.cat(last), order,
                                        cfg.hidden_dtype, settings, layer_ids, norm_weight)
                bar.set(shards=len(written) + 1)
            if pending is not None:
                written.append(pending.result())
    finally:
        shutil.rmtree(capture.scratch_dir, ignore_errors=True)
        try:
            capture.scratch_dir.parent.rmdir()  # the last rank out removes the shared parent
        except OSError:
            pass
    return written, time.perf_counter() - t0, checked, check.engine_of(capture)


def _write(path: Path, aux, last, order: list[Sample], dtype: str, settings: dict, layer_ids, norm_weight) -> dict:
    lengths = [len(s) for s in order]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    rows = [[s.dataset, s.sample_id, len(s), s.digest] for s in order]
    health = check.health(aux, last, layer_ids, norm_weight)
    size = outputs.write_shard(path, aux, last, torch.cat([s.input_ids for s in order]),
                              torch.cat([s.loss_mask for s in order]), offsets, dtype,
                              metadata={"settings": json.dumps(settings), "samples": json.dumps(rows),
                                        "health": json.dumps(health)})
    samples = [{"sample_id": s.sample_id, "dataset": s.dataset, "source": s.source, "offset": int(o), "length": len(s)}
               for s, o in zip(order, offsets)]
    return shard_entry(path.name, samples, size, health)


# ---- check, outputs and summary

def _record_failed_check(out_dir: Path, record: outputs.CheckRecord, identity: dict, layer_ids: list[int],
                         cfg: HiddenConfig) -> None:
    """A failed check: `check.json`, and an index that lists no shard and says why (readers refuse it)."""
    written = record.to_dict()
    write_json_atomic(out_dir / outputs.CHECK, written)
    outputs.write_index(out_dir, {"dtype": cfg.hidden_dtype, "hidden_size": identity["hidden_size"],
                                  "layer_ids": layer_ids, "layer_convention": "output", "backend": cfg.target_backend,
                                  "engine": dict(record.ran),
                                  "target": identity, "check": written, "num_samples": 0, "num_tokens": 0,
                                  "bytes": 0, "shards": []})


def _finish(out_dir, plan: ExtractionPlan, results, identity, layer_ids, cfg: HiddenConfig, log) -> dict:
    """Rank 0: merge every rank's shards with the kept ones into index.json, leaving out (and
    renaming, so a re-run extracts their samples again) the shards whose health fails."""
    entries = plan.keep + [e for r in results for e in r["written"]]
    entries.sort(key=lambda e: e["file"])
    entries, rejected = check.judge_shards(entries)
    for e in rejected:
        name = outputs.rejected_name(e["file"])
        os.replace(out_dir / e["file"], out_dir / name)
        log(f"{e['file']} rejected ({'; '.join(e['problems'])}): renamed {name}, its {len(e['samples'])} samples "
            f"left out; re-running stage 04 extracts them again")
        e["file"] = name
    checked = _this_runs_check(out_dir, [r["check"] for r in results])
    engine = next((r["engine"] for r in results if r.get("engine")), None)  # what ran (rank 0's engine first)
    missing = [e["file"] for e in entries if not (out_dir / e["file"]).is_file()]
    if missing:
        raise FileNotFoundError(f"{out_dir}: shards {missing[:3]} written by other ranks are not visible here; "
                                f"the output folder must be on a filesystem every node shares")
    keys = [(s["dataset"], s["sample_id"]) for e in entries for s in e["samples"]]
    if len(keys) != len(set(keys)):
        raise RuntimeError(f"{out_dir}: a sample appears in two shards")  # planning makes this impossible
    tokens = sum(e["tokens"] for e in entries)
    dtype, backend = cfg.hidden_dtype, cfg.target_backend
    index = {"dtype": dtype, "hidden_size": identity["hidden_size"], "layer_ids": layer_ids,
             "layer_convention": "output", "hf_hidden_state_indices": layers.hf_hidden_state_indices(layer_ids),
             "last": "final hidden state after the final norm (input of lm_head)",
             "backend": backend, "engine": engine, "target": identity, "check": checked,
             "num_samples": len(keys), "num_tokens": tokens,
             "bytes": sum(e["bytes"] for e in entries), "shards": entries, "rejected_shards": rejected}
    outputs.write_index(out_dir, index)
    new_tokens = sum(e["tokens"] for r in results for e in r["written"])
    seconds = max(r["seconds"] for r in results)
    summary = {"samples": len(keys), "tokens": tokens, "shards": len(entries), "shards_kept": len(plan.keep),
               "shards_written": sum(len(r["written"]) for r in results), "tokens_extracted": new_tokens,
               "extract_s": round(seconds, 3), "tokens_per_s": round(new_tokens / seconds, 1) if seconds else None,
               "bytes": index["bytes"], "bytes_per_token": round(index["bytes"] / tokens, 1) if tokens else None,
               "dtype": dtype, "layer_ids": layer_ids, "backend": backend, "ranks": len(results),
               "shards_rejected": len(rejected), "hidden_dir": str(out_dir), "engine": engine,
               "check": checked}
    outputs.write_summary(out_dir, summary)
    log(f"{summary['samples']:,} samples, {tokens:,} tokens in {len(entries)} shard(s) "
        f"({summary['shards_kept']} kept from an earlier run), {index['bytes'] / 2**20:,.1f} MiB")
    return summary


def _this_runs_check(out_dir: Path, records: list[outputs.CheckRecord | None]) -> dict | None:
    """The check of this run (rank 0's record, with every rank's verdict when there are several),
    as saved in `check.json`; when this run extracted nothing, the one saved by the run that did."""
    records = [r for r in records if r]
    path = out_dir / outputs.CHECK
    if not records:
        return json.loads(path.read_text()) if path.is_file() else None
    record = replace(records[0], ranks_checked=len(records), passed=all(r.passed for r in records)).to_dict()
    write_json_atomic(path, record)
    return record


def _start_line(out_dir: Path, plan: ExtractionPlan) -> str:
    """Whether this run resumes or starts clean, and what the last run's check said."""
    last = outputs.read_check(out_dir) if (out_dir / outputs.CHECK).is_file() else None
    said = ("" if last is None else "; the last run's check passed" if last.passed
            else f"; the last run's check FAILED ({'; '.join(last.problems)}), and no shard was kept from it")
    if plan.keep:
        tokens = sum(e["tokens"] for e in plan.keep)
        return (f"resuming: {len(plan.keep)} whole shard(s) ({tokens:,} tokens) kept from an earlier run, "
                f"{len(plan.shards)} to extract{said}")
    return f"starting clean: {len(plan.shards)} shard(s) to extract{said}"
