"""Stage 06's results in one definition, the field's: acceptance length = 1 + accepted / drafts per
verification step, as vLLM's and SGLang's counters give it (no drafter: 1).

One `Result` per (temperature, prompt set, method): measured in vLLM where stage 06 measured there,
else by our decoder. Beside an engine figure stands our decoder's on the same prompts as a
cross-check: at T = 0 the two must agree to the shown precision; at T > 0 they draw different random
numbers and must agree within their sampling noise. Output tok/s appears only where the engine
measured it. For a Kimi-K2.5 target the published drafters' benchmark figures are rows of their own,
marked as references.

`python -m draftsmith.evaluate.results RUN [--readme README.md] [--save FILE]` prints a run's table
for the README, writes it between the README's markers and saves the rows it came from.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from pathlib import Path

import pandas as pd

from ..files import write_text_atomic
from ..paths import Run
from ..verdicts import Figure, Note, Reason, Verdict, read_file
from .outputs import read_report, results_csv_path

PUBLISHED = "published (model card)"
GREEDY_AGREEMENT = 0.005          # at T = 0 the two figures are equal as shown (three decimals)
README_BEGIN = "<!-- stage 06 results: python -m draftsmith.evaluate.results -->"
README_END = "<!-- end of stage 06 results -->"
ALL_HELD_OUT = "held-out, all"   # the held-out prompts of every dataset together
SET_NAMES = {"mt_bench": "MT-bench", "humaneval": "HumanEval", "gsm8k": "GSM8K", "math500": "MATH-500"}


@dataclass(frozen=True)
class Result:
    temperature: float
    prompt_set: str                     # "held-out chat", "MT-bench", ...
    method: str                         # "none", "ngram", "eagle3 50%", "eagle3", a published drafter
    kind: str                           # none | ngram | prompt_lookup | eagle3 | dflash | published
    final: bool                         # the drafter a user ships (the last eagle3 export)
    measured_in: str                    # "vLLM 0.32.0", "our decoder" or PUBLISHED
    acceptance_length: float | None
    drafts: int | None                  # verification steps that drafted: the length's denominator
    draft_acceptance_rate: float | None
    position_acceptance: tuple          # P(draft j accepted), j = 1..k
    lossless: bool | None               # T = 0: outputs equal no drafter's token for token
    tokens_per_s: float | None          # measured by the engine, per request at its load `in_flight`
    in_flight: int | None               # requests in flight as the method's rows were decoded (its load)
    ours: float | None                  # our decoder's acceptance length on the same prompts
    ours_agrees: bool | None
    prompts: int | None = None          # the prompts measured: the sample the standard error is over
    acceptance_length_se: float | None = None   # over the prompts; None: one prompt, or an older report
    k: int | None = None                # drafts per verification step

    @property
    def se(self) -> float | None:
        """The acceptance length's standard error: over prompts where the report has it, else the
        bound `noise` (a report written before it), None where neither can be had."""
        if self.acceptance_length_se is not None:
            return self.acceptance_length_se
        return noise(self.drafts, self.k) if self.drafts and self.k else None


def noise(drafts: int | None, k: int) -> float:
    """A bound on one acceptance length's standard error: accepted per step lies in [0, k] (steps
    taken as independent; `Result.se` uses it only where a report has no standard error over prompts)."""
    return k / (2 * math.sqrt(drafts)) if drafts else math.inf


def agrees(engine: dict, ours: dict, temperature: float, k: int) -> bool:
    """Greedy: the same to the shown precision; sampling: within two standard errors of the difference."""
    diff = abs(engine["acceptance_length"] - ours["acceptance_length"])
    if temperature <= 0:
        return diff < GREEDY_AGREEMENT
    se = math.hypot(noise(engine.get("drafts"), k), noise(ours.get("drafts"), k))
    return diff <= 2 * se


def _set_name(name: str, held_out: bool) -> str:
    return f"held-out {name}" if held_out else SET_NAMES.get(name, name)


def _part(temps: dict, ours_temps: dict, source: str, held_out: bool, draft_tokens: int) -> list[Result]:
    out = []
    for key, t in temps.items():
        temperature = float(t["temperature"])
        ours_methods = (ours_temps or {}).get(key, {}).get("methods", {})
        final = next((n for n, s in t["methods"].items() if s["kind"] == "eagle3" and s.get("final")),
                     "eagle3" if "eagle3" in t["methods"] else None)
        sets = sorted({ds for s in t["methods"].values() for ds in s.get("per_dataset", {})})
        # the held-out prompts of every dataset together are a prompt set too: the run's headline
        for ds in sets + ([ALL_HELD_OUT] if held_out and sets else []):
            for name, s in t["methods"].items():
                p = s if ds == ALL_HELD_OUT else s.get("per_dataset", {}).get(ds)
                if p is None or p.get("acceptance_length") is None:
                    continue
                k = s.get("k", draft_tokens)
                mine = None
                if source != "our decoder":
                    twin = ours_methods.get("prompt lookup" if s["kind"] == "ngram" else name, {})
                    mine = twin if ds == ALL_HELD_OUT else twin.get("per_dataset", {}).get(ds)
                    mine = mine if mine and mine.get("acceptance_length") is not None else None
                out.append(Result(
                    temperature, ds if ds == ALL_HELD_OUT else _set_name(ds, held_out), name, s["kind"], name == final,
                    source, p.get("acceptance_length"), p.get("drafts"),
                    p.get("draft_acceptance_rate"), tuple(p.get("position_acceptance") or ()),
                    s.get("lossless") if temperature <= 0 else None, p.get("tokens_per_s"), s.get("in_flight"),
                    mine["acceptance_length"] if mine else None,
                    agrees(p, mine, temperature, k) if mine and s["kind"] != "ngram" else None,
                    p.get("prompts"), p.get("acceptance_length_se"), k))
    return out


def _published(report: dict, sets: list[str], temperatures: list[float]) -> list[Result]:
    refs = (report.get("benchmarks") or {}).get("references") or []
    out = []
    for temperature in temperatures:
        for name in sets:
            for r in refs:
                v = r["benchmarks"].get(name)
                if v is None:
                    continue
                length = v if r["metric"] == "acceptance_length" else None
                rate = v if r["metric"] == "draft_acceptance_rate" else None
                out.append(Result(temperature, _set_name(name, False), r["drafter"], "published", False, PUBLISHED,
                                  length, None, rate, (), None, None, None, None, None))
    return out


def results(report: dict) -> list[Result]:
    """Every result of a stage 06 report, by temperature: the held-out prompts, then the benchmarks,
    then the published figures; the engine's numbers when it measured, else our decoder's."""
    k = report.get("draft_tokens")
    engine, bench = report.get("engine"), report.get("benchmarks") or {}
    if engine:
        source = f"vLLM {engine['version']}"
        rows = _part(engine["temperatures"], report["temperatures"], source, True, k)
    else:
        rows = _part(report["temperatures"], {}, "our decoder", True, k)
    if bench.get("engine"):
        b = _part(bench["engine"]["temperatures"], bench.get("temperatures"), f"vLLM {bench['engine']['version']}",
                  False, k)
    else:
        b = _part(bench.get("temperatures") or {}, {}, "our decoder", False, k)
    names = [s["name"] for s in bench.get("sets", [])]
    return sorted(rows + b + _published(report, names, sorted({r.temperature for r in b})),
                  key=lambda r: r.temperature)


def mode(temperature: float) -> str:
    return "greedy (T = 0)" if temperature <= 0 else f"sampling (T = {temperature:g})"


def _cross_check(r: Result) -> str:
    """Whether our decoder agrees; vLLM's ngram beside our prompt lookup is "not comparable": the two
    n-gram implementations pick different matches by design, so no agreement is expected."""
    if r.ours is None:
        return "not measured"
    if r.kind == "ngram":
        return f"not comparable (another n-gram matcher), {r.ours - r.acceptance_length:+.3f}"
    return f"{'yes' if r.ours_agrees else 'no'}, {r.ours - r.acceptance_length:+.3f}"


def tables(report: dict) -> dict[str, pd.DataFrame]:
    """Title -> one table per temperature and prompt set, methods as rows; where one source measured
    every row, the title names it ("greedy (T = 0) · held-out chat · vLLM 0.32.0")."""
    rows = results(report)
    measured_speed, cross_checked = (any(x.tokens_per_s is not None for x in rows),
                                     any(x.ours is not None for x in rows))
    out: dict[str, list] = {}
    for r in rows:
        key = f"{mode(r.temperature)} · {r.prompt_set}"
        row = {"method": r.method + (" (final)" if r.final else ""), "measured in": r.measured_in,
               "acceptance length": r.acceptance_length,
               "± (standard error over prompts)": r.acceptance_length_se, "prompts": r.prompts,
               "draft acceptance rate": r.draft_acceptance_rate}
        row |= {f"P(draft {j + 1})": p for j, p in enumerate(r.position_acceptance)}
        if r.temperature <= 0:
            row["lossless"] = r.lossless
        if measured_speed:   # beside its load only: rows decoded at different loads are not compared
            row |= {"output tok/s per request (measured)": r.tokens_per_s, "requests in flight": r.in_flight}
        if cross_checked:
            row["our decoder agrees (by how much)"] = "n/a" if r.kind == "published" else _cross_check(r)
        out.setdefault(key, []).append(row)
    frames = {}
    for key, v in out.items():   # one source for the whole table: named in its title, not on every row
        df = pd.DataFrame(v)
        sources = df["measured in"].unique()
        frames[f"{key} · {sources[0]}" if len(sources) == 1 else key] = \
            df.drop(columns="measured in") if len(sources) == 1 else df
    return frames


MARGIN_SE = 2.0   # a gap counts beyond noise past this many standard errors of the difference


class Versus(str, Enum):
    """The final drafter against a baseline on one prompt set at one temperature."""
    ABOVE = "above"                     # higher by more than MARGIN_SE standard errors of the difference
    WITHIN_NOISE = "within noise"
    BELOW = "below"                     # lower by more than that


def versus(a: float, a_se: float | None, b: float, b_se: float | None) -> tuple[Versus, float, float | None]:
    """(the verdict, the gap a - b, the margin: MARGIN_SE standard errors of the difference). Where
    neither figure has a standard error the margin is None and any gap decides."""
    gap = a - b
    margin = None if a_se is None and b_se is None else MARGIN_SE * math.hypot(a_se or 0.0, b_se or 0.0)
    if gap > (margin or 0.0):
        return Versus.ABOVE, gap, margin
    if gap < -(margin or 0.0):
        return Versus.BELOW, gap, margin
    return Versus.WITHIN_NOISE, gap, margin


@dataclass
class Headline:
    """One prompt set at one temperature: the final drafter, the n-gram baseline and no drafter, each
    with its standard error over prompts and the prompts counted; `lossless`: at T = 0, whether the
    drafter's outputs equal no drafter's (None where not compared)."""

    prompt_set: str
    temperature: float
    drafter: float | None = None
    ngram: float | None = None
    no_drafter: float | None = None
    lossless: bool | None = None
    drafter_se: float | None = None
    ngram_se: float | None = None
    drafter_prompts: int | None = None
    ngram_prompts: int | None = None

    def versus_ngram(self) -> tuple[Versus, float, float | None] | None:
        """The drafter against ngram (`versus`); None where either was not measured."""
        if self.drafter is None or self.ngram is None:
            return None
        return versus(self.drafter, self.drafter_se, self.ngram, self.ngram_se)


def headlines(rows: list[Result]) -> list[Headline]:
    """Per temperature and prompt set (held-out first): the three figures a reader compares first."""
    out: dict[tuple, Headline] = {}
    for r in rows:
        h = out.setdefault((r.temperature, r.prompt_set), Headline(r.prompt_set, r.temperature))
        if r.final:
            h.drafter, h.lossless, h.drafter_se, h.drafter_prompts = r.acceptance_length, r.lossless, r.se, r.prompts
        elif r.kind in ("ngram", "prompt_lookup"):
            h.ngram, h.ngram_se, h.ngram_prompts = r.acceptance_length, r.se, r.prompts
        elif r.kind == "none":
            h.no_drafter = r.acceptance_length
    return sorted(out.values(), key=lambda h: (h.temperature, not h.prompt_set.startswith("held-out")))


def frame(rows: list[Result]) -> pd.DataFrame:
    """The results as data, `eval/results.csv`: one row per method x prompt set x temperature, the
    acceptance length with its standard error over prompts and its counts (prompts, drafts), the
    draft acceptance rate, P(draft j accepted) for j = 1..k (empty past a row's own k), k and lossless."""
    width = max((len(r.position_acceptance) for r in rows), default=0)
    return pd.DataFrame([{
        "temperature": r.temperature, "prompt_set": r.prompt_set, "method": r.method, "kind": r.kind,
        "final": r.final, "measured_in": r.measured_in, "acceptance_length": r.acceptance_length,
        "acceptance_length_se": r.acceptance_length_se, "prompts": r.prompts, "drafts": r.drafts,
        "draft_acceptance_rate": r.draft_acceptance_rate, "k": r.k, "lossless": r.lossless,
        **{f"p_accept_{j + 1}": (r.position_acceptance[j] if j < len(r.position_acceptance) else None)
           for j in range(width)}} for r in rows],
        columns=["temperature", "prompt_set", "method", "kind", "final", "measured_in", "acceptance_length",
                 "acceptance_length_se", "prompts", "drafts", "draft_acceptance_rate", "k", "lossless"]
        + [f"p_accept_{j + 1}" for j in range(width)])


def write_csv(run: Run, report: dict) -> Path:
    """`<run>/eval/results.csv` from the stage's report (`frame`)."""
    path = results_csv_path(run)
    write_text_atomic(path, frame(results(report)).to_csv(index=False))
    return path


@dataclass
class RunHeadline:
    """The run in one line: the final drafter's acceptance length on all the held-out prompts at the
    first greedy temperature (else the first one), with its standard error over prompts, against
    ngram and no drafter; lossless as measured there."""

    temperature: float
    prompts: int | None
    measured_in: str
    drafter: float
    drafter_se: float | None
    ngram: float | None
    ngram_se: float | None
    no_drafter: float
    lossless: bool | None

    def versus_ngram(self) -> Versus | None:
        return None if self.ngram is None else versus(self.drafter, self.drafter_se, self.ngram, self.ngram_se)[0]

    def text(self) -> str:
        pm = lambda x, se: f"{x:.2f}" + ("" if se is None else f" ± {se:.2f}")
        v = self.versus_ngram()
        against = ("" if v is None else " (above ngram beyond noise)" if v == Versus.ABOVE else
                   " (below ngram beyond noise)" if v == Versus.BELOW else " (within noise of ngram)")
        return (f"headline: final drafter {pm(self.drafter, self.drafter_se)}{against}, ngram "
                + ("n/a" if self.ngram is None else pm(self.ngram, self.ngram_se)) + f", no drafter {self.no_drafter:.2f}: "
                f"{'greedy' if self.temperature <= 0 else f'T = {self.temperature:g}'} acceptance length on "
                + (f"{self.prompts} " if self.prompts is not None else "the ") + f"held-out prompts, {self.measured_in}"
                + ("" if self.lossless is None else ", lossless" if self.lossless else ", NOT lossless"))


def run_headline(report: dict) -> RunHeadline | None:
    """The run's headline: the rows of `results` on all held-out prompts together (ALL_HELD_OUT) at
    the first greedy temperature (else the first one), the same figures the tables show; None where
    the final drafter was not measured there."""
    rows = [r for r in results(report) if r.prompt_set == ALL_HELD_OUT]
    temperatures = sorted({r.temperature for r in rows}, key=lambda t: (t > 0, t))
    for t in temperatures[:1]:
        at = [r for r in rows if r.temperature == t]
        final = next((r for r in at if r.final), None)
        if final is None:
            return None
        ngram = next((r for r in at if r.kind in ("ngram", "prompt_lookup")), None)
        return RunHeadline(t, final.prompts, final.measured_in, final.acceptance_length, final.se,
                           ngram and ngram.acceptance_length, ngram and ngram.se, 1.0, final.lossless)
    return None


def readme_table(rows: list[Result]) -> str:
    """The README's markdown table: each figure ± its standard error over prompts, the prompts
    counted beside the set; drafter or n-gram in bold where it is above the other beyond noise
    (`versus`), neither where the gap is within it."""
    lines = ["| | prompts (count) | final drafter | n-gram baseline | no drafter |", "|---|---|---|---|---|"]
    for h in headlines(rows):
        v = h.versus_ngram()
        best = None if v is None or v[0] == Versus.WITHIN_NOISE else h.drafter if v[0] == Versus.ABOVE else h.ngram

        def cell(x, se=None):
            if x is None:
                return "n/a"
            text = f"{x:.2f}" + ("" if se is None else f" ± {se:.2f}")
            return f"**{text}**" if best is not None and x == best else text

        mode = "greedy" if h.temperature <= 0 else f"T = {h.temperature:g}"
        count = "" if h.drafter_prompts is None else f" ({h.drafter_prompts})"
        lines.append(f"| {mode} | {h.prompt_set}{count} | {cell(h.drafter, h.drafter_se)} | {cell(h.ngram, h.ngram_se)} "
                     f"| {cell(h.no_drafter)} |")
    return "\n".join(lines)


def load(path: Path) -> list[Result]:
    """Rows saved by `main --save` (fields an older version saved and this one has not are left out)."""
    names = {f.name for f in fields(Result)}
    return [Result(**{**{k: v for k, v in d.items() if k in names}, "in_flight": d.get("in_flight"),
                      "position_acceptance": tuple(d["position_acceptance"])})
            for d in json.loads(path.read_text(encoding="utf-8"))]


def readme_block(text: str, path: Path) -> str:
    """The table between the README's markers; a clear error naming the file when they are missing."""
    m = re.search(re.escape(README_BEGIN) + r"\n(.*?)\n" + re.escape(README_END), text, re.S)
    if not m:
        raise ValueError(f"{path}: no stage 06 results block (the lines {README_BEGIN!r} ... {README_END!r})")
    return m.group(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draftsmith.evaluate.results", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run folder that stage 06 measured")
    ap.add_argument("--readme", type=Path, help="write the table between this file's markers")
    ap.add_argument("--save", type=Path, help="save the rows as JSON (what the README's table is checked against)")
    a = ap.parse_args(argv)
    report = read_report(Run(a.run.parent, a.run.name))
    rows = results(report)
    table = readme_table(rows)
    if a.save:
        a.save.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n", encoding="utf-8")
    if a.readme:
        text = a.readme.read_text(encoding="utf-8")
        a.readme.write_text(text.replace(readme_block(text, a.readme), table), encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ---- the stage's verdict, for the run summary (`draftsmith.summary` assembles the stages') ----

def _length(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


@dataclass
class EngineRan:
    method: str                         # the engine's method (none, ngram, an export)
    prompt_sets: str                    # "held-out" or "benchmarks": each set of prompts has its engines
    model_runner: str | None            # v1 or v2; where the engine did not start, the one asked for
    model_runner_class: str | None      # the runner's class as the worker held it; None: it did not start
    started: bool


@dataclass
class EvalNumbers:
    source: str                         # "vllm" (the engine's counters) or "decoder" (ours, eval_backend hf)
    drafter: str                        # the method measured as "the drafter"
    rows: list[Headline]                # the final drafter, n-gram and no drafter per prompt set and T
    engines: list[EngineRan] = field(default_factory=list)  # every vLLM engine of the report (none: no vLLM)
    engine_env: dict = field(default_factory=dict)          # the job's engine settings as the engines held them
    disable_custom_all_reduce: bool | None = None
    kv_cache_dtype: str | None = None
    headline: RunHeadline | None = None     # the run's headline (`run_headline`)


def _pm(x: float | None, se: float | None) -> str:
    """An acceptance length with its standard error: `1.76 ± 0.05`."""
    return _length(x) + ("" if x is None or se is None else f" ± {se:.2f}")


def _count(prompts: int | None) -> str:
    return "" if prompts is None else f" ({prompts} prompt{'s' * (prompts != 1)})"


def verdict(run: Run, anchor: str):
    """Stage 06's line of the run summary from eval/report.json: (EvalNumbers, verdict, figures, notes);
    failed when the drafter changed greedy outputs or nothing was measured."""
    r = read_file(run, read_report, run)
    n = EvalNumbers("vllm" if r.get("engine") else "decoder", "eagle3", headlines(results(r)),
                    headline=run_headline(r))
    parts = [("held-out", r.get("engine")), ("benchmarks", (r.get("benchmarks") or {}).get("engine"))]
    n.engines = [EngineRan(name, where, e.get("model_runner"), e.get("model_runner_class"), bool(e.get("started")))
                 for where, part in parts if part for name, e in (part.get("engines") or {}).items()]
    if r.get("engine"):
        n.engine_env = r["engine"].get("engine_env") or {}
        n.disable_custom_all_reduce = r["engine"].get("disable_custom_all_reduce")
        n.kv_cache_dtype = r["engine"].get("kv_cache_dtype")
    engines = ([Figure(f"vLLM engines ({where}): " + ", ".join(
        f"{e.method} {e.model_runner or '?'} ({e.model_runner_class if e.started else 'did not start'})"
        for e in n.engines if e.prompt_sets == where), anchor) for where in ("held-out", "benchmarks")
        if any(e.prompt_sets == where for e in n.engines)] +
        ([Figure(f"engine settings: engine_env {' '.join(f'{k}={v}' for k, v in n.engine_env.items()) or 'none'}, "
                 f"custom all-reduce {'off' if n.disable_custom_all_reduce else 'on'}, KV cache {n.kv_cache_dtype}",
                 anchor)] if n.kv_cache_dtype is not None else []))
    figures = engines + [Figure(f"{row.prompt_set} T={row.temperature:g}: acceptance {_pm(row.drafter, row.drafter_se)}"
                                f"{_count(row.drafter_prompts)} vs ngram {_pm(row.ngram, row.ngram_se)}, none "
                                f"{_length(row.no_drafter)}" + ("" if row.lossless is None else
                                                             ", lossless" if row.lossless else ", NOT lossless"), anchor)
                         for row in n.rows]
    notes = []
    lossy = sorted({f"T={row.temperature:g}" for row in n.rows if row.lossless is False})
    if lossy:
        notes.append(Note(Reason.NOT_LOSSLESS, f"the drafter's outputs differ from no drafter's at {', '.join(lossy)}: "
                          f"speculative decoding must not change greedy outputs"))
    for row in n.rows:
        v = row.versus_ngram()
        if v and v[0] == Versus.BELOW:
            gap, margin = v[1], v[2]
            notes.append(Note(Reason.BELOW_NGRAM, f"the drafter is below ngram beyond noise on {row.prompt_set} "
                              f"T={row.temperature:g}: {_length(row.drafter)} vs {_length(row.ngram)}, gap {gap:+.2f}"
                              + (f" (beyond 2 standard errors of the difference, {margin:.2f})" if margin is not None
                                 else " (no standard error recorded: any gap counts)")))
    if not n.rows:
        notes.append(Note(Reason.NOTHING_MEASURED, "no acceptance length was measured"))
    outcome = Verdict.FAILED if lossy or not n.rows else Verdict.WARNING if notes else Verdict.OK
    return n, outcome, figures, notes
