"""Stage 05: train the run's drafters (EAGLE-3 and/or DFlash, `kinds.py`) on its stage-04 hidden states.

Read top to bottom: `run(run, cfg)` is notebook 05's one call; it takes stage 05's config
(`config.DrafterConfig`) and, for each kind of `drafter_kinds`, a `TrainJob` (the kind, where it
reads and writes, and the knobs no notebook offers). `launch` trains in this process or as torchrun
ranks (`train_nproc`, `nnodes`); `train` prepares (`data.prepare`), trains, scores the held-out
split, checkpoints and exports. Every loss denominator is fixed per global batch before it starts,
so N processes give the result of one on the same global batch; rank 0 alone writes checkpoints,
exports and metrics, so a lost node costs the steps since the last checkpoint. A checkpoint holds
the fingerprint of the settings and data it was trained with (`fingerprint`): a run resumes only
from one that matches. What is written, and where, is `outputs.py`'s."""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .. import layers
from ..config import DrafterConfig, split
from ..distributed import Dist, done_launching, init_dist, launch_dir, torchrun
from ..hidden.outputs import HiddenShards, broken_shards, broken_shards_message, hidden_dir
from ..paths import Run
from ..progress import Progress
from ..targets.checkpoint import resolve_target, target_config, target_tensors
from . import data, kinds, outputs
from .data import Prepared, digest, prepare
from .export import DTYPES
from .kinds import DrafterKind
from .model import DrafterShape
from .objective import TTTObjective, autocast


def run(run: Run, cfg: DrafterConfig, *, log=print) -> dict[str, dict]:
    """Train each kind of `cfg.drafter_kinds` in turn on the same features, each into its own folder
    (`outputs.drafter_dir`; resuming from its latest checkpoint when `train_resume`), export, and
    return the summaries by kind (`outputs.write_summary`). A shard of stage 04's that is missing or
    cut short is a ValueError naming it, before anything is set up."""
    names = cfg.drafter_kinds
    if not names or len(set(names)) != len(names) or not set(names) <= set(outputs.KINDS):
        raise ValueError(f"drafter_kinds must list distinct kinds of {outputs.KINDS}, got {names!r}")
    broken = broken_shards(hidden_dir(run))   # sizes and headers: seconds for thousands of shards
    if broken:
        raise ValueError(broken_shards_message(hidden_dir(run), broken, "re-run stage 04 on this run"))
    jobs = [TrainJob(drafter_kind=kind, hidden_dir=str(hidden_dir(run)), out_dir=str(outputs.drafter_dir(run, kind)),
                     target_path=str(resolve_target(cfg.target_model_path))) for kind in names]
    for job in jobs:   # every kind's settings before the first trains
        check(cfg, job)
    return {job.drafter_kind: launch(cfg, job, log=log) for job in jobs}


# -- the settings --------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """One drafter's training beside stage 05's config: its kind, the stage-04 shards and target it
    reads, the folder it writes, and two knobs no stage declares: `step_weight` (TTT step i weighs
    step_weight**i) and `stop_at` (return after this many steps; 0: train to the end)."""
    drafter_kind: str = "eagle3"   # eagle3 or dflash
    hidden_dir: str
    target_path: str
    out_dir: str
    step_weight: float = 0.8
    stop_at: int = 0


def check(cfg: DrafterConfig, job: TrainJob) -> None:
    """Settings errors a bound cannot state, raised before any work (an export failing after training
    would waste it); the config's own bounds were checked when it was built."""
    if job.drafter_kind not in outputs.KINDS:
        raise ValueError(f"drafter kind must be one of {outputs.KINDS}, got {job.drafter_kind!r}")
    if cfg.export_engine not in layers.ENGINES:
        raise ValueError(f"export_engine must be one of {layers.ENGINES}, got {cfg.export_engine!r}")
    if cfg.export_dtype not in DTYPES:
        raise ValueError(f"export_dtype must be one of {sorted(DTYPES)}, got {cfg.export_dtype!r}")
    if not all(0 < f <= 1 for f in cfg.export_fractions):
        raise ValueError(f"export_fractions must lie in (0, 1], got {cfg.export_fractions}")


