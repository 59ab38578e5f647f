"""Stage 06: acceptance length, measured by actually drafting and verifying against the target.

Speculative decoding, one sequence at a time, the way SGLang and vLLM run an EAGLE-3 chain
(`--speculative-eagle-topk 1`): a proposer drafts k tokens, the target runs once over the last
committed token plus the drafts (with its KV cache), the longest agreeing prefix is accepted and the
target's own next token is appended (the "bonus"), the caches are cut back to what was accepted.

    greedy (temperature 0): draft i is accepted while it equals the target's argmax; the output is the
        target's own greedy output token for token (tests pin this);
    sampling (temperature T > 0): draft i is accepted with probability p_i(draft) (the drafts are
        the proposer's argmax, a one-hot q, as vLLM treats EAGLE and n-gram drafts); on rejection the
        token is drawn from p_i without the draft, renormalised; lossless in distribution.

Proposers: `Eagle3Proposer` (an exported drafter, loaded from its export folder), `PromptLookup`
(n-gram copying from the context, vLLM's `ngram` / HF prompt-lookup decoding) and none (k = 0).

Accounting, from the rounds of each decode (a round = one target verification):
    acceptance length (SGLang's `avg_spec_accept_length`) = tokens emitted by rounds / rounds;
        the first token, which the prefill emits, is not counted, so no drafter gives exactly 1.0;
    vLLM's mean acceptance length = 1 + accepted drafts / rounds that drafted (rounds where the
        proposer had nothing to offer do not count there: differs for prompt lookup);
    per draft position j: P(accepted), and P(accepted | j-1 accepted).

Everything a run measures is appended to `<run>/eval/rounds.jsonl`, one line per (method, prompt),
keyed by the settings, so an interrupted stage resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import layers, store, vllm_eval
from .paths import Run
from .progress import Progress
from .target.hooks import LayerOutputs
from .target.identity import fingerprint

LOOP_NGRAM = 4   # a token whose preceding 4-gram already occurred starts "repeating" text
ROUNDS_FORMAT = 3   # of a rounds.jsonl line; lines of another format are measured again


# ---- held-out prompts -------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    dataset: str
    sample_id: str
    ids: tuple[int, ...]   # the tokens the target saw before its response


def heldout_prompts(hidden_dir: str | os.PathLike, drafter_dir: str | os.PathLike, per_dataset: int) -> list[Prompt]:
    """The first `per_dataset` samples of each dataset that stage 05 held out of training (through
    `drafter.artifacts.read_heldout`), as prompts (the tokens before the response), in the order
    of the hidden-state index."""
    from .drafter.artifacts import read_heldout
    from .shards import HiddenShards

    shards = HiddenShards(hidden_dir)
    wanted = set(read_heldout(drafter_dir))
    held = [i for i, s in enumerate(shards.samples) if (s.dataset, s.sample_id) in wanted]
    if len(held) != len(wanted):
        missing = sorted(wanted - {(shards.samples[i].dataset, shards.samples[i].sample_id) for i in held})
        raise ValueError(f"{drafter_dir}: stage 05 held out {len(missing)} samples that {hidden_dir} does not "
                         f"hold (first: {missing[0]}); were the hidden states extracted again? Run stage 05 again")
    out: list[Prompt] = []
    taken: dict[str, int] = {}
    for i in held:
        ref = shards.samples[i]
        if taken.get(ref.dataset, 0) >= per_dataset:
            continue
        s = shards.sample(i, fields=("input_ids", "loss_mask"))
        where = f"{hidden_dir}: sample {ref.sample_id!r} of {ref.dataset!r}"
        out.append(Prompt(ref.dataset, ref.sample_id,
                          tuple(prompt_ids(s["input_ids"].tolist(), s["loss_mask"].tolist(), where))))
        taken[ref.dataset] = taken.get(ref.dataset, 0) + 1
    return out


def prompt_ids(input_ids: list[int], loss_mask: list[int], where: str) -> list[int]:
    """The prompt part of a training row: the tokens before the first response token."""
    if 1 not in loss_mask:
        raise ValueError(f"{where}: no response token (loss_mask is all 0)")
    n = loss_mask.index(1)
    if n == 0:
        raise ValueError(f"{where}: the response starts at the first token; there is no prompt")
    return list(input_ids[:n])


# ---- the target with a KV cache ----------------------------------------------------------------

class Target:
    """One sequence through the target with a KV cache. `forward(ids)` runs the new tokens and
    returns their logits [T, V] (float32, on the CPU) and, when `layer_ids` (output convention) are given, the
    drafter's features aux [T, 3H]: the outputs of those decoder layers, captured by forward hooks
    exactly as stage 04 captured them for training."""

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
        aux = torch.cat([h[0] for h in outputs], dim=-1).float() if outputs else None
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


# ---- proposers: reset(prompt), advance(new tokens, their aux), propose(k) -----------------------

class PromptLookup:
    """N-gram drafting from the context (prompt + output so far): find the most recent earlier
    occurrence of the longest suffix n-gram (n = max_ngram .. min_ngram) and propose the k tokens
    that followed it, copying on past the end of the context when the match is recent (a loop of
    period p is continued, as an overlapping copy). No match: no drafts this round.
    vLLM's `ngram` (0.32) differs in two details that matter on looping text: it copies
    after the earliest occurrence and never past the end of the context, so it drafts fewer tokens
    near the end of a loop and accepts less there than this one."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.ctx: list[int] = []

    def reset(self, prompt: list[int]) -> None:
        self.ctx = list(prompt)

    def advance(self, tokens: list[int], aux=None) -> None:
        self.ctx += tokens

    def propose(self, k: int) -> list[int]:
        ctx, n_ctx = self.ctx, len(self.ctx)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = ctx[n_ctx - n:]
            for i in range(n_ctx - n - 1, -1, -1):
                if ctx[i:i + n] == tail:
                    out: list[int] = []
                    for j in range(k):
                        src = i + n + j
                        out.append(ctx[src] if src < n_ctx else out[src - n_ctx])
                    return out
        return []


