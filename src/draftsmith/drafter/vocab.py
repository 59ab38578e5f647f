"""The draft vocabulary: the most frequent response tokens, and the d2t / t2d maps engines read.

Frequencies are counted over loss-masked tokens (what the drafter must predict) of the training
split. The top `draft_vocab_size` ids are kept and sorted; when the data has fewer distinct tokens
the rest is filled with the lowest unused ids (as SpecForge does), so the size is always exact.
  d2t[i] = used[i] - i   (int64 offsets: target_id = draft_id + d2t[draft_id])
  t2d[j] = j in used     (bool over the target vocabulary)
Coverage is the share of counted tokens that the draft vocabulary contains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..progress import Progress
from ..hidden.outputs import HiddenShards


def token_counts(shards: HiddenShards, indices, vocab_size: int, max_len: int | None = None) -> torch.Tensor:
    """Counts [vocab_size] of the loss-masked tokens of samples `indices` (first max_len tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    indices = list(indices)
    with Progress(len(indices), "draft vocab: counting tokens", "samples") as bar:
        for i in indices:
            s = shards.sample(i, fields=("input_ids", "loss_mask"))
            ids, mask = s["input_ids"][:max_len], s["loss_mask"][:max_len].bool()
            if ids.numel() and int(ids.max()) >= vocab_size:
                raise ValueError(f"{shards.dir}: sample {shards.samples[i].sample_id!r} has token id "
                                 f"{int(ids.max())} >= the target vocab size {vocab_size}")
            counts += torch.bincount(ids[mask], minlength=vocab_size)
            bar.update(1)
    return counts


@dataclass
class DraftVocab:
    used: torch.Tensor     # [Vd] int64, sorted target ids
    counts: torch.Tensor   # [V] int64, the training counts it was built from
    vocab_size: int

    @classmethod
    def build(cls, counts: torch.Tensor, draft_vocab_size: int) -> "DraftVocab":
        v = counts.numel()
        if draft_vocab_size > v:
            raise ValueError(f"draft_vocab_size {draft_vocab_size} must be at most {v} (the target vocab)")
        # most frequent first; a stable sort keeps ties (and never-seen tokens) in id order
        order = torch.sort(-counts.to(torch.int64), stable=True).indices
        used = torch.sort(order[:draft_vocab_size]).values
        return cls(used, counts.clone(), v)

    @property
    def size(self) -> int:
        return self.used.numel()

    @property
    def d2t(self) -> torch.Tensor:
        return self.used - torch.arange(self.size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:
        t2d = torch.zeros(self.vocab_size, dtype=torch.bool)
        t2d[self.used] = True
        return t2d

    def coverage(self, counts: torch.Tensor | None = None) -> float:
        """Share of the tokens counted in `counts` (default: the training counts) in the vocab."""
        c = self.counts if counts is None else counts
        total = int(c.sum())
        return float(c[self.used].sum()) / total if total else 0.0

    def distinct(self) -> int:
        return int((self.counts > 0).sum())

    def tensors(self) -> dict[str, torch.Tensor]:
        """What is stored: the maps engines read, and what the vocabulary was built from."""
        return {"d2t": self.d2t, "t2d": self.t2d, "used": self.used, "counts": self.counts}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "DraftVocab":
        return cls(t["used"], t["counts"], t["t2d"].numel())


def used_ids(d2t: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """The sorted target ids of a draft vocabulary given its maps, checking that they agree."""
    used = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)
    if not torch.equal(used, t2d.nonzero().flatten()):
        raise ValueError("d2t and t2d describe different draft vocabularies")
    return used


def coverage_curve(counts: torch.Tensor, sizes: list[int]) -> list[float]:
    """Coverage of the top-n tokens for each n in sizes (for the notebook's plot)."""
    c = torch.sort(counts, descending=True).values.double().cumsum(0)
    total = float(c[-1]) if c.numel() else 0.0
    return [float(c[min(n, c.numel()) - 1]) / total if total else 0.0 for n in sizes]
