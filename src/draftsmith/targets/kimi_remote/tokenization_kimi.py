"""A Kimi-style tokenizer: a transformers slow tokenizer over a `tiktoken.Encoding`.

Written by draftsmith into the checkpoint folder of its built-in Kimi-shaped target and loaded from
there by `AutoTokenizer.from_pretrained(folder, trust_remote_code=True)` through the `auto_map` of
`tokenizer_config.json`, the way Kimi-K2.5's own tokenizer is. It follows the documented behaviour
of that tokenizer: the byte-level BPE ranks of `tiktoken.model`, Kimi's split pattern (CJK runs on
their own, letter runs split by case), 256 special/reserved ids after the ranks, and `encode`
windowing a text at 400,000 characters and cutting runs of more than 25,000 whitespace or
non-whitespace characters before tiktoken sees them.

Its constructor takes the config's `added_tokens_decoder` for its own table of special tokens (the
names of ids after the ranks; an id without one is `<|reserved_token_{id}|>`) and hands transformers
only bos/eos/unk/pad and `additional_special_tokens`, as Kimi's does: transformers' own added-token
table then lacks the tool-call markers and `<think>`, while `encode` still makes each of them one id.
"""

from __future__ import annotations

import os
from shutil import copyfile

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_SPECIAL_IDS = 256          # ids after the ranks: named special tokens, the rest reserved
WINDOW_CHARS = 400_000         # texts reach tiktoken in windows of at most this many characters
MAX_RUN_CHARS = 25_000         # a longer run of whitespace (or of non-whitespace) is cut
# the special tokens transformers is told of when the config names none
ADDITIONAL_SPECIAL_TOKENS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                             "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>")


def split_long_runs(text: str, limit: int = MAX_RUN_CHARS):
    """Pieces of `text` in order, cut wherever a run of whitespace or of non-whitespace characters
    would grow past `limit` (tiktoken's regex is slow on very long runs)."""
    start, run, in_space = 0, 0, text[:1].isspace()
    for i, ch in enumerate(text):
        space = ch.isspace()
        if space != in_space:
            in_space, run = space, 1
            continue
        run += 1
        if run > limit:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]


def windows(text: str):
    """The pieces tiktoken encodes one at a time for `text`."""
    for i in range(0, len(text), WINDOW_CHARS):
        yield from split_long_runs(text[i:i + WINDOW_CHARS])


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 additional_special_tokens=None, added_tokens_decoder=None, **kwargs):
        if not os.path.isfile(vocab_file):
            raise FileNotFoundError(f"tiktoken rank file not found: {vocab_file}")
        if additional_special_tokens is None:
            additional_special_tokens = list(ADDITIONAL_SPECIAL_TOKENS)
        ranks = load_tiktoken_bpe(vocab_file)
        named = {int(i): getattr(t, "content", t) for i, t in (added_tokens_decoder or {}).items()}
        base = len(ranks)
        self.special_tokens = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + NUM_SPECIAL_IDS)}
        for name, token in (("bos_token", bos_token), ("eos_token", eos_token), ("unk_token", unk_token),
                            ("pad_token", pad_token)):
            if str(token) not in self.special_tokens:
                raise ValueError(f"{name} {str(token)!r} is not one of the special tokens after the "
                                 f"{base} ranks of {vocab_file}")
        self.vocab_file = vocab_file
        self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PATTERN,
                                       mergeable_ranks=ranks, special_tokens=self.special_tokens)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.decoder = {i: "".join(self.byte_encoder[b] for b in token) for token, i in ranks.items()}
        self.decoder.update({i: s for s, i in self.special_tokens.items()})
        self.encoder = {s: i for i, s in self.decoder.items()}
        # added_tokens_decoder stays here: transformers learns only these special tokens
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         additional_special_tokens=additional_special_tokens, **kwargs)

    # ---- Kimi's own entry points ------------------------------------------------------------------

    def encode(self, text, allow_special_tokens: bool = True, **kwargs):
        """Ids of `text`. With `allow_special_tokens` a special-token string in the text becomes
        that token; without, it is text. Any transformers keyword goes through the slow path."""
        if kwargs:
            return super().encode(text, **kwargs)
        if not isinstance(text, str):
            raise TypeError(f"TikTokenTokenizer.encode takes a str, not {type(text).__name__}")
        ids = []
        for piece in windows(text):
            if allow_special_tokens:
                ids += self.model.encode(piece, allowed_special="all")
            else:
                ids += self.model.encode(piece, disallowed_special=())
        return ids

    def decode(self, token_ids, **kwargs):
        if kwargs:
            return super().decode(token_ids, **kwargs)
        return self.model.decode([token_ids] if isinstance(token_ids, int) else list(token_ids))

    # ---- the slow-tokenizer interface transformers calls ------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[i] for i in self.encode(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.encoder.get(str(self.unk_token)))

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        text = "".join(tokens)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", "replace")

    @staticmethod
    def clean_up_tokenization(out_string):
        return out_string

    def save_vocabulary(self, save_directory, filename_prefix=None):
        name = (filename_prefix + "-" if filename_prefix else "") + self.vocab_files_names["vocab_file"]
        out = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            copyfile(self.vocab_file, out)
        return (out,)