class Eagle3Proposer:
    """Chain drafting with an EAGLE-3 drafter and its KV cache. Drafter position p reads the
    target's features at p and the token at p+1; `advance` adds the committed positions (cutting
    off the chain drafted last round), `propose(k)` drafts k tokens from the last one."""

    def __init__(self, drafter):
        self.d = drafter
        self.device = drafter.fc.weight.device
        self.cache = drafter.new_cache()
        self.committed = 0

    def reset(self, prompt: list[int]) -> None:
        self.cache = self.d.new_cache()
        self.committed = 0

    @torch.inference_mode()
    def advance(self, tokens: list[int], aux: torch.Tensor) -> None:
        if aux is None or len(aux) != len(tokens):
            raise ValueError(f"an EAGLE-3 drafter needs one target feature row per new token "
                             f"({len(tokens)} tokens, {None if aux is None else len(aux)} rows)")
        self.cache.truncate(self.committed)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        h, logits = self.d.extend(self.d.project(aux[None].to(self.device)), ids, self.cache)
        self.committed += len(tokens)
        self.h, self.logits = h[:, -1:], logits[0, -1]

    @torch.inference_mode()
    def propose(self, k: int) -> list[int]:
        out: list[int] = []
        h, logits = self.h, self.logits
        for j in range(k):
            tok = self.d.to_target(logits.argmax(-1))
            out.append(int(tok))
            if j < k - 1:
                h, lg = self.d.extend(h, tok.view(1, 1), self.cache)
                logits = lg[0, -1]
        return out


# ---- one decode ---------------------------------------------------------------------------------

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


def decode(target: Target, proposer, prompt: list[int], k: int, max_new_tokens: int,
           temperature: float = 0.0, gen: torch.Generator | None = None) -> Decoded:
    """Speculative decoding of one prompt: up to `max_new_tokens` tokens, stopping after an
    end-of-sequence token. `proposer` None (or k = 0) is plain decoding, one token a round.
    Every round drafts k, the last one too, as vLLM and SGLang do: a round's accepted drafts are
    counted in full, its emitted tokens stop at `max_new_tokens` (and after an end of sequence)."""
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
        drafts = proposer.propose(k)[:k] if proposer is not None and k > 0 else []
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


# ---- accounting -------------------------------------------------------------------------------

def repeat_start(context: list[int], output: list[int], n: int = LOOP_NGRAM) -> int:
    """Index of the first output token whose n-gram (ending at it) already occurred earlier in
    prompt + output; len(output) when none does. From there on the text repeats itself."""
    seq = list(context) + list(output)
    seen: set[tuple[int, ...]] = set()
    for j in range(n, len(seq) + 1):   # n-gram seq[j-n:j] ends at index j-1
        g = tuple(seq[j - n:j])
        if j - 1 >= len(context) and g in seen:
            return j - 1 - len(context)
        seen.add(g)
    return len(output)


def acceptance(rounds: list[dict], k: int) -> dict:
    """Acceptance of a set of decodes (their `Decoded.rounds()`): SGLang's and vLLM's acceptance
    length, and per draft position j = 1..k the unconditional and conditional acceptance rate."""
    n_rounds = produced = drafting = acc = drafted_tokens = 0
    top = 0.0
    pos_drafted = [0] * k
    pos_reached = [0] * k
    pos_accepted = [0] * k
    for r in rounds:
        top += sum(r["top_prob"])
        for d, a, p in zip(r["drafted"], r["accepted"], r["produced"]):
            n_rounds += 1
            produced += p
            drafted_tokens += d
            acc += a
            drafting += d > 0
            for j in range(min(d, k)):
                pos_drafted[j] += 1
                pos_reached[j] += j <= a   # drafts 1..j-1 were accepted
                pos_accepted[j] += j < a

    def ratio(x, y):
        return x / y if y else float("nan")

    return {
        "rounds": n_rounds, "tokens": produced, "draft_tokens": drafted_tokens, "accepted_tokens": acc,
        "drafting_rounds": drafting,
        "acceptance_length": ratio(produced, n_rounds),
        "acceptance_length_vllm": 1 + ratio(acc, drafting) if drafting else 1.0,
        "draft_acceptance_rate": ratio(acc, drafted_tokens),
        "position_acceptance": [ratio(pos_accepted[j], pos_drafted[j]) for j in range(k)],
        "position_acceptance_conditional": [ratio(pos_accepted[j], pos_reached[j]) for j in range(k)],
        "position1_ceiling": ratio(top, n_rounds),
    }


def split_rounds(rounds: dict, cut: int) -> tuple[dict, dict]:
    """The rounds starting before output index `cut`, and the others."""
    keys = ("drafted", "accepted", "produced", "start", "top_prob")
    before = {key: [v for v, s in zip(rounds[key], rounds["start"]) if s < cut] for key in keys}
    after = {key: [v for v, s in zip(rounds[key], rounds["start"]) if s >= cut] for key in keys}
    return before, after


