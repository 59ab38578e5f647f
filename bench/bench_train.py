"""Drafter training throughput: the whole `train()` loop vs a bare forward+backward of the same
module on the same micro-batches already in memory (the limit the loop can approach).

The loop additionally reads the memory-mapped shards, dequantises, pads, computes the teacher,
clips, steps AdamW and the schedule, and logs; evaluation, checkpoints and exports are timed apart
(`eval_save_seconds`) and left out of its tokens/s. Target: loop >= 0.8 x bare.

    .venv/bin/python bench/bench_train.py                       # demo-sized drafter on the tiny target
    .venv/bin/python bench/bench_train.py --hidden DIR --target tiny --steps 30
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.distributed import Dist
from draftsmith.config import DrafterConfig, HiddenConfig
from draftsmith.drafter import data, stage
from draftsmith.drafter.data import prepare
from draftsmith.drafter.model import DrafterShape
from draftsmith.hidden.stage import extract
from draftsmith.drafter.objective import TTTObjective, build_drafter, step_weights
from draftsmith.drafter.stage import TrainJob
from draftsmith.hidden.outputs import HiddenShards
from draftsmith.targets.checkpoint import resolve_target, target_config, target_tensors

WORDS = ("the function returns a list of values from the given file path and raises an error when the "
         "object is not found so the caller can retry with another name or default").split()


def make_hidden(target: Path, out: Path, n: int, layer_set: str = "eagle3") -> Path:
    """Hidden states of `target` over n synthetic chat samples, via stage 04's extractor."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    rng = random.Random(0)
    rows = []
    for k in range(n):
        conv = [{"role": "user", "content": f"What does helper_{rng.randint(0, 99)} do?"},
                {"role": "assistant", "reasoning_content": " ".join(rng.choices(WORDS, k=rng.randint(10, 40))),
                 "content": " ".join(rng.choices(WORDS, k=rng.randint(60, 160)))}]
        prompt = tok.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
        full = tok.apply_chat_template(conv, tokenize=True, return_dict=False)
        rows.append({"sample_id": f"b{k}", "input_ids": full,
                     "loss_mask": [0] * len(prompt) + [1] * (len(full) - len(prompt))})
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    extract(target, [out / "tokens.jsonl"], out / "hidden", HiddenConfig(hidden_dtype="bf16", target_backend="hf",
                                                                         layer_set=layer_set),
            log=lambda m: None)
    return out / "hidden"


def bare(cfg: DrafterConfig, job: TrainJob, steps: int) -> tuple[float, int]:
    """Forward+backward of the TTT objective over the micro-batches the loop trains on, collated in
    memory beforehand; returns (seconds, tokens)."""
    d = Dist(0, 1, torch.device("cpu"))
    shards = HiddenShards(job.hidden_dir)
    tensors = target_tensors(job.target_path)
    # cached by the loop's run
    prep = prepare(cfg, Path(job.out_dir), shards, tensors["lm_head"], d, log=lambda *a: None)
    shape = DrafterShape.from_target(target_config(job.target_path), cfg.draft_vocab_size)
    drafter = build_drafter(shape, tensors["embed"], prep.vocab, cfg.seed)
    obj = TTTObjective(drafter, tensors["lm_head"][prep.vocab.used].clone(), cfg.ttt_steps)
    weights = step_weights(cfg.ttt_steps, job.step_weight)
    spe = len(prep.train) // cfg.train_batch_size
    plan = []
    for s in range(steps):
        gb = data.global_batches(prep.train, cfg.train_batch_size, cfg.seed, s // spe)[s % spe]
        denom = prep.counts[gb].sum(0).float()
        mbs = data.MicroBatches(job.hidden_dir, data.micro_batches(gb, prep.sup, cfg.train_micro_batch_size), prep.sup)
        plan.append(([mbs[j] for j in range(len(mbs))], weights / denom.clamp_min(1),
                     sum(prep.sup.length(i) for i in gb)))
    t0 = time.perf_counter()
    for micro, scale, _ in plan:
        for b in micro:
            ce, _ = obj(b["aux"], b["input_ids"], b["sup"], b["last"])
            (ce * scale).sum().backward()
        obj.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, sum(t for _, _, t in plan)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="tiny", help="built-in target or checkpoint folder")
    ap.add_argument("--hidden", help="an existing hidden-state folder (default: synthetic samples)")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each; the best is kept")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.threads:
        torch.set_num_threads(a.threads)
    target = resolve_target(a.target, log=lambda *m: None)
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        hidden_dir = Path(a.hidden) if a.hidden else make_hidden(target, Path(tmp) / "data", a.samples)
        n = len(HiddenShards(hidden_dir))
        epochs = a.steps / ((n - max(1, round(0.05 * n))) // a.batch)
        cfg = DrafterConfig(draft_vocab_size=a.draft_vocab, ttt_steps=a.ttt, train_epochs=epochs,
                            train_batch_size=a.batch, train_micro_batch_size=a.micro, train_max_len=1024,
                            train_lr=1e-3, train_warmup_fraction=0.015, train_weight_decay=0.0, train_grad_clip=0.5,
                            train_holdout_fraction=0.05, seed=0, train_fsdp=False, train_eval_every=0,
                            train_checkpoint_every=10 ** 9, export_fractions=[1.0], export_engine="sglang",
                            export_dtype="bfloat16", train_resume=False)
        job = TrainJob(hidden_dir=str(hidden_dir), target_path=str(target), out_dir=str(Path(tmp) / "drafter"))
        loop, limit = [], []
        for r in range(a.rounds):
            s = stage.train(cfg, job, log=lambda *m: None)
            if s["steps"] != a.steps:
                print(f"note: the loop ran {s['steps']} steps", file=sys.stderr)
            loop.append((s["train_seconds"], s["tokens"], s["eval_save_seconds"], s["prep_seconds"]))
            limit.append(bare(cfg, job, s["steps"]))
        lt, ltok, side, _ = min(loop)
        prep = loop[0][3]   # later rounds reuse the cached vocabulary and supervision
        bt, btok = min(limit)
    rows = [("bare forward+backward (batches in memory)", bt, btok),
            ("train() loop (shards, teacher, AdamW, logging)", lt, ltok)]
    print(f"\ndrafter training on {a.target}: hidden {target_config(target)['hidden_size']}, draft vocab "
          f"{a.draft_vocab}, TTT {a.ttt}, batch {a.batch} (micro {a.micro}), {a.steps} steps, best of {a.rounds}, "
          f"{torch.get_num_threads()} CPU thread(s)")
    print(f"{'':50s} {'seconds':>8s} {'tokens':>8s} {'tokens/s':>9s} {'ratio':>6s}")
    for name, sec, tok in rows:
        print(f"{name:50s} {sec:8.2f} {tok:8d} {tok / sec:9.0f} {(tok / sec) / (btok / bt):6.2f}")
    print(f"(outside the loop's tokens/s: preparation {prep:.1f}s once, evaluation+export {side:.1f}s)")
    ratio = (ltok / lt) / (btok / bt)
    print(f"loop / bare = {ratio:.2f} (target >= 0.80)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
