"""Train the EAGLE-3 drafter with training-time test (TTT) on stage 04's hidden states.

Loss: for TTT steps i = 0..k-1, soft cross-entropy between the drafter's draft-vocab distribution
and the target's (softmax of lm_head(last) restricted to the draft vocabulary), summed over the
supervised positions of the global batch and divided by their number (see `data.py`), weighted
0.8^i. AdamW, cosine schedule with linear warmup, gradient clipping, bf16 autocast on GPU,
gradient accumulation over micro-batches.

One process: `train(TrainConfig(...))`. Several (GPUs, or CPU processes with gloo):
`torchrun --nproc_per_node N -m draftsmith.drafter.train CONFIG.json` runs the same function with
DDP (or FSDP2 when `fsdp`); every loss denominator is fixed per global batch before it starts, so
N processes give the result of one process on the same global batch. `launch` picks between the two.

Outputs in `out_dir`: vocab.safetensors, supervision.safetensors (cached teacher masks),
metrics.jsonl (a `train` row per step, a `heldout` row per evaluation: loss, KL to the target and
top-1 agreement acc per TTT step, overall and per source of the samples' answers in `by_source`), checkpoints/step-N.pt (model, optimizer, scheduler, RNG, step: `resume` continues exactly),
exports at `export_fractions` of training (`eagle3-step-N/`, the last one `eagle3/`), exports.json
listing them with their held-out scores, and summary.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import layers
from ..distributed import Dist, init_dist
from ..progress import Progress
from ..shards import HiddenShards
from ..target.checkpoint import target_config, target_tensors
from ..torchrun import torchrun
from . import data
from .export import export
from .model import DrafterConfig, Eagle3Drafter
from .vocab import DraftVocab, token_counts


@dataclass
class TrainConfig:
    hidden_dir: str                  # stage 04's shards
    target_path: str                 # target checkpoint folder (embedding, lm_head, config)
    out_dir: str                     # the drafter folder
    draft_vocab_size: int = 32000
    ttt_steps: int = 7
    step_weight: float = 0.8         # step i weighs step_weight**i
    epochs: float = 1.0
    batch_size: int = 16             # samples per optimizer step, all processes together
    micro_batch_size: int = 1        # samples per forward pass
    max_len: int = 2048              # tokens of a sample used (longer ones are cut)
    lr: float = 1e-4
    warmup_fraction: float = 0.015
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    holdout_fraction: float = 0.05
    seed: int = 0
    fsdp: bool = False               # shard the drafter over processes (FSDP2) instead of DDP
    # bookkeeping: does not change the trained weights
    eval_every: int = 0              # steps between held-out evaluations (0: only at exports)
    checkpoint_every: int = 100
    export_fractions: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0])
    export_engine: str = "sglang"
    export_dtype: str = "bfloat16"
    resume: bool = True
    stop_at: int = 0                 # return after this many steps (0: train to the end)

    BOOKKEEPING = ("eval_every", "checkpoint_every", "export_fractions", "export_engine", "export_dtype",
                   "resume", "stop_at", "out_dir", "hidden_dir", "target_path")

    def fingerprint(self, shards_index: dict, target_config: dict) -> dict:
        """What a checkpoint must agree with to be resumed: the settings that change the weights, and
        the data and target themselves (not their paths, so a moved run folder still resumes)."""
        return {**{k: v for k, v in asdict(self).items() if k not in self.BOOKKEEPING},
                "data": _digest(shards_index), "target": _digest(target_config)}

    def check(self) -> None:
        """Settings errors, raised before any work (an export failing after training would waste it)."""
        from .export import DTYPES

        if self.export_engine not in layers.ENGINES:
            raise ValueError(f"export_engine must be one of {layers.ENGINES}, got {self.export_engine!r}")
        if self.export_dtype not in DTYPES:
            raise ValueError(f"export_dtype must be one of {sorted(DTYPES)}, got {self.export_dtype!r}")
        if not all(0 < f <= 1 for f in self.export_fractions):
            raise ValueError(f"export_fractions must lie in (0, 1], got {self.export_fractions}")
        for name in ("ttt_steps", "batch_size", "micro_batch_size", "max_len", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.epochs <= 0 or self.lr <= 0:
            raise ValueError(f"epochs and lr must be positive, got {self.epochs} and {self.lr}")

    @classmethod
    def from_json(cls, path) -> "TrainConfig":
        raw = json.loads(Path(path).read_text())
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown training settings {sorted(unknown)}")
        return cls(**raw)


# -- processes -------------------------------------------------------------------------------

# -- the objective -----------------------------------------------------------------------------

class TTTObjective(nn.Module):
    """The drafter plus the frozen teacher head (the target's lm_head rows of the draft vocab).
    forward(micro-batch) -> per-step sums over its supervised positions: soft CE [k] (with grad),
    and [3, k] without: teacher-argmax hits, positions, teacher entropy (CE - entropy = KL)."""

    def __init__(self, drafter: Eagle3Drafter, teacher_head: torch.Tensor, steps: int):
        super().__init__()
        self.drafter = drafter
        self.steps = steps
        self.register_buffer("teacher_head", teacher_head, persistent=False)

    def teacher(self, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Teacher probabilities over the draft vocab, their argmax and entropy, per row of `last`."""
        with torch.no_grad():
            logits = (last.to(self.teacher_head.dtype) @ self.teacher_head.T).float()
            logp = F.log_softmax(logits, -1)
            p = logp.exp()
            return p, logits.argmax(-1), -(p * logp).sum(-1)

    def forward(self, aux, input_ids, sup, last):
        p, target, entropy = self.teacher(last)
        b_idx, u_idx = sup.nonzero(as_tuple=True)
        ce, hits, count, ent = [], [], [], []
        for i, hidden in enumerate(self.drafter.ttt(aux, input_ids, self.steps)):
            keep = u_idx >= 1 + i
            n = int(keep.sum())
            if n == 0:   # keep every parameter in the graph (DDP wants all gradients)
                ce.append(0.0 * self.drafter.logits(hidden[:1, :1]).sum())
                hits.append(torch.zeros((), device=aux.device))
                count.append(torch.zeros((), device=aux.device))
                ent.append(torch.zeros((), device=aux.device))
                continue
            logits = self.drafter.logits(hidden[b_idx[keep], u_idx[keep] - 1 - i]).float()
            ce.append(-(p[keep] * F.log_softmax(logits, -1)).sum())
            # top-1 agrees with the teacher (amax is much cheaper than argmax on a CPU)
            hits.append((logits.gather(1, target[keep, None]).squeeze(1) >= logits.amax(-1)).sum().float())
            count.append(torch.tensor(float(n), device=aux.device))
            ent.append(entropy[keep].sum())
        return torch.stack(ce), torch.stack((torch.stack(hits), torch.stack(count), torch.stack(ent)))


def step_weights(cfg: TrainConfig) -> torch.Tensor:
    return torch.tensor([cfg.step_weight ** i for i in range(cfg.ttt_steps)])


def build_drafter(cfg: DrafterConfig, embed: torch.Tensor, vocab: DraftVocab, seed: int) -> Eagle3Drafter:
    """A freshly initialised drafter (seeded) with the target's embedding, frozen."""
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg, embed, vocab.d2t, vocab.t2d)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
    return model


