"""What notebook 06 shows of the report: tables of acceptance per method, what the numbers say in
words, and the figures, one panel per temperature, built and returned (the notebook saves them).

Each table and text says so in words when the part it shows was not measured (`eval_backend: hf`:
no engine numbers; `eval_hf_crosscheck: false`: none of our decoder's). The three acceptance
figures show the engine's numbers when stage 06 measured in vLLM, else our decoder's (`primary`);
the speed-up estimate is our decoder's only.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from .metrics import LOOP_NGRAM, speedup
from .results import ALL_HELD_OUT, Versus, headlines, mode, results, versus


def stage_figures(report: dict) -> dict[str, Figure]:
    """File name -> figure, for every figure this report has numbers for."""
    view = primary(report)
    figs = {"acceptance_by_dataset.png": by_dataset(view), "acceptance_vs_training.png": training(view),
            "per_position.png": positions(view)} if view["temperatures"] else {}
    if report["temperatures"]:
        figs["speedup.png"] = speedup_estimate(report)
    if report.get("benchmarks"):
        figs["benchmarks.png"] = benchmarks(report)
    return figs


def primary(report: dict) -> dict:
    """The report as the figures read it: the engine's numbers when stage 06 measured the drafter in
    vLLM, else our decoder's (also where the drafter's engine was GPU-only: `engine.gpu_only`)."""
    engine = report.get("engine")
    if engine and any(s["kind"] == "eagle3" for t in engine["temperatures"].values() for s in t["methods"].values()):
        return {**report, "temperatures": engine["temperatures"]}
    return report


def _panels(report: dict, width: float, height: float = 3.6):
    temps = list(report["temperatures"].values())
    fig, axes = plt.subplots(1, len(temps), figsize=(width * len(temps), height), squeeze=False)
    return fig, list(zip(axes[0], temps))


def _label(t: dict) -> str:
    return mode(t["temperature"])


# vLLM's ngram and our prompt lookup are two implementations measured apart, so two colours.
KIND_COLORS = {"none": "#7f7f7f", "ngram": "#ff7f0e", "prompt_lookup": "#9467bd"}


def _color(t: dict, name: str):
    """The same colour for a method in every figure, in the engine's view and in our decoder's:
    one per baseline, and blues for the drafter's exports, darker as training goes on."""
    s = t["methods"][name]
    if s["kind"] in KIND_COLORS:
        return KIND_COLORS[s["kind"]]
    return plt.cm.Blues(0.3 + 0.7 * (s.get("fraction") or 1.0))


def by_dataset(report: dict) -> Figure:
    """Grouped bars: acceptance length per dataset and over all prompts, every method."""
    fig, panels = _panels(report, 6.0)
    for ax, t in panels:
        summary = t["methods"]
        groups = sorted({ds for s in summary.values() for ds in s["per_dataset"]}) + ["all"]
        x = np.arange(len(groups))
        w = 0.8 / len(summary)
        for i, (name, s) in enumerate(summary.items()):
            vals = [s["per_dataset"].get(g, {}).get("acceptance_length", float("nan")) for g in groups[:-1]]
            bars = ax.bar(x + (i - (len(summary) - 1) / 2) * w, vals + [s["acceptance_length"]], w,
                          color=_color(t, name), label=name)
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xticks(x, groups)
        ax.set_xlabel("prompt set")
        ax.set_ylabel("acceptance length (1 + accepted / drafts)")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # headroom so the legend sits above the bars
        ax.set_title(f"acceptance length, {_label(t)}, k = {report['draft_tokens']}", fontsize=10)
    panels[0][0].legend(fontsize=7, ncols=len(panels[0][1]["methods"]), loc="upper center")
    fig.tight_layout()
    return fig


