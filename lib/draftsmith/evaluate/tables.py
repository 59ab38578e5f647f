"""What notebook 06 shows of the report: tables of acceptance per method, and what the numbers say in words.

Each function takes the whole report and says so in words when the part it shows was not measured
(`eval_backend: hf`: no engine numbers; `eval_hf_crosscheck: false`: none of our decoder's).
"""

from __future__ import annotations

import pandas as pd

from .metrics import LOOP_NGRAM


def table(summary: dict, temperature: float) -> pd.DataFrame:
    """One row per method: acceptance (both conventions), per dataset, novel/repeating text."""
    rows = []
    for name, s in summary.items():
        row = {"T": temperature, "method": name, "acceptance length": s["acceptance_length"],
               "vLLM 1+acc/drafts": s["acceptance_length_vllm"],
               "draft acceptance rate": s["draft_acceptance_rate"]}
        row |= {f"{ds}": v["acceptance_length"] for ds, v in s["per_dataset"].items()}
        row |= {"P(draft 1)": s["position_acceptance"][0],
                "novel text": s["novel_text"]["acceptance_length"],
                "repeating text": s["repeating_text"]["acceptance_length"],
                "speed-up est.": s["speedup_estimate"], "lossless": s["lossless"]}
        rows.append(row)
    return pd.DataFrame(rows)


def decoder_table(report: dict) -> pd.DataFrame:
    """Our decoder's numbers, one row per (temperature, method); empty when it did not run."""
    if not report["temperatures"]:
        return pd.DataFrame()
    return pd.concat([table(t["methods"], t["temperature"]) for t in report["temperatures"].values()],
                     ignore_index=True).round(3)


def engine_table(report: dict) -> pd.DataFrame:
    """The engine's numbers, one row per (temperature, method), our decoder's acceptance beside them;
    empty when no engine measured."""
    if not report["engine"]:
        return pd.DataFrame()
    rows = []
    for key, t in report["engine"]["temperatures"].items():
        ours = report["temperatures"].get(key, {}).get("methods", {})
        for name, s in t["methods"].items():
            mine = ours.get("prompt lookup" if s["kind"] == "ngram" else name, {})
            row = {"T": t["temperature"], "method": name, "acceptance length": s["acceptance_length"]}
            row |= {ds: v["acceptance_length"] for ds, v in s["per_dataset"].items()}
            row |= {f"P(pos {j + 1})": p for j, p in enumerate(s["position_acceptance"])}
            row |= {"tok/s": s["tokens_per_s"], "× none": s["speedup_tokens_per_s"], "lossless": s["lossless"],
                    "ours": mine.get("acceptance_length_vllm")}
            rows.append(row)
    return pd.DataFrame(rows).round(3)


