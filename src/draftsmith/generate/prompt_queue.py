"""The prompts still to do, per dataset: streamed from the file, one looked ahead.

Samples already saved, or failed for good in an earlier session in the words they have now, are
passed over (that is the resume). Prompts too long for the context are set aside in errors.jsonl
with the reason, so a re-run does not try them again (until they are reworded). Memory holds
one prompt per dataset, not the dataset.
"""

from __future__ import annotations

import time

from ..openrouter.budget import TokenBudget, prompt_tokens_bound
from ..datasets import DatasetReader, DatasetSpec, Prompt, stable_id
from .outputs import DatasetStore


class ContextCheck:
    """Prompts longer than the context (less max_tokens) are skipped with the reason. A prompt's
    byte count bounds its tokens, so only the rare prompt long enough to matter is tokenized, with
    the target's tokenizer; without one, the prompt is sent and the API's 400 says it."""

    def __init__(self, context_length: int | None, max_tokens: int, target_model_path: str | None,
                 trust_remote_code: bool = False):
        self.limit = context_length - max_tokens if context_length else None
        self.path = target_model_path
        self.trust_remote_code = trust_remote_code
        self._tok = None

    def too_long(self, messages: list[dict], bound: int) -> str | None:
        """Why the prompt cannot be sent (None: it fits); `bound` = prompt_tokens_bound(messages)."""
        if self.limit is None or bound <= self.limit:
            return None
        n = self._count(messages)
        if n is None or n <= self.limit:
            return None         # fits, or cannot tell: the API answers 400 if not (a permanent failure)
        return (f"prompt of {n} tokens does not fit the context: {self.limit} tokens are left "
                f"once max_tokens is reserved")

    def _count(self, messages: list[dict]) -> int | None:
        if self._tok is None and self.path:
            try:
                from ..targets.checkpoint import load_tokenizer

                self._tok = load_tokenizer(self.path, self.trust_remote_code, log=lambda *a: None)
            except Exception as e:  # noqa: BLE001 - any failure means: let the API decide
                print(f"note: no tokenizer from target_model_path ({type(e).__name__}: {e}); "
                      f"over-long prompts are left to the API to refuse")
                self.path = None
        if self._tok is None:
            return None
        return 32 + sum(16 + len(self._tok.encode(m["content"], add_special_tokens=False)) for m in messages)


class DatasetQueue:
    """One dataset: its prompts still to do, its files (store) and its token budget."""

    def __init__(self, spec: DatasetSpec, store: DatasetStore, budget: TokenBudget):
        self.spec, self.store, self.budget = spec, store, budget
        self.name = spec.name
        self.reader = DatasetReader(spec)
        self._it = iter(self.reader)
        self._pending: Prompt | None = None
        self._bound = 0
        self._checked = False
        self.exhausted = False
        self.skipped = 0
        self.answered: set[str] = set()  # sample ids and prompt hashes an import already answers (imports.py)

    def peek(self, check: ContextCheck | None = None) -> tuple[Prompt, int] | None:
        """The next prompt to send and its token bound, without taking it; None when none is left.
        With a `check`, a prompt too long for the context is set aside and the next one looked at."""
        while True:
            while self._pending is None and not self.exhausted:
                p = next(self._it, None)
                if p is None:
                    self.exhausted = True
                elif (p.sample_id not in self.store.done and not self.store.failed_for_good(p.sample_id, p.prompt_hash)
                      and not (self.answered and (p.sample_id in self.answered
                                                  or stable_id(p.messages) in self.answered))):
                    self._pending, self._bound, self._checked = p, prompt_tokens_bound(p.messages), False
            if self._pending is None or check is None or self._checked:
                return None if self._pending is None else (self._pending, self._bound)
            reason = check.too_long(self._pending.messages, self._bound)
            if not reason:
                self._checked = True
                continue
            self._skip(self._pending, reason)
            self._pending = None

    def take(self) -> None:
        self._pending = None

    def _skip(self, p: Prompt, reason: str) -> None:
        self.skipped += 1
        self.store.write_error({"sample_id": p.sample_id, "prompt_hash": p.prompt_hash, "dataset": self.name,
                                "action": "permanent", "kind": "too_long", "message": reason, "attempts": 0,
                                "time": round(time.time(), 3)})
