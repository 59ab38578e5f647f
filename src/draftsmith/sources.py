"""Several sources in one training set: the rule for a prompt that two sources answered, and what
stage 03 reports per source.

A sample's source says where its answer came from: `openrouter` (stage 02 through OpenRouter or
the local emulator), the engine a bare OpenAI-compatible server named (stage 02 against a local
vLLM or SGLang), or the `source` field of an import line.

Duplicates, one rule: within a dataset, a prompt (its messages, compared by hash) is answered by
one source only. The first source in this order keeps its answers: stage 02's own responses, then
the imports in the order `imports` lists them. Another source's answers to that prompt are left out
of the training data (`duplicate_of` names the source kept); their checks stay in
`tokens/checks/<dataset>.jsonl`. Answers of one source to equal prompts under distinct ids are
all kept, as stage 02 keeps them (see `datasets`).
"""

from __future__ import annotations

from collections import defaultdict


def drop_answered_elsewhere(rows: list[dict]) -> None:
    """Apply the rule to check rows given in source order (see the module doc)."""
    first: dict[tuple[str, str], str] = {}
    for r in rows:
        kept = first.setdefault((r["dataset"], r["prompt_hash"]), r["source"])
        if kept != r["source"]:
            r["duplicate_of"] = kept
            r["excluded"] = True


def report(rows: list[dict]) -> dict:
    """Per source: samples, kept, left out as answered by another source; `billing` (billed vs
    rebuilt completion tokens) only over samples that carry counts, `saved_ids` (how often the
    engine's ids and the text's rebuild agree) only over samples with ids; None where none has."""
    by = defaultdict(list)
    for r in rows:
        by[r["source"]].append(r)
    out = {}
    for src, rs in sorted(by.items()):
        counted = [r for r in rs if r["billed_completion_tokens"] is not None]
        saved = [r["checks"]["saved_ids"] for r in rs if r["checks"]["saved_ids"] is not None]
        billed = sum(r["billed_completion_tokens"] for r in counted)
        rebuilt = sum(r["reconstructed_completion_tokens"] for r in counted)
        kept = [r for r in rs if not r["excluded"]]
        out[src] = {
            "samples": len(rs),
            "kept": len(kept),
            "duplicates_left_out": sum(1 for r in rs if r.get("duplicate_of")),
            "datasets": sorted({r["dataset"] for r in rs}),
            "response_tokens_kept": sum(r["reconstructed_completion_tokens"] for r in kept),
            "billing": {
                "samples": len(counted),
                "billed_completion_tokens": billed,
                "reconstructed_completion_tokens": rebuilt,
                "relative_error": (billed - rebuilt) / billed if billed else None,
                "exact_match_rate": sum(1 for r in counted if r["checks"]["completion_delta"] == 0) / len(counted),
            } if counted else None,
            "saved_ids": {
                "samples": len(saved),
                "output_agreement_rate": sum(s["output_agree"] for s in saved) / len(saved),
                "prompt_agreement_rate": sum(s["prompt_agree"] for s in saved) / len(saved),
            } if saved else None,
        }
    return out


def table(report_: dict):
    """One row per source, for the notebook."""
    import pandas as pd

    rows = {}
    for src, s in report_["sources"].items():
        b, ids = s["billing"] or {}, s["saved_ids"] or {}
        rows[src] = {"samples": s["samples"], "kept": s["kept"], "duplicates_left_out": s["duplicates_left_out"],
                     "datasets": ", ".join(s["datasets"]), "response_tokens_kept": s["response_tokens_kept"],
                     "billed_vs_rebuilt_error": b.get("relative_error"), "billed_exact_match": b.get("exact_match_rate"),
                     "ids_vs_text_agreement": ids.get("output_agreement_rate")}
    df = pd.DataFrame.from_dict(rows, orient="index")
    df.index.name = "source"
    return df


def summary_lines(report_: dict) -> list[str]:
    lines = []
    for src, s in report_["sources"].items():
        parts = [f"source {src}: {s['samples']} samples ({', '.join(s['datasets'])}), {s['kept']} kept"]
        if s["duplicates_left_out"]:
            parts.append(f"{s['duplicates_left_out']} left out (prompt answered by an earlier source)")
        b, ids = s["billing"], s["saved_ids"]
        if b and b["relative_error"] is not None:
            parts.append(f"billed vs rebuilt {b['relative_error']:+.4%}")
        if ids:
            parts.append(f"engine ids = text rebuild on {ids['output_agreement_rate']:.1%}")
        if not b and not ids:
            parts.append("no counts or ids to check against")
        lines.append("; ".join(parts))
    return lines
