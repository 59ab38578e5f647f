"""The shard check stages 05/06 and `--check` make before training, at thousands of shards.

Writes `--shards` small shards and their index, then times, side by side in one run:
  check      hidden.outputs.broken_shards: each listed shard's size and safetensors header (what
             the preflight runs), no tensor read
  open       safetensors' safe_open on each shard and its `offsets` tensor read (what training's
             HiddenShards does per shard as it first touches it): the floor of any check that
             opens the files
The time of a check is mostly one open and a few hundred bytes per shard, so the shard's size does
not matter; the real job's shards are ~1 GB (shard_mb), of which the check reads the header only.

    .venv/bin/python bench/bench_shard_check.py                  # 5000 shards, ~1 minute
    .venv/bin/python bench/bench_shard_check.py --shards 500
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from draftsmith.hidden import outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3, help="each timed this many times; the median is shown")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        entries = []
        for i in range(args.shards):
            f = outputs.shard_name(i)
            size = outputs.write_shard(folder / f, torch.randn(16, 6), torch.randn(16, 2), torch.arange(16),
                                       torch.ones(16), torch.tensor([0, 8, 16]))
            entries.append({"file": f, "bytes": size, "samples": [{"sample_id": f"{i}a"}, {"sample_id": f"{i}b"}]})
        outputs.write_index(folder, {"shards": entries})

        def check():
            assert outputs.broken_shards(folder) == []

        def open_each():
            for e in entries:
                with safe_open(str(folder / e["file"]), framework="pt") as f:
                    f.get_tensor("offsets")

        times = {}
        for name, fn in (("check", check), ("open", open_each)):
            runs = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - t0)
            times[name] = sorted(runs)[len(runs) // 2]
    print(f"{args.shards:,} shards, median of {args.rounds} rounds (files in the page cache)\n")
    print("| what | seconds | ms per 1000 shards | ratio to open |")
    print("|---|---|---|---|")
    for name, s in times.items():
        print(f"| {name} | {s:.2f} | {1000 * s / args.shards * 1000:.0f} | {s / times['open']:.2f} |")


if __name__ == "__main__":
    main()