# The settings that change the trained weights; every other one is bookkeeping (where it runs, how
# often it scores, checkpoints and exports, in what format).
WEIGHT_SETTINGS = ("draft_vocab_size", "ttt_steps", "train_epochs", "train_batch_size", "train_micro_batch_size",
                   "train_max_len", "train_lr", "train_warmup_fraction", "train_weight_decay", "train_grad_clip",
                   "train_holdout_fraction", "seed", "train_fsdp")
DFLASH_SETTINGS = ("dflash_layers", "dflash_block_size", "dflash_anchors")


def fingerprint(cfg: DrafterConfig, job: TrainJob, shards_index: dict, target_config: dict) -> dict:
    """What a checkpoint must agree with to be resumed: the settings that change the weights, and
    the data and target themselves (not their paths, so a moved run folder still resumes). An
    EAGLE-3 run's holds no DFlash setting and an empty `train_layer_ids` none, so a checkpoint
    made before they existed still resumes."""
    names = WEIGHT_SETTINGS + (("train_layer_ids",) if cfg.train_layer_ids else ()) \
        + (DFLASH_SETTINGS if job.drafter_kind != "eagle3" else ())
    kind = {"drafter_kind": job.drafter_kind} if job.drafter_kind != "eagle3" else {}
    return {**{k: getattr(cfg, k) for k in names}, **kind, "step_weight": job.step_weight,
            "data": digest(shards_index), "target": digest(target_config)}


def settings(cfg: DrafterConfig, job: TrainJob) -> dict:
    """Config and job as one JSON-able dict: what torchrun ranks are handed (`read_settings`) and
    what every rank must agree on."""
    return {**asdict(cfg), **asdict(job)}


def read_settings(path) -> tuple[DrafterConfig, TrainJob]:
    """The config and job a `settings` file holds; a setting neither declares is a ValueError."""
    job, rest = split(TrainJob, json.loads(Path(path).read_text()))
    cfg, unknown = split(DrafterConfig, rest)
    if unknown:
        raise ValueError(f"{path}: unknown training settings {sorted(unknown)}")
    return DrafterConfig(**cfg), TrainJob(**job)


# -- where it runs -------------------------------------------------------------------------------

def launch(cfg: DrafterConfig, job: TrainJob, log=print) -> dict:
    """Train in this process (`train_nproc` 1, one node) or in `train_nproc` torchrun processes on
    this node, of `nnodes` nodes joined at `rdzv_endpoint` (`draftsmith.distributed`); returns the summary."""
    if cfg.train_nproc <= 1 and cfg.nnodes <= 1:
        return train(cfg, job, log)
    check(cfg, job)
    out = Path(job.out_dir)
    here = launch_dir(out, cfg.nnodes)
    here.mkdir(parents=True, exist_ok=True)
    try:
        torchrun(cfg.train_nproc, "draftsmith.drafter.stage", [str(outputs.write_train_config(here, settings(cfg, job)))],
                 nnodes=cfg.nnodes, rdzv_endpoint=cfg.rdzv_endpoint, log=log)
    finally:
        done_launching(here, cfg.nnodes)
    return outputs.read_summary(out)


