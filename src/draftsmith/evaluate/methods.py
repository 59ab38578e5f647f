"""What stage 06 measures: the held-out prompts, and the methods that draft for them.

Prompts: samples stage 05 held out of training, as the tokens before the response (stage 04's
hidden-state shards: exactly what the target saw when the drafter's features were captured); the
field's benchmark prompts (`benchmarks`) take the same shape. Methods: no drafter, prompt lookup,
every export of the EAGLE-3 drafter along training and, where stage 05 trained one on the same
features, the final DFlash drafter; each with a fingerprint that changes when it would draft
differently (measured rows are reused only for the same method), its proposer for our decoder
(`Method.make`) and its vLLM engine (`EngineMethod`, `engine_methods_for`).

A proposer is reset with a prompt, told the committed tokens as they come (`advance`, with the
target's features at them) and asked for k drafts (`propose`). No proposer (None) is plain decoding.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import layers
from ..drafter import dflash, load_exported
from ..drafter.export import for_engine, read_export_config
from ..drafter.outputs import has_exports, read_exports, read_heldout
from ..hidden.outputs import HiddenShards, hidden_dir
from ..paths import Run
from ..targets.checkpoint import fingerprint


# ---- the prompts ----

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
        """What the engine process (`engine`) decodes of it."""
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


# ---- the proposers (our decoder's) ----

class PromptLookup:
    """N-gram drafting from the context (prompt + output so far): find the most recent earlier
    occurrence of the longest suffix n-gram (n = lookup_max_ngram .. lookup_min_ngram) and propose
    the k tokens that followed it, copying on past the end of the context when the match is recent
    (a loop of period p is continued, as an overlapping copy). No match: no drafts this round.
    vLLM's `ngram` (0.32) differs in two details that matter on looping text: it copies
    after the earliest occurrence and never past the end of the context, so it drafts fewer tokens
    near the end of a loop and accepts less there than this one."""

    def __init__(self, *, lookup_max_ngram: int, lookup_min_ngram: int):
        if not 1 <= lookup_min_ngram <= lookup_max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= lookup_min_ngram <= lookup_max_ngram, "
                             f"got {lookup_min_ngram}, {lookup_max_ngram}")
        self.lookup_max_ngram, self.lookup_min_ngram = lookup_max_ngram, lookup_min_ngram
        self.ctx: list[int] = []

    def reset(self, prompt: list[int]) -> None:
        self.ctx = list(prompt)

    def advance(self, tokens: list[int], aux=None) -> None:
        self.ctx += tokens

    def propose(self, k: int) -> list[int]:
        ctx, n_ctx = self.ctx, len(self.ctx)
        for n in range(min(self.lookup_max_ngram, n_ctx - 1), self.lookup_min_ngram - 1, -1):
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


class DFlashProposer:
    """Block drafting with a DFlash drafter: the context rows of every committed position whose
    target feature is known, and the last committed token as the anchor; `propose(k)` is the first
    k of one non-causal block (k <= block_size - 1)."""

    def __init__(self, drafter):
        self.d = drafter
        self.device = drafter.fc.weight.device
        self.ctx = None
        self.anchor = None

    def reset(self, prompt: list[int]) -> None:
        self.ctx, self.anchor = None, None

    @torch.inference_mode()
    def advance(self, tokens: list[int], aux: torch.Tensor) -> None:
        if aux is None or len(aux) != len(tokens):
            raise ValueError(f"a DFlash drafter needs one target feature row per new token "
                             f"({len(tokens)} tokens, {None if aux is None else len(aux)} rows)")
        rows = self.d.context(aux[None].to(self.device))[0]
        self.ctx = rows if self.ctx is None else torch.cat((self.ctx, rows))
        self.anchor = tokens[-1]

    def propose(self, k: int) -> list[int]:
        if k > self.d.config.block_size - 1:
            raise ValueError(f"a DFlash drafter of block size {self.d.config.block_size} drafts at most "
                             f"{self.d.config.block_size - 1} tokens, asked for {k}")
        return self.d.draft(self.ctx, self.anchor)[:k]


class Columns:
    """A proposer that reads only some of the layers our decoder captures: aux [T, n*H] holds `n`
    layers side by side, the proposer gets the columns of layers `cols` (EAGLE-3 and DFlash beside
    each other read different layers of one capture)."""

    def __init__(self, proposer, cols: list[int], n: int):
        self.p, self.cols, self.n = proposer, list(cols), n

    def reset(self, prompt: list[int]) -> None:
        self.p.reset(prompt)

    def advance(self, tokens: list[int], aux: torch.Tensor | None) -> None:
        if aux is not None and len(self.cols) != self.n:
            h = aux.shape[-1] // self.n
            aux = torch.cat([aux[:, c * h:(c + 1) * h] for c in self.cols], dim=-1)
        self.p.advance(tokens, aux)

    def propose(self, k: int) -> list[int]:
        return self.p.propose(k)


# ---- the methods ----

@dataclass
class Method:
    name: str            # "none", "prompt lookup", "eagle3 50%", ...
    kind: str            # none | prompt_lookup | eagle3
    fingerprint: str     # changes when the method would draft differently
    make: object         # () -> proposer (or None)
    info: dict = field(default_factory=dict)


def export_layer_ids(export_dir: Path) -> list[int]:
    """The export's auxiliary layer ids in draftsmith's (output) convention."""
    cfg = read_export_config(export_dir)
    ds = cfg.get("draftsmith") or {}
    if "aux_layer_ids" not in ds:
        raise KeyError(f"{export_dir}/config.json: no draftsmith.aux_layer_ids; the engine-side ids "
                       f"{cfg.get('eagle_config', {}).get('eagle_aux_hidden_state_layer_ids')} are ambiguous "
                       f"(SGLang and vLLM read them differently), so this export cannot be evaluated here")
    return layers.in_output_convention([int(k) for k in ds["aux_layer_ids"]], ds.get("aux_layer_convention", "output"))


def methods_for(drafter_dir: str | os.PathLike, target_path: str | os.PathLike, device, *,
                lookup_max_ngram: int, lookup_min_ngram: int,
                dflash_dir: str | os.PathLike | None = None) -> tuple[list[Method], list[int]]:
    """The methods of one evaluation: no drafter, prompt lookup, every export of the drafter
    (loaded from its folder) and the final export of `dflash_dir` when it holds one. Returns them
    and the auxiliary layer ids our decoder captures for them (each drafter reads its own, `Columns`)."""
    exports = read_exports(drafter_dir)
    layer_ids = export_layer_ids(exports[-1]["dir"])
    drafters = []   # (name, kind, export folder, info)
    for e in exports:
        ids = export_layer_ids(e["dir"])
        if ids != layer_ids:
            raise ValueError(f"{e['dir']}: aux layer ids {ids} differ from the final export's {layer_ids}")
        final = e is exports[-1]
        drafters.append(("eagle3" if final else f"eagle3 {e['fraction']:.0%}", "eagle3", e["dir"],
                         {"step": e["step"], "fraction": e["fraction"], "dir": str(e["dir"]), "final": final,
                          "layer_ids": layer_ids}))
    if dflash_dir and has_exports(dflash_dir):
        e = read_exports(dflash_dir)[-1]
        drafters.append(("dflash", "dflash", e["dir"],
                         {"step": e["step"], "fraction": e["fraction"], "dir": str(e["dir"]), "final": True,
                          "layer_ids": export_layer_ids(e["dir"]),
                          "draft_tokens": read_export_config(e["dir"])["dflash_config"]["block_size"] - 1}))
    captured = sorted({k for *_, info in drafters for k in info["layer_ids"]})

    def maker(kind: str, d: Path, ids: list[int]):
        cols = [captured.index(k) for k in ids]
        if kind == "eagle3":
            return lambda: Columns(Eagle3Proposer(load_exported(d, target_path, device=device)), cols, len(captured))
        return lambda: Columns(DFlashProposer(dflash.load_exported(d, target_path, device=device)),
                               cols, len(captured))

    ms = [Method("none", "none", "none", lambda: None),
          Method("prompt lookup", "prompt_lookup", f"lookup-{lookup_min_ngram}-{lookup_max_ngram}",
                 lambda: PromptLookup(lookup_max_ngram=lookup_max_ngram, lookup_min_ngram=lookup_min_ngram),
                 {"lookup_min_ngram": lookup_min_ngram, "lookup_max_ngram": lookup_max_ngram})]
    ms += [Method(name, kind, fingerprint(d), maker(kind, d, info["layer_ids"]), info)
           for name, kind, d, info in drafters]
    return ms, captured


def on_benchmarks(m: Method) -> bool:
    """Whether `m` decodes the field's benchmarks: they compare the drafter a user ships, so the
    final drafters beside prompt lookup and no drafter do; the exports along training are measured
    on the held-out prompts only (`acceptance_vs_training`)."""
    return m.kind != "eagle3" or m.info["final"]


@dataclass(frozen=True)
class EngineMethod:
    """One method as a vLLM engine (`engine_methods_for`): its `speculative_config` (None: no
    drafting), the layers the engine must capture for its drafter (`expect_layers`, vLLM ids), the
    same method's fingerprint in our decoder, its own `draft_tokens` (a DFlash block; None: the
    stage's) and the prompt sets it does not decode. The engine process gets it in its job (`engine.EngineJob`)."""

    name: str
    kind: str                                   # none | ngram | eagle3 | dflash
    fingerprint: str
    speculative_config: dict | None = None
    expect_layers: list[int] | None = None
    info: dict = field(default_factory=dict)    # the report's fields of the method
    hf_fingerprint: str | None = None
    draft_tokens: int | None = None
    skip_datasets: list[str] = field(default_factory=list)

    def drafts(self, draft_tokens: int) -> int:
        """Tokens it drafts a step, where the stage's setting is `draft_tokens`."""
        return draft_tokens if self.draft_tokens is None else self.draft_tokens


