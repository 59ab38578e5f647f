"""Tokenizer code shipped in a checkpoint folder (Kimi-K2.5's): the one known import such code
makes that our transformers moved.

`bridge_moved_imports(folder)`: older copies of Kimi's tokenizer import `bytes_to_unicode` from
`transformers.models.gpt2.tokenization_gpt2`, where transformers 5 no longer has it (it lives in
`transformers.convert_slow_tokenizer`). When the folder's code imports it from the old place and
the old place lacks it, the function is put back there, and the log says so; otherwise nothing.
"""

from __future__ import annotations

from pathlib import Path

_OLD_HOME = "transformers.models.gpt2.tokenization_gpt2"


def bridge_moved_imports(folder: str | Path, log=print) -> bool:
    """Make `from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode` work for the
    folder's tokenizer code, if that code needs it and this transformers lacks it. True if bridged."""
    sources = [p for p in Path(folder).glob("*.py")
               if _OLD_HOME in (text := p.read_text(encoding="utf-8", errors="replace")) and "bytes_to_unicode" in text]
    if not sources:
        return False
    import importlib

    old = importlib.import_module(_OLD_HOME)
    if hasattr(old, "bytes_to_unicode"):
        return False
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    old.bytes_to_unicode = bytes_to_unicode
    log(f"compatibility: {sources[0].name} imports bytes_to_unicode from {_OLD_HOME}, which this transformers "
        f"moved to transformers.convert_slow_tokenizer; bridged (the same function)")
    return True
