"""Stage 04 benchmark: is extraction bound by the target's forward pass, and is the format lean?

Rows, measured in one run over the same length-bucketed batches of the same samples:
  plain forward     the decoder alone over the padded batches, results thrown away: the limit
  extraction bf16   `hidden.stage.extract`: hooks, un-padding, copies, shard writes (fsync'd), index
  extraction fp8    the same with fp8 storage (per-token scales computed while writing)
  naive             HF CausalLM with output_hidden_states=True (computes logits it does not need)
Each round runs every row once, back to back; a row's ratio is the median over rounds of its speed
over the plain forward's in the same round (the machine is shared and noisy). CPU runs default to one
thread: on a busy 2-core box a second OpenMP thread mostly spins and doubles the noise.
Targets: extraction >= 0.8x the plain forward; bytes on disk <= 1.02x the raw bytes of the tensors
a shard holds (aux, last, scales, input_ids, loss_mask, offsets).

  .venv/bin/python bench/bench_hidden.py [--target tiny] [--tokens 20000] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith.config import HiddenConfig
from draftsmith.hidden.stage import extract, plan_batches
from draftsmith.hidden.outputs import HiddenShards
from draftsmith.targets.checkpoint import load_target, resolve_target
from draftsmith.targets.hf import pad_batch
from draftsmith.tokens import read_tokens


def synthetic_tokens(path: Path, vocab: int, total: int, seed: int = 0) -> None:
    """Samples of chat-like lengths (long tail up to 1024) with random ids: the forward pass costs
    the same whatever the ids, and this needs no earlier stage."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        n = i = 0
        while n < total:
            length = min(1024, max(24, int(rng.lognormvariate(5.2, 0.7))))
            ids = [0] + [rng.randrange(3, vocab) for _ in range(length - 2)] + [1]
            f.write(json.dumps({"sample_id": f"s{i}", "dataset": "bench", "input_ids": ids,
                                "loss_mask": [0] * (length // 3) + [1] * (length - length // 3)}) + "\n")
            n, i = n + length, i + 1


def plain_forward(model, batches) -> float:
    base = model.get_decoder()
    pad = model.config.pad_token_id or 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            ids, _ = pad_batch(batch, pad)
            base(input_ids=ids.to(model.device), use_cache=False)
    return time.perf_counter() - t0


def naive_forward(model, batches) -> float:
    pad = model.config.pad_token_id or 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            ids, keep = pad_batch(batch, pad)
            out = model(input_ids=ids.to(model.device), output_hidden_states=True, use_cache=False)
            [h[keep.to(h.device)].cpu() for h in out.hidden_states]
    return time.perf_counter() - t0


SIZES = {"BF16": 2, "F8_E4M3": 1, "F32": 4, "I64": 8, "U8": 1}


def raw_tensor_bytes(hs: HiddenShards) -> int:
    """Bytes of the tensors the shards hold, without the safetensors header."""
    n = 0
    for e in hs.index["shards"]:
        with safe_open(str(hs.dir / e["file"]), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                n += torch.Size(sl.get_shape()).numel() * SIZES[sl.get_dtype()]
    return n


def print_disk_table(disk: dict[str, tuple[int, int]], tokens: int, H: int) -> None:
    """Bytes per token on disk vs the raw tensors, per storage dtype (target ratio <= 1.02)."""
    print(f"\n{'bytes per token':18s}{'on disk':>10s}{'raw tensors':>13s}{'ratio':>8s}{'of which hidden':>17s}"
          "   (target ratio <= 1.02)")
    for dtype, (on_disk, raw) in disk.items():
        hid = 8 * H if dtype == "bf16" else 4 * H + 16
        print(f"{dtype:18s}{on_disk / tokens:10.1f}{raw / tokens:13.1f}{on_disk / raw:8.3f}{hid:17d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="tiny", help="built-in target name or checkpoint folder")
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--max-tokens-per-batch", type=int, default=8192)
    ap.add_argument("--shard-mb", type=float, default=8.0)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args()

    if a.threads:
        torch.set_num_threads(a.threads)
    target = resolve_target(a.target)
    model = load_target(target, a.device)
    H = model.config.hidden_size
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        synthetic_tokens(tmp / "bench.jsonl", model.config.vocab_size, a.tokens)
        samples = read_tokens([tmp / "bench.jsonl"])
        tokens = sum(len(s) for s in samples)
        batches = [[samples[i] for i in b]
                   for b in plan_batches([len(s) for s in samples], a.max_tokens_per_batch)]
        padded = sum(len(b) * len(b[0]) for b in batches)
        print(f"target {target.name}: hidden {H}, {model.config.num_hidden_layers} layers, "
              f"{torch.get_num_threads()} threads; {len(samples)} samples, {tokens:,} tokens, "
              f"{len(batches)} batches, padding {padded / tokens - 1:.1%}")

        times: dict[str, list[float]] = {"plain forward": [], "extraction bf16": [], "extraction fp8": []}
        disk: dict[str, tuple[int, int]] = {}
        plain_forward(model, batches[:2])  # warm-up
        for r in range(a.rounds):
            times["plain forward"].append(plain_forward(model, batches))
            for dtype in ("bf16", "fp8"):
                out = tmp / f"{dtype}-{r}"
                s = extract(target, [tmp / "bench.jsonl"], out,
                            HiddenConfig(hidden_dtype=dtype, target_backend="hf", device=a.device,
                                         max_tokens_per_batch=a.max_tokens_per_batch, shard_mb=a.shard_mb),
                            log=lambda m: None)
                assert s["tokens_extracted"] == tokens
                times[f"extraction {dtype}"].append(s["extract_s"])
                disk[dtype] = (s["bytes"], raw_tensor_bytes(HiddenShards(out)))
        naive = naive_forward(model, batches)

    plain = times["plain forward"]
    print(f"\n{'':36s}{'tokens/s':>10s}{'vs plain':>10s}   (target >= 0.80; medians of {a.rounds} rounds)")
    for name, ts in times.items():
        ratio = statistics.median(p / t for p, t in zip(plain, ts))
        print(f"{name:36s}{tokens / statistics.median(ts):10,.0f}{ratio:10.2f}")
    print(f"{'naive CausalLM output_hidden_states':36s}{tokens / naive:10,.0f}"
          f"{statistics.median(plain) / naive:10.2f}   (1 pass, vs the median plain)")

    print_disk_table(disk, tokens, H)


if __name__ == "__main__":
    main()