# -- preparation: split, vocab, supervision (cached in out_dir) ----------------------------------

@dataclass
class Prepared:
    train: list[int]
    held: list[int]
    vocab: DraftVocab
    sup: data.Supervision
    counts: torch.Tensor                 # [samples, k] supervised positions per TTT step
    held_counts: torch.Tensor | None     # loss-masked token counts of the held-out split
    seconds: float
    sources: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # source -> {train, held} indices


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def prepare(cfg: TrainConfig, shards: HiddenShards, lm_head: torch.Tensor, d: Dist, log=print) -> Prepared:
    t0 = time.time()
    out = Path(cfg.out_dir)
    vocab_size = lm_head.shape[0]
    train, held = data.split(shards, cfg.holdout_fraction)
    key = _digest([shards.index, cfg.holdout_fraction, cfg.draft_vocab_size, cfg.max_len, vocab_size])
    vocab_path = out / "vocab.safetensors"
    key_path = out / "vocab.key"
    if d.main and not (vocab_path.is_file() and key_path.is_file() and key_path.read_text() == key):
        counts = token_counts(shards, train, vocab_size, cfg.max_len)
        vocab = DraftVocab.build(counts, cfg.draft_vocab_size)
        vocab.save(vocab_path)
        key_path.write_text(key)
    d.barrier()
    vocab = DraftVocab.load(vocab_path)
    log(f"draft vocab: {vocab.size} of {vocab.distinct()} distinct response tokens, "
        f"training coverage {vocab.coverage():.1%}")
    held_counts = token_counts(shards, held, vocab_size, cfg.max_len) if held and d.main else None

    sup_path = out / "supervision.safetensors"
    sup = data.Supervision.load(sup_path, key)
    if sup is None:   # each process does its share of the teacher-argmax pass, the first merges
        part = data.supervision(shards, list(range(d.rank, len(shards), d.world)), lm_head, vocab.t2d,
                                cfg.max_len, d.device, desc=f"teacher argmax (rank {d.rank})")
        if d.world > 1:
            parts = [None] * d.world
            dist.all_gather_object(parts, part)
            part = {i: s for p in parts for i, s in p.items()}
        sup = data.Supervision.from_parts(part, len(shards))
        if d.main:
            sup.save(sup_path, key)
        d.barrier()
    counts = sup.step_counts(cfg.ttt_steps)
    kept = int(counts[train, 0].sum())
    log(f"supervised positions: {kept:,} of {int(vocab.counts.sum()):,} response tokens have the target's "
        f"argmax in the draft vocab ({kept / max(1, int(vocab.counts.sum())):.1%}); the rest are dropped")
    if kept == 0:
        raise ValueError(f"{cfg.hidden_dir}: the target's argmax is never in the {vocab.size}-token draft vocabulary, "
                         f"so there is nothing to train on; raise draft_vocab_size")
    sources = {src: {"train": data.by_source(shards, train).get(src, []), "held": data.by_source(shards, held).get(src, [])}
               for src in data.by_source(shards, range(len(shards)))}
    return Prepared(train, held, vocab, sup, counts, held_counts, time.time() - t0, sources)


