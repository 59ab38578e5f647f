"""Provider quirks applied to what is returned and billed (the ids served stay the truth).

`merges-dropped` billing: the target's tokenizer.json with only the first tenth of its BPE merges
kept, so it splits words into more pieces and bills more tokens than the ids served, like a provider
counting with the wrong tokenizer: on the demo's prompts and answers it disagrees with the target on
nearly every text (about +17% tokens), so even a few samples show both counts off. (No other
tokenizer ships offline; this one is real BPE with the same vocabulary and special tokens, just
fewer merges.)
"""

from __future__ import annotations

import json
from functools import lru_cache

from ..targets.tiny import tokenizer_json_path

TRUNCATE_CHARS = 40  # a truncated reasoning stops after this many characters


@lru_cache(maxsize=4)
def merges_dropped_tokenizer(tokenizer_json: str | None = None, keep: float = 0.1):
    from tokenizers import Tokenizer

    spec = json.loads(open(tokenizer_json or tokenizer_json_path(), encoding="utf-8").read())
    merges = spec["model"]["merges"]
    spec["model"]["merges"] = merges[: int(len(merges) * keep)]
    return Tokenizer.from_str(json.dumps(spec))


class Billing:
    """Token counts as a provider reports and bills them."""

    def __init__(self, encoding, kind: str):
        self.kind = kind
        self._other = merges_dropped_tokenizer() if kind == "merges-dropped" else None
        self._target = encoding

    def count(self, ids: list[int], true_count: int) -> int:
        if self._other is None:
            return true_count
        text = self._target.decode(ids)
        return len(self._other.encode(text, add_special_tokens=False).ids)


class StripStream:
    """Content with leading and trailing whitespace stripped, streamed: leading whitespace is
    dropped, trailing whitespace is held back until more text follows (and dropped at the end)."""

    def __init__(self):
        self.started = False
        self.held = ""

    def feed(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body