def speedup(acceptance_length: float, draft_steps: float, cost_ratio: float) -> float:
    """Decoding speed-up over the target alone when one round costs a target forward (the verify
    of k+1 tokens costs about one decode step while decoding is memory-bound) plus `draft_steps`
    drafter forwards, each `cost_ratio` of a target forward."""
    return acceptance_length / (1 + draft_steps * cost_ratio)


# ---- methods and runs -------------------------------------------------------------------------

@dataclass
class Method:
    name: str            # "none", "prompt lookup", "eagle3 50%", ...
    kind: str            # none | prompt_lookup | eagle3
    fingerprint: str     # changes when the method would draft differently
    make: object         # () -> proposer (or None)
    info: dict = field(default_factory=dict)


def export_layer_ids(export_dir: Path) -> list[int]:
    """The export's auxiliary layer ids in draftsmith's (output) convention."""
    cfg = json.loads((export_dir / "config.json").read_text())
    ds = cfg.get("draftsmith") or {}
    if "aux_layer_ids" not in ds:
        raise KeyError(f"{export_dir}/config.json: no draftsmith.aux_layer_ids; the engine-side ids "
                       f"{cfg.get('eagle_config', {}).get('eagle_aux_hidden_state_layer_ids')} are ambiguous "
                       f"(SGLang and vLLM read them differently), so this export cannot be evaluated here")
    return layers.to_output_ids([int(k) for k in ds["aux_layer_ids"]], ds.get("aux_layer_convention", "output"))


def methods_for(drafter_dir: str | os.PathLike, target_path: str | os.PathLike, device,
                lookup_max_ngram: int = 3, lookup_min_ngram: int = 1) -> tuple[list[Method], list[int]]:
    """The methods of one evaluation: no drafter, prompt lookup, and every export of the drafter
    (loaded from its folder). Returns them and the auxiliary layer ids they share."""
    from .drafter import load_exported
    from .drafter.artifacts import read_exports

    ms = [Method("none", "none", "none", lambda: None),
          Method("prompt lookup", "prompt_lookup", f"lookup-{lookup_min_ngram}-{lookup_max_ngram}",
                 lambda: PromptLookup(lookup_max_ngram, lookup_min_ngram),
                 {"min_ngram": lookup_min_ngram, "max_ngram": lookup_max_ngram})]
    exports = read_exports(drafter_dir)
    layer_ids = export_layer_ids(exports[-1]["dir"])
    for e in exports:
        ids = export_layer_ids(e["dir"])
        if ids != layer_ids:
            raise ValueError(f"{e['dir']}: aux layer ids {ids} differ from the final export's {layer_ids}")
        final = e is exports[-1]
        name = "eagle3" if final else f"eagle3 {e['fraction']:.0%}"

        def make(d=e["dir"]):
            return Eagle3Proposer(load_exported(d, target_path, device=device))
        ms.append(Method(name, "eagle3", fingerprint(e["dir"]), make,
                         {"step": e["step"], "fraction": e["fraction"], "dir": str(e["dir"]), "final": final}))
    return ms, layer_ids


def engine_methods_for(methods: list[Method], layer_ids: list[int], k: int, lookup_min_ngram: int,
                       lookup_max_ngram: int) -> list[dict]:
    """The same methods as vLLM engines: no speculation, vLLM's ngram, and every export written
    for vLLM (`drafter.export.for_engine`), each expected to capture `layer_ids` (output ids)."""
    from .drafter.export import for_engine

    out = [{"name": "none", "kind": "none", "fingerprint": "vllm-none", "speculative_config": None,
            "expect_layers": None, "info": {}},
           {"name": "ngram", "kind": "ngram", "fingerprint": f"vllm-ngram-{lookup_min_ngram}-{lookup_max_ngram}",
            "speculative_config": vllm_eval.speculative_config("ngram", k, lookup_min=lookup_min_ngram,
                                                               lookup_max=lookup_max_ngram),
            "expect_layers": None, "info": {"min_ngram": lookup_min_ngram, "max_ngram": lookup_max_ngram}}]
    for m in methods:
        if m.kind == "eagle3":
            d = for_engine(m.info["dir"], "vllm")
            out.append({"name": m.name, "kind": "eagle3", "fingerprint": "vllm-" + fingerprint(d),
                        "hf_fingerprint": m.fingerprint, "speculative_config": vllm_eval.speculative_config("eagle3", k, d),
                        "expect_layers": layers.engine_layer_ids(layer_ids, "vllm"),
                        "info": {"step": m.info["step"], "fraction": m.info["fraction"], "dir": str(d),
                                 "final": m.info["final"]}})
    return out


def _prompt_seed(seed: int, p: Prompt) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{p.dataset}/{p.sample_id}".encode()).digest()[:6], "big")


