"""Batched text <-> ids for the target's tokenizer, whatever its kind: the one layer the emulator
and stage 03 both encode and decode through.

`Encoding` gives the same ids as the tokenizer's own calls, in batches, for a tokenizers-backed,
a tiktoken-backed (Kimi-K2.5's) or any other transformers tokenizer. `template` turns added-token
strings into their tokens, `plain` keeps every character text, and `compose` encodes a text given
in parts with only the markup parts as tokens. A self-test at load checks that an added-token
string given as plain text stays text, so a user who types "<|im_end|>" never gets the real token."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

WINDOW_CHARS = 400_000
MAX_RUN_CHARS = 25_000
# tiktoken encodes with the GIL released: texts are encoded in this many threads (no more than cores)
_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
# a run longer than MAX_RUN_CHARS, matched from its first character only (no rescan inside a run)
_LONG_RUN = re.compile(r"(?<!\s)\s{%d,}|(?<!\S)\S{%d,}" % (MAX_RUN_CHARS + 1, MAX_RUN_CHARS + 1))


def cuts(text: str) -> list[int]:
    """Offsets where Kimi's tokenizer cuts `text` before tiktoken sees it: every 400,000 characters,
    and inside each such window 25,000 characters into any longer run of whitespace (or of
    non-whitespace), then every 25,000 characters of that run."""
    if len(text) <= MAX_RUN_CHARS:
        return []
    out = []
    for w in range(0, len(text), WINDOW_CHARS):
        if w:
            out.append(w)
        for m in _LONG_RUN.finditer(text[w:w + WINDOW_CHARS]):
            out.extend(range(w + m.start() + MAX_RUN_CHARS, w + m.end(), MAX_RUN_CHARS))
    return out


def windows(text: str) -> list[str]:
    """The pieces Kimi's tokenizer hands tiktoken one at a time for `text`."""
    at = cuts(text)
    if not at:
        return [text]
    bounds = [0, *at, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _cut_parts(parts: list[tuple[str, bool]]) -> list:
    """`parts` with a None wherever Kimi's tokenizer cuts their joined text. A cut inside a markup
    part is dropped: a model emits the markup as its tokens (where that tokenizer, encoding the
    joined text, would spell the two halves as text)."""
    joined = "".join(t for t, _ in parts)
    at = cuts(joined)
    if not at:
        return parts
    out, pos, k = [], 0, 0
    for text, markup in parts:
        end = pos + len(text)
        while k < len(at) and at[k] <= pos:
            out.append(None)
            k += 1
        j = k
        while j < len(at) and at[j] < end:
            j += 1
        if markup:
            out.append((text, True))
        else:
            bounds = [pos, *at[k:j], end]
            for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
                out += [None, (joined[a:b], False)] if n else [(joined[a:b], False)]
        k, pos = j, end
    return out


def _segments(parts: list) -> list[tuple[str, bool]]:
    """Plain text that meets plain text joined (a None between them keeps them apart); empty text dropped."""
    out, buf = [], []
    for part in parts:
        if part is not None and not part[1]:
            if part[0]:
                buf.append(part[0])
            continue
        if buf:
            out.append(("".join(buf), False))
            buf = []
        if part is not None:
            out.append(part)
    if buf:
        out.append(("".join(buf), False))
    return out


def _threaded(encode, texts: list[str]) -> list[list[int]]:
    """`encode` of each text, in _THREADS threads that take a few chunks of the list each (one task
    per text, as tiktoken's own batch calls run, costs more than a short text takes to encode)."""
    if _THREADS == 1 or len(texts) < 2 * _THREADS:
        return [encode(t) for t in texts]
    step = -(-len(texts) // (4 * _THREADS))
    chunks = [texts[i:i + step] for i in range(0, len(texts), step)]
    with ThreadPoolExecutor(_THREADS) as pool:
        return [ids for part in pool.map(lambda c: [encode(t) for t in c], chunks) for ids in part]


def _tiktoken_encoding(tokenizer):
    try:
        import tiktoken
    except ImportError:
        return None
    model = getattr(tokenizer, "model", None)
    return model if isinstance(model, tiktoken.Encoding) else None


def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a vocabulary string."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_OF = _byte_table()


class Encoding:
    """Batched encode/decode for one tokenizer; `kind` is one of:

      fast      a tokenizers-backed one (the built-in tiny targets): Rust batch calls on its
                backend, plus a copy of the backend without its added tokens for plain text
      tiktoken  Kimi-K2.5's remote-code tokenizer, a slow tokenizer whose `model` is a
                `tiktoken.Encoding`: straight to the Encoding, batched, cut exactly where that
                tokenizer's own `encode` cuts a text (`cuts`) but without its per-character loop
      slow      any other transformers tokenizer, through its own calls

    `added` is read the way the tokenizer itself encodes them: the backend's added tokens (fast),
    the Encoding's special tokens (tiktoken: Kimi's code builds that table from the config itself
    and tells transformers of a few only), transformers' table (slow)."""

    def __init__(self, tokenizer, source: str = ""):
        self.tokenizer = tokenizer
        self.source = source
        self.vocab_size = len(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._tiktoken = None if backend is not None else _tiktoken_encoding(tokenizer)
        self.kind = "fast" if backend is not None else "tiktoken" if self._tiktoken is not None else "slow"
        if self.kind == "fast":
            from tokenizers import Tokenizer

            spec = json.loads(backend.to_str())
            spec["added_tokens"] = []
            self._backend, self._bare = backend, Tokenizer.from_str(json.dumps(spec))
            decoder = backend.get_added_tokens_decoder()
        elif self.kind == "tiktoken":
            decoder = {self._tiktoken.encode_single_token(t): t for t in self._tiktoken.special_tokens_set}
        else:
            decoder = tokenizer.added_tokens_decoder
        self.added = {getattr(t, "content", t): i for i, t in sorted(decoder.items())}
        self._markup: dict[str, list[int]] = {}
        self._self_test()

    @property
    def special_ids(self) -> set[int]:
        """Ids of every added token (for tiktoken: every special and reserved token)."""
        return set(self.added.values())

    def describe(self) -> dict:
        return {"kind": self.kind, "class": type(self.tokenizer).__name__, "vocab_size": self.vocab_size}

    # ---- text -> ids ------------------------------------------------------------------------------

    def template(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, added-token strings as their tokens (the chat template's markup, prompts
        as serving engines tokenize them)."""
        if not texts:
            return []
        if self.kind == "fast":
            return _ids(self._backend, texts)
        if self.kind == "tiktoken":
            enc = self._tiktoken
            return self._windowed(texts, lambda ps: _threaded(
                lambda t: enc.encode(t, allowed_special="all", disallowed_special=()), ps))
        return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def plain(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, every character text."""
        if self.kind == "tiktoken":
            return self._windowed(texts, self._bare_batch)
        return self._bare_batch(texts)

    def compose(self, items: list[list[tuple[str, bool]]]) -> list[tuple[list[int], int]]:
        """Ids of each item, a list of (text, markup) parts read as one text: encoded as the tokenizer
        encodes the joined text (runs counted across parts, cut where it cuts them), but only the
        markup parts become their tokens, always; the rest is text, added-token strings included.
        Markup is what a model emits as single ids and an API returns as text (the reasoning
        delimiter, tool-call markers, the end of turn). With each item's ids, how many come before
        its first markup part."""
        flat: list[str] = []
        plans = []
        for parts in items:
            if self.kind == "tiktoken" and sum(len(t) for t, _ in parts) > MAX_RUN_CHARS:
                parts = _cut_parts(parts)
            plan = []
            for text, markup in _segments(parts):
                if markup:
                    plan.append(self._markup_ids(text))
                else:
                    plan.append(len(flat))
                    flat.append(text)
            plans.append(plan)
        encoded = self._bare_batch(flat)
        out = []
        for plan in plans:
            ids, lead = [], None
            for p in plan:
                if type(p) is int:
                    ids += encoded[p]
                else:
                    lead = len(ids) if lead is None else lead
                    ids += p
            out.append((ids, len(ids) if lead is None else lead))
        return out

    def _markup_ids(self, text: str) -> list[int]:
        ids = self._markup.get(text)
        if ids is None:
            ids = self._markup[text] = self.template([text])[0]
        return ids

    def _bare_batch(self, texts: list[str]) -> list[list[int]]:
        """Plain ids of each text as it is (tiktoken: the caller has cut it)."""
        if not texts:
            return []
        if self.kind == "fast":
            return _ids(self._bare, texts)
        if self.kind == "tiktoken":
            return _threaded(self._tiktoken.encode_ordinary, texts)
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

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """The bytes of each id on its own (byte-level BPE: half of a multi-byte character is its
        half, not U+FFFD), as OpenAI-style logprobs return them in `bytes`; added tokens: their string."""
        if self.kind == "tiktoken":
            return [self._tiktoken.decode_single_token_bytes(i) for i in ids]
        names = {i: t for t, i in self.added.items()}
        out = []
        for i in ids:
            piece = names.get(i)
            if piece is None and self.kind == "fast":
                piece = self.token(i)
                if all(c in _BYTE_OF for c in piece):
                    out.append(bytes(_BYTE_OF[c] for c in piece))
                    continue
                piece = None
            out.append((piece if piece is not None else self.decode([i])).encode("utf-8"))
        return out

    def token(self, i: int) -> str:
        """The vocabulary string of id `i` (byte-level BPE: 'Ġ' for a space), "" when none."""
        if self.kind == "fast":
            return self._backend.id_to_token(i) or ""
        return self.tokenizer.convert_ids_to_tokens(i) or ""

    # ---- load-time check --------------------------------------------------------------------------

    def _self_test(self) -> None:
        """An added-token string typed as plain text stays text, and in the template's markup is
        its single token; raises otherwise."""
        probe = [t for t in self.added if t.strip()][:512]
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
