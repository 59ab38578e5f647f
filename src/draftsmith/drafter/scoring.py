"""Scores on the held-out split: loss, KL to the target and top-1 agreement per TTT step, and the
unigram baseline a trained drafter must beat.

A row of the metrics file holds means per TTT step over the supervised positions: `loss_i` (soft
cross-entropy), `kl_i` (minus the teacher's entropy; 0 = a perfect copy), `acc_i` (the drafter's
top token is the target's), `count_i` (positions), and `loss`, the steps weighed as in training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import data
from .config import TrainConfig
from .objective import TTTObjective, autocast
from .prepare import Prepared

if TYPE_CHECKING:
    from ..distributed import Dist


def row(sums: torch.Tensor, weights: torch.Tensor) -> dict:
    """Means per TTT step from the sums [CE, hits, positions, teacher entropy] x [k]."""
    ce, hits, count, ent = sums
    n = count.clamp_min(1)
    return {"loss": float((weights * ce / n).sum()), "loss_i": (ce / n).tolist(),
            "kl_i": ((ce - ent) / n).tolist(), "acc_i": (hits / n).tolist(), "count_i": count.long().tolist()}


def heldout_scores(model, prep: Prepared, cfg: TrainConfig, d: "Dist", weights: torch.Tensor,
                   cols: list[int] | None = None, anchors=None) -> dict:
    """Held-out scores, overall and per source (`by_source`; micro-batches never mix sources, so
    each is exact). `cols`, `anchors`: the feed of `data.MicroBatches` (DFlash: epoch 0's anchors)."""
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
            for i, batch in enumerate(data.loader(cfg.hidden_dir, todo, prep.sup, d.device, cols=cols,
                                                  anchors=anchors, epochs=[0] * len(todo))):
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


def unigram_baseline(objective: TTTObjective, prep: Prepared, cfg: TrainConfig, d: "Dist") -> dict:
    """What a drafter that always proposes the draft-vocab unigram distribution of the training
    tokens (add-one smoothed) scores on the held-out step-0 positions."""
    q = prep.vocab.counts[prep.vocab.used].double() + 1
    logq = (q / q.sum()).log().float().to(d.device)
    top = int(logq.argmax())
    mine = data.micro_batches(prep.held, prep.sup, cfg.train_micro_batch_size)[d.rank::d.world]
    sums = torch.zeros(3)
    for batch in data.loader(cfg.hidden_dir, mine, prep.sup, d.device):
        aux, ids, sup, last = data.to_device(batch, d.device)[:4]
        p, target, _ = objective.teacher(last)
        keep = sup.nonzero(as_tuple=True)[1] >= 1
        sums += torch.stack((-(p[keep] * logq).sum(), (target[keep] == top).sum().float(),
                             keep.sum().float())).cpu()
    ce, hits, count = d.sum(sums)
    return {"loss": float(ce / max(count, 1)), "acc": float(hits / max(count, 1)), "count": int(count)}