class Results:
    """`rounds.jsonl`: one line per (settings, method, prompt); lines of other settings are kept
    but ignored, a line torn by a kill is dropped."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[tuple, dict] = {}
        if path.is_file():
            lines = path.read_text(encoding="utf-8").splitlines()
            good = []
            for i, line in enumerate(lines, 1):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    if i == len(lines):
                        continue   # torn by an interrupted run: measured again
                    raise ValueError(f"{path}:{i}: not valid JSON; delete the file to measure again") from None
                self.rows[self._key(row)] = row
                good.append(line)
            if len(good) != len(lines):
                path.write_text("".join(g + "\n" for g in good), encoding="utf-8")

    @staticmethod
    def _key(row: dict) -> tuple:
        return row["settings"], row["method_fingerprint"], row["dataset"], row["sample_id"]

    def get(self, settings: str, m: Method, p: Prompt) -> dict | None:
        return self.rows.get((settings, m.fingerprint, p.dataset, p.sample_id))

    def add(self, row: dict) -> None:
        self.rows[self._key(row)] = row
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def run_methods(target: Target, methods: list[Method], prompts: list[Prompt], *, k: int, max_new_tokens: int,
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
                    gen = torch.Generator().manual_seed(_prompt_seed(seed, p)) if temperature > 0 else None
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


# ---- summaries: what report.json and the notebook show -------------------------------------------

def summarize(rows: list[dict], methods: list[Method], k: int, cost_ratio: float) -> dict:
    """Per method: acceptance overall, per dataset, per position, on text before/after the output
    starts repeating itself, the speed-up estimate; and whether its greedy outputs equal the
    target's (the `none` method's) token for token."""
    by_method: dict[str, list[dict]] = {}
    for r in rows:
        by_method.setdefault(r["method"], []).append(r)
    reference = {(r["dataset"], r["sample_id"]): r["output"] for r in by_method.get("none", [])}
    out = {}
    for m in methods:
        mine = by_method.get(m.name, [])
        if not mine:
            continue
        total = acceptance([r["rounds"] for r in mine], k)
        datasets = sorted({r["dataset"] for r in mine})
        per_ds = {ds: acceptance([r["rounds"] for r in mine if r["dataset"] == ds], k) for ds in datasets}
        novel = acceptance([split_rounds(r["rounds"], r["repeat_start"])[0] for r in mine], k)
        repeating = acceptance([split_rounds(r["rounds"], r["repeat_start"])[1] for r in mine], k)
        greedy = [r for r in mine if r["temperature"] <= 0 and (r["dataset"], r["sample_id"]) in reference]
        mismatches = [r["sample_id"] for r in greedy if r["output"] != reference[(r["dataset"], r["sample_id"])]]
        draft_steps = 0 if m.kind != "eagle3" else k   # drafter forwards per round (chain of k)
        out[m.name] = {
            "kind": m.kind, **m.info, **total,
            "per_dataset": per_ds,
            "novel_text": novel, "repeating_text": repeating,
            "speedup_estimate": speedup(total["acceptance_length"], draft_steps, cost_ratio),
            "draft_forwards_per_round": draft_steps,
            "lossless": None if not greedy else not mismatches, "mismatched_samples": mismatches,
            "seconds": sum(r["seconds"] for r in mine), "prompts": len(mine),
        }
    return out


def evaluate_run(run: Run, target_model_path: str, drafter_dir: str = "", *, prompts_per_dataset: int,
                 max_new_tokens: int, k: int, temperatures: list[float], lookup_max_ngram: int = 3,
                 lookup_min_ngram: int = 1, draft_cost_ratio: float = 0.05, seed: int = 0,
                 device: str = "auto", backend: str = "hf", hf_crosscheck: bool = True, engine_dtype: str = "float32",
                 tensor_parallel: int = 1, trust_remote_code: bool = False, log=print) -> dict:
    """Stage 06 end to end: the prompts stage 05 held out of training, every method at every
    temperature, `<run>/eval/report.json` (returned).
    `backend` vllm: measured inside vLLM serving every export (`vllm_eval`), then, with
    `hf_crosscheck`, by our decoder over transformers beside it (a target that fits one device);
    hf: our decoder only."""
    from .target.checkpoint import load_target, resolve_target
    from .target.identity import target_identity

    if k < 1:
        raise ValueError(f"draft_tokens must be at least 1, got {k}")
    if backend not in ("hf", "vllm"):
        raise ValueError(f"eval_backend must be 'hf' or 'vllm', got {backend!r}")
    if backend == "hf" and not hf_crosscheck:
        raise ValueError("eval_hf_crosscheck is false and eval_backend is hf: nothing would measure; "
                         "set eval_backend: vllm (or eval_hf_crosscheck: true)")
    ours = backend == "hf" or hf_crosscheck
    drafter_dir = Path(drafter_dir) if drafter_dir else run.dir("drafter")
    eval_dir = run.dir("eval")
    target_path = resolve_target(target_model_path, log=log)
    prompts = heldout_prompts(run.dir("hidden"), drafter_dir, prompts_per_dataset)
    if not prompts:
        raise ValueError(f"{drafter_dir}: stage 05 held out no samples (train_holdout_fraction 0?); "
                         f"acceptance must be measured on prompts the drafter did not train on")
    model = load_target(target_path, device) if ours else None
    methods, layer_ids = methods_for(drafter_dir, target_path,
                                     model.get_input_embeddings().weight.device if ours else "cpu",
                                     lookup_max_ngram, lookup_min_ngram)
    fingerprint = target_identity(target_path, trust_remote_code)["fingerprint"]
    per_ds: dict[str, int] = {}
    for p in prompts:
        per_ds[p.dataset] = per_ds.get(p.dataset, 0) + 1
    log(f"{len(prompts)} held-out prompts ({', '.join(f'{d}: {n}' for d, n in per_ds.items())}), "
        f"{len(methods)} methods, k = {k}, up to {max_new_tokens} new tokens, T = {temperatures}")
    engine_methods = engine_rows = None
    if backend == "vllm":
        engine_methods = engine_methods_for(methods, layer_ids, k, lookup_min_ngram, lookup_max_ngram)
        engine_rows = vllm_eval.measure(
            target_path, engine_methods, prompts, k=k, max_new_tokens=max_new_tokens, temperatures=temperatures,
            seed=seed, out=eval_dir / "engine_rounds.jsonl", dtype=engine_dtype, tensor_parallel_size=tensor_parallel,
            trust_remote_code=trust_remote_code,
            settings=vllm_eval.settings_key(fingerprint, k, max_new_tokens, seed, engine_dtype), log=log)
    by_t, hf_rows = {}, []
    if ours:
        results = Results(eval_dir / "rounds.jsonl")
        target = Target(model, layer_ids)
        try:
            for t in temperatures:
                rows = run_methods(target, methods, prompts, k=k, max_new_tokens=max_new_tokens,
                                   temperature=float(t), seed=seed, results=results, target_fingerprint=fingerprint)
                hf_rows += rows
                summary = summarize(rows, methods, k, draft_cost_ratio)
                by_t[f"{float(t):g}"] = {"temperature": float(t), "methods": summary, "verdict": verdict(summary)}
        finally:
            target.close()
    engine = None
    if backend == "vllm":
        engine = {"backend": "vllm", "version": vllm_eval.VLLM_VERSION, "dtype": engine_dtype,
                  "tensor_parallel": tensor_parallel, "concurrency": 1,
                  "cpu_expand_kernel_replaced": any(r.get("cpu_expand_kernel_replaced") for r in engine_rows),
                  "temperatures": {
                      f"{float(t):g}": {"temperature": float(t),
                                        "methods": vllm_eval.summarize(engine_rows, engine_methods, k, float(t)),
                                        "vs_ours": vllm_eval.compare(engine_rows, hf_rows, engine_methods, float(t))
                                        if ours else None}
                      for t in temperatures}}
    final = next(m for m in methods if m.kind == "eagle3" and m.info["final"])
    bench_file = eval_dir / "bench_prompts_sharegpt.json"
    n_bench = write_bench_prompts(run, prompts, bench_file)
    report = {
        "engine": engine, "hf_crosscheck": ours,
        "target": str(target_path), "target_fingerprint": fingerprint, "drafter_dir": str(drafter_dir),
        "aux_layer_ids": layer_ids, "k": k, "max_new_tokens": max_new_tokens, "seed": seed,
        "prompts": per_ds, "prompt_ids": [[p.dataset, p.sample_id] for p in prompts],
        "draft_cost_ratio": draft_cost_ratio,
        "prompt_lookup": {"min_ngram": lookup_min_ngram, "max_ngram": lookup_max_ngram},
        "definitions": {
            "acceptance_length": "tokens emitted by verification rounds / rounds (SGLang avg_spec_accept_length; "
                                 "the prefill's first token not counted)",
            "acceptance_length_vllm": "1 + accepted draft tokens / rounds that drafted (vLLM)",
            "position_acceptance": "P(draft j accepted) over rounds that drafted position j",
            "position_acceptance_conditional": "P(draft j accepted | drafts 1..j-1 accepted)",
            "position1_ceiling": "mean over rounds of the target's probability of its own top token: "
                                 "P(draft 1 accepted) for a perfect drafter (1 when greedy)",
            "novel_text": f"rounds starting before the output's first repeated {LOOP_NGRAM}-gram",
            "repeating_text": f"rounds starting at or after it",
            "speedup_estimate": "acceptance_length / (1 + draft_forwards_per_round * draft_cost_ratio)",
        },
        "temperatures": by_t,
        "serving": {**serving_commands(final.info["dir"], str(target_path), k, str(bench_file), tp=tensor_parallel,
                                       trust_remote_code=trust_remote_code),
                    "bench_prompts": str(bench_file), "bench_prompts_found": n_bench},
    }
    tmp = eval_dir / "report.json.tmp"
    tmp.write_text(json.dumps(_json_safe(report), indent=1, allow_nan=False))
    os.replace(tmp, eval_dir / "report.json")
    return report


def _json_safe(x):
    """NaN (a rate with nothing to count) as null: report.json stays strict JSON."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def table(summary: dict, temperature: float):
    """One row per method: acceptance (both conventions), per dataset, novel/repeating text."""
    import pandas as pd

    rows = []
    for name, s in summary.items():
        row = {"T": temperature, "method": name, "acceptance length": s["acceptance_length"],
               "vLLM 1+acc/drafts": s["acceptance_length_vllm"],
               "draft acceptance rate": s["draft_acceptance_rate"]}
        row |= {f"{ds}": v["acceptance_length"] for ds, v in s["per_dataset"].items()}
        row |= {"P(draft 1)": s["position_acceptance"][0],
                "novel text": s["novel_text"]["acceptance_length"],
                "repeating text": s["repeating_text"]["acceptance_length"],
                "speed-up est.": s["speedup_estimate"], "lossless": s["lossless"]}
        rows.append(row)
    return pd.DataFrame(rows)


