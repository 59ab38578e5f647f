"""The drafter's training data, read from the hidden-state shards: split, supervision, micro-batches,
and `prepare`, what a training run sets up before its first step (`Prepared`).

Target position u gives the teacher for token u+1, softmax(lm_head(last[u])) over the draft
vocabulary, where `supervision` marks it supervised. `step_counts` fixes every loss denominator
before training starts, so the means of a global batch are exact for any split over micro-batches
and processes. A global batch is `batch_size` samples of a seeded per-epoch permutation, cut into
micro-batches by length; process r of W takes micro-batches r, r+W, ...

`prepare` writes the held-out part of the split to the drafter folder (stage 06 prompts with it) and
caches the vocabulary and the teacher masks there under a key of the inputs they come from
(`digest`), so a resumed or repeated run skips them and a run with other data, vocabulary size or
train_max_len rebuilds them."""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..progress import Progress
from ..hidden.outputs import HiddenShards
from . import outputs
from .vocab import DraftVocab, token_counts

if TYPE_CHECKING:
    from ..config import DrafterConfig
    from ..distributed import Dist


def split(shards: HiddenShards, holdout_fraction: float) -> tuple[list[int], list[int]]:
    """(train, held-out) sample indices. A sample's side depends only on its dataset and id (a hash
    rank), so it stays put when the data is re-extracted. The fraction is taken from each source
    apart (at least one held-out sample per source of two or more), so every source can be scored."""
    if not 0 <= holdout_fraction < 1:
        raise ValueError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
    n = len(shards)
    key = [hashlib.sha256(f"{s.dataset}/{s.sample_id}".encode()).hexdigest() for s in shards.samples]
    held = []
    for group in by_source(shards, range(n)).values():
        order = sorted(group, key=lambda i: key[i])
        m = len(order)
        held += order[:min(m - 1, max(1, math.ceil(holdout_fraction * m)))] if holdout_fraction > 0 else []
    if holdout_fraction > 0 and not held and n > 1:  # every source holds one sample: hold one out anyway
        held = [min(range(n), key=lambda i: key[i])]
    held = sorted(held)
    train = sorted(set(range(n)) - set(held))
    if not train:
        raise ValueError(f"{shards.dir}: no training samples ({n} samples in all)")
    return train, held


def by_source(shards: HiddenShards, indices) -> dict[str, list[int]]:
    """Sample indices grouped by source (`""`: shards made before sources were recorded)."""
    out: dict[str, list[int]] = {}
    for i in indices:
        out.setdefault(shards.samples[i].source, []).append(i)
    return dict(sorted(out.items()))


