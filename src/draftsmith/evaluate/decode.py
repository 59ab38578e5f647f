"""One speculative decode, the way SGLang and vLLM run an EAGLE-3 chain (`--speculative-eagle-topk 1`).

A proposer drafts k tokens (k = `draft_tokens`), the target runs once over the last committed
token plus the drafts (with its KV cache), the longest agreeing prefix is accepted and the target's
own next token is appended (the "bonus"), the caches are cut back to what was accepted.

    greedy (temperature 0): draft i is accepted while it equals the target's argmax; the output is the
        target's own greedy output token for token (tests pin this);
    sampling (temperature T > 0): draft i is accepted with probability p_i(draft) (the drafts are
        the proposer's argmax, a one-hot q, as vLLM treats EAGLE and n-gram drafts); on rejection the
        token is drawn from p_i without the draft, renormalised; lossless in distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .target_cache import Target


def choose(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    p = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(p, 1, generator=gen))


def verify(logits: torch.Tensor, drafts: list[int], temperature: float,
           gen: torch.Generator | None = None) -> tuple[int, int]:
    """(accepted drafts, next token) from the target's logits [len(drafts) + 1, V] at the last
    committed token and each draft."""
    if temperature <= 0:
        best = logits.argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == best[a]:
            a += 1
        return a, best[a]
    p = torch.softmax(logits / temperature, dim=-1)
    for i, d in enumerate(drafts):
        if torch.rand((), generator=gen) < p[i, d]:
            continue
        residual = p[i].clone()
        residual[d] = 0
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))


@dataclass
class Decoded:
    output: list[int]                     # generated ids (first one from the prefill)
    start: list[int] = field(default_factory=list)     # per round: output index it starts at
    drafted: list[int] = field(default_factory=list)   # per round: drafts proposed
    accepted: list[int] = field(default_factory=list)  # per round: drafts the target accepted
    produced: list[int] = field(default_factory=list)  # per round: tokens it emitted (<= accepted + 1)
    top_prob: list[float] = field(default_factory=list)  # per round: the target's probability of its
    #   own most likely next token = P(a perfect drafter's first draft is accepted); 1 when greedy

    def rounds(self) -> dict:
        return {"start": self.start, "drafted": self.drafted, "accepted": self.accepted,
                "produced": self.produced, "top_prob": self.top_prob}


def decode(target: Target, proposer, prompt: list[int], draft_tokens: int, max_new_tokens: int,
           temperature: float = 0.0, gen: torch.Generator | None = None) -> Decoded:
    """Speculative decoding of one prompt: up to `max_new_tokens` tokens, stopping after an
    end-of-sequence token. `proposer` None (or `draft_tokens` 0) is plain decoding, one token a round.
    Every round drafts `draft_tokens`, the last one too, as vLLM and SGLang do: a round's accepted
    drafts are counted in full, its emitted tokens stop at `max_new_tokens` (and after an end of
    sequence)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    target.reset()
    logits, aux = target.forward(list(prompt), logits_to_keep=1)
    out = [choose(logits[-1], temperature, gen)]
    res = Decoded(out)
    if proposer is not None:
        proposer.reset(list(prompt))
        proposer.advance(list(prompt[1:]) + out, aux)
    while len(out) < max_new_tokens and out[-1] not in target.eos:
        drafts = proposer.propose(draft_tokens)[:draft_tokens] if proposer is not None and draft_tokens > 0 else []
        committed = len(target)   # every committed token but the last is in the target cache
        logits, aux = target.forward([out[-1]] + drafts)
        a, nxt = verify(logits, drafts, temperature, gen)
        new = (drafts[:a] + [nxt])[:max_new_tokens - len(out)]
        for i, t in enumerate(new):
            if t in target.eos:
                new = new[:i + 1]
                break
        target.truncate(committed + 1 + a)
        res.start.append(len(out))
        res.drafted.append(len(drafts))
        res.accepted.append(a)
        res.produced.append(len(new))
        res.top_prob.append(1.0 if temperature <= 0 else float(torch.softmax(logits[0] / temperature, -1).max()))
        out += new
        if proposer is not None and len(out) < max_new_tokens and out[-1] not in target.eos:
            proposer.advance(new, aux[:a + 1] if aux is not None else None)
    return res
