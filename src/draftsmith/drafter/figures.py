"""Tables and figures of stage 05 for notebook 05: the draft vocabulary and its coverage, loss /
accuracy per TTT step during training, held-out scores before and after training against the unigram
baseline, the exports, and the commands that serve the final one."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from .. import parameters
from ..tables import plain_log_ticks
from .dflash import serving_command as dflash_serving_command
from .export import for_engine, serving_command
from .vocab import DraftVocab, coverage_curve


def coverage_figure(vocab: DraftVocab):
    """Share of training response tokens covered by the top-n tokens, with the chosen n marked."""
    distinct = max(vocab.distinct(), 1)
    sizes = sorted({max(1, int(distinct * f)) for f in [i / 100 for i in range(1, 101)]} | {vocab.size})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(sizes, coverage_curve(vocab.counts, sizes))
    ax.axvline(vocab.size, color="C3", ls="--", label=f"draft vocab {vocab.size}: {vocab.coverage():.1%}")
    ax.set(xscale="log", xlabel="draft vocabulary size (tokens, most frequent first)",
           ylabel="response tokens covered (fraction)",
           title="response tokens covered by the draft vocabulary")
    ax.legend()
    fig.tight_layout()
    return fig


# One look per TTT step, told apart by colour and by line style alike (so also in greyscale), each
# colour dark enough to read on white.
STEP_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")
STEP_STYLES = ("-", "--", ":", "-.")
STEP_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def step_style(i: int) -> dict:
    """Colour, line style and marker of TTT step `i` in every curve of stage 05."""
    return {"color": STEP_COLORS[i % len(STEP_COLORS)], "ls": STEP_STYLES[i % len(STEP_STYLES)],
            "marker": STEP_MARKERS[i % len(STEP_MARKERS)]}


def curves_figure(metrics: list[dict], baseline: dict | None = None, kind: str = "eagle3"):
    """Against the optimizer step, one line per TTT step (DFlash: per block position; at most four,
    the first, the last and evenly between): train loss, held-out KL to the target (loss minus the
    teacher's entropy, 0 = a perfect copy) and held-out acc_i."""
    train = [r for r in metrics if r["split"] == "train"]
    held = [r for r in metrics if r["split"] == "heldout"]
    k = len((train or held)[0]["loss_i"]) if (train or held) else 0
    unit = "TTT step" if kind == "eagle3" else "block position"
    name = "TTT step" if kind == "eagle3" else "position"
    shown = list(range(k)) if k <= 4 else sorted({round(j * (k - 1) / 3) for j in range(4)})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    every = max(1, len(train) // 8)
    for i in shown:
        # hollow markers of different shapes, staggered along the train curve: steps whose curves
        # coincide still show one mark each
        st = {**step_style(i), "mfc": "none", "lw": 1.4}
        axes[0].plot([r["step"] for r in train], [r["loss_i"][i] for r in train], ms=5,
                     markevery=(i * every // max(k, 1), every), label=f"{name} {i}", **st)
        ms = 4 + 2 * shown.index(i)
        axes[1].plot([r["step"] for r in held], [r["kl_i"][i] for r in held], ms=ms, label=f"{name} {i}", **st)
        axes[2].plot([r["step"] for r in held], [r["acc_i"][i] for r in held], ms=ms, label=f"{name} {i}", **st)
    if baseline:
        axes[2].axhline(baseline["acc"], color="k", ls=":", label="unigram")
    axes[0].set(title=f"train loss per {unit}", xlabel="optimizer step (batches)",
                ylabel="soft cross-entropy (nats)")
    axes[1].set(title=f"held-out KL(target || drafter) per {unit}", xlabel="optimizer step (batches)",
                ylabel="KL (nats, log scale)", yscale="log")
    axes[2].set(title=f"held-out acc_i per {unit}", xlabel="optimizer step (batches)",
                ylabel="top-1 agrees with the target (fraction)", ylim=(0, 1))
    plain_log_ticks(axes[1].yaxis)
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


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
    export folder written in its own layer-id convention, drafting notebook 06's `draft_tokens`
    (the default stage 06 measures)."""
    from ..tables import shell_lines   # one option a line: the whole command on the page

    final = summary["exports"][-1]["dir"]
    if summary.get("kind") == "dflash":
        return f"**vllm**\n```\n{shell_lines(dflash_serving_command(target_path, final, summary['block_size']))}\n```"
    draft_tokens = parameters.declaration("draft_tokens").default
    commands = {engine: serving_command(engine, target_path, for_engine(final, engine), draft_tokens)
                for engine in ("sglang", "vllm")}
    return "\n\n".join(f"**{e}**\n```\n{shell_lines(c)}\n```" for e, c in commands.items())