def speculative_config(kind: str, draft_tokens: int, export_dir: str | None = None, *,
                       lookup_min_ngram: int | None = None, lookup_max_ngram: int | None = None) -> dict | None:
    """vLLM's `speculative_config` for a method: none, ngram (prompt lookup: both lookup settings
    given) or an eagle3 export."""
    if kind == "none":
        return None
    if kind == "ngram":
        if lookup_min_ngram is None or lookup_max_ngram is None:
            raise ValueError("vLLM's ngram needs lookup_min_ngram and lookup_max_ngram")
        return {"method": "ngram", "num_speculative_tokens": draft_tokens, "prompt_lookup_min": lookup_min_ngram,
                "prompt_lookup_max": lookup_max_ngram}
    if kind in ("eagle3", "dflash"):
        return {"method": kind, "model": str(export_dir), "num_speculative_tokens": draft_tokens}
    raise ValueError(f"unknown method kind {kind!r}")


def engine_methods_for(methods: list[Method], *, draft_tokens: int, lookup_min_ngram: int,
                       lookup_max_ngram: int, benchmarks: list[str] = ()) -> list[EngineMethod]:
    """The same methods as vLLM engines: no speculation, vLLM's ngram, and every export written
    for vLLM (`drafter.export.for_engine`), each expected to capture its own layers (output ids).
    An export along training skips the prompt sets named in `benchmarks` (`on_benchmarks`)."""
    out = [EngineMethod("none", "none", "vllm-none"),
           EngineMethod("ngram", "ngram", f"vllm-ngram-{lookup_min_ngram}-{lookup_max_ngram}",
                        speculative_config=speculative_config("ngram", draft_tokens,
                                                                     lookup_min_ngram=lookup_min_ngram,
                                                                     lookup_max_ngram=lookup_max_ngram),
                        info={"lookup_min_ngram": lookup_min_ngram, "lookup_max_ngram": lookup_max_ngram})]
    for m in methods:
        if m.kind not in ("eagle3", "dflash"):
            continue
        expect = layers.engine_layer_ids(m.info["layer_ids"], "vllm")
        if m.kind == "eagle3":
            d = for_engine(m.info["dir"], "vllm")
            out.append(EngineMethod(m.name, "eagle3", "vllm-" + fingerprint(d), hf_fingerprint=m.fingerprint,
                                    speculative_config=speculative_config("eagle3", draft_tokens, d),
                                    expect_layers=expect,
                                    info={"step": m.info["step"], "fraction": m.info["fraction"], "dir": str(d),
                                          "final": m.info["final"]},
                                    skip_datasets=[] if on_benchmarks(m) else sorted(benchmarks)))
        else:   # DFlash: its export is vLLM's format already; it drafts a whole block
            k = m.info["draft_tokens"]
            out.append(EngineMethod(m.name, "dflash", "vllm-" + m.fingerprint, hf_fingerprint=m.fingerprint,
                                    speculative_config=speculative_config("dflash", k, m.info["dir"]),
                                    expect_layers=expect, draft_tokens=k,
                                    info={"step": m.info["step"], "fraction": m.info["fraction"],
                                          "dir": m.info["dir"], "final": True, "draft_tokens": k}))
    return out
