"""Batched text <-> ids for the target's tokenizer, whatever its kind: the one layer the emulator
and stage 03 both encode and decode through.

Three kinds of tokenizer reach here. `fast` (a tokenizers-backed one, the built-in targets): Rust
batch calls on its backend, plus a copy of the backend without its added tokens for plain text.
`tiktoken` (Kimi-K2.5's remote-code tokenizer, a slow tokenizer whose `model` is a
`tiktoken.Encoding`): straight to the Encoding, batched, windowed exactly as that tokenizer's own
`encode` windows a text (400,000-character windows, runs of more than 25,000 whitespace or
non-whitespace characters cut) but without its per-character Python loop. `slow`: any other
transformers tokenizer, through its own calls.

Two ways to encode: `template` turns added-token strings into their tokens (the chat template's
markup, prompts as serving engines tokenize them); `plain` keeps every character text, except the
added tokens named in `tokens` (e.g. tool-call markers, which a model emits as single ids and an
API returns as text). A self-test at load checks that an added-token string given as plain text
stays text, so a user who types "<|im_end|>" never gets the real token.
"""

from __future__ import annotations

import json
import os
import re

WINDOW_CHARS = 400_000
MAX_RUN_CHARS = 25_000
# tiktoken's batch calls run a thread pool (8 threads by default); more threads than cores only cost
_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (MAX_RUN_CHARS + 1, MAX_RUN_CHARS + 1))


def windows(text: str) -> list[str]:
    """The pieces Kimi's tokenizer hands tiktoken for `text`: 400,000-character windows, each cut
    inside any run of whitespace (or of non-whitespace) every 25,000 characters of that run."""
    if len(text) <= MAX_RUN_CHARS:
        return [text]
    out = []
    for w in range(0, len(text), WINDOW_CHARS):
        window = text[w:w + WINDOW_CHARS]
        start = 0
        for m in _LONG_RUN.finditer(window):
            for cut in range(m.start() + MAX_RUN_CHARS, m.end(), MAX_RUN_CHARS):
                out.append(window[start:cut])
                start = cut
        out.append(window[start:])
    return out


def _tiktoken_encoding(tokenizer):
    try:
        import tiktoken
    except ImportError:
        return None
    model = getattr(tokenizer, "model", None)
    return model if isinstance(model, tiktoken.Encoding) else None