def engine_table(report: dict):
    """The engine's numbers, one row per (temperature, method), our decoder's acceptance beside them."""
    import pandas as pd

    rows = []
    for key, t in report["engine"]["temperatures"].items():
        ours = report["temperatures"].get(key, {}).get("methods", {})
        for name, s in t["methods"].items():
            mine = ours.get("prompt lookup" if s["kind"] == "ngram" else name, {})
            row = {"T": t["temperature"], "method": name, "acceptance length": s["acceptance_length"]}
            row |= {ds: v["acceptance_length"] for ds, v in s["per_dataset"].items()}
            row |= {f"P(pos {j + 1})": p for j, p in enumerate(s["position_acceptance"])}
            row |= {"tok/s": s["tokens_per_s"], "× none": s["speedup_tokens_per_s"], "lossless": s["lossless"],
                    "ours": mine.get("acceptance_length_vllm")}
            rows.append(row)
    return pd.DataFrame(rows).round(3)


def explain_engine(report: dict) -> str:
    """What the engine's numbers say, and where they and our decoder's part (markdown)."""
    e, lines = report["engine"], []
    for key, t in e["temperatures"].items():
        m, v = t["methods"], t["vs_ours"]
        name, final = next((n, s) for n, s in m.items() if s["kind"] == "eagle3" and s.get("final"))
        mode = "greedy" if t["temperature"] <= 0 else f"T = {t['temperature']:g}"
        ck = sorted((s["fraction"], s["acceptance_length"]) for s in m.values() if s["kind"] == "eagle3")
        line = (f"**vLLM {e['version']}, {mode}, k = {report['k']}:** drafter **{final['acceptance_length']:.2f}**, "
                f"ngram {m['ngram']['acceptance_length']:.2f} tokens per verification "
                f"({'the drafter wins' if final['acceptance_length'] > m['ngram']['acceptance_length'] else 'ngram wins'}); "
                f"through training " + " → ".join(f"{a:.2f} ({f:.0%})" for f, a in ck)
                + f". Output {final['tokens_per_s']:.0f} tok/s with the drafter, {m['none']['tokens_per_s']:.0f} without "
                  f"({final['speedup_tokens_per_s']:.2f}x).")
        ours = report["temperatures"].get(key, {}).get("methods", {}).get(name)
        if ours and t["temperature"] <= 0:
            c = v["methods"][name]
            line += (f" Our decoder: {ours['acceptance_length_vllm']:.2f}. The two targets (vLLM's kernels, "
                     f"transformers) decode {v['same_no_drafter_output']} of {v['prompts']} prompts identically; on "
                     f"{c['same_accepted_per_step']} the accepted count is the same at every verification step (same "
                     f"rule, same float32 weights: only a near-tie argmax that one side breaks the other way can part them).")
        elif ours:
            line += (f" Our decoder: {ours['acceptance_length_vllm']:.2f}; at T > 0 the two draw different random "
                     f"numbers, so they agree in expectation only (same rule: a draft is accepted with the target's "
                     f"probability of it).")
        lines.append(line)
    if e.get("cpu_expand_kernel_replaced"):
        lines.append("vLLM 0.32.0's CPU build loses the batch's float temperatures in its rejection sampler (T > 0: "
                     "every draft rejected); this run replaced that one kernel with a correct torch version. "
                     "GPU builds (Triton) are not affected.")
    return "\n\n".join(lines)


