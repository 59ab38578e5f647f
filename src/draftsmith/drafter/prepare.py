"""Before training: the held-out split, the draft vocabulary and the teacher masks.

The held-out part of the split is written to the drafter folder (stage 06 prompts with it); the
vocabulary and the masks are cached there under a key of the inputs they come from, so a resumed
or repeated run skips them and a run with other data, vocabulary size or train_max_len rebuilds them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..hidden.outputs import HiddenShards
from . import outputs, data
from .config import TrainConfig, digest
from .vocab import DraftVocab, token_counts

if TYPE_CHECKING:
    from ..distributed import Dist


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


def prepare(cfg: TrainConfig, shards: HiddenShards, lm_head: torch.Tensor, d: "Dist", log=print) -> Prepared:
    t0 = time.time()
    out = Path(cfg.out_dir)
    vocab_size = lm_head.shape[0]
    train, held = data.split(shards, cfg.train_holdout_fraction)
    key = digest([shards.index, cfg.train_holdout_fraction, cfg.draft_vocab_size, cfg.train_max_len, vocab_size])
    if d.main:
        outputs.write_heldout(out, [(shards.samples[i].dataset, shards.samples[i].sample_id) for i in held],
                              cfg.train_holdout_fraction)
        if outputs.read_vocab(out, key) is None:
            counts = token_counts(shards, train, vocab_size, cfg.train_max_len)
            outputs.write_vocab(out, DraftVocab.build(counts, cfg.draft_vocab_size), key)
    d.barrier()
    vocab = outputs.read_vocab(out, key)
    log(f"draft vocab: {vocab.size} of {vocab.distinct()} distinct response tokens, "
        f"training coverage {vocab.coverage():.1%}")
    held_counts = token_counts(shards, held, vocab_size, cfg.train_max_len) if held and d.main else None

    cached = outputs.read_supervision(out, key)
    if cached is not None:
        sup = data.Supervision(*cached)
    else:   # each process does its share of the teacher-argmax pass, the first merges
        part = data.supervision(shards, list(range(d.rank, len(shards), d.world)), lm_head, vocab.t2d,
                                cfg.train_max_len, d.device, desc=f"teacher argmax (rank {d.rank})")
        if d.world > 1:
            part = {i: s for p in d.all_gather(part) for i, s in p.items()}
        sup = data.Supervision.from_parts(part, len(shards))
        if d.main:
            outputs.write_supervision(out, sup.flat, sup.offsets, key)
        d.barrier()
    counts = sup.step_counts(cfg.ttt_steps)
    kept = int(counts[train, 0].sum())
    log(f"supervised positions: {kept:,} of {int(vocab.counts.sum()):,} response tokens have the target's "
        f"argmax in the draft vocab ({kept / max(1, int(vocab.counts.sum())):.1%}); the rest are dropped")
    if kept == 0:
        raise ValueError(f"{cfg.hidden_dir}: the target's argmax is never in the {vocab.size}-token draft vocabulary, "
                         f"so there is nothing to train on; raise draft_vocab_size")
    train_by, held_by = data.by_source(shards, train), data.by_source(shards, held)
    sources = {src: {"train": train_by.get(src, []), "held": held_by.get(src, [])}
               for src in data.by_source(shards, range(len(shards)))}
    return Prepared(train, held, vocab, sup, counts, held_counts, time.time() - t0, sources)
