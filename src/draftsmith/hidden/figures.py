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
    b.set(xlabel="stored tensor", ylabel="token L2 norm", title=f"stored tensors, {len(norms):,} tokens")
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
    """Each stored layer's RMS per shard (rejected shards marked), on plain ticks (a log axis only
    where the RMS spans more than a decade) and whole shard numbers; beside it NaN/inf values per
    shard, or "NaN/inf: none" in the title when every shard has none."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, ScalarFormatter

    from ..tables import plain_log_ticks

    nonfinite = [sum(e["health"]["nonfinite"].values()) for e in entries]
    if any(nonfinite):
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [3, 1]})
    else:
        fig, a = plt.subplots(figsize=(8.5, 3.6))
    x = list(range(len(entries)))
    values = []
    for name in entries[0]["health"]["rms"]:
        ys = [e["health"]["rms"].get(name) for e in entries]
        values += [y for y in ys if y]
        a.plot(x, ys, "o-", ms=3, label=name)
    bad = [i for i, e in enumerate(entries) if e.get("problems")]
    for i in bad:
        a.axvline(i, color="C3", alpha=0.3)
    if values and min(values) > 0 and max(values) / min(values) > 10:
        a.set_yscale("log")
        plain_log_ticks(a.yaxis)
    else:
        a.yaxis.set_major_formatter(ScalarFormatter(useOffset=False))
    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.set_xlim(-0.5, len(entries) - 0.5)
    title = f"stored layers' RMS per shard ({len(bad)} rejected)" if bad else "stored layers' RMS per shard"
    a.set(xlabel="shard (in index order)", ylabel="RMS (activation units)",
          title=title if any(nonfinite) else f"{title}; NaN/inf: none")
    a.legend(fontsize=8)
    if any(nonfinite):
        b.bar(x, nonfinite, color="C3")
        b.xaxis.set_major_locator(MaxNLocator(integer=True))
        b.set(xlabel="shard (in index order)", ylabel="NaN/inf values", title="NaN/inf per shard")
    fig.tight_layout()
    return fig
