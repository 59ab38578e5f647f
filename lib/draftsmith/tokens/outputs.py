"""Stage 03's outputs: where they live, and reading them back (the one reader stage 04 uses).

`tokens/<dataset>.jsonl` holds the ids of every kept sample: `input_ids` (prompt + response),
`loss_mask` (1 on response tokens), `source` and the sample's checks. A sample marked
`"excluded": true` is left out by `read_tokens`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..paths import Run
from ..progress import Progress


@dataclass(frozen=True)
class Sample:
    dataset: str
    sample_id: str
    input_ids: torch.Tensor   # int32 [L]
    loss_mask: torch.Tensor   # uint8 [L]
    digest: str               # of input_ids and loss_mask: a changed sample invalidates its shard
    source: str = ""          # where its answer came from (stage 03's `source`): per-sample index metadata

    @property
    def key(self) -> tuple[str, str]:
        return self.dataset, self.sample_id

    def __len__(self) -> int:
        return len(self.input_ids)


def token_files(run: Run, datasets: list | None = None) -> list[Path]:
    """`tokens/<name>.jsonl` of `run` for each dataset (dicts with a `name`, or names); all of them if none."""
    tokens_dir = run.dir("tokens")
    if not datasets:
        files = sorted(tokens_dir.glob("*.jsonl"))
        if not files:
            raise FileNotFoundError(f"{tokens_dir}: no tokens/<dataset>.jsonl files (run stage 03 first)")
        return files
    files = [tokens_dir / f"{d['name'] if isinstance(d, dict) else d}.jsonl" for d in datasets]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: not found (run stage 03 for this dataset first)")
    return files


def _digest(ids: torch.Tensor, mask: torch.Tensor) -> str:
    return hashlib.blake2b(ids.numpy().tobytes() + mask.numpy().tobytes(), digest_size=8).hexdigest()


def read_tokens(files: list[str | os.PathLike], vocab_size: int | None = None) -> list[Sample]:
    """Every sample not marked `"excluded": true`, in file order. A malformed line is an error naming
    its file and line: stage 03 writes whole lines, so one that is not means something is wrong."""
    samples: list[Sample] = []
    seen: dict[tuple[str, str], str] = {}
    total = sum(Path(f).stat().st_size for f in files)
    with Progress(total=total, desc="read tokens", unit="B") as bar:
        for path in map(Path, files):
            with open(path, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    bar.update(len(line))
                    if not line.strip():
                        continue
                    where = f"{path}:{lineno}"
                    sample = _parse_line(line, where, path.stem, vocab_size)
                    if sample is None:
                        continue
                    if sample.key in seen:
                        raise ValueError(f"{where}: sample {sample.sample_id!r} of dataset {sample.dataset!r} "
                                         f"already appeared at {seen[sample.key]}")
                    seen[sample.key] = where
                    samples.append(sample)
    return samples


def _parse_line(line: str, where: str, default_dataset: str, vocab_size: int | None) -> Sample | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if row.get("excluded"):
        return None
    sid = row.get("sample_id")
    if not isinstance(sid, str) or not sid:
        raise ValueError(f"{where}: missing or empty 'sample_id'")
    ids, mask = row.get("input_ids"), row.get("loss_mask")
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise ValueError(f"{where}: 'input_ids' must be a non-empty list of token ids")
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
        raise ValueError(f"{where}: 'loss_mask' must be a list of 0/1 as long as 'input_ids' ({len(ids)})")
    if vocab_size is not None and max(ids) >= vocab_size:
        raise ValueError(f"{where}: token id {max(ids)} is outside the target's vocabulary ({vocab_size})")
    t_ids = torch.tensor(ids, dtype=torch.int32)
    t_mask = torch.tensor(mask, dtype=torch.uint8)
    return Sample(str(row.get("dataset") or default_dataset), sid, t_ids, t_mask, _digest(t_ids, t_mask),
                  str(row.get("source") or ""))
