"""Stage 05: train a drafter (EAGLE-3 or DFlash, `kinds.py`) on stage 04's hidden states.

`train(cfg)` prepares, trains, scores the held-out split, checkpoints and exports, in one process
or as torchrun ranks (`launch` picks; `stage.run` is notebook 05's call into it). Every loss
denominator is fixed per global batch before it starts, so N processes give the result of one on
the same global batch; rank 0 alone writes checkpoints, exports and metrics, so a lost node costs
the steps since the last checkpoint. What it writes, and where, is `outputs.py`'s."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import layers
from ..distributed import Dist, done_launching, init_dist, launch_dir, torchrun
from ..hidden.outputs import HiddenShards
from ..progress import Progress
from ..targets.checkpoint import target_config, target_tensors
from . import checkpoints, data, kinds, outputs
from .config import TrainConfig
from .kinds import DrafterKind
from .model import DrafterShape
from .objective import autocast
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


class Optimiser:
    """The objective wrapped for this process's world (`_wrap`), AdamW over its trainable parameters
    and the warmup-cosine schedule; `step` makes one optimiser step of a global batch, accumulating
    gradients over this process's micro-batches and reducing them across processes on the last."""

    def __init__(self, objective: nn.Module, cfg: TrainConfig, d: Dist, total: int):
        self.cfg, self.d = cfg, d
        self.model = _wrap(objective, cfg, d)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.adamw = torch.optim.AdamW(self.params, lr=cfg.train_lr, weight_decay=cfg.train_weight_decay,
                                       betas=(0.9, 0.95))
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.adamw, _schedule(total, cfg.train_warmup_fraction))
        self.accum = cfg.train_batch_size // (cfg.train_micro_batch_size * d.world)

    def step(self, batches, denom: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, float]:
        """One step over the next `accum` micro-batches of `batches`, term k weighed by
        weights[k] / denom[k] (0 where nothing counts); returns this process's sums [4, k] and the
        gradient norm before clipping."""
        d = self.d
        denom = denom.to(d.device)
        scale = torch.where(denom > 0, weights.to(d.device) / denom.clamp_min(1), 0.0) * d.world
        sums = torch.zeros(4, len(weights))
        for a in range(self.accum):
            with self._syncing(a == self.accum - 1):
                with autocast(d.device):
                    ce, stats = self.model(*data.to_device(next(batches), d.device))
                (ce * scale).sum().backward()
            sums += torch.cat((ce.detach()[None], stats)).float().cpu()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train_grad_clip)
        self.adamw.step()
        self.schedule.step()
        self.adamw.zero_grad(set_to_none=True)
        return sums, float(grad_norm)

    def _syncing(self, last: bool):
        """The context of one micro-batch: gradients reduced across processes on the last only."""
        if self.cfg.train_fsdp and self.d.world > 1:
            self.model.set_requires_gradient_sync(last)
        no_sync = isinstance(self.model, nn.parallel.DistributedDataParallel) and not last
        return self.model.no_sync() if no_sync else contextlib.nullcontext()


@dataclass(frozen=True)
class Steps:
    """The step schedule: steps per epoch, `total` over `train_epochs`, `end` where this run stops
    (`stop_at`), the steps that export (`export_fractions` and the last) and those that score the
    held-out split (those and every `train_eval_every`); `checkpoints(done)` says when to checkpoint."""
    per_epoch: int
    total: int
    end: int
    exports: list[int]
    evals: set[int]
    checkpoint_every: int

    @classmethod
    def of(cls, cfg: TrainConfig, train_samples: int) -> Steps:
        per_epoch = train_samples // cfg.train_batch_size
        if per_epoch == 0:
            raise ValueError(f"{train_samples} training samples is less than one batch of {cfg.train_batch_size}")
        total = max(1, round(cfg.train_epochs * per_epoch))
        end = min(total, cfg.stop_at) if cfg.stop_at > 0 else total
        exports = sorted({min(total, max(1, round(f * total))) for f in cfg.export_fractions} | {total})
        every = range(cfg.train_eval_every, total + 1, cfg.train_eval_every) if cfg.train_eval_every > 0 else ()
        return cls(per_epoch, total, end, exports, set(exports) | set(every), cfg.train_checkpoint_every)

    def checkpoints(self, done: int) -> bool:
        return done % self.checkpoint_every == 0 or done == self.end


