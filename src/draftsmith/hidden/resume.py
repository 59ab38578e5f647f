"""Stage 04's resume: what the shards already in the folder hold, and the plan for the rest.

Each shard records in its header the samples it holds (with a digest of their tokens) and the
settings it was made with, so a re-run keeps every whole shard whose samples are unchanged and
re-plans only the rest. A killed run leaves at most `*.tmp` files (and vLLM's scratch folder),
removed here before planning; the index is removed until every shard is whole again. A second run
into a folder that one is still writing is refused (`lock`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
from pathlib import Path

from . import outputs
from ..tokens.outputs import Sample
from .plan import ExtractionPlan, bytes_per_token, check_disk, plan_batches, plan_shards

SCRATCH = ".vllm-scratch"  # vLLM's per-sample feature files, deleted once read
LOCK = ".lock"


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


def prepare(out_dir: Path, samples: list[Sample], identity: dict, layer_ids: list[int], dtype: str,
             max_tokens_per_batch: int, shard_mb: float, backend: str, log) -> ExtractionPlan:
    """Rank 0: clear leftovers, keep whole shards, check the disk, plan the rest."""
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
    per_shard = max(1, int(shard_mb * 2**20 / per_token))
    # vLLM packs prefills without padding: only the token count of a batch matters
    max_padding = 1.0 if backend == "vllm" else 0.1
    batches = [[todo[j] for j in b] for b in plan_batches(lengths, max_tokens_per_batch, max_padding)]
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
