"""What drafts the next tokens: prompt lookup (n-gram copying from the context), an EAGLE-3 drafter or a
DFlash drafter.

A proposer is reset with a prompt, told the committed tokens as they come (`advance`, with the
target's features at them) and asked for k drafts (`propose`). No proposer (None) is plain decoding.
"""

from __future__ import annotations

import torch


class PromptLookup:
    """N-gram drafting from the context (prompt + output so far): find the most recent earlier
    occurrence of the longest suffix n-gram (n = lookup_max_ngram .. lookup_min_ngram) and propose
    the k tokens that followed it, copying on past the end of the context when the match is recent
    (a loop of period p is continued, as an overlapping copy). No match: no drafts this round.
    vLLM's `ngram` (0.32) differs in two details that matter on looping text: it copies
    after the earliest occurrence and never past the end of the context, so it drafts fewer tokens
    near the end of a loop and accepts less there than this one."""

    def __init__(self, *, lookup_max_ngram: int, lookup_min_ngram: int):
        if not 1 <= lookup_min_ngram <= lookup_max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= lookup_min_ngram <= lookup_max_ngram, "
                             f"got {lookup_min_ngram}, {lookup_max_ngram}")
        self.lookup_max_ngram, self.lookup_min_ngram = lookup_max_ngram, lookup_min_ngram
        self.ctx: list[int] = []

    def reset(self, prompt: list[int]) -> None:
        self.ctx = list(prompt)

    def advance(self, tokens: list[int], aux=None) -> None:
        self.ctx += tokens

    def propose(self, k: int) -> list[int]:
        ctx, n_ctx = self.ctx, len(self.ctx)
        for n in range(min(self.lookup_max_ngram, n_ctx - 1), self.lookup_min_ngram - 1, -1):
            tail = ctx[n_ctx - n:]
            for i in range(n_ctx - n - 1, -1, -1):
                if ctx[i:i + n] == tail:
                    out: list[int] = []
                    for j in range(k):
                        src = i + n + j
                        out.append(ctx[src] if src < n_ctx else out[src - n_ctx])
                    return out
        return []


class Eagle3Proposer:
    """Chain drafting with an EAGLE-3 drafter and its KV cache. Drafter position p reads the
    target's features at p and the token at p+1; `advance` adds the committed positions (cutting
    off the chain drafted last round), `propose(k)` drafts k tokens from the last one."""

    def __init__(self, drafter):
        self.d = drafter
        self.device = drafter.fc.weight.device
        self.cache = drafter.new_cache()
        self.committed = 0

    def reset(self, prompt: list[int]) -> None:
        self.cache = self.d.new_cache()
        self.committed = 0

    @torch.inference_mode()
    def advance(self, tokens: list[int], aux: torch.Tensor) -> None:
        if aux is None or len(aux) != len(tokens):
            raise ValueError(f"an EAGLE-3 drafter needs one target feature row per new token "
                             f"({len(tokens)} tokens, {None if aux is None else len(aux)} rows)")
        self.cache.truncate(self.committed)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        h, logits = self.d.extend(self.d.project(aux[None].to(self.device)), ids, self.cache)
        self.committed += len(tokens)
        self.h, self.logits = h[:, -1:], logits[0, -1]

    @torch.inference_mode()
    def propose(self, k: int) -> list[int]:
        out: list[int] = []
        h, logits = self.h, self.logits
        for j in range(k):
            tok = self.d.to_target(logits.argmax(-1))
            out.append(int(tok))
            if j < k - 1:
                h, lg = self.d.extend(h, tok.view(1, 1), self.cache)
                logits = lg[0, -1]
        return out


class DFlashProposer:
    """Block drafting with a DFlash drafter: the context rows of every committed position whose
    target feature is known, and the last committed token as the anchor; `propose(k)` is the first
    k of one non-causal block (k <= block_size - 1)."""

    def __init__(self, drafter):
        self.d = drafter
        self.device = drafter.fc.weight.device
        self.ctx = None
        self.anchor = None

    def reset(self, prompt: list[int]) -> None:
        self.ctx, self.anchor = None, None

    @torch.inference_mode()
    def advance(self, tokens: list[int], aux: torch.Tensor) -> None:
        if aux is None or len(aux) != len(tokens):
            raise ValueError(f"a DFlash drafter needs one target feature row per new token "
                             f"({len(tokens)} tokens, {None if aux is None else len(aux)} rows)")
        rows = self.d.context(aux[None].to(self.device))[0]
        self.ctx = rows if self.ctx is None else torch.cat((self.ctx, rows))
        self.anchor = tokens[-1]

    def propose(self, k: int) -> list[int]:
        if k > self.d.config.block_size - 1:
            raise ValueError(f"a DFlash drafter of block size {self.d.config.block_size} drafts at most "
                             f"{self.d.config.block_size - 1} tokens, asked for {k}")
        return self.d.draft(self.ctx, self.anchor)[:k]


class Columns:
    """A proposer that reads only some of the layers our decoder captures: aux [T, n*H] holds `n`
    layers side by side, the proposer gets the columns of layers `cols` (EAGLE-3 and DFlash beside
    each other read different layers of one capture)."""

    def __init__(self, proposer, cols: list[int], n: int):
        self.p, self.cols, self.n = proposer, list(cols), n

    def reset(self, prompt: list[int]) -> None:
        self.p.reset(prompt)

    def advance(self, tokens: list[int], aux: torch.Tensor | None) -> None:
        if aux is not None and len(self.cols) != self.n:
            h = aux.shape[-1] // self.n
            aux = torch.cat([aux[:, c * h:(c + 1) * h] for c in self.cols], dim=-1)
        self.p.advance(tokens, aux)

    def propose(self, k: int) -> list[int]:
        return self.p.propose(k)
