"""The logprob probe: the providers' own per-token logprobs, the reference stage 04's check holds its
engine to (`hidden.check.reference_figures`).

Each allowed endpoint whose `supported_parameters` list `logprobs` gets the same few dozen short
prompts, pinned (`order` + `allow_fallbacks: false`), at temperature 1 and top_p 1 with
`logprobs: true`. A provider's logprobs describe the model's own distribution before temperature
and top-p (vLLM's default, `raw_logprobs`; OpenAI's are the same), and stage 04 reads its engine's
`prompt_logprobs`, also before any sampling setting: at temperature 1 and top_p 1 the tokens are
also drawn from that very distribution, so both sides describe the same thing whatever a provider
does. An endpoint whose answers carry no logprobs (`absent`), values on a 0.01 grid or coarser
(`rounded`: up to 0.005 nat off per token, half the gate's mean bound, as much as the bf16 noise it
works at; three decimals stay usable) or the same value for every token, or 0 / -9999
(`placeholder`), is named and set aside: never the reference.

The answers of the usable ones go to `providers/logprobs.jsonl`, one line each: the endpoint, the
prompt messages, the returned tokens and logprobs, and the ids they are, rebuilt from the answer's
text through the target's tokenizer and chat template as stage 03 does. An answer whose rebuilt ids
do not give back the returned tokens byte for byte (a provider splitting tokens its own way, or
returning text that differs from the ids, e.g. stripped whitespace) is left out: its logprobs
belong to other ids. The probe is paid like the pilot: worst case shown and checked first, cost
recorded, answers reused by a re-run unless `refresh_providers`.
"""

from __future__ import annotations

import json
from enum import StrEnum

import pandas as pd

from ..datasets import DatasetSpec
from ..files import write_text_atomic
from ..openrouter.api import Api
from ..openrouter.client import BodyMaker, messages_json, request_settings
from ..openrouter.pricing import table_worst_prices
from ..paths import Run
from ..targets.rebuild import Reconstructor, Response
from . import outputs
from .probe import shortest_prompts

GRID = 1e-2          # values all on this grid (or a coarser one) are rounded
PLACEHOLDERS = (0.0, -9999.0)
PARAMETER = "logprobs"


class Verdict(StrEnum):
    """What an endpoint's logprobs are good for."""

    USABLE = "usable"
    ABSENT = "absent"
    ROUNDED = "rounded"
    PLACEHOLDER = "placeholder"
    UNAVAILABLE = "unavailable"


WHY = {Verdict.ABSENT: "no logprobs in its answers although it lists them",
       Verdict.ROUNDED: f"every logprob on a {GRID:g} grid or coarser (rounded)",
       Verdict.PLACEHOLDER: "the same placeholder logprob for every token (e.g. 0 or -9999)",
       Verdict.UNAVAILABLE: "no answer came, after every retry (rate limits, errors)"}


def judge(answers: list[list[float] | None]) -> Verdict:
    """The verdict on one endpoint's logprobs, `answers` being each answer's values (None: none came; an
    answer with a value that is not a number counts as none)."""
    answers = [a if a and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in a) else None
               for a in answers]
    flat = [float(x) for a in answers if a for x in a]
    if not flat:
        return Verdict.ABSENT
    if len(set(flat)) == 1 or all(x in PLACEHOLDERS or x > 0 for x in flat):
        return Verdict.PLACEHOLDER
    if all(abs(x / GRID - round(x / GRID)) < 1e-6 for x in flat):
        return Verdict.ROUNDED
    return Verdict.USABLE


def listing_logprobs(table: pd.DataFrame) -> pd.Series:
    """Which endpoints of the endpoint table list `logprobs`."""
    return table["supported_parameters"].fillna("").map(lambda s: PARAMETER in s.split(","))


def returned_bytes(entries: list[dict]) -> list[bytes]:
    """Each returned token's bytes (`bytes` when given, else its string's UTF-8)."""
    return [bytes(e["bytes"]) if isinstance(e.get("bytes"), list) else str(e.get("token", "")).encode("utf-8")
            for e in entries]


def rebuild(rebuilder: Reconstructor, messages: list[dict], reply) -> tuple[list[int], list[int]] | None:
    """(prompt ids, answer ids) of `reply` rebuilt from its text, when they are the returned tokens byte
    for byte; None otherwise."""
    r = Response(sample_id="probe", dataset="probe", provider=reply.provider or "", generation_id=reply.generation_id,
                 messages=messages, reasoning=reply.reasoning or "", content=reply.content or "",
                 finish_reason=reply.finish_reason, billed_prompt=None, billed_completion=None,
                 billed_reasoning=None, reasoning_excluded=False, reasoning_disabled=False)
    b = rebuilder.rebuild([r])[0]
    if rebuilder.encoder.token_bytes(b.output_ids) != returned_bytes(reply.logprobs):
        return None
    return b.prompt_ids, b.output_ids


def ask(api: Api, model: str, tags: list[str], prompts: list[list[dict]], max_tokens: int, seed: int,
        reasoning: dict) -> dict:
    """(tag, prompt index) -> reply, each endpoint pinned, at temperature 1 and top_p 1 with logprobs."""
    bodies = []
    for tag in tags:
        settings = request_settings(model, max_tokens, 1.0, 1.0, seed, {"order": [tag], "allow_fallbacks": False},
                                    reasoning)
        pinned = BodyMaker({**settings, "logprobs": True})
        bodies += [pinned.body(messages_json(m)) for m in prompts]
    # an endpoint that keeps failing (429s past every retry) is no reference, not a reason to stop stage 01
    replies = iter(api.chat_all(bodies, "logprob probe", failures=True))
    return {(tag, i): next(replies) for tag in tags for i in range(len(prompts))}


