"""Training cost of DFlash against EAGLE-3 on one capture: the same features (stage 04 with
`layer_set: both`), the same batches, each drafter's `train()` loop, rounds alternated so both see
the same box. Prints seconds per step, trained tokens per second, trainable parameters, and
DFlash's ratio to EAGLE-3 (measured in this run; absolute times mean little on a shared box).

    .venv/bin/python bench/bench_dflash_train.py                      # tiny target, 5 draft layers, block 16
    .venv/bin/python bench/bench_dflash_train.py --target tiny-test --layers 2 --block 8 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from bench_train import make_hidden
from draftsmith.config import DrafterConfig
from draftsmith.drafter import stage
from draftsmith.drafter.stage import TrainJob
from draftsmith.targets.checkpoint import resolve_target


def config(hidden: Path, target: Path, out: Path, kind: str, a) -> tuple[DrafterConfig, TrainJob]:
    job = TrainJob(hidden_dir=str(hidden), target_path=str(target), out_dir=str(out), drafter_kind=kind,
                   stop_at=a.steps)
    return DrafterConfig(draft_vocab_size=a.draft_vocab, ttt_steps=7, train_epochs=1.0, train_batch_size=a.batch,
                         train_micro_batch_size=a.batch, train_max_len=1024, train_lr=1e-3,
                         train_warmup_fraction=0.015, train_weight_decay=0.0, train_grad_clip=0.5,
                         train_holdout_fraction=0.05, seed=0, train_fsdp=False, train_eval_every=0,
                         train_checkpoint_every=10 ** 9, export_fractions=[1.0], export_engine="vllm",
                         export_dtype="bfloat16", train_resume=False, dflash_layers=a.layers,
                         dflash_block_size=a.block, dflash_anchors=a.anchors), job


def params(out: Path) -> int:
    ck = sorted((out / "checkpoints").glob("step-*.pt"))[-1]
    state = torch.load(ck, weights_only=False)["model"]
    return sum(v.numel() for k, v in state.items() if v.is_floating_point() and "embed_tokens" not in k)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="tiny")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--draft-vocab", type=int, default=2048)
    p.add_argument("--layers", type=int, default=5, help="DFlash draft layers")
    p.add_argument("--block", type=int, default=16, help="DFlash block size")
    p.add_argument("--anchors", type=int, default=512, help="DFlash blocks per sample")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    target = resolve_target(a.target, log=lambda *m: None)
    with tempfile.TemporaryDirectory(prefix="bench_dflash_") as tmp:
        hidden = make_hidden(target, Path(tmp) / "data", a.samples, layer_set="both")
        got = {"eagle3": [], "dflash": []}
        size = {}
        for r in range(a.rounds):
            for kind in ("eagle3", "dflash") if r % 2 == 0 else ("dflash", "eagle3"):
                out = Path(tmp) / f"{kind}-{r}"
                s = stage.train(*config(hidden, target, out, kind, a), log=lambda *m: None)
                got[kind].append((s["train_seconds"] / s["steps"], s["tokens"] / s["train_seconds"]))
                size[kind] = params(out)
    print(f"\ndrafter training on {a.target}, one capture (layer_set both), batch {a.batch}, {a.steps} steps, "
          f"best of {a.rounds}, {torch.get_num_threads()} CPU thread(s); EAGLE-3 TTT 7, DFlash {a.layers} layers, "
          f"block {a.block}, {a.anchors} anchors/sample")
    print(f"{'':8s} {'s/step':>8s} {'tokens/s':>9s} {'params':>11s} {'s/step ratio':>13s}")
    best = {k: min(v) for k, v in got.items()}
    for kind in ("eagle3", "dflash"):
        sec, tps = best[kind]
        print(f"{kind:8s} {sec:8.3f} {tps:9.0f} {size[kind]:11,d} {sec / best['eagle3'][0]:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
