"""Our decoder over every method, prompt and temperature, resumable: what the rounds file
(`results`) already holds for the same settings is not measured again.
"""

from __future__ import annotations

import json
import time

import torch

from ..progress import Progress
from .decode import decode
from .methods import Method
from .metrics import repeat_start, summarize, verdict
from .prompts import HeldoutPrompt, prompt_seed
from .results import Results
from .target_cache import Target

ROUNDS_FORMAT = 3   # of a line of the rounds file; lines of another format are measured again


def run_methods(target: Target, methods: list[Method], prompts: list[HeldoutPrompt], *, k: int, max_new_tokens: int,
                temperature: float, seed: int, results: Results, target_fingerprint: str) -> list[dict]:
    """Decode every prompt with every method (skipping what `results` already holds for these
    settings); returns one row per (method, prompt)."""
    settings = json.dumps({"k": k, "max_new_tokens": max_new_tokens, "temperature": temperature,
                           "seed": seed, "target": target_fingerprint, "format": ROUNDS_FORMAT}, sort_keys=True)
    rows = []
    todo = [(m, p) for m in methods for p in prompts if results.get(settings, m, p) is None]
    with Progress(len(methods) * len(prompts), f"speculative decoding (T={temperature:g}, k={k})",
                  "decodes") as bar:
        bar.update(len(methods) * len(prompts) - len(todo))
        for m in methods:
            proposer = None
            tokens = n_rounds = 0
            for p in prompts:
                row = results.get(settings, m, p)
                if row is None:
                    if proposer is None:
                        proposer = m.make()
                    gen = None if temperature <= 0 else \
                        torch.Generator().manual_seed(prompt_seed(seed, p.dataset, p.sample_id, 6))
                    t0 = time.perf_counter()
                    d = decode(target, proposer, list(p.ids), k, max_new_tokens, temperature, gen)
                    row = {"settings": settings, "method": m.name, "method_fingerprint": m.fingerprint,
                           "kind": m.kind, "dataset": p.dataset, "sample_id": p.sample_id,
                           "temperature": temperature, "prompt_tokens": len(p.ids), "output": d.output,
                           "repeat_start": repeat_start(list(p.ids), d.output), "rounds": d.rounds(),
                           "seconds": time.perf_counter() - t0}
                    results.add(row)
                    bar.update(1)
                tokens += sum(row["rounds"]["produced"])
                n_rounds += len(row["rounds"]["produced"])
                bar.set(method=m.name, acceptance=tokens / max(n_rounds, 1))
                rows.append(row)
    return rows


def decoder_report(model, methods: list[Method], prompts: list[HeldoutPrompt], layer_ids: list[int], *, k: int,
                   max_new_tokens: int, temperatures: list[float], seed: int, draft_cost_ratio: float,
                   results: Results, target_fingerprint: str) -> tuple[dict, list[dict]]:
    """The report's `temperatures` (per temperature: every method's summary and the verdict) and
    the rows they were summed from."""
    by_t, rows = {}, []
    target = Target(model, layer_ids)
    try:
        for t in temperatures:
            mine = run_methods(target, methods, prompts, k=k, max_new_tokens=max_new_tokens, temperature=float(t),
                               seed=seed, results=results, target_fingerprint=target_fingerprint)
            rows += mine
            summary = summarize(mine, methods, k, draft_cost_ratio)
            by_t[f"{float(t):g}"] = {"temperature": float(t), "methods": summary, "verdict": verdict(summary)}
    finally:
        target.close()
    return by_t, rows
