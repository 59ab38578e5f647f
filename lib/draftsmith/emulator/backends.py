"""What a text backend is asked to do, and the token facts both backends share.

A backend turns a `Job` (the prompt ids and sampling settings) into a stream of `(token_id, text)`
pairs: the ids actually sampled, in the target tokenizer, each with the text it adds (`""` for
`</think>` and the end-of-turn token). The response is `{reasoning}</think>{content}<eos>`: the
prompt ends inside the reasoning (`<think>`), so everything before `</think>` is reasoning. The
stream ends after the end-of-turn token (finish `stop`) or after `max_tokens` ids (finish `length`).
`completion_tokens` is the number of ids in the stream, `</think>` and end-of-turn included.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..target.tiny import END_THINK, EOS


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    key: str = ""  # what makes the synthetic text of this request (prompt, seed, draw)
    reasoning_max_tokens: int | None = None  # force `</think>` after this many reasoning tokens
    perturbed: float = 0.0  # relative noise on the weights of the model serving it (0 = the target)
    noncanonical_rate: float = 0.0  # per token: emit a non-canonical split of it instead
    cancelled: bool = False  # set by the server when the client went away


class Vocab:
    """Special ids of the target tokenizer, the ids a response may never contain, and the byte
    strings of tokens (to split one into two non-canonically)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.end_think = tokenizer.convert_tokens_to_ids(END_THINK)
        self.eos = tokenizer.convert_tokens_to_ids(EOS)
        self.blank_line = tokenizer.encode("\n\n", add_special_tokens=False)  # one id in the target tokenizer
        if self.end_think is None or self.eos is None or self.end_think == tokenizer.unk_token_id:
            raise ValueError(f"target tokenizer lacks {END_THINK!r} or {EOS!r}")
        self.size = len(tokenizer)
        # every added special token except </think> and end-of-turn: a real model never emits them here
        self.banned = sorted(i for i in tokenizer.added_tokens_decoder if i not in (self.end_think, self.eos))
        self._token_to_id = tokenizer.get_vocab()
        self._special = set(tokenizer.added_tokens_decoder)

    @lru_cache(maxsize=65536)
    def split(self, token_id: int) -> tuple[int, int] | None:
        """Two ids whose bytes together are those of `token_id` (a split BPE would not make), or None."""
        if token_id in self._special:
            return None
        s = self.tokenizer.convert_ids_to_tokens(token_id)
        for i in range(len(s) // 2, 0, -1):
            for j in (i, len(s) - i):
                a, b = self._token_to_id.get(s[:j]), self._token_to_id.get(s[j:])
                if a is not None and b is not None and all("\ufffd" not in self.tokenizer.decode([x]) for x in (a, b)):
                    return a, b
        return None
