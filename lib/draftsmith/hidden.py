"""Stage 04: run the target over the token ids and store the features the drafter learns from.

For every token of every sample: the outputs of the three auxiliary decoder layers (`aux`, side by
side) and the final hidden state after the final norm (`last`: the decoder's `last_hidden_state`,
what the lm_head reads; HF's `output_hidden_states[-1]` is that same normed tensor). Layer ids are
kept in the OUTPUT convention (`draftsmith.layers`): id k is captured by a forward hook on decoder
layer k, which is Hugging Face `output_hidden_states[k + 1]`. Only the decoder runs, not the lm_head.

How it runs
- Samples are sorted longest first and cut into batches whose padded size (count x longest) stays
  under `max_tokens_per_batch`, at most 10% of it padding; sequences are right-padded and run without an attention mask: under
  a causal mask a real token never sees the padding after it, and the padded rows are dropped before
  anything is stored.
- Consecutive batches make a shard of about `shard_mb`; the shard is the unit of writing (atomic,
  `shards.write_shard`) and of resuming. Each shard records in its header the samples it holds (with
  a digest of their tokens) and the settings it was made with, so a re-run keeps every whole shard
  whose samples are unchanged and re-plans only the rest. A killed run leaves at most a `*.tmp`
  file, removed on the next run; `index.json` is written last. A second run into a folder that
  one is still writing is refused.
- Under `torchrun` (or `launch`) rank 0 plans, shard i goes to rank i mod world size, each rank
  writes its own shards, and rank 0 merges their entries into the index. Several nodes need the
  output folder on a filesystem they all see.
- Free disk is checked against bytes per token x tokens before the target is even loaded.

- `backend` picks where the target runs (`draftsmith.target_backend`): `hf` (transformers, in
  this process or one per torchrun rank) or `vllm` (the serving engine in a child process, tensor
  parallel over the GPUs; one engine, so no torchrun). With vLLM a batch is a group of prefills the
  engine schedules itself (no padding); each sample's features pass through one file in
  `.vllm-scratch/`, deleted once read (and the folder with it at the end, or on the next run after
  a kill). The shards, index, resume and settings checks are the same for both; the backend is one
  of the settings, so features of two engines are never mixed in one folder.

Command line (what `launch` runs under torchrun):
  torchrun --nproc-per-node 8 -m draftsmith.hidden --target DIR --tokens A.jsonl B.jsonl --out DIR
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from . import layers, shards
from .progress import Progress
from .target.backends import BACKENDS, open_capture
from .target.checkpoint import load_target
from .target.identity import target_identity
from .tokens.outputs import Sample, read_tokens
from .torchrun import torchrun

SHARD_GLOB = "shard-*.safetensors"
SUMMARY = "summary.json"
SCRATCH = ".vllm-scratch"
ENGINE_LOG = "vllm.log"
LOCK = ".lock"


# ---- planning: batches by length, shards of batches --------------------------------------------

def plan_batches(lengths: list[int], max_tokens: int, max_padding: float = 0.1) -> list[list[int]]:
    """Indices into `lengths`, longest first (an out-of-memory shows on the first batch), cut so that
    each padded batch (count x its longest) holds at most `max_tokens` and at most `max_padding` of
    it is padding; a sample longer than `max_tokens` goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    real = 0
    for i in order:
        if batches:
            width, n = lengths[batches[-1][0]], len(batches[-1]) + 1
            if n * width <= max_tokens and real + lengths[i] >= (1 - max_padding) * n * width:
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


def bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Disk bytes per token: aux + last (+ fp8 scales), input_ids (int64), loss_mask (uint8)."""
    if dtype == "bf16":
        hidden = 2 * 4 * hidden_size
    elif dtype == "fp8":
        hidden = 4 * hidden_size + 4 * 4
    else:
        raise ValueError(f"dtype must be one of {shards.DTYPES}, got {dtype!r}")
    return hidden + 8 + 1


def check_disk(directory: Path, tokens: int, per_token: int, dtype: str) -> None:
    need = tokens * per_token + (64 << 20)
    free = shutil.disk_usage(directory).free
    if need > free:
        hint = " or hidden_dtype fp8 (about half the bytes)" if dtype == "bf16" else ""
        raise OSError(f"{directory}: hidden states need about {need / 2**30:,.2f} GiB ({tokens:,} tokens x "
                      f"{per_token:,} bytes, dtype {dtype}) but only {free / 2**30:,.2f} GiB is free; free "
                      f"space, point outputs_dir at a bigger disk{hint}")


# ---- resume: what the shards already on disk hold ------------------------------------------------

def _settings(identity: dict, output_ids: list[int], dtype: str, backend: str) -> dict:
    return {"target": identity["fingerprint"], "layer_ids": list(output_ids), "dtype": dtype, "backend": backend}


def _shard_entry(file: str, samples: list[dict], size: int) -> dict:
    return {"file": file, "tokens": sum(s["length"] for s in samples), "bytes": size, "samples": samples}


def scan_shards(out_dir: Path, settings: dict, by_key: dict[tuple[str, str], Sample]) -> tuple[list[dict], list[Path]]:
    """(entries of whole shards to keep, stale shard files). A shard is stale when one of its samples
    is gone, excluded, changed, or already held by an earlier shard. Shards made with other settings
    are an error: mixing them would give the drafter inconsistent features."""
    from safetensors import safe_open

    keep, stale, done = [], [], set()
    for path in sorted(out_dir.glob(SHARD_GLOB)):
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception:  # unreadable (not one of ours, or a damaged disk): re-extract its samples
            stale.append(path)
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
            stale.append(path)
            continue
        done.update(keys)
        samples, off = [], 0
        for d, s, n, _ in rows:
            samples.append({"sample_id": s, "dataset": d, "source": by_key[d, s].source, "offset": off, "length": n})
            off += n
        keep.append(_shard_entry(path.name, samples, path.stat().st_size))
    return keep, stale


# ---- the run -----------------------------------------------------------------------------------

def _dist() -> tuple[int, int, bool]:
    """(rank, world size, whether we initialised torch.distributed) from the torchrun environment."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return 0, 1, False
    import torch.distributed as dist

    ours = not dist.is_initialized()
    if ours:
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), ours


def _broadcast(obj, rank: int, world: int):
    if world == 1:
        return obj
    import torch.distributed as dist

    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj, rank: int, world: int) -> list:
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _prepare(out_dir: Path, samples: list[Sample], identity: dict, output_ids: list[int], dtype: str,
             max_tokens_per_batch: int, shard_mb: float, backend: str, log) -> dict:
    """Rank 0: clear leftovers, keep whole shards, check the disk, plan the rest."""
    for tmp in out_dir.glob("*.tmp"):
        tmp.unlink()
    shutil.rmtree(out_dir / SCRATCH, ignore_errors=True)
    settings = _settings(identity, output_ids, dtype, backend)
    by_key = {s.key: s for s in samples}
    keep, stale = scan_shards(out_dir, settings, by_key)
    numbers = [int(p.name.split("-")[1].split(".")[0]) for p in out_dir.glob(SHARD_GLOB)]
    for p in stale:
        log(f"{p.name}: its samples changed since it was written; re-extracting them")
        p.unlink()
    (out_dir / shards.INDEX).unlink(missing_ok=True)  # rewritten when every shard is whole again
    done = {(s["dataset"], s["sample_id"]) for e in keep for s in e["samples"]}
    todo = [i for i, s in enumerate(samples) if s.key not in done]
    lengths = [len(samples[i]) for i in todo]
    per_token = bytes_per_token(identity["hidden_size"], dtype)
    check_disk(out_dir, sum(lengths), per_token, dtype)
    per_shard = max(1, int(shard_mb * 2**20 / per_token))
    # vLLM packs prefills without padding: only the token count of a batch matters
    max_padding = 1.0 if backend == "vllm" else 0.1
    batches = [[todo[j] for j in b] for b in plan_batches(lengths, max_tokens_per_batch, max_padding)]
    planned = plan_shards(batches, [len(s) for s in samples], per_shard)
    first = max(numbers, default=-1) + 1
    return {"keep": keep, "shards": [(f"shard-{first + n:05d}.safetensors", p) for n, p in enumerate(planned)],
            "settings": settings, "check": _fingerprint_samples(samples)}