def explain(report: dict) -> str:
    """What the numbers say, in a few sentences per temperature (markdown)."""
    lines = []
    for t in report["temperatures"].values():
        m, v = t["methods"], t["verdict"]
        d, pl = m["eagle3"], m["prompt lookup"]
        mode = "greedy" if t["temperature"] <= 0 else f"sampling at T = {t['temperature']:g}"
        ck = [(s["fraction"], s["acceptance_length"]) for s in m.values() if s["kind"] == "eagle3"]
        line = (f"**{mode}, k = {report['k']}:** drafter **{v['drafter']:.2f}**, prompt lookup "
                f"{v['prompt_lookup']:.2f}, no drafter 1.00 tokens per verification. Through training "
                + " → ".join(f"{a:.2f} ({f:.0%})" for f, a in sorted(ck)) + ". ")
        if len(ck) > 1 and not max(a for _, a in ck) > min(ck)[1]:
            line += "Training did not raise it here" + (
                ": compare stage 05's held-out acc_i with its unigram baseline (a drafter that has not left the "
                "unigram proposes the same token everywhere). " if t["temperature"] <= 0 else ". ")
        rep = d["repeating_text"]["rounds"] / d["rounds"] if d["rounds"] else 0.0
        nv, rp = v["novel_text"], v["repeating_text"]
        if v["beats_prompt_lookup"]:
            line += f"The drafter beats prompt lookup by {v['drafter'] / v['prompt_lookup']:.2f}x. "
        else:
            line += (f"Prompt lookup wins here: {rep:.0%} of the drafter's rounds fall in text the target is "
                     f"repeating (after its first repeated {LOOP_NGRAM}-gram), where copying from the context is "
                     f"almost always right (prompt lookup {rp['prompt_lookup']:.2f} there). ")
        if nv["rounds"]:
            line += (f"On novel text ({nv['rounds']} drafter rounds before the first repeat) the drafter reaches "
                     f"{nv['drafter']:.2f} against prompt lookup's {nv['prompt_lookup']:.2f}. ")
        if t["temperature"] > 0:
            line += (f"Its first draft is accepted {d['position_acceptance'][0]:.1%} of the time; a perfect drafter's "
                     f"would be {d['position1_ceiling']:.1%} (the target's mean probability of its own top token), "
                     f"so at this temperature no drafter can do much better on this target.")
        lossless = d["lossless"]
        if lossless is not None:
            line += " Outputs equal the target's greedy decoding: " + ("yes, every method." if all(
                s["lossless"] for s in m.values()) else "NO — see `mismatched_samples` in report.json.")
        lines.append(line.replace("  ", " ").strip())
    return "\n\n".join(lines)