def explain_engine(report: dict) -> str:
    """What the engine's numbers say, and where they and our decoder's part (markdown)."""
    if not report["engine"]:
        return "`eval_backend` is hf: no engine numbers; our decoder's are below."
    e, lines = report["engine"], []
    for key, t in e["temperatures"].items():
        m, v = t["methods"], t["vs_ours"]
        mode = "greedy" if t["temperature"] <= 0 else f"T = {t['temperature']:g}"
        found = next(((n, s) for n, s in m.items() if s["kind"] == "eagle3" and s.get("final")), None)
        if found is None:  # the drafter's engine could not start here (`gpu_only` below)
            lines.append(f"**vLLM {e['version']}, {mode}, k = {report['k']}:** no drafter engine; ngram "
                         f"{m['ngram']['acceptance_length']:.2f} tokens per verification, "
                         f"{m['none']['tokens_per_s']:.0f} tok/s without speculation.")
            continue
        name, final = found
        ck = sorted((s["fraction"], s["acceptance_length"]) for s in m.values() if s["kind"] == "eagle3")
        line = (f"**vLLM {e['version']}, {mode}, k = {report['k']}:** drafter **{final['acceptance_length']:.2f}**, "
                f"ngram {m['ngram']['acceptance_length']:.2f} tokens per verification "
                f"({'the drafter wins' if final['acceptance_length'] > m['ngram']['acceptance_length'] else 'ngram wins'}); "
                f"through training " + " → ".join(f"{a:.2f} ({f:.0%})" for f, a in ck)
                + f". Output {final['tokens_per_s']:.0f} tok/s with the drafter, {m['none']['tokens_per_s']:.0f} without "
                  f"({final['speedup_tokens_per_s']:.2f}x).")
        ours = report["temperatures"].get(key, {}).get("methods", {}).get(name)
        if ours and t["temperature"] <= 0:
            c = v["methods"][name]
            line += (f" Our decoder: {ours['acceptance_length_vllm']:.2f}. The two targets (vLLM's kernels, "
                     f"transformers) decode {v['same_no_drafter_output']} of {v['prompts']} prompts identically; on "
                     f"{c['same_accepted_per_step']} the accepted count is the same at every verification step (same "
                     f"rule, same float32 weights: only a near-tie argmax that one side breaks the other way can part them).")
        elif ours:
            line += (f" Our decoder: {ours['acceptance_length_vllm']:.2f}; at T > 0 the two draw different random "
                     f"numbers, so they agree in expectation only (same rule: a draft is accepted with the target's "
                     f"probability of it).")
        lines.append(line)
    for method, line in e.get("gpu_only", {}).items():
        lines.append(f"`{method}` in vLLM: {line} (vLLM's CPU build cannot run it; a GPU build can).")
    if e.get("cpu_expand_kernel_replaced"):
        lines.append("vLLM 0.32.0's CPU build loses the batch's float temperatures in its rejection sampler (T > 0: "
                     "every draft rejected); this run replaced that one kernel with a correct torch version. "
                     "GPU builds (Triton) are not affected.")
    return "\n\n".join(lines)


def explain(report: dict) -> str:
    """What our decoder's numbers say, in a few sentences per temperature (markdown)."""
    if not report["temperatures"]:
        return "`eval_hf_crosscheck` is false: the engine's numbers only."
    lines = []
    for t in report["temperatures"].values():
        m, v = t["methods"], t["verdict"]
        d = m["eagle3"]
        mode = "greedy" if t["temperature"] <= 0 else f"sampling at T = {t['temperature']:g}"
        ck = [(s["fraction"], s["acceptance_length"]) for s in m.values() if s["kind"] == "eagle3"]
        line = (f"**{mode}, k = {report['k']}:** drafter **{v['drafter']:.2f}**, prompt lookup "
                f"{v['prompt_lookup']:.2f}, no drafter 1.00 tokens per verification. Through training "
                + " → ".join(f"{a:.2f} ({f:.0%})" for f, a in sorted(ck)) + ". ")
        if len(ck) > 1 and not max(a for _, a in ck) > min(ck)[1]:
            line += "Training did not raise it here" + (
                ": compare stage 05's held-out acc_i with its unigram baseline (a drafter that has not left the "
                "unigram proposes the same token everywhere). " if t["temperature"] <= 0 else ". ")
        rep = d["repeating_text"]["rounds"] / d["rounds"] if d["rounds"] else 0.0
        nv, rp = v["novel_text"], v["repeating_text"]
        if v["beats_prompt_lookup"]:
            line += f"The drafter beats prompt lookup by {v['drafter'] / v['prompt_lookup']:.2f}x. "
        else:
            line += (f"Prompt lookup wins here: {rep:.0%} of the drafter's rounds fall in text the target is "
                     f"repeating (after its first repeated {LOOP_NGRAM}-gram), where copying from the context is "
                     f"almost always right (prompt lookup {rp['prompt_lookup']:.2f} there). ")
        if nv["rounds"]:
            line += (f"On novel text ({nv['rounds']} drafter rounds before the first repeat) the drafter reaches "
                     f"{nv['drafter']:.2f} against prompt lookup's {nv['prompt_lookup']:.2f}. ")
        if t["temperature"] > 0:
            line += (f"Its first draft is accepted {d['position_acceptance'][0]:.1%} of the time; a perfect drafter's "
                     f"would be {d['position1_ceiling']:.1%} (the target's mean probability of its own top token), "
                     f"so at this temperature no drafter can do much better on this target.")
        lossless = d["lossless"]
        if lossless is not None:
            line += " Outputs equal the target's greedy decoding: " + ("yes, every method." if all(
                s["lossless"] for s in m.values()) else "NO — see `mismatched_samples` in the report.")
        lines.append(line.replace("  ", " ").strip())
    return "\n\n".join(lines)


