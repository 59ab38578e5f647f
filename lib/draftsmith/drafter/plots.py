"""Figures of stage 05: draft-vocab coverage, and loss / accuracy per TTT step during training."""

from __future__ import annotations

import matplotlib.pyplot as plt

from .vocab import DraftVocab, coverage_curve


def coverage_figure(vocab: DraftVocab):
    """Share of training response tokens covered by the top-n tokens, with the chosen n marked."""
    distinct = max(vocab.distinct(), 1)
    sizes = sorted({max(1, int(distinct * f)) for f in [i / 100 for i in range(1, 101)]} | {vocab.size})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(sizes, coverage_curve(vocab.counts, sizes))
    ax.axvline(vocab.size, color="C3", ls="--", label=f"draft vocab {vocab.size}: {vocab.coverage():.1%}")
    ax.set(xscale="log", xlabel="draft vocabulary size (most frequent tokens)", ylabel="coverage",
           title="response tokens covered by the draft vocabulary")
    ax.legend()
    fig.tight_layout()
    return fig


def curves_figure(metrics: list[dict], baseline: dict | None = None):
    """Against the optimizer step, one line per TTT step: train loss, held-out KL to the target
    (loss minus the teacher's entropy, 0 = a perfect copy) and held-out acc_i."""
    train = [r for r in metrics if r["split"] == "train"]
    held = [r for r in metrics if r["split"] == "heldout"]
    k = len((train or held)[0]["loss_i"]) if (train or held) else 0
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for i in range(k):
        c = plt.cm.viridis(i / max(k - 1, 1))
        axes[0].plot([r["step"] for r in train], [r["loss_i"][i] for r in train], color=c, lw=0.8, label=f"step {i}")
        axes[1].plot([r["step"] for r in held], [r["kl_i"][i] for r in held], "o-", color=c, ms=3, label=f"step {i}")
        axes[2].plot([r["step"] for r in held], [r["acc_i"][i] for r in held], "o-", color=c, ms=3, label=f"acc_{i}")
    if baseline:
        axes[2].axhline(baseline["acc"], color="k", ls=":", label="unigram")
    axes[0].set(title="train loss per TTT step", xlabel="optimizer step", ylabel="soft cross-entropy")
    axes[1].set(title="held-out KL(target || drafter) per TTT step", xlabel="optimizer step", yscale="log")
    axes[2].set(title="held-out acc_i (top-1 agrees with the target)", xlabel="optimizer step", ylim=(0, 1))
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
