"""Our decoder over every method, prompt and temperature it is given, resumable: what the rounds
file (`outputs.RoundsFile`) already holds for the same settings is not measured again. Which prompts
and temperatures those are is `decoder_scope`'s to say: all of them where our decoder is the only
measurement, the held-out prompts greedily where it is the cross-check beside vLLM.

A benchmark prompt with follow-up turns (MT-bench) is one row: each follow-up is asked after the
answer this decode gave to the turn before (`benchmarks.Turns`), and the rounds of all its turns
are counted together, as the field counts both turns.
"""

from __future__ import annotations

import json
import time

import torch

from ..progress import Progress
from .decode import Decoded, decode
from .methods import Method
from .metrics import repeat_start, summarize, verdict
from .prompts import HeldoutPrompt, prompt_seed
from .outputs import RoundsFile
from .target_cache import Target

ROUNDS_FORMAT = 3   # of a line of the rounds file; lines of another format are measured again


def prompt_settings(p: HeldoutPrompt, *, draft_tokens: int, eval_max_new_tokens: int, temperature: float, seed: int,
                    target_fingerprint: str) -> str:
    """What a row of this prompt is measured with (a benchmark's own max_new_tokens and turns
    included). Its field names (k, max_new_tokens) are those of the rows earlier runs wrote: renaming
    them would measure every earlier run again."""
    s = {"k": draft_tokens, "max_new_tokens": p.new_tokens(eval_max_new_tokens), "temperature": temperature,
         "seed": seed, "target": target_fingerprint, "format": ROUNDS_FORMAT}
    if p.followups:
        s["turns"] = 1 + len(p.followups)
    return json.dumps(s, sort_keys=True)


def decode_turns(target: Target, proposer, p: HeldoutPrompt, draft_tokens: int, eval_max_new_tokens: int,
                 temperature: float, gen, turns) -> tuple[Decoded, list[dict]]:
    """Every turn of the prompt (each up to the prompt's own max_new_tokens, else
    `eval_max_new_tokens`), each follow-up after this decode's own answer; one `Decoded` of all
    turns (outputs concatenated, rounds' starts shifted) and each turn's prompt/output length."""
    max_new_tokens = p.new_tokens(eval_max_new_tokens)
    d = decode(target, proposer, list(p.ids), draft_tokens, max_new_tokens, temperature, gen)
    parts, lengths, messages = [d], [{"prompt_tokens": len(p.ids), "output_tokens": len(d.output)}], list(p.messages)
    for q in p.followups:
        messages, ids = turns.follow(messages, parts[-1].output, q)
        parts.append(decode(target, proposer, ids, draft_tokens, max_new_tokens, temperature, gen))
        lengths.append({"prompt_tokens": len(ids), "output_tokens": len(parts[-1].output)})
    if len(parts) == 1:
        return d, lengths
    out = Decoded([])
    for part in parts:
        out.start += [s + len(out.output) for s in part.start]
        out.drafted += part.drafted
        out.accepted += part.accepted
        out.produced += part.produced
        out.top_prob += part.top_prob
        out.output += part.output
    return out, lengths