def judge_replies(replies: dict, tags: list[str], prompts: list[list[dict]],
                  rebuilder: Reconstructor) -> tuple[pd.DataFrame, list[dict]]:
    """(a row per endpoint: verdict, answers, answers kept, tokens kept, cost; the lines of
    logprobs.jsonl from the usable endpoints)."""
    rows, lines = [], []
    for tag in tags:
        answered = {i: replies[tag, i] for i in range(len(prompts)) if not isinstance(replies[tag, i], Exception)}
        got = list(answered.values())
        verdict = (judge([[e.get("logprob") for e in r.logprobs] if r.logprobs else None for r in got]) if got
                   else Verdict.UNAVAILABLE)
        kept = []
        if verdict is Verdict.USABLE:
            for i, reply in answered.items():
                ids = rebuild(rebuilder, prompts[i], reply) if reply.logprobs else None
                if ids is not None:
                    kept.append({"provider": tag, "messages": prompts[i],
                                 "tokens": [e["token"] for e in reply.logprobs],
                                 "logprobs": [float(e["logprob"]) for e in reply.logprobs],
                                 "prompt_ids": ids[0], "output_ids": ids[1]})
        lines += kept
        rows.append({"tag": tag, "verdict": verdict.value, "answers": len(got), "failed": len(prompts) - len(got),
                     "with_logprobs": sum(1 for r in got if r.logprobs), "kept": len(kept),
                     "kept_tokens": sum(len(k["output_ids"]) for k in kept),
                     "cost": sum(r.usage.get("cost") or 0.0 for r in got)})
    return pd.DataFrame(rows), lines


def run_logprob_probe(api: Api, run: Run, model: str, policy: pd.DataFrame, datasets: list[DatasetSpec], tokenizer,
                      prompts: int, max_tokens: int, seed: int, reasoning: dict, spend_limit_usd: float,
                      refresh_providers: bool) -> pd.DataFrame | None:
    """The probe's table per endpoint (None when `prompts` is 0 or no allowed endpoint lists
    logprobs), its usable answers written to logprobs.jsonl; reused from an earlier run unless
    `refresh_providers`."""
    path = outputs.logprobs_file(run)
    if prompts <= 0:
        return None
    table = outputs.reuse(run, "logprob_probe", refresh_providers)
    if table is None or not path.is_file():
        candidates = policy[policy["allowed"] & listing_logprobs(policy)]
        if candidates.empty:
            write_text_atomic(path, "")
            print("logprob probe: no allowed endpoint lists logprobs: stage 04's check has no independent reference")
            return None
        chosen = shortest_prompts(datasets, prompts)
        p_tokens = sum(len(tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False))
                       for m in chosen)
        n, tags = len(chosen), list(candidates["tag"])
        worst = sum(p.cost(p_tokens, max_tokens * n, n) for p in table_worst_prices(candidates))
        print(f"logprob probe: {n} prompts x {len(tags)} endpoints listing logprobs ({', '.join(tags)}), "
              f"at most ${worst:.4f}")
        outputs.check_spend(run, worst, spend_limit_usd)
        replies = ask(api, model, tags, chosen, max_tokens, seed, reasoning)
        table, lines = judge_replies(replies, tags, chosen, Reconstructor(tokenizer, source="target"))
        write_text_atomic(path, "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
        outputs.keep_paid(run, "logprob_probe", table)
    print(verdict_line(table))
    return table


def verdict_line(table: pd.DataFrame) -> str:
    """One line: the reference kept, and each endpoint set aside with why."""
    aside = [f"{r.tag} ({WHY[Verdict(r.verdict)]})" for r in table.itertuples() if r.verdict != Verdict.USABLE]
    usable = table[table["verdict"] == Verdict.USABLE.value]
    said = (f"logprob reference: {int(usable['kept'].sum())} answers, {int(usable['kept_tokens'].sum())} tokens "
            f"from {', '.join(usable['tag'])}" if int(usable["kept"].sum()) else
            "no provider returned usable logprobs: stage 04's check falls back to its own bounds")
    return said + (f"; set aside: {'; '.join(aside)}" if aside else "")


def read_reference(path, vocab_size: int | None = None) -> list[dict]:
    """logprobs.jsonl's answers (none when the file is absent or empty); a malformed line, or an id
    outside the target's `vocab_size`, is an error naming the file and line."""
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ok = all(isinstance(row[k], list) for k in ("prompt_ids", "output_ids", "logprobs")) and \
                len(row["output_ids"]) == len(row["logprobs"]) and row["prompt_ids"]
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise ValueError(f"{path}:{n}: expected {{provider, messages, tokens, logprobs, prompt_ids, output_ids}} "
                             f"with one logprob per output id")
        if vocab_size is not None and not all(isinstance(i, int) and 0 <= i < vocab_size
                                              for i in row["prompt_ids"] + row["output_ids"]):
            raise ValueError(f"{path}:{n}: token ids outside the target's vocabulary of {vocab_size}: stage 01 "
                             f"rebuilt them with another tokenizer (run it with this target_model_path)")
        out.append(row)
    return out
