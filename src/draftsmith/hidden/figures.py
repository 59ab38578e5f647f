"""Stage 04's figures: activation norms by layer (the stored layers on the target's own curve), each
shard's health."""

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


def health_figures(hidden_dir) -> dict:
    """{"health": Figure} of every shard's health record in the index (kept and rejected shards),
    else {} (a folder without shards, or shards written before health was recorded)."""
    import json
    from pathlib import Path

    from .outputs import INDEX

    index = json.loads((Path(hidden_dir) / INDEX).read_text())
    entries = sorted([e for e in index.get("shards", []) + index.get("rejected_shards", []) if e.get("health")],
                     key=lambda e: e["file"].split("-")[-1])
    return {"health": plot_health(entries)} if entries else {}


def plot_health(entries: list[dict]):
    """Left: each stored layer's RMS per shard (rejected shards marked). Right: NaN/inf values per shard."""
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [3, 1]})
    x = list(range(len(entries)))
    for name in entries[0]["health"]["rms"]:
        a.plot(x, [e["health"]["rms"].get(name) for e in entries], "o-", ms=3, label=name)
    bad = [i for i, e in enumerate(entries) if e.get("problems")]
    for i in bad:
        a.axvline(i, color="C3", alpha=0.3)
    a.set(xlabel="shard", ylabel="RMS", yscale="log",
          title=f"stored layers' RMS per shard ({len(bad)} rejected)" if bad else "stored layers' RMS per shard")
    a.legend(fontsize=8)
    b.bar(x, [sum(e["health"]["nonfinite"].values()) for e in entries], color="C3")
    b.set(xlabel="shard", ylabel="values", title="NaN/inf")
    fig.tight_layout()
    return fig
