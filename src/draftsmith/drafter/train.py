"""Stage 05: train the EAGLE-3 drafter with training-time test (TTT) on stage 04's hidden states.

`train(cfg)` prepares, trains, scores the held-out split, checkpoints and exports, in one process
or as torchrun ranks (`launch` picks; `stage.run` is notebook 05's call into it). Every loss
denominator is fixed per global batch before it starts, so N processes give the result of one on
the same global batch; rank 0 alone writes checkpoints, exports and metrics, so a lost node costs
the steps since the last checkpoint. What it writes, and where, is `outputs.py`'s."""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

from .. import layers
from ..distributed import Dist, init_dist
from ..progress import Progress
from ..hidden.outputs import HiddenShards
from ..targets.checkpoint import target_config, target_tensors
from ..distributed import done_launching, launch_dir, torchrun
from . import outputs, checkpoints, data
from .config import TrainConfig
from . import dflash, dflash_export
from .export import export
from .model import DrafterConfig
from .objective import TTTObjective, autocast, build_drafter, step_weights
from .prepare import Prepared, prepare
from .scoring import heldout_scores, row, unigram_baseline


# -- the loop ----------------------------------------------------------------------------------

def _schedule(total: int, warmup_fraction: float):
    warmup = max(1, round(warmup_fraction * total))

    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))
    return f


def _wrap(objective: nn.Module, cfg: TrainConfig, d: Dist) -> nn.Module:
    """DDP (or FSDP2 when asked) over several processes; the objective itself in one."""
    if d.world == 1:
        return objective
    if cfg.train_fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in getattr(objective.drafter, "layers", [getattr(objective.drafter, "midlayer", None)]):
            fully_shard(layer)
        fully_shard(objective.drafter.lm_head)
        return fully_shard(objective)
    return nn.parallel.DistributedDataParallel(objective, broadcast_buffers=False)


def _plan(prep: Prepared, cfg: TrainConfig, d: Dist, steps: range, steps_per_epoch: int, anchors=None):
    """This process's micro-batches of the given steps in order with their epochs, and per step the
    loss denominators [k] and the tokens of the whole global batch. With `anchors` (DFlash) the
    denominators count the scored block rows of each sample's anchors of that epoch."""
    micro, epochs, denoms, tokens = [], [], [], []
    for s in steps:
        epoch = s // steps_per_epoch
        gb = data.global_batches(prep.train, cfg.train_batch_size, cfg.seed, epoch)[s % steps_per_epoch]
        mine = data.micro_batches(gb, prep.sup, cfg.train_micro_batch_size)[d.rank::d.world]
        micro.extend(mine)
        epochs.extend([epoch] * len(mine))
        if anchors is None:
            denoms.append(prep.counts[gb].sum(0).float())
        else:
            denoms.append(sum(dflash.block_counts(prep.sup[i], anchors(i, epoch), cfg.dflash_block_size)
                              for i in gb).float())
        tokens.append(sum(prep.sup.length(i) for i in gb))
    return micro, epochs, denoms, tokens


def _drafter(cfg: TrainConfig, mcfg: DrafterConfig, prep: Prepared, tensors: dict, layer_ids: list[int]):
    """The objective of `cfg.drafter_kind` (a fresh drafter and the frozen teacher head), its per-step
    weights, the DFlash anchors (None for EAGLE-3) and the function that exports its state."""
    head = tensors["lm_head"][prep.vocab.used].clone()
    if cfg.drafter_kind == "eagle3":
        drafter = build_drafter(mcfg, tensors["embed"], prep.vocab, cfg.seed)
        def write(path, state, extra):
            return export(path, state, mcfg, layer_ids, cfg.export_engine, cfg.export_dtype, extra)
        return TTTObjective(drafter, head, cfg.ttt_steps), step_weights(cfg), None, write
    unused = (prep.vocab.counts == 0).nonzero().flatten()
    if len(unused) == 0:
        raise ValueError("every token of the target's vocabulary occurs in the responses: DFlash needs one "
                         "that never does for its MASK slots")
    dcfg = dflash.DFlashConfig(base=mcfg, num_layers=cfg.dflash_layers, block_size=cfg.dflash_block_size,
                               num_aux=len(layer_ids), mask_token_id=int(unused.max()))
    drafter = dflash.build_dflash(dcfg, tensors["embed"], prep.vocab.d2t, prep.vocab.t2d, cfg.seed)
    anchors = functools.partial(dflash.anchors_for, prep.sup, cfg.seed, cfg.dflash_anchors)

    def write(path, state, extra):
        return dflash_export.export(path, state, dcfg, layer_ids, cfg.export_dtype, extra)
    return dflash.DFlashObjective(drafter, head), dflash.position_weights(cfg.dflash_block_size), anchors, write