def _plan(prep: Prepared, cfg: TrainConfig, d: Dist, steps: range, per_epoch: int, denominators):
    """This process's micro-batches of the given steps in order with their epochs, and per step the
    loss denominators [k] of the whole global batch (`DrafterKind.denominators`) and its tokens."""
    micro, epochs, denoms, tokens, by_epoch = [], [], [], [], {}
    for s in steps:
        epoch = s // per_epoch
        if epoch not in by_epoch:     # one shuffle per epoch, not per step
            by_epoch[epoch] = data.global_batches(prep.train, cfg.train_batch_size, cfg.seed, epoch)
        gb = by_epoch[epoch][s % per_epoch]
        mine = data.micro_batches(gb, prep.sup, cfg.train_micro_batch_size)[d.rank::d.world]
        micro.extend(mine)
        epochs.extend([epoch] * len(mine))
        denoms.append(denominators(gb, epoch))
        tokens.append(sum(prep.sup.length(i) for i in gb))
    return micro, epochs, denoms, tokens


# -- one run ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Inputs:
    """What a run reads, checked against each other: the hidden-state shards, the drafter's shape
    (the target's), the layers stored (output convention), those trained on and their columns in
    the shards, and the fingerprint a checkpoint must match."""
    shards: HiddenShards
    mcfg: DrafterShape
    stored: list[int]
    layer_ids: list[int]
    cols: list[int]
    fingerprint: dict


def _inputs(cfg: TrainConfig, d: Dist) -> Inputs:
    shards = HiddenShards(cfg.hidden_dir)
    tconf = target_config(cfg.target_path)
    mcfg = DrafterShape.from_target(tconf, cfg.draft_vocab_size)
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
    return Inputs(shards, mcfg, stored, layer_ids, cols, cfg.fingerprint(shards.index, tconf))


@dataclass
class Run:
    """A run as set up before its first step: settings, processes, inputs, the prepared split, the
    steps, the drafter and its optimiser, the step it starts from, the metrics and exports it adds
    to, and the held-out unigram baseline (None without a held-out split)."""
    cfg: TrainConfig
    d: Dist
    out: Path
    inputs: Inputs
    prep: Prepared
    steps: Steps
    kind: DrafterKind
    opt: Optimiser
    start: int
    metrics: outputs.Metrics
    exports: outputs.Exports
    baseline: dict | None

    @property
    def feed(self) -> dict:
        """What `data.MicroBatches` adds to each micro-batch: the layers' columns and the anchors."""
        return {"cols": self.inputs.cols, "anchors": self.kind.anchors}