def verdict(summary: dict) -> dict:
    """The final drafter against prompt lookup, overall and on novel / repeating text."""
    d, pl = summary["eagle3"], summary["prompt lookup"]
    out = {"drafter": d["acceptance_length"], "prompt_lookup": pl["acceptance_length"], "no_drafter": 1.0,
           "beats_prompt_lookup": d["acceptance_length"] > pl["acceptance_length"]}
    for part in ("novel_text", "repeating_text"):
        a, b = d[part]["acceptance_length"], pl[part]["acceptance_length"]
        out[part] = {"drafter": a, "prompt_lookup": b, "rounds": d[part]["rounds"],
                     "beats_prompt_lookup": a > b if a == a and b == b else None}
    return out


# ---- figures: one panel per temperature -------------------------------------------------------

def _panels(report: dict, width: float, height: float = 3.6):
    import matplotlib.pyplot as plt

    temps = list(report["temperatures"].values())
    fig, axes = plt.subplots(1, len(temps), figsize=(width * len(temps), height), squeeze=False)
    return fig, list(zip(axes[0], temps))


def _label(t: dict) -> str:
    return "greedy (T = 0)" if t["temperature"] <= 0 else f"sampling (T = {t['temperature']:g})"


def _color(t: dict, name: str) -> str:
    """The same color for a method in every figure."""
    return f"C{list(t['methods']).index(name)}"


def _save(fig, path: Path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def plot_by_dataset(report: dict, path: Path):
    """Grouped bars: acceptance length per dataset and over all prompts, every method."""
    import numpy as np

    fig, panels = _panels(report, 6.0)
    for ax, t in panels:
        summary = t["methods"]
        groups = sorted({ds for s in summary.values() for ds in s["per_dataset"]}) + ["all"]
        x = np.arange(len(groups))
        w = 0.8 / len(summary)
        for i, (name, s) in enumerate(summary.items()):
            vals = [s["per_dataset"].get(g, {}).get("acceptance_length", float("nan")) for g in groups[:-1]]
            bars = ax.bar(x + (i - (len(summary) - 1) / 2) * w, vals + [s["acceptance_length"]], w,
                          color=_color(t, name), label=name)
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xticks(x, groups)
        ax.set_ylabel("tokens per verification")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # headroom so the legend sits above the bars
        ax.set_title(f"acceptance length, {_label(t)}, k = {report['k']}", fontsize=10)
    panels[0][0].legend(fontsize=7, ncols=len(panels[0][1]["methods"]), loc="upper center")
    return _save(fig, path)


def primary(report: dict) -> dict:
    """The report as the figures read it: the engine's numbers when stage 06 measured in vLLM,
    else our decoder's."""
    return {**report, "temperatures": report["engine"]["temperatures"]} if report.get("engine") else report


def plot_training(report: dict, path: Path):
    """The drafter's exports along training, against prompt lookup (vLLM's ngram) and no drafter;
    our decoder's numbers also split off novel text."""
    fig, panels = _panels(report, 5.0)
    for ax, t in panels:
        summary = t["methods"]
        base = "ngram" if "ngram" in summary else "prompt lookup"
        d, pl = summary["eagle3"], summary[base]
        ck = sorted((s["fraction"], s["acceptance_length"]) for s in summary.values() if s["kind"] == "eagle3")
        ax.plot([c[0] for c in ck], [c[1] for c in ck], marker="o", color=_color(t, "eagle3"),
                label=f"drafter: all text ({d.get('drafts', d.get('rounds'))} verifications)")
        ax.axhline(pl["acceptance_length"], color=_color(t, base), lw=1, label=f"{base}: all text")
        if "novel_text" in d:
            novel = sorted((s["fraction"], s["novel_text"]["acceptance_length"]) for s in summary.values()
                           if s["kind"] == "eagle3")
            ax.plot([c[0] for c in novel], [c[1] for c in novel], marker="s", ls="--", color=_color(t, "eagle3"),
                    label=f"drafter: novel text ({d['novel_text']['rounds']} rounds)")
            ax.axhline(pl["novel_text"]["acceptance_length"], color=_color(t, base), ls="--", lw=1,
                       label=f"{base}: novel text")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":", label="no drafter")
        ax.set_xlim(0, 1.05)
        ax.set_xlabel("fraction of training")
        ax.set_ylabel("acceptance length")
        ax.set_title(f"as the drafter trains, {_label(t)}", fontsize=10)
    for ax, _ in panels:
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_positions(report: dict, path: Path):
    """P(draft position j accepted), unconditional (solid) and given j-1 accepted (dashed)."""
    fig, panels = _panels(report, 5.0)
    for ax, t in panels:
        for name, s in t["methods"].items():
            if s["kind"] == "none":
                continue
            pos = list(range(1, len(s["position_acceptance"]) + 1))
            ax.plot(pos, s["position_acceptance"], marker="o", color=_color(t, name), label=name)
            if "position_acceptance_conditional" in s:
                ax.plot(pos, s["position_acceptance_conditional"], ls="--", color=_color(t, name), alpha=0.6)
        ceiling = t["methods"]["none"].get("position1_ceiling")
        if ceiling is not None:
            ax.plot([1], [ceiling], marker="*", ms=12, color="black", ls="none", label="perfect drafter, j = 1")
        ax.set_xticks(pos)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("draft position j")
        ax.set_ylabel("P(draft j accepted)")
        given = any("position_acceptance_conditional" in s for s in t["methods"].values())
        ax.set_title(f"per position, {_label(t)}" + (" (dashed: given j-1)" if given else ""), fontsize=10)
    panels[0][0].legend(fontsize=7)
    return _save(fig, path)


