"""Tables of stage 05 for notebook 05: the draft vocabulary, held-out scores before and after
training against the unigram baseline, the exports, and the commands that serve the final one."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .export import for_engine, serving_command


def vocab_table(summary: dict) -> pd.DataFrame:
    """Sizes as whole numbers (1024, not 1024.000000), coverages and fractions as percentages."""
    shown = {k: "n/a" if v is None else f"{v:.1%}" if isinstance(v, float) else str(v)
             for k, v in summary["vocab"].items()}
    return pd.Series(shown).to_frame("draft vocabulary")


def heldout_table(summary: dict) -> pd.DataFrame:
    """Step-0 held-out loss, KL and acc before and after training, and the unigram baseline's."""
    start, end, base = summary["heldout_start"], summary["heldout"], summary["unigram_baseline"]
    return pd.DataFrame({"before training": [start["loss_i"][0], start["kl_i"][0], start["acc_i"][0]],
                         "after training": [end["loss_i"][0], end["kl_i"][0], end["acc_i"][0]],
                         "unigram baseline": [base["loss"], None, base["acc"]]},
                        index=["held-out loss (step 0)", "held-out KL (step 0)", "held-out acc_0"]).round(3)


def exports_table(summary: dict) -> pd.DataFrame:
    """One row per export: its step, fraction of training and held-out acc_i."""
    return pd.DataFrame([{"step": e["step"], "fraction": e["fraction"],
                          **{f"acc_{i}": a for i, a in enumerate(e["heldout"]["acc_i"])}, "dir": e["dir"]}
                         for e in summary["exports"]]).round(3)


def serving_markdown(summary: dict, target_path: str | Path) -> str:
    """The SGLang and vLLM commands serving the target with the final export, each pointed at the
    export folder written in its own layer-id convention."""
    final = summary["exports"][-1]["dir"]
    commands = {engine: serving_command(engine, target_path, for_engine(final, engine))
                for engine in ("sglang", "vllm")}
    return "\n\n".join(f"**{e}**\n```\n{c}\n```" for e, c in commands.items())
