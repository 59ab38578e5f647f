"""Stage 04's figure: activation norms by layer, the stored layers on the target's own curve."""

from __future__ import annotations

from .verify import stored_norms


def norm_figures(check: dict | None, hidden_dir, max_samples: int = 64) -> dict:
    """{"norms": Figure} when a check ran (`verify.check_stored`), else {}."""
    if check is None:
        return {}
    return {"norms": plot_norms(check, stored_norms(hidden_dir, max_samples=max_samples))}


def plot_norms(check: dict, norms):
    """Left: the target's mean token norm at every layer of one sample, with the stored aux layers of
    that sample circled at their ids (a convention slip puts them one layer off the curve). Right:
    the stored tensors' token norms over many samples."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    n = len(check["layer_norms"])
    a.plot(range(-1, n - 1), check["layer_norms"], "o-", color="0.6", label="target, every layer")
    a.plot(check["layer_ids"], check["stored_aux_norms"], "o", ms=11, mfc="none",
           color="C3", label="stored aux, at their layer ids")
    a.set(xlabel="output of layer (-1 = embeddings)", ylabel="mean token L2 norm",
          title=f"activation norm by layer (sample {check['sample_id']})")
    a.legend()
    b.boxplot([norms[c] for c in norms.columns], showfliers=False)
    b.set_xticks(range(1, len(norms.columns) + 1), norms.columns, rotation=15)
    b.set(ylabel="token L2 norm", title=f"stored tensors, {len(norms):,} tokens")
    fig.tight_layout()
    return fig