def supervision(shards: HiddenShards, indices: list[int], lm_head: torch.Tensor, t2d: torch.Tensor,
                max_len: int, device: torch.device, desc: str = "teacher argmax") -> dict[int, torch.Tensor]:
    """sup [min(L, max_len)] uint8 of each sample in `indices`. Position u (hidden state after token
    u) is supervised when token u+1 is a response token (loss_mask[u+1] = 1, so the end-of-turn
    token is predicted and the assistant header never is) and the target's argmax over its FULL
    vocabulary at u lies in the draft vocabulary (other positions are dropped, as in EAGLE-3). That
    argmax needs one pass over `last` with the target's lm_head: done once before training and
    cached beside the drafter."""
    lm_head = lm_head.to(device)
    used = t2d.nonzero().flatten().to(device)
    # logits of a chunk stay in cache on a CPU; a GPU wants big matmuls
    rows_per_chunk = max(1, (2 ** 28 if device.type == "cuda" else 2 ** 23) // lm_head.shape[0])
    out: dict[int, torch.Tensor] = {}
    pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []   # (sample, positions, rows)
    n_rows = 0

    def flush():
        nonlocal pending, n_rows
        if not pending:
            return
        rows = torch.cat([r for _, _, r in pending]).to(device, lm_head.dtype)
        # the full-vocab argmax is a draft token iff the best draft logit reaches the overall max
        ok = torch.cat([_argmax_in(c @ lm_head.T, used) for c in rows.split(rows_per_chunk)]).cpu()
        k = 0
        for i, pos, r in pending:
            out[i][pos] = ok[k:k + len(pos)].to(torch.uint8)
            k += len(pos)
        pending, n_rows = [], 0

    with Progress(len(indices), f"{desc}", "samples") as bar, torch.no_grad():
        for i in indices:
            s = shards.sample(i, fields=("last", "loss_mask"))
            n = min(s["loss_mask"].numel(), max_len)
            sup = torch.zeros(n, dtype=torch.uint8)
            out[i] = sup
            pos = (s["loss_mask"][1:n] > 0).nonzero().flatten()   # u with a response token at u+1
            if len(pos):
                pending.append((i, pos, s["last"][pos]))
                n_rows += len(pos)
            if n_rows >= rows_per_chunk:
                flush()
            bar.update(1)
        flush()
    return out


def _argmax_in(logits: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """Whether each row's argmax is one of the `used` columns: their best logit reaches the row's
    max (the same numbers compared, so exact; amax is far cheaper than argmax on a CPU)."""
    return logits.index_select(1, used).amax(-1) >= logits.amax(-1)


def step_counts(sup: torch.Tensor, steps: int) -> torch.Tensor:
    """[steps] number of positions TTT step i supervises in one sample: sup[u] for u >= 1+i (step i
    at drafter position t predicts token t+2+i from target position u = t+1+i)."""
    c = sup.long().flip(0).cumsum(0).flip(0)          # c[u] = sup[u:].sum()
    return torch.stack([c[1 + i] if 1 + i < len(c) else c.new_zeros(()) for i in range(steps)])


class Supervision:
    """The sup masks of all samples in one flat uint8 tensor with offsets: one object to cache, and
    cheap to hand to loader processes however many samples there are."""

    def __init__(self, flat: torch.Tensor, offsets: torch.Tensor):
        self.flat, self.offsets = flat, offsets

    @classmethod
    def from_parts(cls, parts: dict[int, torch.Tensor], n: int) -> "Supervision":
        lengths = torch.tensor([len(parts[i]) for i in range(n)], dtype=torch.int64)
        offsets = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)))
        flat = torch.cat([parts[i] for i in range(n)]) if n else torch.zeros(0, dtype=torch.uint8)
        return cls(flat, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.flat[self.offsets[i]:self.offsets[i + 1]]

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def step_counts(self, steps: int) -> torch.Tensor:
        """[samples, steps]: positions each TTT step supervises in each sample."""
        return torch.stack([step_counts(self[i], steps) for i in range(len(self))]) if len(self) else \
            torch.zeros(0, steps, dtype=torch.int64)


def global_batches(train: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The global batches of one epoch (an incomplete last batch is dropped)."""
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    perm = [train[j] for j in torch.randperm(len(train), generator=g).tolist()]
    return [perm[k:k + batch_size] for k in range(0, len(perm) - batch_size + 1, batch_size)]


def micro_batches(batch: list[int], sup: Supervision, micro_batch_size: int) -> list[list[int]]:
    """A global batch sorted by length (longest first, ties by index: less padding) and cut into
    micro-batches, each right-padded to its longest sample (`MicroBatches`)."""
    ordered = sorted(batch, key=lambda i: (-sup.length(i), i))
    return [ordered[k:k + micro_batch_size] for k in range(0, len(ordered), micro_batch_size)]


class MicroBatches(torch.utils.data.Dataset):
    """Item j = micro-batch `batches[j]` collated: aux [b, L, nH] (the columns of the layers kept,
    `cols`: all when None), input_ids [b, L], sup [b, L] bool, last [N, H] (only the rows of
    supervised positions, in sup.nonzero() order), tokens; with `anchors` (a function of sample
    and epoch, DFlash), also anchors [b, A] (-1: none) of epoch `epochs[j]`."""

    def __init__(self, hidden_dir, batches: list[list[int]], sup: Supervision, cols: list[int] | None = None,
                 anchors=None, epochs: list[int] | None = None):
        self.hidden_dir = hidden_dir
        self.batches = batches
        self.sup = sup
        self.cols = cols
        self.anchors = anchors
        self.epochs = epochs
        self._shards = None

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, j: int) -> dict[str, torch.Tensor]:
        if self._shards is None:   # opened in the process that reads (DataLoader workers)
            self._shards = HiddenShards(self.hidden_dir)
        samples = [(self._shards.sample(i), self.sup[i]) for i in self.batches[j]]
        b, n = len(samples), max(len(sup) for _, sup in samples)
        width = samples[0][0]["aux"].shape[1]
        h = self._shards.hidden_size
        keep = None if self.cols is None or len(self.cols) * h == width else \
            torch.cat([torch.arange(c * h, (c + 1) * h) for c in self.cols])
        aux = torch.zeros(b, n, width if keep is None else len(keep))
        ids = torch.zeros(b, n, dtype=torch.int64)
        supm = torch.zeros(b, n, dtype=torch.bool)
        last = []
        for r, (s, sup) in enumerate(samples):
            m = len(sup)
            aux[r, :m] = s["aux"][:m] if keep is None else s["aux"][:m].index_select(1, keep)
            ids[r, :m] = s["input_ids"][:m]
            supm[r, :m] = sup.bool()
            last.append(s["last"][:m][sup.bool()])
        out = {"aux": aux, "input_ids": ids, "sup": supm, "last": torch.cat(last),
               "tokens": torch.tensor(sum(len(sup) for _, sup in samples))}
        if self.anchors is not None:
            got = [self.anchors(i, self.epochs[j]) for i in self.batches[j]]
            a = torch.full((b, max(1, max(len(g) for g in got))), -1, dtype=torch.int64)
            for r, g in enumerate(got):
                a[r, :len(g)] = g
            out["anchors"] = a
        return out


def loader(hidden_dir, batches: list[list[int]], sup: Supervision, device: torch.device, **kinds):
    """The collated micro-batches in order; on a GPU read by two worker processes into pinned memory.
    `kinds`: `MicroBatches`' cols, anchors and epochs."""
    cuda = device.type == "cuda"
    return torch.utils.data.DataLoader(MicroBatches(hidden_dir, batches, sup, **kinds), batch_size=None,
                                       shuffle=False, num_workers=2 if cuda else 0, pin_memory=cuda)


def to_device(batch: dict, device: torch.device) -> tuple:
    """The objective's inputs (aux, input_ids, sup, last, and anchors where the batch has them) of a
    collated micro-batch, on `device`."""
    keys = ("aux", "input_ids", "sup", "last") + (("anchors",) if "anchors" in batch else ())
    return tuple(batch[k].to(device, non_blocking=True) for k in keys)


# -- before training ------------------------------------------------------------------------------

@dataclass
class Prepared:
    """A training run's data as prepared: train and held-out indices, vocabulary, supervision."""
    train: list[int]
    held: list[int]
    vocab: DraftVocab
    sup: Supervision
    counts: torch.Tensor                 # [samples, k] supervised positions per TTT step
    held_counts: torch.Tensor | None     # loss-masked token counts of the held-out split
    seconds: float
    sources: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # source -> {train, held} indices


def prepare(cfg: "DrafterConfig", out: Path, shards: HiddenShards, lm_head: torch.Tensor, d: "Dist",
            log=print) -> Prepared:
    """The split, the draft vocabulary and the teacher masks of `shards` for stage 05's `cfg`, cached
    in the drafter folder `out`; each process computes its share of the masks, rank 0 writes."""
    t0 = time.time()
    vocab_size = lm_head.shape[0]
    train, held = split(shards, cfg.train_holdout_fraction)
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
        sup = Supervision(*cached)
    else:   # each process does its share of the teacher-argmax pass, the first merges
        part = supervision(shards, list(range(d.rank, len(shards), d.world)), lm_head, vocab.t2d,
                           cfg.train_max_len, d.device, desc=f"teacher argmax (rank {d.rank})")
        if d.world > 1:
            part = {i: s for p in d.all_gather(part) for i, s in p.items()}
        sup = Supervision.from_parts(part, len(shards))
        if d.main:
            outputs.write_supervision(out, sup.flat, sup.offsets, key)
        d.barrier()
    counts = sup.step_counts(cfg.ttt_steps)
    kept = int(counts[train, 0].sum())
    log(f"supervised positions: {kept:,} of {int(vocab.counts.sum()):,} response tokens have the target's "
        f"argmax in the draft vocab ({kept / max(1, int(vocab.counts.sum())):.1%}); the rest are dropped")
    if kept == 0:
        raise ValueError(f"{shards.dir}: the target's argmax is never in the {vocab.size}-token draft vocabulary, "
                         f"so there is nothing to train on; raise draft_vocab_size")
    train_by, held_by = by_source(shards, train), by_source(shards, held)
    sources = {src: {"train": train_by.get(src, []), "held": held_by.get(src, [])}
               for src in by_source(shards, range(len(shards)))}
    return Prepared(train, held, vocab, sup, counts, held_counts, time.time() - t0, sources)


def digest(obj) -> str:
    """A short hash of a JSON-able object (the inputs a cache or checkpoint was made from)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
