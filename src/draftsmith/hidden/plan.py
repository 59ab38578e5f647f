"""Stage 04's plan: samples cut into batches by length, batches grouped into shards, disk checked.

Samples are sorted longest first (an out-of-memory shows on the first batch) and cut into batches
whose padded size (count x longest) stays under `max_tokens_per_batch`, at most 10% of it padding
(`hf` runs a batch right-padded; vLLM packs prefills, so there only the token count matters).
Consecutive batches make a shard of about `shard_mb`, the unit of writing and of resuming. Free
disk is checked against bytes per token x tokens before the target is even loaded.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from . import outputs


@dataclass(frozen=True)
class ExtractionPlan:
    """One extraction, planned by rank 0 and the same on every rank: `keep`, the index entries of the
    whole shards kept from an earlier run; `shards`, (file name, batches of sample indices) to
    extract; `settings`, what each shard records in its header; `samples`, the fingerprint of the
    samples planned (`resume.fingerprint_samples`)."""

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
