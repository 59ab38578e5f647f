"""The tiny target's training text: chat-formatted docstrings of Python's standard library.

Offline and deterministic: the same stdlib and seed give the same conversations, so a build of the
tiny target is reproducible. Each conversation's final assistant turn carries reasoning (the
docstring's first line) and an answer (the rest), the shape the chat template renders with thinking.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from functools import lru_cache
from pathlib import Path

_QUESTIONS = [
    "What does {name} do?",
    "Explain {name} from the {module} module.",
    "How do I use {name}?",
    "Describe {name} briefly.",
    "What is {name} in {module} for?",
]


def stdlib_docstrings(limit: int = 20000) -> list[tuple[str, str, str]]:
    """(module, qualified name, docstring) for documented functions and classes of the stdlib,
    in a fixed order so builds are reproducible; parsed once per process (a new list each call)."""
    return list(_stdlib_docstrings(limit))


@lru_cache(maxsize=4)
def _stdlib_docstrings(limit: int) -> tuple[tuple[str, str, str], ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or path.name.startswith("test"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = path.stem if path.parent == root else f"{path.parent.name}.{path.stem}"
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    out.append((module, node.name, doc))
                    if len(out) >= limit:
                        return tuple(out)
    return tuple(out)


def chat_examples(seed: int = 0, limit: int = 20000) -> list[list[dict]]:
    """Conversations whose final assistant turn carries reasoning (the docstring's first line)
    and an answer (the rest), shuffled deterministically."""
    rng = random.Random(seed)
    convs = []
    for module, name, doc in stdlib_docstrings(limit):
        first, _, rest = doc.strip().partition("\n")
        rest = " ".join(rest.split())[:400] or first
        q = rng.choice(_QUESTIONS).format(name=f"`{name}`", module=module)
        convs.append([
            {"role": "user", "content": q},
            {"role": "assistant", "reasoning_content": f"The user asks about {name}. {first.strip()}",
             "content": "\n\n" + rest},  # answers open with a blank line, as DeepSeek-R1's and Kimi's do
        ])
    rng.shuffle(convs)
    return convs


def training_stream(tok, n_tokens: int, seed: int) -> list[int]:
    ids: list[int] = []
    for conv in chat_examples(seed):
        ids.extend(tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=False,
                                           return_dict=False))
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    while len(ids) < n_tokens:  # a corpus shorter than the budget repeats
        ids.extend(ids[: n_tokens - len(ids)])
    return ids