def _lock(out_dir: Path):
    """Held by rank 0 for the whole run: two extractions into one folder would plan the same shards."""
    f = open(out_dir / LOCK, "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RuntimeError(f"{out_dir}: another extraction is writing into this folder; wait for it to "
                           f"finish or stop it") from None
    return f


def _fingerprint_samples(samples: list[Sample]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for s in samples:
        h.update(f"{s.dataset}\0{s.sample_id}\0{s.digest}\n".encode())
    return h.hexdigest()


def extract(target: str | os.PathLike, token_files: list[str | os.PathLike], out_dir: str | os.PathLike, *,
            layer_ids: list[int] | None = None, convention: str = "output", dtype: str = "bf16",
            max_tokens_per_batch: int = 16384, shard_mb: float = 1024.0, device: str = "auto",
            backend: str = "hf", engine_options: dict | None = None, capture=None, log=print) -> dict:
    """Extract hidden states of every sample in `token_files` into `out_dir` (shards + index.json),
    keeping whole shards of an earlier run. Runs as one rank of several under torchrun (`hf`).
    `backend` `vllm` starts an engine with `engine_options` (`target_backend.VllmCapture`'s:
    tensor_parallel_size, trust_remote_code, gpu_memory_utilization, max_num_batched_tokens, ...),
    unless `capture`, an open capture of the same target and layers, is given to reuse. Returns a
    summary (rank 0: of the whole run)."""
    if backend not in BACKENDS:
        raise ValueError(f"target_backend must be one of {BACKENDS}, got {backend!r}")
    if capture is not None and capture.backend != backend:
        raise ValueError(f"capture runs on {capture.backend!r}, not on backend {backend!r}")
    rank, world, ours = _dist()
    if backend == "vllm" and world > 1:
        raise ValueError("backend vllm runs one engine (tensor parallel over the GPUs): start it without torchrun "
                         "(nproc_per_node 1) and set tensor_parallel_size instead")
    say = log if world == 1 else (lambda m: log(f"[rank {rank}/{world}] {m}"))
    lock = None
    try:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if dtype not in shards.DTYPES:
            raise ValueError(f"dtype must be one of {shards.DTYPES}, got {dtype!r}")
        if max_tokens_per_batch < 1 or shard_mb <= 0:
            raise ValueError("max_tokens_per_batch and shard_mb must be positive")
        identity = target_identity(target, bool((engine_options or {}).get("trust_remote_code")))
        n_layers = identity["num_hidden_layers"]
        output_ids = (layers.default_layer_ids(n_layers) if not layer_ids
                      else layers.to_output_ids(list(layer_ids), convention))
        if len(set(output_ids)) != 3 or not all(0 <= k < n_layers for k in output_ids):
            raise ValueError(f"layer_ids {list(layer_ids or [])} ({convention} convention): need three distinct "
                             f"layers of the target's {n_layers} (output ids 0..{n_layers - 1})")
        samples = read_tokens(token_files, identity["vocab_size"])
        plan = None
        if rank == 0:
            try:
                lock = _lock(out_dir)
                plan = _prepare(out_dir, samples, identity, output_ids, dtype, max_tokens_per_batch, shard_mb,
                                backend, say)
            except Exception as e:  # tell the other ranks, so they stop too instead of waiting
                plan = {"error": f"{type(e).__name__}: {e}"}
                _broadcast(plan, rank, world)
                raise
        plan = _broadcast(plan, rank, world)
        if "error" in plan:
            raise RuntimeError(f"rank 0 failed: {plan['error']}")
        if plan["check"] != _fingerprint_samples(samples):
            raise RuntimeError(f"rank {rank} read different samples than rank 0 from {token_files}")

        mine = plan["shards"][rank::world]
        if capture is not None and getattr(capture, "ids", output_ids) != output_ids:
            raise ValueError(f"capture keeps layers {capture.ids}, this run wants {output_ids}")
        opened = None
        if capture is None and mine:
            opts = dict(engine_options or {})
            if backend == "vllm":
                longest = max(len(samples[i]) for _, p in mine for b in p for i in b)
                opts = {"max_model_len": longest + 1, "log_file": out_dir / ENGINE_LOG, **opts}
            capture = opened = open_capture(backend, target, output_ids, device=device, log=say, **opts)
        try:
            written, seconds = _run_shards(capture, samples, mine, output_ids, dtype, plan["settings"], out_dir,
                                           f"hidden {rank}/{world}" if world > 1 else "hidden", say)
        finally:
            if opened is not None:
                opened.close()
        results = _gather({"written": written, "seconds": seconds}, rank, world)
        if rank != 0:
            return {"rank": rank, "shards_written": len(written), "seconds": seconds}
        return _finish(out_dir, plan, results, identity, output_ids, dtype, backend, say)
    finally:
        if lock is not None:
            lock.close()
        if ours:
            import torch.distributed as dist

            dist.destroy_process_group()


def _run_shards(capture, samples, mine, output_ids, dtype, settings, out_dir, desc, log) -> tuple[list, float]:
    """Extract this rank's shards; writing a shard overlaps computing the next one."""
    if not mine:
        return [], 0.0
    capture.scratch_dir = out_dir / SCRATCH
    total = sum(len(samples[i]) for _, plan in mine for b in plan for i in b)
    log(f"extracting {total:,} tokens into {len(mine)} shard(s), layers {output_ids} (output convention), "
        f"{dtype}, on {capture.device}")
    written, pending = [], None
    t0 = time.perf_counter()
    try:
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
                                        settings)
                bar.set(shards=len(written) + 1)
            if pending is not None:
                written.append(pending.result())
    finally:
        shutil.rmtree(capture.scratch_dir, ignore_errors=True)
    return written, time.perf_counter() - t0


