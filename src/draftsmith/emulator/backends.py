"""What a text backend is asked to do, and the token facts both backends share.

A backend turns a `Job` (the prompt ids and sampling settings) into a stream of `(token_id, text)`
pairs: the ids actually sampled, in the target tokenizer, each with the text it adds (`""` for
`</think>` and the end-of-turn token). The response is `{reasoning}</think>{content}<eos>`: the
prompt ends inside the reasoning (`<think>`), so everything before `</think>` is reasoning. Both
markers are read off the target's chat template (`templates.response_layout`), so a Kimi-style
target ends its turn with `<|im_end|>` and a DeepSeek-style one with its end-of-sentence token. The
stream ends after the end-of-turn token (finish `stop`) or after `max_tokens` ids (finish `length`).
`completion_tokens` is the number of ids in the stream, `</think>` and end-of-turn included.

Two backends: `SyntheticBackend` (below: canonical text from an offline corpus, for load tests)
and the model backend (model.py: the target checkpoint itself).
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from dataclasses import dataclass
from functools import lru_cache

from ..encoding import Encoding
from ..targets.corpus import stdlib_docstrings
from ..targets.tiny import cache_dir
from ..templates import response_layout
from .faults import uniform


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


# ------------------------------------------------------------------------------------------------
# The synthetic backend: canonical text from an offline corpus, fast enough for load tests.
#
# Responses are windows of a stream of sentences of Python's standard-library docstrings, encoded
# once with the target tokenizer at start-up (ASCII sentences only, so every id decodes to text on its
# own). Sentences end in punctuation and the next one starts with a space and a word, a boundary the
# tokenizer's pre-tokenizer always splits at, so a window starting at a sentence is exactly what the
# tokenizer makes of its text (canonical), and the token counts are those of the target tokenizer.
# A response is two slices of the stream (reasoning, content): no per-token work. Lengths are
# lognormal around `median_tokens`; the text is a function of the job's key (prompt, seed, or a
# fresh draw), so temperature 0 gives the same response every time.


_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


class SyntheticBackend:
    def __init__(self, vocab: Vocab, median_tokens: int = 300, reasoning_fraction: float = 0.4,
                 docstrings: int = 800):
        self.vocab = vocab
        tok = vocab.encoding  # batched, no Python overhead per token
        self.median_tokens, self.reasoning_fraction = median_tokens, reasoning_fraction
        self.ids, self.texts, self.starts = _corpus(tok, docstrings)
        # safe_end[e]: the last position <= e where the text can end canonically: before an id that
        # starts a new word (" word" after a non-space), a split the pre-tokenizer always makes
        self.safe_end, last = [], 0
        for e, t in enumerate(self.texts):
            if len(t) > 1 and t[0] == " " and t[1].isalpha() and e and not self.texts[e - 1][-1:].isspace():
                last = e
            self.safe_end.append(last)
        self.safe_end.append(len(self.ids))
        self.filler = tok.plain([" the"])[0][0]
        self.filler_text = tok.decode([self.filler])
        self._tok = tok

    def _segment(self, rng: random.Random, n: int) -> tuple[list[int], list[str]]:
        """Exactly `n` canonical ids: windows of the corpus stream that start at a sentence and end
        before a word (padded with ' the' up to n)."""
        ids: list[int] = []
        texts: list[str] = []
        while len(ids) < n:
            s = self.starts[rng.randrange(len(self.starts))]
            want = min(s + n - len(ids), len(self.ids))
            e = max(s, self.safe_end[want])
            pad = want - e if want < len(self.ids) else 0
            ids += self.ids[s:e] + [self.filler] * pad
            texts += self.texts[s:e] + [self.filler_text] * pad
        return ids, texts

    def tokens(self, job: Job) -> tuple[list[int], list[str]]:
        """The whole response: its ids (at most `job.max_tokens`) and the text each adds."""
        v = self.vocab
        rng = random.Random(f"synthetic|{job.key}|{job.perturbed}")
        length = max(2, int(rng.lognormvariate(0, 0.5) * self.median_tokens))
        think = not job.prompt_ids or job.prompt_ids[-1] != v.end_think
        n_reason = max(1, round(length * self.reasoning_fraction)) if think else 0
        if job.reasoning_max_tokens is not None:
            n_reason = min(n_reason, job.reasoning_max_tokens)
        n_content = max(1, length - n_reason - 2)
        m = job.max_tokens
        ids, texts = self._segment(rng, min(n_reason, m))
        if think and len(ids) < m:
            ids.append(v.end_think)
            texts.append("")
        prefix = (v.blank_line if rng.random() < 0.5 else [])[: m - len(ids)]  # answers often open with a blank line
        ids += prefix
        texts += [self._tok.decode([i]) for i in prefix]
        if len(ids) < m:
            more, more_texts = self._segment(rng, min(n_content, m - len(ids)))
            ids += more
            texts += more_texts
        if len(ids) < m:
            ids.append(v.eos)
            texts.append("")
        if job.noncanonical_rate > 0:
            ids = _split_some(ids, v, job.noncanonical_rate, job.key)[:m]
            texts = ["" if i in (v.end_think, v.eos) else self._tok.decode([i]) for i in ids]
        return ids, texts


def corpus_sentences(docstrings: int = 800) -> list[str]:
    """ASCII sentences of standard-library docstrings; parsed once, then read from the cache."""
    path = cache_dir() / f"synthetic-corpus-{docstrings}-py{sys.version_info[0]}{sys.version_info[1]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    sentences, seen = [], set()
    for _, _, doc in stdlib_docstrings(docstrings):
        for s in _SENTENCE.split(" ".join(doc.split())):
            if 8 <= len(s) <= 300 and s.isascii() and s[-1] in ".!?" and s[0].isalpha() and s not in seen:
                seen.add(s)
                sentences.append(s)
    if len(sentences) < 50:
        raise RuntimeError("synthetic backend: too few corpus sentences found in the standard library")
    path.parent.mkdir(parents=True, exist_ok=True)
    # a temp file per process, not write_text_atomic's one name: several processes may build it at once
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(sentences))
    os.replace(tmp, path)
    return sentences


@lru_cache(maxsize=2)
def _corpus(tok, docstrings: int) -> tuple[list[int], list[str], list[int]]:
    """The corpus as one stream: ids of every sentence with a leading space, one after the other,
    the text each id adds, and where each sentence starts. Built once per process."""
    texts = corpus_sentences(docstrings)
    ids, starts = [], []
    for enc in tok.plain([" " + s for s in texts]):
        starts.append(len(ids))
        ids += enc
    vocab = sorted(set(ids))
    text_of = dict(zip(vocab, tok.decode_each(vocab)))
    return ids, [text_of[i] for i in ids], starts


def _split_some(ids: list[int], vocab: Vocab, rate: float, key: str) -> list[int]:
    out = []
    for n, i in enumerate(ids):
        pair = vocab.split(i) if uniform("split", key, n) < rate else None
        out += pair if pair else [i]
    return out