# -- checkpoints -----------------------------------------------------------------------------

def _state(model, opt) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state on CPU, without the frozen embedding."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v for k, v in msd.items() if not k.endswith("embed_tokens.weight")}, osd


def _load_state(model, opt, msd, osd) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True, strict=False))


def _latest_checkpoint(out: Path) -> Path | None:
    found = sorted((out / "checkpoints").glob("step-*.pt"))
    return found[-1] if found else None


def save_checkpoint(out: Path, step: int, msd, osd, sched, fingerprint: dict, keep: int = 2) -> Path:
    ckdir = out / "checkpoints"
    ckdir.mkdir(parents=True, exist_ok=True)
    path = ckdir / f"step-{step:07d}.pt"
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    tmp = path.with_suffix(".pt.tmp")
    torch.save({"step": step, "model": msd, "optimizer": osd, "scheduler": sched.state_dict(), "rng": rng,
                "config": fingerprint}, tmp)
    os.replace(tmp, path)
    for old in sorted(ckdir.glob("step-*.pt"))[:-keep]:
        old.unlink()
    return path


# -- the loop ----------------------------------------------------------------------------------

def _schedule(total: int, warmup_fraction: float):
    warmup = max(1, round(warmup_fraction * total))

    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup)))
    return f


def _loader(hidden_dir, batches, sup, d: Dist):
    cuda = d.device.type == "cuda"
    return torch.utils.data.DataLoader(data.MicroBatches(hidden_dir, batches, sup), batch_size=None,
                                       shuffle=False, num_workers=2 if cuda else 0, pin_memory=cuda)


def _autocast(d: Dist):
    return torch.autocast("cuda", dtype=torch.bfloat16) if d.device.type == "cuda" else contextlib.nullcontext()


def _to(batch: dict, d: Dist) -> tuple:
    return tuple(batch[k].to(d.device, non_blocking=True) for k in ("aux", "input_ids", "sup", "last"))


def evaluate(model, prep: Prepared, cfg: TrainConfig, d: Dist, weights: torch.Tensor) -> dict:
    """Held-out loss and teacher-argmax accuracy per TTT step (mean over supervised positions),
    overall and per source (`by_source`; micro-batches never mix sources, so each is exact)."""
    per_source = {}
    model.eval()
    with torch.no_grad():
        for src, split_ in prep.sources.items():
            mine = data.micro_batches(split_["held"], prep.sup, cfg.micro_batch_size)[d.rank::d.world]
            sums = torch.zeros(4, cfg.ttt_steps)
            for batch in _loader(cfg.hidden_dir, mine, prep.sup, d):
                with _autocast(d):
                    ce, stats = model(*_to(batch, d))
                sums += torch.cat((ce[None], stats)).float().cpu()
            per_source[src] = d.sum(sums)
    model.train()
    row = _row(sum(per_source.values()), weights)
    row["by_source"] = {src: {**_row(sums, weights), "samples": len(prep.sources[src]["held"])}
                        for src, sums in per_source.items() if prep.sources[src]["held"]}
    return row


