"""The methods stage 06 compares: no drafter, prompt lookup, every export of the EAGLE-3 drafter along
training and, where stage 05 trained one on the same features, the final DFlash drafter.

Each method has a fingerprint that changes when it would draft differently, so measured rounds are
reused only for the same method. `engine_methods_for` gives the same methods as vLLM engines.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import layers
from ..drafter import dflash_export, load_exported
from ..drafter.outputs import has_exports, read_exports
from ..drafter.export import for_engine, read_export_config
from ..targets.checkpoint import fingerprint
from . import engine
from .engine import EngineMethod
from .proposers import Columns, DFlashProposer, Eagle3Proposer, PromptLookup


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
        return lambda: Columns(DFlashProposer(dflash_export.load_exported(d, target_path, device=device)),
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


def engine_methods_for(methods: list[Method], *, draft_tokens: int, lookup_min_ngram: int,
                       lookup_max_ngram: int, benchmarks: list[str] = ()) -> list[EngineMethod]:
    """The same methods as vLLM engines: no speculation, vLLM's ngram, and every export written
    for vLLM (`drafter.export.for_engine`), each expected to capture its own layers (output ids).
    An export along training skips the prompt sets named in `benchmarks` (`on_benchmarks`)."""
    out = [EngineMethod("none", "none", "vllm-none"),
           EngineMethod("ngram", "ngram", f"vllm-ngram-{lookup_min_ngram}-{lookup_max_ngram}",
                        speculative_config=engine.speculative_config("ngram", draft_tokens,
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
                                    speculative_config=engine.speculative_config("eagle3", draft_tokens, d),
                                    expect_layers=expect,
                                    info={"step": m.info["step"], "fraction": m.info["fraction"], "dir": str(d),
                                          "final": m.info["final"]},
                                    skip_datasets=[] if on_benchmarks(m) else sorted(benchmarks)))
        else:   # DFlash: its export is vLLM's format already; it drafts a whole block
            k = m.info["draft_tokens"]
            out.append(EngineMethod(m.name, "dflash", "vllm-" + m.fingerprint, hf_fingerprint=m.fingerprint,
                                    speculative_config=engine.speculative_config("dflash", k, m.info["dir"]),
                                    expect_layers=expect, draft_tokens=k,
                                    info={"step": m.info["step"], "fraction": m.info["fraction"],
                                          "dir": m.info["dir"], "final": True, "draft_tokens": k}))
    return out
