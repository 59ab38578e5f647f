"""The published Kimi-K2.5 drafters' benchmark figures, shown beside ours when the target is Kimi-K2.5.

Copied from the drafters' model cards (as of 2026-11), with what they were measured on and how. They
are references, not measurements of this run: another drafter, another machine, the settings its
card states. Whether the target is Kimi-K2.5 is read off its config (model_type `kimi_k25`, or its
architecture), never off a path or a name; for any other target there are no references.
"""

from __future__ import annotations

import os

from ..targets.checkpoint import target_config

SETTING_314 = "chain of 3 drafts, top-k 1, 4 draft tokens per verification (3-1-4)"

REFERENCES = [
    {"drafter": "lightseekorg/kimi-k2.5-eagle3", "kind": "EAGLE-3, one Llama-style (MHA) layer",
     "metric": "acceptance_length", "setting": SETTING_314,
     "how": "SpecForge's bench_eagle3.py on SGLang (its phase-2 checkpoint: ~300k regenerated samples in each of two phases); "
            "temperature not stated on the card",
     "source": "https://huggingface.co/lightseekorg/kimi-k2.5-eagle3",
     "benchmarks": {"mt_bench": 2.687, "gsm8k": 3.201, "humaneval": 3.285, "math500": 3.342}},
    {"drafter": "lightseekorg/kimi-k2.5-eagle3-mla", "kind": "EAGLE-3, one MLA layer",
     "metric": "acceptance_length", "setting": SETTING_314,
     "how": "lm_eval against vLLM (num_speculative_tokens 3); temperature not stated on the card",
     "source": "https://huggingface.co/lightseekorg/kimi-k2.5-eagle3-mla",
     "benchmarks": {"mt_bench": 2.940, "gsm8k": 3.017, "humaneval": 2.969}},
    {"drafter": "AQ-MedAI/Kimi-K25-eagle3", "kind": "EAGLE-3, one Llama-style layer",
     "metric": "draft_acceptance_rate", "setting": "4 speculative tokens (SGLang flags 3-1-4 on the card)",
     "how": "acceptance rate (accepted / drafted), not an acceptance length: not comparable column for column",
     "source": "https://huggingface.co/AQ-MedAI/Kimi-K25-eagle3",
     "benchmarks": {"gsm8k": 0.5178}},
]

KIMI_K25_TYPES = {"kimi_k25"}
KIMI_K25_ARCHITECTURES = {"KimiK25ForConditionalGeneration"}


def is_kimi_k25(target_path: str | os.PathLike) -> bool:
    cfg = target_config(target_path)
    return cfg.get("model_type") in KIMI_K25_TYPES or bool(KIMI_K25_ARCHITECTURES & set(cfg.get("architectures") or []))


def references_for(target_path: str | os.PathLike) -> list[dict] | None:
    """The published drafters' figures when the target is Kimi-K2.5, else None."""
    return REFERENCES if is_kimi_k25(target_path) else None
