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


async def tick(session) -> None:
    last_save = last_t = time.monotonic()
    last_tokens, rate = session.counts.completion_tokens, 0.0
    while True:
        await asyncio.sleep(1.0)
        now = time.monotonic()
        rate = 0.7 * rate + 0.3 * (session.counts.completion_tokens - last_tokens) / max(1e-9, now - last_t)
        last_tokens, last_t = session.counts.completion_tokens, now
        session.progress.set(**progress_fields(session, rate))
        session.wake.set()       # the limit may have grown back, or a reservation been freed
        try:
            point(session)
            if now - last_save >= 2:
                for d in session.datasets:
                    d.store.sync()
                save_manifest(session)
                last_save = now
        except OSError as e:    # a full disk: the session stops (session.write_failed)
            session.write_failed(e)


def point(session) -> None:
    """A line of `timeline.jsonl`, every second of every session: money, slots and tokens now
    (the report's spend-vs-balance and in-flight figures)."""
    left = session.spend.balance_left
    session.timeline.append({
        "t": round(time.time(), 2), "session": len(session.manifest.sessions), "in_flight": session.in_flight,
        "limit": session.aimd.limit, "spent": round(session.spend.spent, 6), "reserved": round(session.spend.reserved, 6),
        "balance": None if left is None else round(left, 6),
        "tokens": {d.name: d.budget.done for d in session.datasets}})


def progress_fields(session, rate: float) -> dict:
    """The progress line's fields; `padding`: the requests whose reply has been keep-alive alone
    (whitespace, SSE comments) for longer than request_timeout_s, each given up at its deadline."""
    f = {}
    for d in session.datasets:
        b = d.spec.output_token_budget
        f[d.name] = f"{short(d.budget.done)}/{short(b)}" if b else short(d.budget.done)
    f.update(samples=session.counts.samples, spent=f"${session.spend.spent:.4f}/{session.spend.limit:g}",
             tok_s=round(rate), in_flight=f"{session.in_flight}/{session.aimd.limit}",
             err=f"{100 * sum(session.counts.errors_by_kind.values()) / max(1, session.counts.attempts):.1f}%",
             padding=session.watch.waiting(session.opts.request_timeout_s))
    return f


def dataset_table(session) -> dict:
    out = {}
    for d in session.datasets:
        out[d.name] = {**d.store.totals.as_dict(), "budget": d.spec.output_token_budget, "path": d.spec.path,
                       "failed_for_good": len(d.store.permanent)}
    return out


def provider_table(session) -> dict:
    merged: dict[str, dict] = {}
    for d in session.datasets:
        for name, t in d.store.providers.items():
            m = merged.setdefault(name, {"samples": 0, "completion_tokens": 0, "prompt_tokens": 0, "cost": 0.0})
            m["samples"] += t.samples
            m["completion_tokens"] += t.completion_tokens
            m["prompt_tokens"] += t.prompt_tokens
            m["cost"] = round(m["cost"] + t.cost, 8)
    return merged


def save_manifest(session, final: bool = False) -> None:
    problems = {d.name: [str(p) for p in d.reader.problems[:20]] +
                ([f"... {len(d.reader.problems) - 20} more"] if len(d.reader.problems) > 20 else [])
                for d in session.datasets if d.reader.problems}
    session.entry.update(
        updated=now(), **session.counts.entry(), reserved_usd=round(session.spend.reserved, 8),
        concurrency_limit=session.aimd.limit, concurrency_cuts=session.aimd.cuts,
        skipped_too_long={d.name: d.skipped for d in session.datasets if d.skipped}, malformed_rows=problems)
    if final:
        session.entry.update(ended=now(), status=session.reason, message=session.message, reserved_usd=0.0)
    session.manifest.write(session.config, dataset_table(session), provider_table(session), session.spend.spent)


def result(session) -> GenerationResult:
    done = session.reason in ("finished", "nothing_to_do")
    parts = []
    for d in session.datasets:
        t, b = d.store.totals, d.spec.output_token_budget
        ran_out = done and b and d.exhausted and t.completion_tokens < b
        parts.append(f"{d.name}: {t.samples} samples, {t.completion_tokens:,} tokens" + (f" of {b:,}" if b else "")
                     + (" (its prompts ran out below the budget)" if ran_out else "")
                     + (f", {len(d.store.permanent)} failed for good" if d.store.permanent else ""))
    summary = "; ".join(parts)
    stage_01 = ", stage 01 included" if session.stage_01_usd else ""
    c = session.counts
    lost = c.failed_attempts_cost + c.abandoned_reserved_usd + c.unsaved_cost
    spent = (f"spent ${c.cost + lost:.4f} this session, "
             f"${session.spend.spent:.4f} in this run{stage_01} (limit ${session.spend.limit:.2f})")
    if lost > 0:
        unknown = (f", of which ${c.abandoned_reserved_usd:.4f} is counted at its worst case for "
                   f"{c.unknown_bills} requests whose bill could not be read" if c.unknown_bills else "")
        parts = [f"failed attempts that were billed{unknown}"] if lost > c.unsaved_cost else []
        if c.unsaved_answers:
            parts.append(f"${c.unsaved_cost:.4f} for {c.unsaved_answers} answers that came back and could not be written")
        paid = f"Paid for and not saved this session: ${lost:.4f} ({'; '.join(parts)})"
    else:
        paid = "Nothing paid for was lost"
    cached = c.errors_by_kind.get("cached", 0)
    if cached:
        paid += (f". {cached} replies came from OpenRouter's response cache (copies of earlier answers, usage "
                 f"zeroed) although every request sends X-OpenRouter-Cache: false: none was saved; turn caching "
                 f"off in the key's preset")
    if done:
        head = session.message + ": " if session.reason == "nothing_to_do" else "finished: "
        msg = f"{head}{summary}; {spent}. {paid}."
        if c.exhausted_samples:
            msg += (f" {c.exhausted_samples} samples were GIVEN UP after {session.opts.max_attempts} failed "
                    f"attempts each ({outputs.ERRORS}); a re-run tries them again.")
    else:
        msg = (f"stopped: {session.message}. Done so far: {summary}; {spent}. {paid}; every saved response is "
               f"kept: {TODO.get(session.reason, 're-run')} and it resumes where it stopped.")
        if c.exhausted_samples:
            msg += f" {c.exhausted_samples} samples were given up this session (a re-run tries them again)."
    return GenerationResult("finished" if done else "stopped", session.reason, msg, session.folder,
                            session.spend.spent, dict(session.entry), dataset_table(session))


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def short(n: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"