def training(report: dict) -> Figure:
    """The drafter's exports along training, against prompt lookup (vLLM's ngram) and no drafter;
    our decoder's numbers also split off novel text."""
    fig, panels = _panels(report, 5.0)
    for ax, t in panels:
        summary = t["methods"]
        base = "ngram" if "ngram" in summary else "prompt lookup"
        d, pl = summary["eagle3"], summary[base]
        ck = sorted((s["fraction"], s["acceptance_length"]) for s in summary.values() if s["kind"] == "eagle3")
        ax.plot([c[0] for c in ck], [c[1] for c in ck], marker="o", color=_color(t, "eagle3"),
                label=f"drafter: all text ({d.get('drafts', d.get('rounds'))} verifications)")
        ax.axhline(pl["acceptance_length"], color=_color(t, base), lw=1, label=f"{base}: all text")
        if "novel_text" in d:
            novel = sorted((s["fraction"], s["novel_text"]["acceptance_length"]) for s in summary.values()
                           if s["kind"] == "eagle3")
            ax.plot([c[0] for c in novel], [c[1] for c in novel], marker="s", ls="--", color=_color(t, "eagle3"),
                    label=f"drafter: novel text ({d['novel_text']['rounds']} rounds)")
            ax.axhline(pl["novel_text"]["acceptance_length"], color=_color(t, base), ls="--", lw=1,
                       label=f"{base}: novel text")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":", label="no drafter")
        ax.set_xlim(0, 1.05)
        ax.set_xlabel("fraction of training")
        ax.set_ylabel("acceptance length (1 + accepted / drafts)")
        ax.set_title(f"as the drafter trains, {_label(t)}", fontsize=10)
    for ax, _ in panels:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def positions(report: dict) -> Figure:
    """P(draft position j accepted), unconditional (solid) and given j-1 accepted (dashed)."""
    fig, panels = _panels(report, 5.0)
    for ax, t in panels:
        for name, s in t["methods"].items():
            if s["kind"] == "none":
                continue
            pos = list(range(1, len(s["position_acceptance"]) + 1))
            ax.plot(pos, s["position_acceptance"], marker="o", color=_color(t, name), label=name)
            if "position_acceptance_conditional" in s:
                ax.plot(pos, s["position_acceptance_conditional"], ls="--", color=_color(t, name), alpha=0.6)
        ceiling = t["methods"]["none"].get("position1_ceiling")
        if ceiling is not None:
            ax.plot([1], [ceiling], marker="*", ms=12, color="black", ls="none", label="perfect drafter, j = 1")
        ax.set_xticks(pos)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("draft position j")
        ax.set_ylabel("P(draft j accepted)")
        given = any("position_acceptance_conditional" in s for s in t["methods"].values())
        ax.set_title(f"per position, {_label(t)}" + (" (dashed: given j-1)" if given else ""), fontsize=10)
        ax.legend(fontsize=7)  # each panel its own: the perfect drafter's mark is not in every one
    fig.tight_layout()
    return fig