def _row(sums: torch.Tensor, weights: torch.Tensor) -> dict:
    """Means per TTT step from the sums [CE, hits, positions, teacher entropy] x [k]."""
    ce, hits, count, ent = sums
    n = count.clamp_min(1)
    return {"loss": float((weights * ce / n).sum()), "loss_i": (ce / n).tolist(),
            "kl_i": ((ce - ent) / n).tolist(), "acc_i": (hits / n).tolist(), "count_i": count.long().tolist()}


def unigram_baseline(objective: TTTObjective, prep: Prepared, cfg: TrainConfig, d: Dist) -> dict:
    """What a drafter that always proposes the draft-vocab unigram distribution of the training
    tokens (add-one smoothed) scores on the held-out step-0 positions."""
    q = prep.vocab.counts[prep.vocab.used].double() + 1
    logq = (q / q.sum()).log().float().to(d.device)
    top = int(logq.argmax())
    mine = data.micro_batches(prep.held, prep.sup, cfg.micro_batch_size)[d.rank::d.world]
    sums = torch.zeros(3)
    for batch in _loader(cfg.hidden_dir, mine, prep.sup, d):
        aux, ids, sup, last = _to(batch, d)
        p, target, _ = objective.teacher(last)
        keep = sup.nonzero(as_tuple=True)[1] >= 1
        sums += torch.stack((-(p[keep] * logq).sum(), (target[keep] == top).sum().float(),
                             keep.sum().float())).cpu()
    ce, hits, count = d.sum(sums)
    return {"loss": float(ce / max(count, 1)), "acc": float(hits / max(count, 1)), "count": int(count)}


def _wrap(objective: TTTObjective, cfg: TrainConfig, d: Dist) -> nn.Module:
    """DDP (or FSDP2 when asked) over several processes; the objective itself in one."""
    if d.world == 1:
        return objective
    if cfg.fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(objective.drafter.midlayer)
        fully_shard(objective.drafter.lm_head)
        return fully_shard(objective)
    return nn.parallel.DistributedDataParallel(objective, broadcast_buffers=False)


