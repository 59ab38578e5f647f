"""The two drafters `train` knows, behind one `DrafterKind`: EAGLE-3 (training-time test, `objective`)
and DFlash (block drafting, `dflash`), each set up from stage 05's config. `build(cfg, kind, ...)`
gives the one `kind` names; the loop, the held-out scores and the metrics are the same for both."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import nn

from ..config import DrafterConfig
from . import dflash
from .data import Prepared
from .export import export as export_eagle3
from .model import DrafterShape
from .objective import TTTObjective, build_drafter, step_weights


class DrafterKind(Protocol):
    """A fresh drafter and its frozen teacher head (`objective`), the weights of its loss terms [k],
    the anchors its micro-batches carry (None: none), the loss denominators [k] of a global batch in
    an epoch, its export folder from a state dict, and what the summary adds about it."""
    objective: nn.Module
    weights: torch.Tensor
    anchors: Callable[[int, int], torch.Tensor] | None

    def denominators(self, batch: list[int], epoch: int) -> torch.Tensor: ...
    def export(self, path: Path, state: dict, extra: dict) -> Path: ...
    def summary(self) -> dict: ...


class Eagle3:
    """EAGLE-3: `ttt_steps` steps of training-time test; a step's denominator counts the batch's
    supervised positions at that step, weighed `step_weight`**i; exported for `export_engine`."""
    anchors = None

    def __init__(self, cfg: DrafterConfig, shape: DrafterShape, prep: Prepared, head: torch.Tensor,
                 embed: torch.Tensor, layer_ids: list[int], step_weight: float):
        self.cfg, self.shape, self.counts, self.layer_ids = cfg, shape, prep.counts, layer_ids
        self.objective = TTTObjective(build_drafter(shape, embed, prep.vocab, cfg.seed), head, cfg.ttt_steps)
        self.weights = step_weights(cfg.ttt_steps, step_weight)

    def denominators(self, batch: list[int], epoch: int) -> torch.Tensor:
        return self.counts[batch].sum(0).float()

    def export(self, path: Path, state: dict, extra: dict) -> Path:
        return export_eagle3(path, state, self.shape, self.layer_ids, self.cfg.export_engine,
                             self.cfg.export_dtype, extra)

    def summary(self) -> dict:
        return {}


class DFlash:
    """DFlash: blocks of `dflash_block_size` from seeded anchors, MASK slots filled with a token the
    responses never use; a block row's denominator counts its scored rows over the epoch's anchors."""

    def __init__(self, cfg: DrafterConfig, shape: DrafterShape, prep: Prepared, head: torch.Tensor,
                 embed: torch.Tensor, layer_ids: list[int]):
        unused = (prep.vocab.counts == 0).nonzero().flatten()
        if len(unused) == 0:
            raise ValueError("every token of the target's vocabulary occurs in the responses: DFlash needs one "
                             "that never does for its MASK slots")
        self.cfg, self.sup, self.layer_ids = cfg, prep.sup, layer_ids
        self.dcfg = dflash.DFlashConfig(base=shape, num_layers=cfg.dflash_layers, block_size=cfg.dflash_block_size,
                                        num_aux=len(layer_ids), mask_token_id=int(unused.max()))
        drafter = dflash.build_dflash(self.dcfg, embed, prep.vocab.d2t, prep.vocab.t2d, cfg.seed)
        self.objective = dflash.DFlashObjective(drafter, head)
        self.weights = dflash.position_weights(cfg.dflash_block_size)
        self.anchors = functools.partial(dflash.anchors_for, prep.sup, cfg.seed, cfg.dflash_anchors)

    def denominators(self, batch: list[int], epoch: int) -> torch.Tensor:
        return sum(dflash.block_counts(self.sup[i], self.anchors(i, epoch), self.cfg.dflash_block_size)
                   for i in batch).float()

    def export(self, path: Path, state: dict, extra: dict) -> Path:
        return dflash.export(path, state, self.dcfg, self.layer_ids, self.cfg.export_dtype, extra)

    def summary(self) -> dict:
        return {"block_size": self.cfg.dflash_block_size, "draft_layers": self.cfg.dflash_layers}


def build(cfg: DrafterConfig, kind: str, shape: DrafterShape, prep: Prepared, tensors: dict, layer_ids: list[int],
          step_weight: float) -> DrafterKind:
    """The drafter `kind` names (eagle3 or dflash), fresh (seeded), over the target's embedding and
    lm_head; `step_weight` weighs EAGLE-3's TTT steps."""
    head = tensors["lm_head"][prep.vocab.used].clone()
    if kind == "eagle3":
        return Eagle3(cfg, shape, prep, head, tensors["embed"], layer_ids, step_weight)
    return DFlash(cfg, shape, prep, head, tensors["embed"], layer_ids)