def train(cfg: TrainConfig, log=print) -> dict:
    """Prepare, train (resuming from the latest checkpoint when asked), export; returns the summary.
    Prepares with `prepare.py` (split, draft vocabulary, teacher masks), then minimises the TTT
    objective (`objective.py`) with AdamW, a cosine schedule with linear warmup, gradient clipping,
    bf16 autocast on GPU and gradient accumulation over micro-batches; scores the held-out split
    (`scoring.py`), checkpoints (`checkpoints.py`) and exports at `export_fractions` of training
    (`export.py`). Each rank reads only its micro-batches from the shared hidden-state folder."""
    cfg.check()
    d = init_dist()
    log = log if d.main else (lambda *a, **k: None)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d.check_together(out, cfg.to_dict())
    shards = HiddenShards(cfg.hidden_dir)
    tconf = target_config(cfg.target_path)
    mcfg = DrafterConfig.from_target(tconf, cfg.draft_vocab_size)
    if shards.hidden_size != mcfg.target_hidden_size:
        raise ValueError(f"{cfg.hidden_dir}: hidden_size {shards.hidden_size} but the target "
                         f"{cfg.target_path} has {mcfg.target_hidden_size}: shards from another target?")
    stored = layers.in_output_convention([int(k) for k in shards.index["layer_ids"]],
                                         shards.index.get("layer_convention", "output"))
    layer_ids = layers.training_layer_ids(stored, cfg.drafter_kind, _num_layers(tconf), cfg.train_layer_ids)
    cols = [stored.index(k) for k in layer_ids]
    if cfg.train_batch_size % (cfg.train_micro_batch_size * d.world):
        raise ValueError(f"train_batch_size {cfg.train_batch_size} must be a multiple of train_micro_batch_size "
                         f"{cfg.train_micro_batch_size} x {d.world} processes")
    fingerprint = cfg.fingerprint(shards.index, tconf)
    found = checkpoints.latest_matching(out, fingerprint) if cfg.train_resume else None

    tensors = target_tensors(cfg.target_path)
    prep = prepare(cfg, shards, tensors["lm_head"], d, log)
    steps_per_epoch = len(prep.train) // cfg.train_batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{len(prep.train)} training samples is less than one batch of {cfg.train_batch_size}")
    total = max(1, round(cfg.train_epochs * steps_per_epoch))
    end = min(total, cfg.stop_at) if cfg.stop_at > 0 else total

    objective, weights, anchors, write_export = _drafter(cfg, mcfg, prep, tensors, layer_ids)
    objective = objective.to(d.device)
    feed = {"cols": cols, "anchors": anchors}
    del tensors
    model = _wrap(objective, cfg, d)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.train_lr, weight_decay=cfg.train_weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(total, cfg.train_warmup_fraction))
    start = 0
    if found is not None:
        start = checkpoints.restore(model, opt, sched, found[1])
        log(f"resuming from {found[0]} (step {start} of {total})")
        del found
    elif d.main:
        outputs.remove_checkpoints(out)
    metrics = outputs.Metrics(out, start, d.main)
    exports = outputs.Exports(out, start, d.main)
    export_steps = sorted({min(total, max(1, round(f * total))) for f in cfg.export_fractions} | {total})
    eval_steps = set(export_steps) | (set(range(cfg.train_eval_every, total + 1, cfg.train_eval_every))
                                      if cfg.train_eval_every > 0 else set())

    baseline = unigram_baseline(objective, prep, cfg, d) if prep.held else None
    if baseline:
        log(f"held-out unigram baseline: loss {baseline['loss']:.3f}, acc {baseline['acc']:.3f}")
    if start == 0 and prep.held:
        metrics.write({"split": "heldout", "step": 0, **heldout_scores(model, prep, cfg, d, weights, **feed)})

    micro, epochs, denoms, step_tokens = _plan(prep, cfg, d, range(start, end), steps_per_epoch, anchors)
    batches = iter(data.loader(cfg.hidden_dir, micro, prep.sup, d.device, epochs=epochs, **feed))
    accum = cfg.train_batch_size // (cfg.train_micro_batch_size * d.world)
    log(f"training {total} steps ({steps_per_epoch}/epoch, {len(prep.train)} train / {len(prep.held)} "
        f"held-out samples) on {d.world} x {d.device.type}" + (f", from step {start}" if start else ""))
    model.train()
    t0, side = time.time(), 0.0      # side: time in evaluation, checkpoints and exports
    tokens = metrics.last("train")["tokens"] if start and metrics.last("train") else 0
    bar = Progress(end - start, "training", "steps")
    for s in range(start, end):
        denom = denoms[s - start].to(d.device)
        scale = torch.where(denom > 0, weights.to(d.device) / denom.clamp_min(1), 0.0) * d.world
        sums = torch.zeros(4, len(weights))
        for a in range(accum):
            last_micro = a == accum - 1
            if cfg.train_fsdp and d.world > 1:
                model.set_requires_gradient_sync(last_micro)
            no_sync = isinstance(model, nn.parallel.DistributedDataParallel) and not last_micro
            with model.no_sync() if no_sync else contextlib.nullcontext():
                with autocast(d.device):
                    ce, stats = model(*data.to_device(next(batches), d.device))
                (ce * scale).sum().backward()
            sums += torch.cat((ce.detach()[None], stats)).float().cpu()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train_grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += step_tokens[s - start]
        done = s + 1
        r = row(d.sum(sums), weights)
        metrics.write({"split": "train", "step": done, "epoch": done / steps_per_epoch,
                       "lr": sched.get_last_lr()[0], "grad_norm": float(grad_norm), "tokens": tokens, **r})
        bar.update(1)
        bar.set(loss=r["loss"], acc0=r["acc_i"][0])

        t_side = time.time()
        if done in eval_steps and prep.held:
            ev = heldout_scores(model, prep, cfg, d, weights, **feed)
            metrics.write({"split": "heldout", "step": done, **ev})
            log(f"step {done}/{total}: held-out loss {ev['loss']:.3f}, acc_i "
                + " ".join(f"{a:.3f}" for a in ev["acc_i"]))
        if done in export_steps or done % cfg.train_checkpoint_every == 0 or done == end:
            msd, osd = checkpoints.gather_state(model, opt)
            if d.main and done in export_steps:
                path = write_export(outputs.export_dir(out, done, total, cfg.drafter_kind),
                                    {k.removeprefix("drafter."): v for k, v in msd.items()},
                                    {"step": done, "total_steps": total, "target": shards.index.get("target")})
                exports.add({"step": done, "fraction": done / total, "dir": str(path),
                             "heldout": metrics.last("heldout") if prep.held else None})
            if d.main and (done % cfg.train_checkpoint_every == 0 or done == end):
                checkpoints.save(out, done, msd, osd, sched, fingerprint)
            d.barrier()
        side += time.time() - t_side
    bar.close()
    seconds = time.time() - t0 - side
    summary = {
        "steps": end, "total_steps": total, "finished": end == total, "world_size": d.world,
        "train_samples": len(prep.train), "heldout_samples": len(prep.held),
        "tokens": tokens, "train_seconds": seconds,
        "tokens_per_s": sum(step_tokens) / seconds if seconds else None,
        "eval_save_seconds": side, "prep_seconds": prep.seconds, "vocab": _vocab_summary(prep),
        "heldout": metrics.last("heldout"), "heldout_start": metrics.first("heldout"),
        "unigram_baseline": baseline, "exports": exports.items, "layer_ids": layer_ids,
        "kind": cfg.drafter_kind, "stored_layer_ids": stored,
        **({"block_size": cfg.dflash_block_size, "draft_layers": cfg.dflash_layers} if anchors else {}),
        "sources": {src: {"train_samples": len(v["train"]), "heldout_samples": len(v["held"]),
                          "heldout": (metrics.last("heldout") or {}).get("by_source", {}).get(src)}
                    for src, v in prep.sources.items()},
    }
    if d.main:
        outputs.write_summary(out, summary)
    d.barrier()  # every node's launcher reads the summary once its torchrun ends
    d.close()
    return summary