class Encoding:
    """Batched encode/decode for one tokenizer; `kind` is "fast", "tiktoken" or "slow"."""

    def __init__(self, tokenizer, source: str = ""):
        self.tokenizer = tokenizer
        self.source = source
        self.vocab_size = len(tokenizer)
        self.added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._tiktoken = None if backend is not None else _tiktoken_encoding(tokenizer)
        self.kind = "fast" if backend is not None else "tiktoken" if self._tiktoken is not None else "slow"
        if self.kind == "fast":
            from tokenizers import Tokenizer

            spec = json.loads(backend.to_str())
            spec["added_tokens"] = []
            self._backend, self._bare = backend, Tokenizer.from_str(json.dumps(spec))
        self._self_test()

    @property
    def special_ids(self) -> set[int]:
        """Ids of every added token, and of the tiktoken Encoding's reserved special tokens."""
        ids = set(self.added.values())
        if self._tiktoken is not None:
            ids |= {self._tiktoken.encode_single_token(t) for t in self._tiktoken.special_tokens_set}
        return ids

    def describe(self) -> dict:
        return {"kind": self.kind, "class": type(self.tokenizer).__name__, "vocab_size": self.vocab_size}

    # ---- text -> ids ------------------------------------------------------------------------------

    def template(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, added-token strings as their tokens."""
        if not texts:
            return []
        if self.kind == "fast":
            return _ids(self._backend, texts)
        if self.kind == "tiktoken":
            return self._windowed(texts, lambda ps: self._tiktoken.encode_batch(ps, num_threads=_THREADS,
                                                                                allowed_special="all"))
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def plain(self, texts: list[str], tokens: dict[str, int] | None = None) -> list[list[int]]:
        """Ids of each text, every character text, except the strings of `tokens` (-> their id)."""
        if not tokens:
            return self._plain(texts)
        marker = re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))
        pieces = [marker.split(t) for t in texts]
        found = [marker.findall(t) for t in texts]
        flat = self._plain([p for ps in pieces for p in ps])
        out, k = [], 0
        for ps, ms in zip(pieces, found):
            ids = []
            for j in range(len(ps)):
                ids += flat[k + j]
                if j < len(ms):
                    ids.append(tokens[ms[j]])
            k += len(ps)
            out.append(ids)
        return out

    def _plain(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.kind == "fast":
            return _ids(self._bare, texts)
        if self.kind == "tiktoken":
            return self._windowed(texts, lambda ps: self._tiktoken.encode_ordinary_batch(ps, num_threads=_THREADS))
        return self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def _windowed(self, texts: list[str], encode_batch) -> list[list[int]]:
        split = [windows(t) for t in texts]
        if all(len(s) == 1 for s in split):
            return encode_batch(texts)
        flat = encode_batch([p for s in split for p in s])
        out, k = [], 0
        for s in split:
            out.append([i for ids in flat[k:k + len(s)] for i in ids])
            k += len(s)
        return out

    def one_id(self, text: str, what: str) -> int:
        """The single id `text` is in the template's markup (e.g. the end-of-turn); an error naming
        `what` when it is several ids or the unknown token."""
        ids = self.template([text])[0]
        unk = self.tokenizer.unk_token_id
        if len(ids) != 1 or (unk is not None and ids[0] == unk and text != self.tokenizer.unk_token):
            shown = "the unknown token" if len(ids) == 1 else f"{len(ids)} ids {ids[:8]}"
            raise ValueError(f"tokenizer {self.source or type(self.tokenizer).__name__}: the {what} {text!r} "
                             f"is {shown}, not one token of its vocabulary: the chat template and the "
                             f"tokenizer do not belong together")
        return ids[0]

    # ---- ids -> text ------------------------------------------------------------------------------

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, added tokens included as their strings."""
        if self.kind == "fast":
            return self._backend.decode(ids, skip_special_tokens=False)
        if self.kind == "tiktoken":
            return self._tiktoken.decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode_each(self, ids: list[int]) -> list[str]:
        """The text of each id on its own."""
        if self.kind == "fast":
            return self._backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        if self.kind == "tiktoken":
            return self._tiktoken.decode_batch([[i] for i in ids])
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def token(self, i: int) -> str:
        """The vocabulary string of id `i` (byte-level BPE: 'Ġ' for a space), "" when none."""
        if self.kind == "fast":
            return self._backend.id_to_token(i) or ""
        return self.tokenizer.convert_ids_to_tokens(i) or ""

    # ---- load-time check --------------------------------------------------------------------------

    def _self_test(self) -> None:
        probe = [t for t in self.added if t.strip()][:64]
        if not probe:
            return
        typed = self.plain(probe)
        leaked = [t for t, ids in zip(probe, typed) if self.added[t] in ids]
        if leaked:
            raise RuntimeError(f"tokenizer {self.source or type(self.tokenizer).__name__} ({self.kind}): "
                               f"special-token strings typed as text became their tokens: {leaked[:3]}")
        markup = self.template(probe)
        wrong = [t for t, ids in zip(probe, markup) if ids != [self.added[t]]]
        if wrong:
            raise RuntimeError(f"tokenizer {self.source or type(self.tokenizer).__name__} ({self.kind}): "
                               f"added-token strings in the template's markup are not their single "
                               f"tokens: {wrong[:3]}")


def _ids(tok, texts: list[str]) -> list[list[int]]:
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: no character offsets
    return [e.ids for e in encode(texts, add_special_tokens=False)]