def _setup(cfg: TrainConfig, d: Dist, log) -> Run:
    """Check the inputs, prepare (`prepare.py`), build the drafter and its optimiser, resume from the
    latest checkpoint (`train_resume`; else clear old ones) and score the held-out split at step 0."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d.check_together(out, cfg.to_dict())
    inputs = _inputs(cfg, d)
    found = checkpoints.latest_matching(out, inputs.fingerprint) if cfg.train_resume else None
    tensors = target_tensors(cfg.target_path)
    prep = prepare(cfg, inputs.shards, tensors["lm_head"], d, log)
    steps = Steps.of(cfg, len(prep.train))
    kind = kinds.build(cfg, inputs.mcfg, prep, tensors, inputs.layer_ids)
    del tensors
    opt = Optimiser(kind.objective.to(d.device), cfg, d, steps.total)
    start = 0
    if found is not None:
        start = checkpoints.restore(opt.model, opt.adamw, opt.schedule, found[1])
        log(f"resuming from {found[0]} (step {start} of {steps.total})")
        del found
    elif d.main:
        outputs.remove_checkpoints(out)
    metrics, exports = outputs.Metrics(out, start, d.main), outputs.Exports(out, start, d.main)
    baseline = unigram_baseline(kind.objective, prep, cfg, d) if prep.held else None
    if baseline:
        log(f"held-out unigram baseline: loss {baseline['loss']:.3f}, acc {baseline['acc']:.3f}")
    run = Run(cfg, d, out, inputs, prep, steps, kind, opt, start, metrics, exports, baseline)
    if start == 0 and prep.held:
        metrics.write({"split": "heldout", "step": 0, **_heldout(run)})
    return run


def train(cfg: TrainConfig, log=print) -> dict:
    """Prepare, train (resuming from the latest checkpoint when asked), export; returns the summary.
    Prepares with `prepare.py` (split, draft vocabulary, teacher masks), then minimises the drafter's
    objective (`kinds.py`) with AdamW, a cosine schedule with linear warmup, gradient clipping, bf16
    autocast on GPU and gradient accumulation (`Optimiser`); scores the held-out split (`scoring.py`),
    checkpoints (`checkpoints.py`) and exports at `export_fractions` of training. Each rank reads only
    its micro-batches from the shared hidden-state folder."""
    cfg.check()
    d = init_dist()
    log = log if d.main else (lambda *a, **k: None)
    run = _setup(cfg, d, log)
    start, steps, prep = run.start, run.steps, run.prep
    micro, epochs, denoms, step_tokens = _plan(prep, cfg, d, range(start, steps.end), steps.per_epoch,
                                               run.kind.denominators)
    batches = iter(data.loader(cfg.hidden_dir, micro, prep.sup, d.device, epochs=epochs, **run.feed))
    log(f"training {steps.total} steps ({steps.per_epoch}/epoch, {len(prep.train)} train / {len(prep.held)} "
        f"held-out samples) on {d.world} x {d.device.type}" + (f", from step {start}" if start else ""))
    run.opt.model.train()
    t0, side = time.time(), 0.0      # side: time in evaluation, checkpoints and exports
    tokens = run.metrics.last("train")["tokens"] if start and run.metrics.last("train") else 0
    bar = Progress(steps.end - start, "training", "steps")
    for s in range(start, steps.end):
        sums, grad_norm = run.opt.step(batches, denoms[s - start], run.kind.weights)
        tokens += step_tokens[s - start]
        done = s + 1
        r = row(d.sum(sums), run.kind.weights)
        run.metrics.write({"split": "train", "step": done, "epoch": done / steps.per_epoch,
                           "lr": run.opt.schedule.get_last_lr()[0], "grad_norm": grad_norm, "tokens": tokens, **r})
        bar.update(1)
        bar.set(loss=r["loss"], acc0=r["acc_i"][0])
        t_side = time.time()
        _evaluate(run, done, log)
        _save(run, done)
        side += time.time() - t_side
    bar.close()
    summary = _summary(run, tokens, sum(step_tokens), time.time() - t0 - side, side)
    if d.main:
        outputs.write_summary(run.out, summary)
    d.barrier()  # every node's launcher reads the summary once its torchrun ends
    d.close()
    return summary


def _heldout(run: Run) -> dict:
    return heldout_scores(run.opt.model, run.prep, run.cfg, run.d, run.kind.weights, **run.feed)


def _evaluate(run: Run, done: int, log) -> None:
    """Score the held-out split after step `done` when it is one to score (and there is one)."""
    if done not in run.steps.evals or not run.prep.held:
        return
    ev = _heldout(run)
    run.metrics.write({"split": "heldout", "step": done, **ev})
    log(f"step {done}/{run.steps.total}: held-out loss {ev['loss']:.3f}, acc_i "
        + " ".join(f"{a:.3f}" for a in ev["acc_i"]))


def _save(run: Run, done: int) -> None:
    """After an export step rank 0 exports the drafter, after a checkpoint step it checkpoints; every
    rank gathers the full state for it first and waits for rank 0 after."""
    steps, d = run.steps, run.d
    if done not in steps.exports and not steps.checkpoints(done):
        return
    msd, osd = checkpoints.gather_state(run.opt.model, run.opt.adamw)
    if d.main and done in steps.exports:
        extra = {"step": done, "total_steps": steps.total, "target": run.inputs.shards.index.get("target")}
        path = run.kind.export(outputs.export_dir(run.out, done, steps.total, run.cfg.drafter_kind),
                               {k.removeprefix("drafter."): v for k, v in msd.items()}, extra)
        run.exports.add({"step": done, "fraction": done / steps.total, "dir": str(path),
                         "heldout": run.metrics.last("heldout") if run.prep.held else None})
    if d.main and steps.checkpoints(done):
        checkpoints.save(run.out, done, msd, osd, run.opt.schedule, run.inputs.fingerprint)
    d.barrier()


def _summary(run: Run, tokens: int, trained: int, seconds: float, side: float) -> dict:
    """The run's summary: `tokens` seen in all, `trained` of them by this run in `seconds` of
    training, `side` seconds of evaluation, checkpoints and exports."""
    prep, metrics, heldout = run.prep, run.metrics, run.metrics.last("heldout")
    return {
        "steps": run.steps.end, "total_steps": run.steps.total, "finished": run.steps.end == run.steps.total,
        "world_size": run.d.world, "train_samples": len(prep.train), "heldout_samples": len(prep.held),
        "tokens": tokens, "train_seconds": seconds, "tokens_per_s": trained / seconds if seconds else None,
        "eval_save_seconds": side, "prep_seconds": prep.seconds, "vocab": _vocab_summary(prep),
        "heldout": heldout, "heldout_start": metrics.first("heldout"),
        "unigram_baseline": run.baseline, "exports": run.exports.items, "layer_ids": run.inputs.layer_ids,
        "kind": run.cfg.drafter_kind, "stored_layer_ids": run.inputs.stored, **run.kind.summary(),
        "sources": {src: {"train_samples": len(v["train"]), "heldout_samples": len(v["held"]),
                          "heldout": (heldout or {}).get("by_source", {}).get(src)}
                    for src, v in prep.sources.items()},
    }


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