def _write(path: Path, aux, last, order: list[Sample], dtype: str, settings: dict) -> dict:
    lengths = [len(s) for s in order]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    rows = [[s.dataset, s.sample_id, len(s), s.digest] for s in order]
    size = shards.write_shard(path, aux, last, torch.cat([s.input_ids for s in order]),
                              torch.cat([s.loss_mask for s in order]), offsets, dtype,
                              metadata={"settings": json.dumps(settings), "samples": json.dumps(rows)})
    samples = [{"sample_id": s.sample_id, "dataset": s.dataset, "source": s.source, "offset": int(o), "length": len(s)}
               for s, o in zip(order, offsets)]
    return _shard_entry(path.name, samples, size)


def _finish(out_dir, plan, results, identity, output_ids, dtype, backend, log) -> dict:
    """Rank 0: merge every rank's shards with the kept ones into index.json."""
    entries = plan["keep"] + [e for r in results for e in r["written"]]
    entries.sort(key=lambda e: e["file"])
    missing = [e["file"] for e in entries if not (out_dir / e["file"]).is_file()]
    if missing:
        raise FileNotFoundError(f"{out_dir}: shards {missing[:3]} written by other ranks are not visible here; "
                                f"the output folder must be on a filesystem every node shares")
    keys = [(s["dataset"], s["sample_id"]) for e in entries for s in e["samples"]]
    if len(keys) != len(set(keys)):
        raise RuntimeError(f"{out_dir}: a sample appears in two shards")  # planning makes this impossible
    tokens = sum(e["tokens"] for e in entries)
    index = {"dtype": dtype, "hidden_size": identity["hidden_size"], "layer_ids": output_ids,
             "layer_convention": "output", "hf_hidden_state_indices": layers.hf_hidden_state_indices(output_ids),
             "last": "final hidden state after the final norm (input of lm_head)",
             "backend": backend, "target": identity, "num_samples": len(keys), "num_tokens": tokens,
             "bytes": sum(e["bytes"] for e in entries), "shards": entries}
    shards.write_index(out_dir, index)
    new_tokens = sum(e["tokens"] for r in results for e in r["written"])
    seconds = max(r["seconds"] for r in results)
    summary = {"samples": len(keys), "tokens": tokens, "shards": len(entries), "shards_kept": len(plan["keep"]),
               "shards_written": sum(len(r["written"]) for r in results), "tokens_extracted": new_tokens,
               "extract_s": round(seconds, 3), "tokens_per_s": round(new_tokens / seconds, 1) if seconds else None,
               "bytes": index["bytes"], "bytes_per_token": round(index["bytes"] / tokens, 1) if tokens else None,
               "dtype": dtype, "layer_ids": output_ids, "backend": backend, "ranks": len(results),
               "hidden_dir": str(out_dir)}
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    log(f"{summary['samples']:,} samples, {tokens:,} tokens in {len(entries)} shard(s) "
        f"({summary['shards_kept']} kept from an earlier run), {index['bytes'] / 2**20:,.1f} MiB")
    return summary