def benchmark_view(report: dict) -> tuple[str, dict]:
    """Which numbers the benchmark table and figure show: the engine's when stage 06 measured in
    vLLM, else our decoder's; (name of the source, temperature key -> summaries)."""
    b = report["benchmarks"]
    if b["engine"]:
        return f"vLLM {b['engine']['version']}", b["engine"]["temperatures"]
    return "our decoder", b["temperatures"]


def benchmark_table(report: dict) -> pd.DataFrame:
    """One row per (temperature, benchmark): acceptance length of every method (each export, vLLM's
    ngram or our prompt lookup, no drafter), the final drafter per draft position and its output
    tok/s against no drafter; when the target is Kimi-K2.5 the published drafters' figures beside
    (`published`), for a benchmark they report. Empty when no benchmark was asked for."""
    if not report.get("benchmarks"):
        return pd.DataFrame()
    source, temps = benchmark_view(report)
    sets = {s["name"]: s for s in report["benchmarks"]["sets"]}
    refs = report["benchmarks"]["references"] or []
    rows = []
    for t in temps.values():
        methods = t["methods"]
        final = next(n for n, s in methods.items() if s["kind"] == "eagle3" and s.get("final"))
        for name, info in sets.items():
            row = {"T": t["temperature"], "benchmark": name, "prompts": info["prompts"], "turns": info["turns"],
                   "max_new_tokens": info["max_new_tokens"], "measured in": source}
            per = {m: s["per_dataset"].get(name, {}) for m, s in methods.items()}
            row |= {m: p.get("acceptance_length") for m, p in per.items()}
            row |= {f"{final} P(pos {j + 1})": p for j, p in enumerate(per[final].get("position_acceptance", []))}
            row[f"{final} draft acceptance rate"] = per[final].get("draft_acceptance_rate")
            if "tokens_per_s" in per[final]:
                row |= {"tok/s none": per["none"].get("tokens_per_s"), f"tok/s {final}": per[final]["tokens_per_s"]}
            row |= {f"{r['drafter']} (published{', rate' if r['metric'] != 'acceptance_length' else ''})":
                    r["benchmarks"].get(name) for r in refs}
            rows.append(row)
    return pd.DataFrame(rows).round(3)


def explain_benchmarks(report: dict) -> str:
    """What the benchmark table says, and how the published figures beside it were measured (markdown)."""
    b = report.get("benchmarks")
    if not b:
        return "`eval_benchmarks` is empty: no benchmark prompts were measured."
    source, temps = benchmark_view(report)
    lines = [f"Measured in {source}, k = {report['k']} drafts in a chain (SGLang 3-1-4 for k = 3), each prompt "
             f"alone; " + "; ".join(f"{s['name']}: {s['prompts']} prompt(s) of {s['turns']} turn(s), up to "
                                    f"{s['max_new_tokens']} new tokens per turn ({s['source']})" for s in b["sets"]) + "."]
    held = report["engine"]["temperatures"] if b["engine"] else report["temperatures"]
    for key, t in temps.items():
        m = t["methods"]
        final = next(n for n, s in m.items() if s["kind"] == "eagle3" and s.get("final"))
        mode = "greedy" if t["temperature"] <= 0 else f"T = {t['temperature']:g}"
        line = f"**{mode}:** " + "; ".join(
            f"{s['name']} {m[final]['per_dataset'].get(s['name'], {}).get('acceptance_length', float('nan')):.2f}"
            for s in b["sets"]) + " tokens per verification with the drafter (no drafter: 1.00)"
        mine = held.get(key, {}).get("methods", {}).get(final)
        if mine:
            line += f"; on the held-out prompts of this run {mine['acceptance_length']:.2f}"
        lines.append(line + ".")
    if b["references"]:
        lines.append("The target is Kimi-K2.5: the published drafters' figures are beside ours, as their cards give "
                     "them (references, not measured here): " + "; ".join(
                         f"[{r['drafter']}]({r['source']}): {r['kind']}, {r['setting']}, {r['how']}" for r in b["references"]))
    return "\n\n".join(lines)
