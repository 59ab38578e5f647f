"""What a text backend is asked to do, and the token facts both backends share.

A backend turns a `Job` (the prompt ids and sampling settings) into a stream of `(token_id, text)`
pairs: the ids actually sampled, in the target tokenizer, each with the text it adds (`""` for
`</think>` and the end-of-turn token). The response is `{reasoning}</think>{content}<eos>`: the
prompt ends inside the reasoning (`<think>`), so everything before `</think>` is reasoning. Both
markers are read off the target's chat template (`templates.response_layout`), so a Kimi-style
target ends its turn with `<|im_end|>` and a DeepSeek-style one with its end-of-sentence token. The
stream ends after the end-of-turn token (finish `stop`) or after `max_tokens` ids (finish `length`).
`completion_tokens` is the number of ids in the stream, `</think>` and end-of-turn included.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..encoding import Encoding
from ..templates import response_layout


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
        self.encoding = Encoding(tokenizer)
        layout = response_layout(lambda msgs, gen: tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen))
        if not layout.thinking:
            raise ValueError("the target's chat template has no reasoning block (its generation prompt must "
                             "open one, e.g. with <think>); the emulator serves thinking models only")
        self.end_think = self.encoding.one_id(layout.think_end, "end of reasoning")
        self.eos = self.encoding.one_id(layout.end_of_turn, "end-of-turn")
        self.blank_line = self.encoding.plain(["\n\n"])[0]  # one id in the built-in tokenizers
        self.size = len(tokenizer)
        # every added or reserved special token except </think> and end-of-turn: a real model never
        # emits them here
        self._special = self.encoding.special_ids
        self.banned = sorted(self._special - {self.end_think, self.eos})
        self._token_to_id = tokenizer.get_vocab()

    @lru_cache(maxsize=65536)
    def split(self, token_id: int) -> tuple[int, int] | None:
        """Two ids whose bytes together are those of `token_id` (a split BPE would not make), or None."""
        if token_id in self._special:
            return None
        s = self.tokenizer.convert_ids_to_tokens(token_id)
        for i in range(len(s) // 2, 0, -1):
            for j in (i, len(s) - i):
                a, b = self._token_to_id.get(s[:j]), self._token_to_id.get(s[j:])
                if a is not None and b is not None and all("\ufffd" not in self.encoding.decode([x]) for x in (a, b)):
                    return a, b
        return None