# ---- several processes: torchrun ---------------------------------------------------------------

def _cli_args(target, token_files, out_dir, layer_ids, convention, dtype, max_tokens_per_batch, shard_mb,
              device) -> list[str]:
    args = ["--target", str(target), "--out", str(out_dir), "--tokens", *map(str, token_files),
            "--convention", convention, "--dtype", dtype, "--max-tokens-per-batch", str(max_tokens_per_batch),
            "--shard-mb", str(shard_mb), "--device", device]
    if layer_ids:
        args += ["--layer-ids", ",".join(map(str, layer_ids))]
    return args


def launch(nproc: int, target, token_files, out_dir, *, layer_ids=None, convention="output", dtype="bf16",
           max_tokens_per_batch=16384, shard_mb=1024.0, device="auto", attempts: int = 2, log=print) -> dict:
    """Run `extract` as `nproc` torchrun ranks on this machine (one per GPU, or gloo on CPU); returns
    rank 0's summary. A failed torchrun is started again (`attempts` in all); whole shards are kept."""
    (Path(out_dir) / SUMMARY).unlink(missing_ok=True)
    torchrun(nproc, "draftsmith.hidden", _cli_args(target, token_files, out_dir, layer_ids, convention, dtype,
                                                   max_tokens_per_batch, shard_mb, device),
             attempts=attempts, log=log)
    return json.loads((Path(out_dir) / SUMMARY).read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draftsmith.hidden", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="checkpoint folder (or a built-in target name)")
    ap.add_argument("--tokens", nargs="+", required=True, help="tokens/<dataset>.jsonl files from stage 03")
    ap.add_argument("--out", required=True, help="hidden-state folder")
    ap.add_argument("--layer-ids", default="", help="comma-separated; empty: the EAGLE-3 default")
    ap.add_argument("--convention", default="output", choices=layers.CONVENTIONS)
    ap.add_argument("--dtype", default="bf16", choices=shards.DTYPES)
    ap.add_argument("--max-tokens-per-batch", type=int, default=16384)
    ap.add_argument("--shard-mb", type=float, default=1024.0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--backend", default="hf", choices=BACKENDS)
    ap.add_argument("--engine-options", default="{}", help="JSON object (backend vllm), e.g. "
                    '\'{"tensor_parallel_size": 8, "trust_remote_code": true}\'')
    a = ap.parse_args(argv)
    from .target.checkpoint import resolve_target

    ids = [int(x) for x in a.layer_ids.split(",") if x.strip()]
    extract(resolve_target(a.target, log=lambda *m: None), a.tokens, a.out, layer_ids=ids, convention=a.convention,
            dtype=a.dtype, max_tokens_per_batch=a.max_tokens_per_batch, shard_mb=a.shard_mb, device=a.device,
            backend=a.backend, engine_options=json.loads(a.engine_options), log=lambda m: print(m, flush=True))
    return 0


# ---- checks the notebook shows -----------------------------------------------------------------

def verify_sample(target, hidden_dir, i: int = 0, device: str = "auto") -> dict:
    """Run the target alone on stored sample i and compare: stored aux vs its own
    `output_hidden_states` at the index's HF indices, and lm_head(stored last) vs its logits. Also
    the mean token norm of every layer, for the sanity plot."""
    hs = shards.HiddenShards(hidden_dir)
    s = hs.sample(i)
    model = load_target(target, device)
    dev = model.get_input_embeddings().weight.device
    with torch.inference_mode():
        out = model(input_ids=s["input_ids"][None].to(dev), output_hidden_states=True, use_cache=False)
        logits = out.logits[0].float().cpu()
        ref = [h[0].float().cpu() for h in out.hidden_states]
        head = model.get_output_embeddings()
        stored_logits = head(s["last"].to(dev, head.weight.dtype)).float().cpu()
    idx = hs.index["hf_hidden_state_indices"]
    H = hs.hidden_size
    aux = [s["aux"][:, j * H:(j + 1) * H] for j in range(3)]
    aux_err = [_rel_err(a, ref[k]) for a, k in zip(aux, idx)]
    return {"sample_id": hs.samples[i].sample_id, "tokens": len(s["input_ids"]), "layer_ids": hs.index["layer_ids"],
            "aux_rel_err": aux_err, "last_rel_err": _rel_err(s["last"], ref[-1]),
            "logits_max_abs_diff": float((stored_logits - logits).abs().max()),
            "logits_max_abs": float(logits.abs().max()),
            "top1_agreement": float((stored_logits.argmax(-1) == logits.argmax(-1)).float().mean()),
            # ref[0] is the embedding output (id -1), ref[k + 1] the output of layer k, ref[-1] normed
            "layer_norms": [float(h.norm(dim=-1).mean()) for h in ref[:-1]],
            "stored_aux_norms": [float(a.norm(dim=-1).mean()) for a in aux]}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def stored_norms(hidden_dir, max_samples: int = 64):
    """Per-token L2 norms of the stored tensors, one column per captured layer and `last`."""
    import pandas as pd

    hs = shards.HiddenShards(hidden_dir)
    H, ids = hs.hidden_size, hs.index["layer_ids"]
    cols: dict[str, list] = {f"aux layer {k}": [] for k in ids} | {"last (normed)": []}
    for i in range(min(max_samples, len(hs))):
        s = hs.sample(i, fields=("aux", "last"))
        for j, k in enumerate(ids):
            cols[f"aux layer {k}"].append(s["aux"][:, j * H:(j + 1) * H].norm(dim=-1))
        cols["last (normed)"].append(s["last"].norm(dim=-1))
    return pd.DataFrame({k: torch.cat(v).numpy() for k, v in cols.items()})


def plot_norms(check: dict, norms):
    """Left: the target's mean token norm at every layer of one sample, with the stored aux layers of
    that sample circled at their ids (a convention slip puts them one layer off the curve). Right:
    the stored tensors' token norms over many samples."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    n = len(check["layer_norms"])
    a.plot(range(-1, n - 1), check["layer_norms"], "o-", color="0.6", label="target, every layer")
    a.plot(check["layer_ids"], check["stored_aux_norms"], "o", ms=11, mfc="none",
           color="C3", label="stored aux, at their layer ids")
    a.set(xlabel="output of layer (-1 = embeddings)", ylabel="mean token L2 norm",
          title=f"activation norm by layer (sample {check['sample_id']})")
    a.legend()
    b.boxplot([norms[c] for c in norms.columns], showfliers=False)
    b.set_xticks(range(1, len(norms.columns) + 1), norms.columns, rotation=15)
    b.set(ylabel="token L2 norm", title=f"stored tensors, {len(norms):,} tokens")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    sys.exit(main())