def _restore(model, opt, sched, state: dict) -> int:
    _load_state(model, opt, state["model"], state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"]


def _plan(prep: Prepared, cfg: TrainConfig, d: Dist, steps: range, steps_per_epoch: int):
    """This process's micro-batches of the given steps in order, and per step the loss
    denominators [k] and the tokens of the whole global batch."""
    micro, denoms, tokens = [], [], []
    for s in steps:
        gb = data.global_batches(prep.train, cfg.batch_size, cfg.seed, s // steps_per_epoch)[s % steps_per_epoch]
        micro.extend(data.micro_batches(gb, prep.sup, cfg.micro_batch_size)[d.rank::d.world])
        denoms.append(prep.counts[gb].sum(0).float())
        tokens.append(sum(prep.sup.length(i) for i in gb))
    return micro, denoms, tokens


def train(cfg: TrainConfig, log=print) -> dict:
    """Prepare, train (resuming from the latest checkpoint when asked), export; returns the summary."""
    cfg.check()
    d = init_dist()
    log = log if d.main else (lambda *a, **k: None)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = HiddenShards(cfg.hidden_dir)
    tconf = target_config(cfg.target_path)
    mcfg = DrafterConfig.from_target(tconf, cfg.draft_vocab_size)
    if shards.hidden_size != mcfg.target_hidden_size:
        raise ValueError(f"{cfg.hidden_dir}: hidden_size {shards.hidden_size} but the target "
                         f"{cfg.target_path} has {mcfg.target_hidden_size}: shards from another target?")
    layer_ids = layers.to_output_ids([int(k) for k in shards.index["layer_ids"]],
                                     shards.index.get("layer_convention", "output"))
    if cfg.batch_size % (cfg.micro_batch_size * d.world):
        raise ValueError(f"batch_size {cfg.batch_size} must be a multiple of micro_batch_size "
                         f"{cfg.micro_batch_size} x {d.world} processes")
    fingerprint = cfg.fingerprint(shards.index, tconf)
    ck = _latest_checkpoint(out) if cfg.resume else None
    state = None
    if ck is not None:   # checked before any long preparation
        state = torch.load(ck, map_location="cpu", weights_only=False)
        if state["config"] != fingerprint:
            diff = sorted(k for k in fingerprint if state["config"].get(k) != fingerprint[k])
            raise ValueError(f"{ck}: checkpoint was trained with other settings or data ({', '.join(diff)}); "
                             f"restore them, or start over: train_resume false (resume=False), or delete {out / 'checkpoints'}")

    tensors = target_tensors(cfg.target_path)
    prep = prepare(cfg, shards, tensors["lm_head"], d, log)
    steps_per_epoch = len(prep.train) // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{len(prep.train)} training samples is less than one batch of {cfg.batch_size}")
    total = max(1, round(cfg.epochs * steps_per_epoch))
    end = min(total, cfg.stop_at) if cfg.stop_at > 0 else total

    drafter = build_drafter(mcfg, tensors["embed"], prep.vocab, cfg.seed)
    objective = TTTObjective(drafter, tensors["lm_head"][prep.vocab.used].clone(), cfg.ttt_steps).to(d.device)
    del tensors
    model = _wrap(objective, cfg, d)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(total, cfg.warmup_fraction))
    weights = step_weights(cfg)
    start = 0
    if state is not None:
        start = _restore(model, opt, sched, state)
        del state
        log(f"resuming from {ck} (step {start} of {total})")
    elif d.main and (out / "checkpoints").exists():
        for old in (out / "checkpoints").glob("step-*.pt"):
            old.unlink()
    metrics = _Metrics(out / "metrics.jsonl", start, d.main)
    exports = _Exports(out / "exports.json", start, d.main)
    export_steps = sorted({min(total, max(1, round(f * total))) for f in cfg.export_fractions} | {total})
    eval_steps = set(export_steps) | (set(range(cfg.eval_every, total + 1, cfg.eval_every))
                                      if cfg.eval_every > 0 else set())

    baseline = unigram_baseline(objective, prep, cfg, d) if prep.held else None
    if baseline:
        log(f"held-out unigram baseline: loss {baseline['loss']:.3f}, acc {baseline['acc']:.3f}")
    if start == 0 and prep.held:
        metrics.write({"split": "heldout", "step": 0, **evaluate(model, prep, cfg, d, weights)})

    micro, denoms, step_tokens = _plan(prep, cfg, d, range(start, end), steps_per_epoch)
    batches = iter(_loader(cfg.hidden_dir, micro, prep.sup, d))
    accum = cfg.batch_size // (cfg.micro_batch_size * d.world)
    log(f"training {total} steps ({steps_per_epoch}/epoch, {len(prep.train)} train / {len(prep.held)} "
        f"held-out samples) on {d.world} x {d.device.type}" + (f", from step {start}" if start else ""))
    model.train()
    t0, side = time.time(), 0.0      # side: time in evaluation, checkpoints and exports
    tokens = metrics.last("train")["tokens"] if start and metrics.last("train") else 0
    bar = Progress(end - start, "training", "steps")
    for s in range(start, end):
        denom = denoms[s - start].to(d.device)
        scale = torch.where(denom > 0, weights.to(d.device) / denom.clamp_min(1), 0.0) * d.world
        sums = torch.zeros(4, cfg.ttt_steps)
        for a in range(accum):
            last_micro = a == accum - 1
            if cfg.fsdp and d.world > 1:
                model.set_requires_gradient_sync(last_micro)
            no_sync = isinstance(model, nn.parallel.DistributedDataParallel) and not last_micro
            with model.no_sync() if no_sync else contextlib.nullcontext():
                with _autocast(d):
                    ce, stats = model(*_to(next(batches), d))
                (ce * scale).sum().backward()
            sums += torch.cat((ce.detach()[None], stats)).float().cpu()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += step_tokens[s - start]
        done = s + 1
        row = _row(d.sum(sums), weights)
        metrics.write({"split": "train", "step": done, "epoch": done / steps_per_epoch,
                       "lr": sched.get_last_lr()[0], "grad_norm": float(grad_norm), "tokens": tokens, **row})
        bar.update(1)
        bar.set(loss=row["loss"], acc0=row["acc_i"][0])

        t_side = time.time()
        if done in eval_steps and prep.held:
            ev = evaluate(model, prep, cfg, d, weights)
            metrics.write({"split": "heldout", "step": done, **ev})
            log(f"step {done}/{total}: held-out loss {ev['loss']:.3f}, acc_i "
                + " ".join(f"{a:.3f}" for a in ev["acc_i"]))
        if done in export_steps or done % cfg.checkpoint_every == 0 or done == end:
            msd, osd = _state(model, opt)
            if d.main and done in export_steps:
                name = "eagle3" if done == total else f"eagle3-step-{done:07d}"
                path = export(out / name, {k.removeprefix("drafter."): v for k, v in msd.items()}, mcfg,
                              layer_ids, cfg.export_engine, cfg.export_dtype,
                              {"step": done, "total_steps": total, "target": shards.index.get("target")})
                exports.add({"step": done, "fraction": done / total, "dir": str(path),
                             "heldout": metrics.last("heldout") if prep.held else None})
            if d.main and (done % cfg.checkpoint_every == 0 or done == end):
                save_checkpoint(out, done, msd, osd, sched, fingerprint)
            d.barrier()
        side += time.time() - t_side
    bar.close()
    seconds = time.time() - t0 - side
    run_tokens = sum(step_tokens)
    summary = {
        "steps": end, "total_steps": total, "finished": end == total, "world_size": d.world,
        "train_samples": len(prep.train), "heldout_samples": len(prep.held),
        "tokens": tokens, "train_seconds": seconds, "tokens_per_s": run_tokens / seconds if seconds else None,
        "eval_save_seconds": side, "prep_seconds": prep.seconds,
        "vocab": {"draft_vocab_size": prep.vocab.size, "distinct_tokens": prep.vocab.distinct(),
                  "train_coverage": prep.vocab.coverage(),
                  "supervised_fraction": float(prep.counts[prep.train, 0].sum()) / max(1, int(prep.vocab.counts.sum())),
                  "heldout_coverage": prep.vocab.coverage(prep.held_counts) if prep.held_counts is not None else None},
        "heldout": metrics.last("heldout"), "heldout_start": metrics.first("heldout"),
        "unigram_baseline": baseline, "exports": exports.items, "layer_ids": layer_ids,
        "sources": {src: {"train_samples": len(v["train"]), "heldout_samples": len(v["held"]),
                          "heldout": (metrics.last("heldout") or {}).get("by_source", {}).get(src)}
                    for src, v in prep.sources.items()},
    }
    if d.main:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


class _Metrics:
    """metrics.jsonl; on resume, rows past the checkpoint are dropped (they will be redone)."""

    def __init__(self, path: Path, start: int, main: bool):
        self.path, self.main = path, main
        rows = []
        if path.is_file() and start > 0:
            rows = [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] <= start]
        self.rows = rows
        if main:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if self.main:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def last(self, split: str) -> dict | None:
        return next((r for r in reversed(self.rows) if r["split"] == split), None)

    def first(self, split: str) -> dict | None:
        return next((r for r in self.rows if r["split"] == split), None)


class _Exports:
    def __init__(self, path: Path, start: int, main: bool):
        self.path, self.main = path, main
        self.items = [e for e in json.loads(path.read_text()) if e["step"] <= start] \
            if path.is_file() and start > 0 else []

    def add(self, item: dict) -> None:
        self.items = [e for e in self.items if e["step"] != item["step"]] + [item]
        if self.main:
            self.path.write_text(json.dumps(self.items, indent=1))


def read_metrics(out_dir) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def launch(cfg: TrainConfig, nproc: int = 1, log=print) -> dict:
    """Train in this process (nproc 1) or in `nproc` torchrun processes; returns the summary."""
    if nproc <= 1:
        return train(cfg, log)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "train_config.json"
    cfg_path.write_text(json.dumps(asdict(cfg), indent=1))
    torchrun(nproc, "draftsmith.drafter.train", [str(cfg_path)], log=log)
    return json.loads((out / "summary.json").read_text())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc_per_node N -m draftsmith.drafter.train CONFIG.json", file=sys.stderr)
        return 2
    train(TrainConfig.from_json(argv[0]), log=lambda *a: print(*a, flush=True))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
