"""Stage 04's extraction: run the target over the token ids and write the features as shards.

For every token of every sample: the outputs of the three auxiliary decoder layers (`aux`, side by
side) and the final hidden state after the final norm (`last`: what the lm_head reads). Layer ids
are kept in the OUTPUT convention (`draftsmith.layers`). The target runs behind
one seam (`open_capture`): `hf` in this process (one process per rank under torchrun, shard i
going to rank i mod world size, each rank writing its own shards) or `vllm` (one engine in a child
process, tensor parallel over the node's GPUs; on several nodes one torchrun rank per node, each
with its engine, the shards split the same way). With vLLM each sample's features pass
through one file in the scratch folder, deleted once read. Writing a shard overlaps computing the
next one; rank 0 merges every rank's entries into the index, written last (`draftsmith.hidden.outputs`).
The backend is one of the settings a shard records, so features of two engines are never mixed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .. import layers, parameters
from . import check, outputs
from ..distributed import init_dist
from ..files import write_json_atomic
from ..progress import Progress
from ..targets.checkpoint import final_norm, load_target
from ..targets.hf import Capture
from ..targets.vllm import VllmCapture, engine_settings
from ..targets.checkpoint import target_identity
from ..providers.logprobs import read_reference
from ..tokens.outputs import Sample, read_tokens
from .plan import ExtractionPlan
from .resume import SCRATCH, fingerprint_samples, lock, prepare, shard_entry

ENGINE_LOG = "vllm.log"  # on several ranks (one engine per node): vllm.rank<N>.log

BACKENDS = ("hf", "vllm")


def open_capture(target_backend: str, target, layer_ids: list[int], *, device: str, log=print, **vllm_options):
    """A capture of layers `layer_ids` (output convention) on `target` through `target_backend`
    (`hf` or `vllm`)."""
    if target_backend == "hf":
        return Capture(load_target(target, device, vllm_options.get("trust_remote_code", False)), layer_ids)
    if target_backend == "vllm":
        return VllmCapture(target, layer_ids, log=log, **vllm_options)
    raise ValueError(f"target_backend must be one of {BACKENDS}, got {target_backend!r}")


@dataclass
class Settings:
    """How to extract: stage 04's settings under their names, each left out at its config's
    default (`parameters.declaration`), held to its declared bounds by `check`."""

    layer_ids: list[int] | None = parameters.default_field("layer_ids")  # None or []: layer_set's
    layer_set: str = parameters.default_field("layer_set")              # eagle3, dflash or both
    layer_convention: str = parameters.default_field("layer_convention")  # how layer_ids count (layers.py)
    hidden_dtype: str = parameters.default_field("hidden_dtype")          # bf16, or fp8 with per-token scales
    max_tokens_per_batch: int = parameters.default_field("max_tokens_per_batch")
    shard_mb: float = parameters.default_field("shard_mb")
    device: str = parameters.default_field("device")                      # hf: auto, cpu, cuda, cuda:0, ...
    target_backend: str = parameters.default_field("target_backend")      # hf or vllm
    check_samples: int = parameters.default_field("check_samples")        # stage 04's own check (check.py); 0: off
    check_answers: bool = parameters.default_field("check_answers")       # the check also holds the engine to the answers
    scratch_dir: str = parameters.default_field("scratch_dir")            # vllm: the per-sample files; "": out_dir
    engine_options: dict = field(default_factory=dict)     # vllm: `VllmCapture`'s keyword arguments
    reference_logprobs: str | None = None  # stage 01's logprobs.jsonl: the check holds the engine to it (check.py)

    def check(self) -> None:
        parameters.check_bounds({"max_tokens_per_batch": self.max_tokens_per_batch, "shard_mb": self.shard_mb,
                                 "check_samples": self.check_samples})
        if self.target_backend not in BACKENDS:
            raise ValueError(f"target_backend must be one of {BACKENDS}, got {self.target_backend!r}")
        o = self.engine_options
        engine_settings(o.get("vllm_model_runner", "v1"), o.get("engine_env"), o.get("kv_cache_dtype", "auto"))
        if self.hidden_dtype not in outputs.DTYPES:
            raise ValueError(f"hidden_dtype must be one of {outputs.DTYPES}, got {self.hidden_dtype!r}")

    def layer_ids_of(self, n_layers: int) -> list[int]:
        """The layer ids to capture on a target of `n_layers`, in the output convention, ascending:
        `layer_ids` when given, else `layer_set`'s (`layers.capture_layer_ids`)."""
        if not self.layer_ids:
            return layers.capture_layer_ids(n_layers, self.layer_set)
        ids = layers.in_output_convention(list(self.layer_ids), self.layer_convention)
        if len(set(ids)) != len(ids) or not all(0 <= k < n_layers for k in ids):
            raise ValueError(f"layer_ids {list(self.layer_ids)} ({self.layer_convention} convention): need "
                             f"distinct layers of the target's {n_layers} (output ids 0..{n_layers - 1})")
        return sorted(ids)