def main(argv=None) -> int:
    """`torchrun --nproc_per_node N -m draftsmith.drafter.stage CONFIG.json`: `train` as one rank,
    with DDP (or FSDP2 when `train_fsdp`); on CPU the processes use gloo."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc_per_node N -m draftsmith.drafter.stage CONFIG.json", file=sys.stderr)
        return 2
    train(*read_settings(argv[0]), log=lambda *a: print(*a, flush=True))
    return 0


# -- one drafter's training ----------------------------------------------------------------------

def train(cfg: DrafterConfig, job: TrainJob, log=print) -> dict:
    """Prepare, train (resuming from the latest checkpoint when asked), export; returns the summary.
    Prepares with `data.prepare` (split, draft vocabulary, teacher masks), then minimises the
    drafter's objective (`kinds.py`) with AdamW, a cosine schedule with linear warmup, gradient
    clipping, bf16 autocast on GPU and gradient accumulation (`Optimiser`); scores the held-out split,
    checkpoints and exports at `export_fractions` of training. Each rank reads only its
    micro-batches from the shared hidden-state folder."""
    check(cfg, job)
    d = init_dist()
    log = log if d.main else (lambda *a, **k: None)
    t = _setup(cfg, job, d, log)
    start, steps, prep = t.start, t.steps, t.prep
    micro, epochs, denoms, step_tokens = _plan(prep, cfg, d, range(start, steps.end), steps.per_epoch,
                                               t.kind.denominators)
    batches = iter(data.loader(job.hidden_dir, micro, prep.sup, d.device, epochs=epochs, **t.feed))
    log(f"training {steps.total} steps ({steps.per_epoch}/epoch, {len(prep.train)} train / {len(prep.held)} "
        f"held-out samples) on {d.world} x {d.device.type}" + (f", from step {start}" if start else ""))
    t.opt.model.train()
    t0, side = time.time(), 0.0      # side: time in evaluation, checkpoints and exports
    tokens = t.metrics.last("train")["tokens"] if start and t.metrics.last("train") else 0
    bar = Progress(steps.end - start, "training", "steps")
    for s in range(start, steps.end):
        sums, grad_norm = t.opt.step(batches, denoms[s - start], t.kind.weights)
        tokens += step_tokens[s - start]
        done = s + 1
        r = row(d.sum(sums), t.kind.weights)
        t.metrics.write({"split": "train", "step": done, "epoch": done / steps.per_epoch,
                         "lr": t.opt.schedule.get_last_lr()[0], "grad_norm": grad_norm, "tokens": tokens, **r})
        bar.update(1)
        bar.set(loss=r["loss"], acc0=r["acc_i"][0])
        t_side = time.time()
        _evaluate(t, done, log)
        _save(t, done)
        side += time.time() - t_side
    bar.close()
    summary = _summary(t, tokens, sum(step_tokens), time.time() - t0 - side, side)
    if d.main:
        outputs.write_summary(t.out, summary)
    d.barrier()  # every node's launcher reads the summary once its torchrun ends
    d.close()
    return summary


# -- setup ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Inputs:
    """What a training run reads, checked against each other: the hidden-state shards, the drafter's
    shape (the target's), the layers stored (output convention), those trained on and their columns
    in the shards, and the fingerprint a checkpoint must match."""
    shards: HiddenShards
    shape: DrafterShape
    stored: list[int]
    layer_ids: list[int]
    cols: list[int]
    fingerprint: dict


def _inputs(cfg: DrafterConfig, job: TrainJob, d: Dist) -> Inputs:
    shards = HiddenShards(job.hidden_dir)
    tconf = target_config(job.target_path)
    shape = DrafterShape.from_target(tconf, cfg.draft_vocab_size)
    if shards.hidden_size != shape.target_hidden_size:
        raise ValueError(f"{job.hidden_dir}: hidden_size {shards.hidden_size} but the target "
                         f"{job.target_path} has {shape.target_hidden_size}: shards from another target?")
    stored = layers.in_output_convention([int(k) for k in shards.index["layer_ids"]],
                                         shards.index.get("layer_convention", "output"))
    layer_ids = layers.training_layer_ids(stored, job.drafter_kind, _num_layers(tconf), cfg.train_layer_ids)
    cols = [stored.index(k) for k in layer_ids]
    if cfg.train_batch_size % (cfg.train_micro_batch_size * d.world):
        raise ValueError(f"train_batch_size {cfg.train_batch_size} must be a multiple of train_micro_batch_size "
                         f"{cfg.train_micro_batch_size} x {d.world} processes")
    return Inputs(shards, shape, stored, layer_ids, cols, fingerprint(cfg, job, shards.index, tconf))


@dataclass
class Training:
    """A training run as set up before its first step: settings, processes, inputs, the prepared
    split, the steps, the drafter and its optimiser, the step it starts from, the metrics and
    exports it adds to, and the held-out unigram baseline (None without a held-out split)."""
    cfg: DrafterConfig
    job: TrainJob
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


def _setup(cfg: DrafterConfig, job: TrainJob, d: Dist, log) -> Training:
    """Check the inputs, prepare (`data.prepare`), build the drafter and its optimiser, resume from
    the latest checkpoint (`train_resume`; else clear old ones) and score the held-out split at step 0."""
    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d.check_together(out, settings(cfg, job))
    inputs = _inputs(cfg, job, d)
    found = latest_checkpoint(out, inputs.fingerprint) if cfg.train_resume else None
    tensors = target_tensors(job.target_path)
    prep = prepare(cfg, out, inputs.shards, tensors["lm_head"], d, log)
    steps = Steps.of(cfg, job, len(prep.train))
    kind = kinds.build(cfg, job.drafter_kind, inputs.shape, prep, tensors, inputs.layer_ids, job.step_weight)
    del tensors
    opt = Optimiser(kind.objective.to(d.device), cfg, d, steps.total)
    start = 0
    if found is not None:
        start = restore(opt.model, opt.adamw, opt.schedule, found[1])
        log(f"resuming from {found[0]} (step {start} of {steps.total})")
        del found
    elif d.main:
        outputs.remove_checkpoints(out)
    metrics, exports = outputs.Metrics(out, start, d.main), outputs.Exports(out, start, d.main)
    baseline = unigram_baseline(kind.objective, prep, cfg, job, d) if prep.held else None
    if baseline:
        log(f"held-out unigram baseline: loss {baseline['loss']:.3f}, acc {baseline['acc']:.3f}")
    t = Training(cfg, job, d, out, inputs, prep, steps, kind, opt, start, metrics, exports, baseline)
    if start == 0 and prep.held:
        metrics.write({"split": "heldout", "step": 0, **heldout_scores(t)})
    return t


def _num_layers(tconf: dict) -> int:
    return int(tconf.get("text_config", tconf)["num_hidden_layers"])


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
    def of(cls, cfg: DrafterConfig, job: TrainJob, train_samples: int) -> Steps:
        per_epoch = train_samples // cfg.train_batch_size
        if per_epoch == 0:
            raise ValueError(f"{train_samples} training samples is less than one batch of {cfg.train_batch_size}")
        total = max(1, round(cfg.train_epochs * per_epoch))
        end = min(total, job.stop_at) if job.stop_at > 0 else total
        exports = sorted({min(total, max(1, round(f * total))) for f in cfg.export_fractions} | {total})
        every = range(cfg.train_eval_every, total + 1, cfg.train_eval_every) if cfg.train_eval_every > 0 else ()
        return cls(per_epoch, total, end, exports, set(exports) | set(every), cfg.train_checkpoint_every)

    def checkpoints(self, done: int) -> bool:
        return done % self.checkpoint_every == 0 or done == self.end


# -- the loop ------------------------------------------------------------------------------------

def _schedule(total: int, warmup_fraction: float):
    warmup = max(1, round(warmup_fraction * total))

    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))
    return f


def _wrap(objective: nn.Module, cfg: DrafterConfig, d: Dist) -> nn.Module:
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

    def __init__(self, objective: nn.Module, cfg: DrafterConfig, d: Dist, total: int):
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


def _plan(prep: Prepared, cfg: DrafterConfig, d: Dist, steps: range, per_epoch: int, denominators):
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


# -- held-out scores -----------------------------------------------------------------------------
# A metrics row holds means per TTT step over the supervised positions: `loss_i` (soft cross-entropy),
# `kl_i` (minus the teacher's entropy; 0 = a perfect copy), `acc_i` (the drafter's top token is the
# target's), `count_i` (positions), and `loss`, the steps weighed as in training.

def row(sums: torch.Tensor, weights: torch.Tensor) -> dict:
    """Means per TTT step from the sums [CE, hits, positions, teacher entropy] x [k]."""
    ce, hits, count, ent = sums
    n = count.clamp_min(1)
    return {"loss": float((weights * ce / n).sum()), "loss_i": (ce / n).tolist(),
            "kl_i": ((ce - ent) / n).tolist(), "acc_i": (hits / n).tolist(), "count_i": count.long().tolist()}


def heldout_scores(t: Training) -> dict:
    """Held-out scores, overall and per source (`by_source`; micro-batches never mix sources, so
    each is exact), fed as in training (DFlash: epoch 0's anchors)."""
    cfg, d, prep, model, weights = t.cfg, t.d, t.prep, t.opt.model, t.kind.weights
    per_source = {}
    model.eval()
    with torch.no_grad():
        for src, split_ in prep.sources.items():
            batches = data.micro_batches(split_["held"], prep.sup, cfg.train_micro_batch_size)
            mine = batches[d.rank::d.world]
            # under FSDP every forward is a collective: a rank with one micro-batch fewer runs a
            # repeat of one (its sums left out), or the other ranks would wait for it forever
            spare = (-(-len(batches) // d.world) - len(mine)) if cfg.train_fsdp else 0
            sums = torch.zeros(4, len(weights))
            todo = mine + batches[:spare]
            for i, batch in enumerate(data.loader(t.job.hidden_dir, todo, prep.sup, d.device,
                                                  epochs=[0] * len(todo), **t.feed)):
                with autocast(d.device):
                    ce, stats = model(*data.to_device(batch, d.device))
                if i < len(mine):
                    sums += torch.cat((ce[None], stats)).float().cpu()
            per_source[src] = d.sum(sums)
    model.train()
    out = row(sum(per_source.values()), weights)
    out["by_source"] = {src: {**row(sums, weights), "samples": len(prep.sources[src]["held"])}
                        for src, sums in per_source.items() if prep.sources[src]["held"]}
    return out


def unigram_baseline(objective: TTTObjective, prep: Prepared, cfg: DrafterConfig, job: TrainJob, d: Dist) -> dict:
    """What a drafter that always proposes the draft-vocab unigram distribution of the training
    tokens (add-one smoothed) scores on the held-out step-0 positions."""
    q = prep.vocab.counts[prep.vocab.used].double() + 1
    logq = (q / q.sum()).log().float().to(d.device)
    top = int(logq.argmax())
    mine = data.micro_batches(prep.held, prep.sup, cfg.train_micro_batch_size)[d.rank::d.world]
    sums = torch.zeros(3)
    for batch in data.loader(job.hidden_dir, mine, prep.sup, d.device):
        aux, ids, sup, last = data.to_device(batch, d.device)[:4]
        p, target, _ = objective.teacher(last)
        keep = sup.nonzero(as_tuple=True)[1] >= 1
        sums += torch.stack((-(p[keep] * logq).sum(), (target[keep] == top).sum().float(),
                             keep.sum().float())).cpu()
    ce, hits, count = d.sum(sums)
    return {"loss": float(ce / max(count, 1)), "acc": float(hits / max(count, 1)), "count": int(count)}


def _evaluate(t: Training, done: int, log) -> None:
    """Score the held-out split after step `done` when it is one to score (and there is one)."""
    if done not in t.steps.evals or not t.prep.held:
        return
    ev = heldout_scores(t)
    t.metrics.write({"split": "heldout", "step": done, **ev})
    log(f"step {done}/{t.steps.total}: held-out loss {ev['loss']:.3f}, acc_i "
        + " ".join(f"{a:.3f}" for a in ev["acc_i"]))


# -- checkpoints and exports ---------------------------------------------------------------------
# A checkpoint is the full (unsharded) model and optimizer state without the frozen embedding, the
# schedule, every random generator and the step, plus the run's `fingerprint`.

def _save(t: Training, done: int) -> None:
    """After an export step rank 0 exports the drafter, after a checkpoint step it checkpoints; every
    rank gathers the full state for it first and waits for rank 0 after."""
    steps, d = t.steps, t.d
    if done not in steps.exports and not steps.checkpoints(done):
        return
    msd, osd = gather_state(t.opt.model, t.opt.adamw)
    if d.main and done in steps.exports:
        extra = {"step": done, "total_steps": steps.total, "target": t.inputs.shards.index.get("target")}
        path = t.kind.export(outputs.export_dir(t.out, done, steps.total, t.job.drafter_kind),
                             {k.removeprefix("drafter."): v for k, v in msd.items()}, extra)
        t.exports.add({"step": done, "fraction": done / steps.total, "dir": str(path),
                       "heldout": t.metrics.last("heldout") if t.prep.held else None})
    if d.main and steps.checkpoints(done):
        write_checkpoint(t.out, done, msd, osd, t.opt.schedule, t.inputs.fingerprint)
    d.barrier()


def gather_state(model, opt) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state on CPU, without the frozen embedding."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v for k, v in msd.items() if not k.endswith("embed_tokens.weight")}, osd


def write_checkpoint(out: Path, step: int, msd: dict, osd: dict, sched, fingerprint: dict) -> Path:
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return outputs.save_checkpoint(out, step, {"step": step, "model": msd, "optimizer": osd,
                                                 "scheduler": sched.state_dict(), "rng": rng,
                                                 "config": fingerprint})


# A checkpoint written before the settings took notebook 05's names remembers them by their old
# names: its fingerprint is read through this map, so such a run still resumes.
OLD_NAMES = {old: f"train_{old}" for old in (
    "epochs", "batch_size", "micro_batch_size", "max_len", "lr", "warmup_fraction", "weight_decay", "grad_clip",
    "holdout_fraction", "fsdp", "eval_every", "checkpoint_every", "resume")}


def latest_checkpoint(out: Path, fingerprint: dict) -> tuple[Path, dict] | None:
    """The latest checkpoint and its state, or None when there is none; an error when it was
    trained with other settings or data (checked before any long preparation)."""
    found = outputs.checkpoints(out)
    if not found:
        return None
    state = torch.load(found[-1], map_location="cpu", weights_only=False)
    state["config"] = {OLD_NAMES.get(k, k): v for k, v in state["config"].items()}
    if state["config"] != fingerprint:
        diff = sorted(k for k in fingerprint if state["config"].get(k) != fingerprint[k])
        raise ValueError(f"{found[-1]}: checkpoint was trained with other settings or data ({', '.join(diff)}); "
                         f"restore them, or start over: train_resume false, or delete "
                         f"{found[-1].parent}")
    return found[-1], state


def restore(model, opt, sched, state: dict) -> int:
    """Put model, optimizer, schedule and random generators back; returns the step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(full_state_dict=True, strict=False))
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"]


# -- summary -------------------------------------------------------------------------------------

def _summary(t: Training, tokens: int, trained: int, seconds: float, side: float) -> dict:
    """The run's summary: `tokens` seen in all, `trained` of them by this run in `seconds` of
    training, `side` seconds of evaluation, checkpoints and exports."""
    prep, metrics, heldout = t.prep, t.metrics, t.metrics.last("heldout")
    return {
        "steps": t.steps.end, "total_steps": t.steps.total, "finished": t.steps.end == t.steps.total,
        "world_size": t.d.world, "train_samples": len(prep.train), "heldout_samples": len(prep.held),
        "tokens": tokens, "train_seconds": seconds, "tokens_per_s": trained / seconds if seconds else None,
        "eval_save_seconds": side, "prep_seconds": prep.seconds, "vocab": _vocab_summary(prep),
        "heldout": heldout, "heldout_start": metrics.first("heldout"),
        "unigram_baseline": t.baseline, "exports": t.exports.items, "layer_ids": t.inputs.layer_ids,
        "kind": t.job.drafter_kind, "stored_layer_ids": t.inputs.stored, **t.kind.summary(),
        "sources": {src: {"train_samples": len(v["train"]), "heldout_samples": len(v["held"]),
                          "heldout": (heldout or {}).get("by_source", {}).get(src)}
                    for src, v in prep.sources.items()},
    }


def _vocab_summary(prep: Prepared) -> dict:
    v = prep.vocab
    return {"draft_vocab_size": v.size, "distinct_tokens": v.distinct(), "train_coverage": v.coverage(),
            "supervised_fraction": float(prep.counts[prep.train, 0].sum()) / max(1, int(v.counts.sum())),
            "heldout_coverage": v.coverage(prep.held_counts) if prep.held_counts is not None else None}


if __name__ == "__main__":
    sys.exit(main())
