"""What a session records as it goes: a progress line, a timeline point every second, the manifest
rewritten every two seconds and at the end, and the closing message of the result."""

from __future__ import annotations

import asyncio
import time

from . import outputs
from .options import GenerationResult

TODO = {"balance": "top up the balance, then re-run", "spend_limit": "raise spend_limit_usd, then re-run",
        "fatal": "fix that, then re-run", "interrupted": "re-run",
        "write_error": "free space on that disk (or fix the folder), then re-run", "no_room": "re-run"}


async def tick(eng) -> None:
    last_save = last_t = time.monotonic()
    last_tokens, rate = eng.counts.completion_tokens, 0.0
    while True:
        await asyncio.sleep(1.0)
        now = time.monotonic()
        rate = 0.7 * rate + 0.3 * (eng.counts.completion_tokens - last_tokens) / max(1e-9, now - last_t)
        last_tokens, last_t = eng.counts.completion_tokens, now
        eng.progress.set(**progress_fields(eng, rate))
        eng.wake.set()       # the limit may have grown back, or a reservation been freed
        try:
            point(eng)
            if now - last_save >= 2:
                for d in eng.datasets:
                    d.store.sync()
                save_manifest(eng)
                last_save = now
        except OSError as e:    # a full disk: the session stops (engine.write_failed)
            eng.write_failed(e)


def point(eng) -> None:
    """A line of `timeline.jsonl`, every second of every session: money, slots and tokens now
    (the report's spend-vs-balance and in-flight figures)."""
    left = eng.spend.balance_left
    eng.timeline.append({
        "t": round(time.time(), 2), "session": len(eng.manifest.sessions), "in_flight": eng.in_flight,
        "limit": eng.aimd.limit, "spent": round(eng.spend.spent, 6), "reserved": round(eng.spend.reserved, 6),
        "balance": None if left is None else round(left, 6),
        "tokens": {d.name: d.budget.done for d in eng.datasets}})


def progress_fields(eng, rate: float) -> dict:
    f = {}
    for d in eng.datasets:
        b = d.spec.output_token_budget
        f[d.name] = f"{short(d.budget.done)}/{short(b)}" if b else short(d.budget.done)
    f.update(samples=eng.counts.samples, spent=f"${eng.spend.spent:.4f}/{eng.spend.limit:g}",
             tok_s=round(rate), in_flight=f"{eng.in_flight}/{eng.aimd.limit}",
             err=f"{100 * sum(eng.counts.errors_by_kind.values()) / max(1, eng.counts.attempts):.1f}%")
    return f


def dataset_table(eng) -> dict:
    out = {}
    for d in eng.datasets:
        out[d.name] = {**d.store.totals.as_dict(), "budget": d.spec.output_token_budget, "path": d.spec.path,
                       "failed_for_good": len(d.store.permanent)}
    return out


def provider_table(eng) -> dict:
    merged: dict[str, dict] = {}
    for d in eng.datasets:
        for name, t in d.store.providers.items():
            m = merged.setdefault(name, {"samples": 0, "completion_tokens": 0, "prompt_tokens": 0, "cost": 0.0})
            m["samples"] += t.samples
            m["completion_tokens"] += t.completion_tokens
            m["prompt_tokens"] += t.prompt_tokens
            m["cost"] = round(m["cost"] + t.cost, 8)
    return merged


def save_manifest(eng, final: bool = False) -> None:
    problems = {d.name: [str(p) for p in d.reader.problems[:20]] +
                ([f"... {len(d.reader.problems) - 20} more"] if len(d.reader.problems) > 20 else [])
                for d in eng.datasets if d.reader.problems}
    eng.entry.update(
        updated=now(), **eng.counts.entry(), reserved_usd=round(eng.spend.reserved, 8),
        concurrency_limit=eng.aimd.limit, concurrency_cuts=eng.aimd.cuts,
        skipped_too_long={d.name: d.skipped for d in eng.datasets if d.skipped}, malformed_rows=problems)
    if final:
        eng.entry.update(ended=now(), status=eng.reason, message=eng.message, reserved_usd=0.0)
    eng.manifest.write(eng.config, dataset_table(eng), provider_table(eng), eng.spend.spent)


def result(eng) -> GenerationResult:
    done = eng.reason in ("finished", "nothing_to_do")
    parts = []
    for d in eng.datasets:
        t, b = d.store.totals, d.spec.output_token_budget
        ran_out = done and b and d.exhausted and t.completion_tokens < b
        parts.append(f"{d.name}: {t.samples} samples, {t.completion_tokens:,} tokens" + (f" of {b:,}" if b else "")
                     + (" (its prompts ran out below the budget)" if ran_out else "")
                     + (f", {len(d.store.permanent)} failed for good" if d.store.permanent else ""))
    summary = "; ".join(parts)
    stage_01 = ", stage 01 included" if eng.stage_01_usd else ""
    c = eng.counts
    lost = c.failed_attempts_cost + c.abandoned_reserved_usd + c.unsaved_cost
    spent = (f"spent ${c.cost + c.failed_attempts_cost + c.abandoned_reserved_usd + c.unsaved_cost:.4f} this session, "
             f"${eng.spend.spent:.4f} in this run{stage_01} (limit ${eng.spend.limit:.2f})")
    if lost > 0:
        unknown = (f", of which ${c.abandoned_reserved_usd:.4f} is counted at its worst case for "
                   f"{c.unknown_bills} requests whose bill could not be read" if c.unknown_bills else "")
        parts = [f"failed attempts that were billed{unknown}"] if lost > c.unsaved_cost else []
        if c.unsaved_answers:
            parts.append(f"${c.unsaved_cost:.4f} for {c.unsaved_answers} answers that came back and could not be written")
        paid = f"Paid for and not saved this session: ${lost:.4f} ({'; '.join(parts)})"
    else:
        paid = "Nothing paid for was lost"
    if done:
        head = eng.message + ": " if eng.reason == "nothing_to_do" else "finished: "
        msg = f"{head}{summary}; {spent}. {paid}."
        if c.exhausted_samples:
            msg += (f" {c.exhausted_samples} samples were GIVEN UP after {eng.opts.max_attempts} failed "
                    f"attempts each ({outputs.ERRORS}); a re-run tries them again.")
    else:
        msg = (f"stopped: {eng.message}. Done so far: {summary}; {spent}. {paid}; every saved response is "
               f"kept: {TODO.get(eng.reason, 're-run')} and it resumes where it stopped.")
        if c.exhausted_samples:
            msg += f" {c.exhausted_samples} samples were given up this session (a re-run tries them again)."
    return GenerationResult("finished" if done else "stopped", eng.reason, msg, eng.folder,
                            eng.spend.spent, dict(eng.entry), dataset_table(eng))


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def short(n: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"
