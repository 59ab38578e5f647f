"""Our decoder: speculative decoding over the target in transformers, the way SGLang and vLLM run
an EAGLE-3 chain (`--speculative-eagle-topk 1`), over every method, prompt and temperature it is given.

`Target` runs one sequence through the target with a KV cache and captures the drafter's features
(the outputs of the auxiliary decoder layers, by forward hooks exactly as stage 04 captured them for
training). `decode`: a proposer drafts k tokens (k = `draft_tokens`), the target runs once over the
last committed token plus the drafts, the longest agreeing prefix is accepted and the target's own
next token is appended (the "bonus"), the caches are cut back to what was accepted.

    greedy (temperature 0): draft i is accepted while it equals the target's argmax; the output is the
        target's own greedy output token for token (tests pin this);
    sampling (temperature T > 0): draft i is accepted with probability p_i(draft) (the drafts are
        the proposer's argmax, a one-hot q, as vLLM treats EAGLE and n-gram drafts); on rejection the
        token is drawn from p_i without the draft, renormalised; lossless in distribution.

`decoder_report` runs every method on every prompt, resumable: what the rounds file
(`outputs.RoundsFile`) already holds for the same settings is not measured again. Which prompts and
temperatures those are is `decoder_scope`'s to say: all of them where our decoder is the only
measurement, the held-out prompts greedily where it is the cross-check beside vLLM. A benchmark
prompt with follow-up turns (MT-bench) is one row: each follow-up is asked after the answer this
decode gave to the turn before (`benchmarks.Turns`), its turns' rounds counted together, as the
field counts both turns.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from ..progress import Progress
from ..targets.hf import LayerOutputs
from .methods import HeldoutPrompt, Method, prompt_seed
from .metrics import repeat_start, summarize, verdict
from .outputs import RoundsFile

ROUNDS_FORMAT = 3   # of a line of the rounds file; lines of another format are measured again


class Target:
    """One sequence through the target with a KV cache. `forward(ids)` runs the new tokens and
    returns their logits [T, V] (float32, on the CPU) and, when `layer_ids` (output convention) are
    given, the drafter's features aux [T, nH]: the outputs of those decoder layers
    (`targets.hf.LayerOutputs`)."""

    def __init__(self, model, layer_ids: list[int] | None = None):
        from transformers import DynamicCache

        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self._new_cache = lambda: DynamicCache(config=model.config)
        self.cache = self._new_cache()
        self.layer_ids = list(layer_ids or [])
        self._layers = LayerOutputs(model, self.layer_ids)
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
            else model.config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    def reset(self) -> None:
        self.cache = self._new_cache()

    def __len__(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, ids: list[int], logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True, logits_to_keep=logits_to_keep)
        self.cache = out.past_key_values
        outputs = self._layers.take()
        aux = torch.cat([o[0] for o in outputs], dim=-1).float() if outputs else None
        return out.logits[0].float().cpu(), aux   # logits on the CPU: sampling uses a CPU generator

    def truncate(self, n: int) -> None:
        """Keep the first n positions of the cache."""
        drop = len(self) - n
        if drop < 0:
            raise ValueError(f"cannot truncate a cache of {len(self)} positions to {n}")
        if drop:
            self.cache.crop(-drop)

    def close(self) -> None:
        self._layers.close()


def choose(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    p = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(p, 1, generator=gen))


def verify(logits: torch.Tensor, drafts: list[int], temperature: float,
           gen: torch.Generator | None = None) -> tuple[int, int]:
    """(accepted drafts, next token) from the target's logits [len(drafts) + 1, V] at the last
    committed token and each draft."""
    if temperature <= 0:
        best = logits.argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == best[a]:
            a += 1
        return a, best[a]
    p = torch.softmax(logits / temperature, dim=-1)
    for i, d in enumerate(drafts):
        if torch.rand((), generator=gen) < p[i, d]:
            continue
        residual = p[i].clone()
        residual[d] = 0
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))


@dataclass
class Decoded:
    output: list[int]                     # generated ids (first one from the prefill)
    start: list[int] = field(default_factory=list)     # per round: output index it starts at
    drafted: list[int] = field(default_factory=list)   # per round: drafts proposed
    accepted: list[int] = field(default_factory=list)  # per round: drafts the target accepted
    produced: list[int] = field(default_factory=list)  # per round: tokens it emitted (<= accepted + 1)
    top_prob: list[float] = field(default_factory=list)  # per round: the target's probability of its
    #   own most likely next token = P(a perfect drafter's first draft is accepted); 1 when greedy

    def rounds(self) -> dict:
        return {"start": self.start, "drafted": self.drafted, "accepted": self.accepted,
                "produced": self.produced, "top_prob": self.top_prob}


def decode(target: Target, proposer, prompt: list[int], draft_tokens: int, max_new_tokens: int,
           temperature: float = 0.0, gen: torch.Generator | None = None) -> Decoded:
    """Speculative decoding of one prompt: up to `max_new_tokens` tokens, stopping after an
    end-of-sequence token. `proposer` None (or `draft_tokens` 0) is plain decoding, one token a round.
    Every round drafts `draft_tokens`, the last one too, as vLLM and SGLang do: a round's accepted
    drafts are counted in full, its emitted tokens stop at `max_new_tokens` (and after an end of
    sequence)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    target.reset()
    logits, aux = target.forward(list(prompt), logits_to_keep=1)
    out = [choose(logits[-1], temperature, gen)]
    res = Decoded(out)
    if proposer is not None:
        proposer.reset(list(prompt))
        proposer.advance(list(prompt[1:]) + out, aux)
    while len(out) < max_new_tokens and out[-1] not in target.eos:
        drafts = proposer.propose(draft_tokens)[:draft_tokens] if proposer is not None and draft_tokens > 0 else []
        committed = len(target)   # every committed token but the last is in the target cache
        logits, aux = target.forward([out[-1]] + drafts)
        a, nxt = verify(logits, drafts, temperature, gen)
        new = (drafts[:a] + [nxt])[:max_new_tokens - len(out)]
        for i, t in enumerate(new):
            if t in target.eos:
                new = new[:i + 1]
                break
        target.truncate(committed + 1 + a)
        res.start.append(len(out))
        res.drafted.append(len(drafts))
        res.accepted.append(a)
        res.produced.append(len(new))
        res.top_prob.append(1.0 if temperature <= 0 else float(torch.softmax(logits[0] / temperature, -1).max()))
        out += new
        if proposer is not None and len(out) < max_new_tokens and out[-1] not in target.eos:
            proposer.advance(new, aux[:a + 1] if aux is not None else None)
    return res


# ---- every method, prompt and temperature, resumable ----


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
