"""The prompts stage 06 measures on: samples stage 05 held out of training, as the tokens before the response
(and the field's benchmark prompts, `benchmarks`, in the same shape).

Which samples were held out is stage 05's to say (its held-out ids file); their tokens come from
stage 04's hidden-state shards, so the prompt is exactly what the target saw when the drafter's
features were captured.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from ..drafter.outputs import read_heldout
from ..paths import Run
from ..hidden.outputs import HiddenShards, hidden_dir


@dataclass(frozen=True)
class HeldoutPrompt:
    dataset: str
    sample_id: str
    ids: tuple[int, ...]   # the tokens the target saw before its response
    # a benchmark's prompt (`benchmarks`) also has: the messages `ids` render, the user turns asked
    # after the target's own answer, its own max_new_tokens per turn, and the tokens its follow-up
    # turns add besides the answers (for the engine's context length)
    messages: tuple = field(default=(), compare=False)
    followups: tuple[str, ...] = ()
    max_new_tokens: int | None = None
    reserve: int = 0

    def new_tokens(self, eval_max_new_tokens: int) -> int:
        """Tokens generated per turn: its own max_new_tokens, else the stage's."""
        return self.max_new_tokens or eval_max_new_tokens

    def context_needed(self, eval_max_new_tokens: int) -> int:
        """The longest sequence its decode can reach: every turn's prompt and answers."""
        return len(self.ids) + (1 + len(self.followups)) * self.new_tokens(eval_max_new_tokens) + self.reserve

    def job(self) -> dict:
        """What the engine process (`engine_child`) decodes of it."""
        out = {"dataset": self.dataset, "sample_id": self.sample_id, "ids": list(self.ids)}
        if self.followups:
            out |= {"messages": list(self.messages), "followups": list(self.followups)}
        if self.max_new_tokens:
            out["max_new_tokens"] = self.max_new_tokens
        return out


def heldout_prompts(run: Run, drafter_dir: str | os.PathLike, eval_prompts_per_dataset: int) -> list[HeldoutPrompt]:
    """The first `eval_prompts_per_dataset` samples of each dataset that stage 05 (in `drafter_dir`)
    held out of training, in the order it lists them, as prompts."""
    held = read_heldout(drafter_dir)
    if not held:
        raise ValueError(f"{drafter_dir}: stage 05 held out no samples (train_holdout_fraction 0?); "
                         f"acceptance must be measured on prompts the drafter did not train on")
    shards = HiddenShards(hidden_dir(run))
    where_is = {(ref.dataset, ref.sample_id): i for i, ref in enumerate(shards.samples)}
    out: list[HeldoutPrompt] = []
    taken: dict[str, int] = {}
    for dataset, sample_id in held:
        if taken.get(dataset, 0) >= eval_prompts_per_dataset:
            continue
        where = f"{shards.dir}: sample {sample_id!r} of {dataset!r}"
        if (dataset, sample_id) not in where_is:
            raise ValueError(f"{where}: held out by stage 05 ({drafter_dir}) but not in stage 04's hidden states; "
                             f"re-run stage 05 on these hidden states")
        s = shards.sample(where_is[dataset, sample_id], fields=("input_ids", "loss_mask"))
        out.append(HeldoutPrompt(dataset, sample_id,
                                 tuple(prompt_ids(s["input_ids"].tolist(), s["loss_mask"].tolist(), where))))
        taken[dataset] = taken.get(dataset, 0) + 1
    return out


def first_of_each(prompts: list[HeldoutPrompt], eval_first_pass_prompts: int) -> list[HeldoutPrompt]:
    """The first `eval_first_pass_prompts` prompts of each prompt set (`dataset`), in their order."""
    taken: dict[str, int] = {}
    out = []
    for p in prompts:
        if taken.get(p.dataset, 0) < eval_first_pass_prompts:
            out.append(p)
            taken[p.dataset] = taken.get(p.dataset, 0) + 1
    return out


def prompt_ids(input_ids: list[int], loss_mask: list[int], where: str) -> list[int]:
    """The prompt part of a training row: the tokens before the first response token."""
    if 1 not in loss_mask:
        raise ValueError(f"{where}: no response token (loss_mask is all 0)")
    n = loss_mask.index(1)
    if n == 0:
        raise ValueError(f"{where}: the response starts at the first token; there is no prompt")
    return list(input_ids[:n])


def prompt_seed(seed: int, dataset: str, sample_id: str, n_bytes: int) -> int:
    """A sampling seed of one prompt, the same in every run with this `seed`. Our decoder seeds
    torch with 6 bytes of it, the vLLM engine with 4 (kept apart: changing either would change
    what earlier runs measured)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{dataset}/{sample_id}".encode()).digest()[:n_bytes], "big")