def extract(target: str | os.PathLike, token_files: list[str | os.PathLike], out_dir: str | os.PathLike, *,
            capture=None, log=print, **settings) -> dict:
    """Extract hidden states of every sample in `token_files` into `out_dir` (shards + index),
    keeping whole shards of an earlier run. `settings` are `Settings`' fields. Runs as one rank of
    several under torchrun (`hf`). `target_backend` `vllm` starts an engine with `engine_options`
    (tensor_parallel_size, trust_remote_code, gpu_memory_utilization, max_num_batched_tokens, ...),
    unless `capture`, an open capture of the same target and layers, is given to reuse. Returns a
    summary (rank 0: of the whole run)."""
    s = Settings(**settings)
    s.check()
    if capture is not None and capture.backend != s.target_backend:
        raise ValueError(f"capture runs on {capture.backend!r}, not on target_backend {s.target_backend!r}")
    if s.target_backend == "vllm" and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        raise ValueError("target_backend vllm runs one engine per node (tensor parallel over the node's GPUs): "
                         "nproc_per_node must be 1; set tensor_parallel_size, and nnodes for several nodes")
    d = init_dist(gpu=s.target_backend != "vllm")  # vLLM's engine owns the GPUs
    say = log if d.world == 1 else (lambda m: log(f"[rank {d.rank}/{d.world}] {m}"))
    held = None
    try:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        identity = target_identity(target, bool(s.engine_options.get("trust_remote_code")))
        d.check_together(out_dir, {"target": identity["fingerprint"], "token_files": [str(f) for f in token_files],
                                   "out_dir": str(out_dir), **asdict(s)})
        layer_ids = s.layer_ids_of(identity["num_hidden_layers"])
        samples = read_tokens(token_files, identity["vocab_size"])
        reference = read_reference(s.reference_logprobs, identity["vocab_size"]) \
            if s.reference_logprobs and s.check_samples > 0 else []
        plan = None
        if d.main:
            try:
                held = lock(out_dir)
                plan = prepare(out_dir, samples, identity, layer_ids, s.hidden_dtype, s.max_tokens_per_batch,
                               s.shard_mb, s.target_backend, say)
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
                target, capture, samples, reference, mine, plan.order(), layer_ids, s, plan.settings, out_dir,
                engine_log,
                f"hidden {d.rank}/{d.world}" if d.world > 1 else "hidden", say)
        except check.CheckFailed as e:
            if d.main:
                _record_failed_check(out_dir, e.record, identity, layer_ids, s)
            raise
        results = d.gather({"written": written, "seconds": seconds, "check": checked, "engine": engine})
        summary = None
        if d.main:
            try:
                summary = _finish(out_dir, plan, results, identity, layer_ids, s.hidden_dtype, s.target_backend, say)
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