def plot_speedup(report: dict, path: Path):
    """Estimated speed-up against the drafter's cost per forward (a fraction of a target forward)."""
    import numpy as np

    c = np.linspace(0, 0.3, 61)
    fig, panels = _panels(report, 5.0)
    for ax, t in panels:
        for name, s in t["methods"].items():
            if s["kind"] != "none":
                ax.plot(c, [speedup(s["acceptance_length"], s["draft_forwards_per_round"], x) for x in c],
                        color=_color(t, name), label=name)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.axvline(report["draft_cost_ratio"], color="black", lw=0.8, ls="--")
        ax.set_xlabel("drafter forward cost / target forward cost")
        ax.set_ylabel("estimated speed-up")
        ax.set_title(f"speed-up estimate, {_label(t)}, k = {report['k']}", fontsize=10)
    panels[0][0].legend(fontsize=7)
    return _save(fig, path)


# ---- serving: how to measure the export on GPUs with the real target ----------------------------

def write_bench_prompts(run: Run, prompts: list[Prompt], path: Path) -> int:
    """The evaluated held-out prompts as a ShareGPT file (`[{id, conversations}]`, the last user
    turn and the sampled answer) for `sglang.bench_serving` / `vllm bench serve`
    (`--dataset-name sharegpt --dataset-path FILE`). Returns how many were found in stage 02's
    raw_responses."""
    wanted = {(p.dataset, p.sample_id) for p in prompts}
    rows = []
    for ds in sorted({p.dataset for p in prompts}):
        for _, r in store.read_responses(run, ds):
            if (ds, r.get("sample_id")) not in wanted:
                continue
            users = [m["content"] for m in r.get("messages", []) if m.get("role") == "user"]
            if users:
                rows.append({"id": f"{ds}/{r['sample_id']}", "conversations": [
                    {"from": "human", "value": users[-1]},
                    {"from": "gpt", "value": r.get("content") or ""}]})
    path.write_text(json.dumps(rows, indent=1, ensure_ascii=False), encoding="utf-8")
    return len(rows)


def serving_commands(export_dir: str | os.PathLike, target_path: str, k: int, bench_file: str,
                     tp: int = 8, num_prompts: int = 80, trust_remote_code: bool = False) -> dict[str, str]:
    """Shell commands that serve the export next to the target in SGLang and vLLM (each engine
    gets the export folder written in its own layer-id convention, `drafter.export.for_engine`),
    serve a baseline without speculation, and benchmark both on the held-out prompts."""
    from .drafter.export import for_engine, serving_command

    sglang_dir, vllm_dir = for_engine(export_dir, "sglang"), for_engine(export_dir, "vllm")
    trust = " --trust-remote-code" if trust_remote_code else ""
    return {
        "sglang_export": str(sglang_dir), "vllm_export": str(vllm_dir),
        "sglang_server": serving_command("sglang", target_path, sglang_dir, k, trust_remote_code)
                         + f" --tp {tp} --port 30000",
        "sglang_baseline": f"python -m sglang.launch_server --model-path {target_path} --tp {tp} --port 30001{trust}",
        "sglang_ngram": (f"python -m sglang.launch_server --model-path {target_path} --tp {tp} --port 30002 "
                         f"--speculative-algorithm NGRAM --speculative-num-draft-tokens {k + 1}{trust}"),
        "sglang_bench": (
            f"python -m sglang.bench_serving --backend sglang --port 30000 --dataset-name sharegpt "
            f"--dataset-path {bench_file} --num-prompts {num_prompts} --max-concurrency 1 --apply-chat-template\n"
            f"# prints 'Accept length' (the server's avg_spec_accept_length, cumulative: use a fresh server);\n"
            f"# repeat with --port 30001 (baseline) and 30002 (n-gram), and --max-concurrency 16, 64\n"
            f"curl -s localhost:30000/get_server_info | python -c \"import json, sys; "
            f"print(json.load(sys.stdin)['internal_states'][0]['avg_spec_accept_length'])\""),
        "sglang_acceptance": (
            "# per request: acceptance length = meta_info['completion_tokens'] / meta_info['spec_verify_ct']\n"
            "# (verification steps of that request; SGLang counts tokens per step, the bonus token included)\n"
            "curl -s localhost:30000/generate -d '{\"text\": \"Hello\", \"sampling_params\": {\"max_new_tokens\": 256, "
            "\"temperature\": 0}}' | python -c \"import json, sys; m = json.load(sys.stdin)['meta_info']; "
            "print(m['completion_tokens'] / m['spec_verify_ct'])\""),
        "vllm_server": serving_command("vllm", target_path, vllm_dir, k, trust_remote_code)
                       + f" --tensor-parallel-size {tp} --port 8000",
        "vllm_baseline": f"vllm serve {target_path} --tensor-parallel-size {tp} --port 8001{trust}",
        "vllm_bench": (
            f"vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --port 8000 "
            f"--model {target_path} --dataset-name sharegpt --dataset-path {bench_file} "
            f"--num-prompts {num_prompts} --max-concurrency 1\n"
            f"curl -s localhost:8000/metrics | grep -E '^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)'\n"
            f"# acceptance length = 1 + num_accepted_tokens_total / num_drafts_total (difference of two scrapes\n"
            f"# around the benchmark); per position: num_accepted_tokens_per_pos_total / num_drafts_total"),
    }
