"""The training-time-test (TTT) objective: what one micro-batch costs, and how the steps are weighed.

For TTT steps i = 0..k-1: soft cross-entropy between the drafter's draft-vocab distribution and the
target's (softmax of lm_head(last) restricted to the draft vocabulary), summed over the supervised
positions (see `data.py`); the loop divides by their number in the global batch and weighs step i
by step_weight**i. The same sums give KL to the target (CE minus the teacher's entropy) and top-1
agreement, which `stage.py` reports as held-out scores.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .model import DrafterShape, Eagle3Drafter
from .vocab import DraftVocab


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
        return teacher_distribution(last, self.teacher_head)

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


def teacher_distribution(last: torch.Tensor, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher probabilities over the draft vocab, their argmax and entropy, per row of `last`."""
    with torch.no_grad():
        logits = (last.to(head.dtype) @ head.T).float()
        logp = F.log_softmax(logits, -1)
        p = logp.exp()
        return p, logits.argmax(-1), -(p * logp).sum(-1)


def step_weights(ttt_steps: int, step_weight: float) -> torch.Tensor:
    """TTT step i's loss weight, step_weight**i."""
    return torch.tensor([step_weight ** i for i in range(ttt_steps)])


def build_drafter(cfg: DrafterShape, embed: torch.Tensor, vocab: DraftVocab, seed: int) -> Eagle3Drafter:
    """A freshly initialised drafter (seeded) with the target's embedding, frozen."""
    torch.manual_seed(seed)
    return init_linears(Eagle3Drafter(cfg, embed, vocab.d2t, vocab.t2d))


def init_linears(model: nn.Module) -> nn.Module:
    """Every linear weight drawn from N(0, 0.02) (the caller seeds), both drafters' initialisation."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
    return model


def autocast(device: torch.device):
    """bf16 autocast on a GPU; full precision on a CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