def _num_layers(tconf: dict) -> int:
    return int(tconf.get("text_config", tconf)["num_hidden_layers"])


def _vocab_summary(prep: Prepared) -> dict:
    v = prep.vocab
    return {"draft_vocab_size": v.size, "distinct_tokens": v.distinct(), "train_coverage": v.coverage(),
            "supervised_fraction": float(prep.counts[prep.train, 0].sum()) / max(1, int(v.counts.sum())),
            "heldout_coverage": v.coverage(prep.held_counts) if prep.held_counts is not None else None}


def launch(cfg: TrainConfig, train_nproc: int = 1, nnodes: int = 1, rdzv_endpoint: str = "", log=print) -> dict:
    """Train in this process (train_nproc 1, one node) or in `train_nproc` torchrun processes on this node, of
    `nnodes` nodes joined at `rdzv_endpoint` (`draftsmith.distributed`); returns the summary."""
    if train_nproc <= 1 and nnodes <= 1:
        return train(cfg, log)
    cfg.check()
    out = Path(cfg.out_dir)
    here = launch_dir(out, nnodes)
    here.mkdir(parents=True, exist_ok=True)
    try:
        torchrun(train_nproc, "draftsmith.drafter.train", [str(outputs.write_train_config(here, cfg.to_dict()))],
                 nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, log=log)
    finally:
        done_launching(here, nnodes)
    return outputs.read_summary(out)


def main(argv=None) -> int:
    """`torchrun --nproc_per_node N -m draftsmith.drafter.train CONFIG.json`: `train` as one rank,
    with DDP (or FSDP2 when `train_fsdp`); on CPU the processes use gloo."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc_per_node N -m draftsmith.drafter.train CONFIG.json", file=sys.stderr)
        return 2
    train(TrainConfig.from_json(argv[0]), log=lambda *a: print(*a, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