def speedup_estimate(report: dict) -> Figure:
    """Estimated speed-up against the drafter's cost per forward (a fraction of a target forward)."""
    c = np.linspace(0, 0.3, 61)
    fig, panels = _panels(report, 5.0)
    for ax, t in panels:
        for name, s in t["methods"].items():
            if s["kind"] != "none":
                ax.plot(c, [speedup(s["tokens_per_round"], s["draft_forwards_per_round"], x) for x in c],
                        color=_color(t, name), label=name)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.axvline(report["draft_cost_ratio"], color="black", lw=0.8, ls="--")
        ax.set_xlabel("drafter forward cost / target forward cost")
        ax.set_ylabel("estimated speed-up (× no drafter)")
        ax.set_title(f"speed-up estimate, {_label(t)}, k = {report['draft_tokens']}", fontsize=10)
    panels[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def benchmarks(report: dict) -> Figure:
    """Acceptance length per benchmark (MT-bench, HumanEval, user files), every method measured there
    (the final drafters, prompt lookup, no drafter), the
    engine's numbers when measured there; the published Kimi-K2.5 drafters' acceptance lengths as
    hatched grey bars beside ours when the report has them."""
    source, temps = benchmark_view(report)
    view = {"temperatures": temps}
    names = [s["name"] for s in report["benchmarks"]["sets"]]
    refs = [r for r in report["benchmarks"]["references"] or [] if r["metric"] == "acceptance_length"]
    fig, panels = _panels(view, 1.6 + 1.2 * len(names) * (1 + 0.2 * len(refs)), 4.0)
    for ax, t in panels:
        summary = t["methods"]
        n = len(summary) + len(refs)
        x = np.arange(len(names))
        w = 0.8 / n
        for i, (name, s) in enumerate(summary.items()):
            vals = [s["per_dataset"].get(b, {}).get("acceptance_length", float("nan")) for b in names]
            bars = ax.bar(x + (i - (n - 1) / 2) * w, vals, w, color=_color(t, name), label=name)
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
        for j, r in enumerate(refs):
            vals = [r["benchmarks"].get(b, float("nan")) for b in names]
            bars = ax.bar(x + (len(summary) + j - (n - 1) / 2) * w, vals, w, color=str(0.55 + 0.2 * j), hatch="//",
                          edgecolor="white", label=f"{r['drafter']} (published)")
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xticks(x, names)
        ax.set_xlabel("benchmark")
        ax.set_ylabel("acceptance length (1 + accepted / drafts)")
        ax.set_ylim(0, max(ax.get_ylim()[1], report["draft_tokens"] + 1) * 1.15)
        ax.set_title(f"benchmarks, {_label(t)}, k = {report['draft_tokens']} ({source})", fontsize=10)
    panels[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def decoder_table(report: dict) -> pd.DataFrame:
    """Where our decoder's acceptance comes from, one row per (temperature, method), on all its
    held-out prompts: the acceptance length with its standard error over prompts, on novel text and
    on text the target repeats (see the module `metrics`); empty when it did not run."""
    rows = [{"T": t["temperature"], "method": name, "acceptance length": s["acceptance_length"],
             "±": s.get("acceptance_length_se"),
             "novel text": s["novel_text"]["acceptance_length"], "novel rounds": s["novel_text"]["rounds"],
             "repeating text": s["repeating_text"]["acceptance_length"],
             "repeating rounds": s["repeating_text"]["rounds"]}
            for t in report["temperatures"].values() for name, s in t["methods"].items() if s["kind"] != "none"]
    return pd.DataFrame(rows)


def _pm(x: float, se: float | None) -> str:
    return f"{x:.2f}" + ("" if se is None else f" ± {se:.2f}")


def against(v: Versus, baseline: str) -> str:
    """The words for `results.versus`'s verdict of the drafter against `baseline`."""
    return {Versus.ABOVE: f"the drafter is above {baseline} beyond noise",
            Versus.BELOW: f"{baseline} is above the drafter beyond noise",
            Versus.WITHIN_NOISE: f"within noise of {baseline}: neither wins"}[v]


def explain_engine(report: dict) -> str:
    """What the engine's numbers say, and where they and our decoder's part (markdown). Every figure
    is a row of `results.results` on all held-out prompts together (the `held-out, all` table above
    and the run's headline), never computed again here."""
    if not report["engine"]:
        return "`eval_backend` is hf: no engine numbers; our decoder's are below."
    e, lines = report["engine"], []
    if report.get("eval_first_pass_prompts"):
        lines.append(f"**A first pass:** the first {report['eval_first_pass_prompts']} prompts of every prompt set "
                     f"(`eval_first_pass_prompts`); run the stage again with 0 to measure the rest.")
    everything = [r for r in results(report) if r.prompt_set == ALL_HELD_OUT]
    for key, t in e["temperatures"].items():
        m, v = t["methods"], t["vs_ours"]
        rows = [r for r in everything if r.temperature == t["temperature"]]
        mode_ = "greedy" if t["temperature"] <= 0 else f"T = {t['temperature']:g}"
        final = next((r for r in rows if r.final), None)
        ngram = next((r for r in rows if r.kind == "ngram"), None)
        speed = "; ".join(f"{r.method} {r.tokens_per_s:.0f} ("
                          + ("each prompt alone" if r.in_flight == 1 else f"up to {r.in_flight} in flight") + ")"
                          for r in rows if r.tokens_per_s is not None)
        speed = (f" Output tok/s per request, each at its own load: {speed} (rows decoded at different loads are "
                 f"not compared)." if speed else "")
        if final is None:  # the drafter's engine could not start here (`gpu_only` below)
            lines.append(f"**vLLM {e['version']}, {mode_}, k = {report['draft_tokens']}:** no drafter engine; ngram "
                         + (_pm(ngram.acceptance_length, ngram.se) if ngram else "n/a") + "." + speed)
            continue
        h = next(x for x in headlines(rows) if x.prompt_set == ALL_HELD_OUT)
        verdict = h.versus_ngram()
        fraction = {name: s.get("fraction") for name, s in m.items()}
        ck = sorted((fraction[r.method] or 0, r.acceptance_length) for r in rows if r.kind == "eagle3")
        line = (f"**vLLM {e['version']}, {mode_}, k = {report['draft_tokens']}, all {final.prompts} held-out prompts:** "
                f"drafter **{_pm(final.acceptance_length, final.se)}**, ngram "
                + (_pm(ngram.acceptance_length, ngram.se) if ngram else "n/a")
                + (f" ({against(verdict[0], 'ngram')})" if verdict else "")
                + "; through training " + " → ".join(f"{a:.2f} ({f:.0%})" for f, a in ck) + "." + speed)
        if final.ours is not None and t["temperature"] <= 0 and v:
            c = v["methods"][final.method]
            line += (f" Our decoder: {final.ours:.2f}. The two targets (vLLM's kernels, "
                     f"transformers) decode {v['same_no_drafter_output']} of {v['prompts']} prompts identically; on "
                     f"{c['same_accepted_per_step']} the accepted count is the same at every verification step (same "
                     f"rule, same float32 weights: only a near-tie argmax that one side breaks the other way can part them).")
        elif final.ours is not None:
            line += (f" Our decoder: {final.ours:.2f}; at T > 0 the two draw different random "
                     f"numbers, so they agree in expectation only (same rule: a draft is accepted with the target's "
                     f"probability of it).")
        elif report.get("hf_scope"):
            line += f" Our decoder did not measure this temperature: it measured {report['hf_scope']['why']}."
        lines.append(line)
    if any(r.kind == "ngram" and r.ours is not None for r in everything):
        lines.append("vLLM's `ngram` and our decoder's prompt lookup are two n-gram matchers that pick different "
                     "matches by design: their figures are not comparable, and the cross-check column says so.")
    for method, line in e.get("gpu_only", {}).items():
        lines.append(f"`{method}` in vLLM: {line} (vLLM's CPU build cannot run it; a GPU build can).")
    if e.get("cpu_expand_kernel_replaced"):
        lines.append("vLLM 0.32.0's CPU build loses the batch's float temperatures in its rejection sampler (T > 0: "
                     "every draft rejected); this run replaced that one kernel with a correct torch version. "
                     "GPU builds (Triton) are not affected.")
    return "\n\n".join(lines)


def explain(report: dict) -> str:
    """What our decoder's numbers say, in a few sentences per temperature (markdown): the figures of
    `decoder_table` (the same summaries), the drafter against our prompt lookup by `results.versus`.
    Beside vLLM these are our decoder's own, against its own n-gram matcher: the verdict on vLLM's
    numbers is `explain_engine`'s."""
    if not report["temperatures"]:
        return "`eval_hf_crosscheck` is false: the engine's numbers only."
    lines = []
    beside = bool(report.get("engine"))
    for t in report["temperatures"].values():
        m = t["methods"]
        d, pl = m["eagle3"], m["prompt lookup"]
        mode_ = "greedy" if t["temperature"] <= 0 else f"sampling at T = {t['temperature']:g}"
        ck = [(s["fraction"], s["acceptance_length"]) for s in m.values() if s["kind"] == "eagle3"]
        v = versus(d["acceptance_length"], d.get("acceptance_length_se"), pl["acceptance_length"],
                   pl.get("acceptance_length_se"))[0]
        line = (f"**{'Our decoder, ' if beside else ''}{mode_}, k = {report['draft_tokens']}:** drafter "
                f"**{_pm(d['acceptance_length'], d.get('acceptance_length_se'))}**, prompt lookup "
                f"{_pm(pl['acceptance_length'], pl.get('acceptance_length_se'))} ({against(v, 'prompt lookup')}"
                + ("; our n-gram matcher, not vLLM's ngram" if beside else "") + "), no drafter 1.00. Through training "
                + " → ".join(f"{a:.2f} ({f:.0%})" for f, a in sorted(ck)) + ". ")
        if len(ck) > 1 and not max(a for _, a in ck) > min(ck)[1]:
            line += "Training did not raise it here" + (
                ": compare stage 05's held-out acc_i with its unigram baseline (a drafter that has not left the "
                "unigram proposes the same token everywhere). " if t["temperature"] <= 0 else ". ")
        rep = d["repeating_text"]["rounds"] / d["rounds"] if d["rounds"] else 0.0
        nv, rp = d["novel_text"], pl["repeating_text"]
        if v == Versus.BELOW:
            line += (f"{rep:.0%} of the drafter's rounds fall in text the target is repeating (after its first "
                     f"repeated {LOOP_NGRAM}-gram), where copying from the context is almost always right (prompt "
                     f"lookup {rp['acceptance_length']:.2f} there). ")
        if nv["rounds"]:
            line += (f"On novel text ({nv['rounds']} drafter rounds before the first repeat) the drafter reaches "
                     f"{nv['acceptance_length']:.2f} against prompt lookup's {pl['novel_text']['acceptance_length']:.2f}. ")
        if t["temperature"] > 0:
            line += (f"Its first draft is accepted {d['position_acceptance'][0]:.1%} of the time; a perfect drafter's "
                     f"would be {d['position1_ceiling']:.1%} (the target's mean probability of its own top token), "
                     f"so at this temperature no drafter can do much better on this target.")
        lossless = d["lossless"]
        if lossless is not None:
            line += " Outputs equal the target's greedy decoding: " + ("yes, every method." if all(
                s["lossless"] for s in m.values()) else "NO — see `mismatched_samples` in the report.")
        lines.append(line.replace("  ", " ").strip())
    scope = report.get("hf_scope")
    if scope and not scope["benchmarks"]:
        lines.append(f"Our decoder measured {scope['why']}; vLLM's numbers above are the measurement.")
    return "\n\n".join(lines)


def benchmark_view(report: dict) -> tuple[str, dict]:
    """Which numbers the benchmark table and figure show: the engine's when stage 06 measured in
    vLLM, else our decoder's; (name of the source, temperature key -> summaries)."""
    b = report["benchmarks"]
    if b["engine"]:
        return f"vLLM {b['engine']['version']}", b["engine"]["temperatures"]
    return "our decoder", b["temperatures"]


def load(engine: dict) -> str:
    """How many requests the engine's rows were decoded with in flight (acceptance does not depend
    on it; tok/s per request does)."""
    n = engine.get("concurrency", [1])
    if n == [1]:
        return "each prompt alone"
    return f"up to {' / '.join(str(c) for c in n)} prompts in flight"


def explain_benchmarks(report: dict) -> str:
    """What the benchmark table says, and how the published figures beside it were measured (markdown)."""
    b = report.get("benchmarks")
    if not b:
        return "`eval_benchmarks` is empty: no benchmark prompts were measured."
    source, temps = benchmark_view(report)
    sets = "; ".join(f"{s['name']}: {s['prompts']} prompt(s) of {s['turns']} turn(s), up to {s['max_new_tokens']} "
                     f"new tokens per turn ({s['source']})" for s in b["sets"])
    lines = [f"Measured in {source}, k = {report['draft_tokens']} drafts in a chain (SGLang 3-1-4 for k = 3), "
             f"{load(b['engine']) if b['engine'] else 'each prompt alone'}; {sets}."]
    held = report["engine"]["temperatures"] if b["engine"] else report["temperatures"]
    for key, t in temps.items():
        m = t["methods"]
        final = next(n for n, s in m.items() if s["kind"] == "eagle3" and s.get("final"))
        mode = "greedy" if t["temperature"] <= 0 else f"T = {t['temperature']:g}"
        line = f"**{mode}:** " + "; ".join(
            f"{s['name']} {m[final]['per_dataset'].get(s['name'], {}).get('acceptance_length', float('nan')):.2f}"
            for s in b["sets"]) + " with the drafter (no drafter: 1.00)"
        mine = held.get(key, {}).get("methods", {}).get(final)
        if mine:
            line += f"; on the held-out prompts of this run {mine['acceptance_length']:.2f}"
        lines.append(line + ".")
    if b["references"]:
        lines.append("The target is Kimi-K2.5: the published drafters' figures are beside ours, as their cards give "
                     "them (references, not measured here): " + "; ".join(
                         f"[{r['drafter']}]({r['source']}): {r['kind']}, {r['setting']}, {r['how']}" for r in b["references"]))
    return "\n\n".join(lines)