def _capture_shards(target, capture, samples, reference, mine, order, layer_ids, s: Settings, settings, out_dir,
                    engine_log, desc, log):
    """This rank's shards through `capture`, or through one opened here (and closed) for them, after
    stage 04's own check on the same engine (`check_samples` of the samples in extraction `order`)."""
    if capture is not None and getattr(capture, "ids", layer_ids) != layer_ids:
        raise ValueError(f"capture keeps layers {capture.ids}, this run wants {layer_ids}")
    work = dict(target=target, order=order, check_samples=s.check_samples, check_answers=s.check_answers,
                reference=reference, layer_ids=layer_ids, dtype=s.hidden_dtype, settings=settings, out_dir=out_dir,
                desc=desc, log=log, scratch_dir=s.scratch_dir)
    if capture is not None or not mine:
        return _run_shards(capture, samples, mine, **work)
    opts = dict(s.engine_options)
    if s.target_backend == "vllm":
        # the check may take any sample of the run (the first in `order`, and the longest), not only this rank's
        longest = max(len(samples[i]) for i in ([i for _, p in mine for b in p for i in b] +
                                                 (list(order) if s.check_samples > 0 else [])))
        longest = max([longest] + [len(r["prompt_ids"]) + len(r["output_ids"]) for r in reference])
        opts = {"max_model_len": longest + 1, "log_file": engine_log, **opts}
    opened = open_capture(s.target_backend, target, layer_ids, device=s.device, log=log, **opts)
    try:
        return _run_shards(opened, samples, mine, **work)
    finally:
        opened.close()


def _run_shards(capture, samples, mine, *, target, order, check_samples, check_answers, reference, layer_ids, dtype,
                settings, out_dir, desc, log, scratch_dir: str = "") -> tuple[list, float, outputs.CheckRecord | None,
                                                                               dict | None]:
    """Stage 04's own check, then this rank's shards (writing one overlaps computing the next);
    returns (shard entries, seconds, the check's record, what ran: `check.engine_of`)."""
    if not mine:
        return [], 0.0, None, None
    to_check = check.check_samples_of(samples, order, check_samples)
    crossing = check.crossing_sample_of(samples, order, getattr(capture, "step_tokens", None)) if to_check else None
    # one scratch folder per process: ranks on several nodes share out_dir, and each engine numbers
    # its feature files from 0 (a shared folder mixed two ranks' files, and one rank's cleanup
    # removed the files another was waiting for)
    # (`scratch_dir`: elsewhere than out_dir, e.g. local NVMe: every feature byte is written there first)
    capture.scratch_dir = Path(scratch_dir or out_dir) / SCRATCH / f"{socket.gethostname()}-{os.getpid()}"
    norm_weight = final_norm(target)[0]
    total = sum(len(samples[i]) for _, plan in mine for b in plan for i in b)
    written, pending, checked = [], None, None
    t0 = time.perf_counter()
    try:
        if to_check:
            checked = check.run_check(capture, to_check, target=target, layer_ids=layer_ids, dtype=dtype,
                                      work_dir=capture.scratch_dir, check_answers=check_answers,
                                      crossing_sample=crossing, reference=reference, log=log)
            if not checked.passed:
                raise check.CheckFailed(check.failure_line(checked), checked)
            log(check.passed_line(checked))
        else:
            log("stage 04's own check is off (check_samples 0): nothing proves these features")
        log(f"extracting {total:,} tokens into {len(mine)} shard(s), layers {layer_ids} (output convention), "
            f"{dtype}, on {capture.device}" + (f"; each batch's features pass through {capture.scratch_dir} "
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
                pending = writer.submit(_write, out_dir / name, torch.cat(aux), torch.cat(last), order, dtype,
                                        settings, layer_ids, norm_weight)
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


def _record_failed_check(out_dir: Path, record: outputs.CheckRecord, identity: dict, layer_ids: list[int],
                         s: Settings) -> None:
    """A failed check: `check.json`, and an index that lists no shard and says why (readers refuse it)."""
    written = record.to_dict()
    write_json_atomic(out_dir / outputs.CHECK, written)
    outputs.write_index(out_dir, {"dtype": s.hidden_dtype, "hidden_size": identity["hidden_size"],
                                  "layer_ids": layer_ids, "layer_convention": "output", "backend": s.target_backend,
                                  "engine": dict(record.ran),
                                  "target": identity, "check": written, "num_samples": 0, "num_tokens": 0,
                                  "bytes": 0, "shards": []})


def _finish(out_dir, plan: ExtractionPlan, results, identity, layer_ids, dtype, backend, log) -> dict:
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