def run_methods(target: Target, methods: list[Method], prompts: list[HeldoutPrompt], *, draft_tokens: int,
                eval_max_new_tokens: int, temperature: float, seed: int, rounds_file: RoundsFile,
                target_fingerprint: str, turns=None) -> list[dict]:
    """Decode every prompt with every method (skipping what `rounds_file` already holds for these
    settings); returns one row per (method, prompt). `turns` (`benchmarks.Turns`) renders the
    follow-up turns of prompts that have them."""
    settings_of = {(m.name, p.dataset, p.sample_id): prompt_settings(
        p, draft_tokens=m.info.get("draft_tokens", draft_tokens), eval_max_new_tokens=eval_max_new_tokens,
        temperature=temperature, seed=seed, target_fingerprint=target_fingerprint) for m in methods for p in prompts}
    rows = []
    todo = [(m, p) for m in methods for p in prompts
            if rounds_file.get(settings_of[m.name, p.dataset, p.sample_id], m, p) is None]
    with Progress(len(methods) * len(prompts), f"speculative decoding (T={temperature:g}, k={draft_tokens})",
                  "decodes") as bar:
        bar.update(len(methods) * len(prompts) - len(todo))
        for m in methods:
            proposer = None
            tokens = n_rounds = 0
            for p in prompts:
                settings = settings_of[m.name, p.dataset, p.sample_id]
                row = rounds_file.get(settings, m, p)
                if row is None:
                    if proposer is None:
                        proposer = m.make()
                    gen = None if temperature <= 0 else \
                        torch.Generator().manual_seed(prompt_seed(seed, p.dataset, p.sample_id, 6))
                    t0 = time.perf_counter()
                    d, lengths = decode_turns(target, proposer, p, m.info.get("draft_tokens", draft_tokens),
                                              eval_max_new_tokens, temperature, gen, turns)
                    row = {"settings": settings, "method": m.name, "method_fingerprint": m.fingerprint,
                           "kind": m.kind, "dataset": p.dataset, "sample_id": p.sample_id,
                           "temperature": temperature, "prompt_tokens": len(p.ids), "output": d.output,
                           "repeat_start": repeat_start(list(p.ids), d.output), "rounds": d.rounds(),
                           "seconds": time.perf_counter() - t0}
                    if p.followups:
                        row["turns"] = lengths
                    rounds_file.add(row)
                    bar.update(1)
                tokens += sum(row["rounds"]["produced"])
                n_rounds += len(row["rounds"]["produced"])
                bar.set(method=m.name, acceptance=tokens / max(n_rounds, 1))
                rows.append(row)
    return rows


def decoder_scope(eval_temperatures: list[float], *, eval_hf_crosscheck_all: bool,
                  engine_rows: list[dict] | None) -> dict:
    """What our decoder measures: {temperatures, benchmarks (bool), why}. Beside an engine that
    measured the drafter (`engine_rows`, vLLM's) it is the cross-check, and the cross-check needs
    the held-out prompts greedily only: there the two must give the same output and the same
    accepted count at every step (at T > 0 they draw different random numbers, so they agree in
    expectation only, and the benchmarks are the engine's to measure). The greedy temperatures
    of `eval_temperatures` (none: its first). Everything, every prompt set at every temperature,
    where it is the only one measuring the drafter (no engine: `eval_backend` hf; or the engine
    could not start it: a `gpu_only` eagle3 row) or where `eval_hf_crosscheck_all` asks for it."""
    temperatures = [float(t) for t in eval_temperatures]
    everything = "every prompt set at every temperature"
    if engine_rows is None:
        return {"temperatures": temperatures, "benchmarks": True, "why": f"{everything}, the only measurement "
                                                                          f"(eval_backend hf)"}
    if any(r.get("gpu_only") and r["kind"] == "eagle3" for r in engine_rows):
        return {"temperatures": temperatures, "benchmarks": True,
                "why": f"{everything}: vLLM could not serve the drafter here (gpu_only)"}
    if eval_hf_crosscheck_all:
        return {"temperatures": temperatures, "benchmarks": True, "why": f"{everything}, beside vLLM "
                                                                          f"(eval_hf_crosscheck_all)"}
    greedy = [t for t in temperatures if t <= 0] or temperatures[:1]
    return {"temperatures": greedy, "benchmarks": False,
            "why": f"the held-out prompts at T = {', '.join(f'{t:g}' for t in greedy)} only, the cross-check beside "
                   f"vLLM (`eval_hf_crosscheck_all: true` measures every prompt set at every temperature)"}


def decoder_report(model, methods: list[Method], prompts: list[HeldoutPrompt], layer_ids: list[int], *,
                   draft_tokens: int, eval_max_new_tokens: int, eval_temperatures: list[float], seed: int,
                   draft_cost_ratio: float, rounds_file: RoundsFile, target_fingerprint: str,
                   turns=None) -> tuple[dict, list[dict]]:
    """The report's `temperatures` (per temperature: every method's summary and the verdict) and
    the rows they were summed from."""
    by_t, rows = {}, []
    target = Target(model, layer_ids)
    try:
        for t in eval_temperatures:
            mine = run_methods(target, methods, prompts, draft_tokens=draft_tokens,
                               eval_max_new_tokens=eval_max_new_tokens, temperature=float(t), seed=seed,
                               rounds_file=rounds_file, target_fingerprint=target_fingerprint, turns=turns)
            rows += mine
            summary = summarize(mine, methods, draft_tokens, draft_cost_ratio)
            by_t[f"{float(t):g}"] = {"temperature": float(t), "methods": summary, "verdict": verdict(summary)}
    finally:
        target.close()
    return by_t, rows
