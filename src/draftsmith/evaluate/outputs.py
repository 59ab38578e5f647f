"""The files stage 06 writes under `<run>/eval/`, and the only code that knows their names.

    rounds.jsonl         our decoder: one line per (settings, method, prompt), the rounds it took
    engine_rounds.jsonl  vLLM: one line per (settings, method, temperature, prompt), its counters
    report.json          what the stage measured, summed up (NaN rates written as null)
    results.csv          the results as data: one row per method x prompt set x temperature (`results.frame`)
    bench_prompts_sharegpt.json   the held-out prompts as a benchmark file for the serving engines
    bench_<name>_sharegpt.json    the first turns of benchmark <name> (`eval_benchmarks`), the same way
    engine_job.json      what the vLLM engine process is to measure

Lines are appended whole, so an interrupted stage resumes where it stopped: lines of other
settings are kept but not used, and a last line torn by a kill is cut before anything is appended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..files import read_jsonl, repair_tail, write_json_atomic, write_text_atomic
from ..paths import Run
from ..verdicts import Figure, Note, Reason, Verdict, read_file

ROUNDS = "rounds.jsonl"
ENGINE_ROUNDS = "engine_rounds.jsonl"
REPORT = "report.json"
RESULTS_CSV = "results.csv"
BENCH_PROMPTS = "bench_prompts_sharegpt.json"
BENCHMARK_PROMPTS = "bench_{name}_sharegpt.json"
ENGINE_JOB = "engine_job.json"


def append_row(path: Path, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


class RoundsFile:
    """Our decoder's `rounds.jsonl`, by (settings, method fingerprint, dataset, sample id)."""

    def __init__(self, run: Run):
        self.path = run.dir("eval") / ROUNDS
        repair_tail(self.path)
        self.rows = {self._key(row): row for _, row in read_jsonl(self.path)}

    @staticmethod
    def _key(row: dict) -> tuple:
        return row["settings"], row["method_fingerprint"], row["dataset"], row["sample_id"]

    def get(self, settings: str, method, prompt) -> dict | None:
        """The row of a `methods.Method` on a `methods.HeldoutPrompt`, if measured with these settings."""
        return self.rows.get((settings, method.fingerprint, prompt.dataset, prompt.sample_id))

    def add(self, row: dict) -> None:
        self.rows[self._key(row)] = row
        append_row(self.path, row)


def engine_rounds_file(run: Run) -> Path:
    """vLLM's `engine_rounds.jsonl` (appended to by the engine process), a torn last line cut."""
    path = run.dir("eval") / ENGINE_ROUNDS
    repair_tail(path)
    return path


def read_engine_rows(path: Path, settings: str) -> dict[tuple, dict]:
    """Rows of `engine_rounds.jsonl` measured with these settings, by (method fingerprint,
    temperature, dataset, sample id)."""
    rows = {}
    for _, r in read_jsonl(path):
        if r.get("settings") == settings:
            rows[(r["method_fingerprint"], r["temperature"], r["dataset"], r["sample_id"])] = r
    return rows


def write_engine_job(run: Run, job: dict) -> Path:
    path = run.dir("eval") / ENGINE_JOB
    write_json_atomic(path, job)
    return path


def write_bench_prompts(run: Run, rows: list[dict]) -> Path:
    path = run.dir("eval") / BENCH_PROMPTS
    write_text_atomic(path, json.dumps(rows, indent=1, ensure_ascii=False))
    return path


def write_benchmark_prompts(run: Run, name: str, rows: list[dict]) -> Path:
    path = run.dir("eval") / BENCHMARK_PROMPTS.format(name=name)
    write_text_atomic(path, json.dumps(rows, indent=1, ensure_ascii=False))
    return path


def report_path(run: Run) -> Path:
    return run.dir("eval") / REPORT


def write_report(run: Run, report: dict) -> Path:
    path = report_path(run)
    write_json_atomic(path, _json_safe(report))
    return path


def results_csv_path(run: Run) -> Path:
    return run.dir("eval") / RESULTS_CSV


def read_report(run: Run) -> dict:
    path = report_path(run)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no stage 06 report (run stage 06 first)")
    return json.loads(path.read_text(encoding="utf-8"))


def _json_safe(x):
    """NaN (a rate with nothing to count) as null: report.json stays strict JSON."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


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
    headline: RunHeadline | None = None     # the run's headline (`results.run_headline`)


def _pm(x: float | None, se: float | None) -> str:
    """An acceptance length with its standard error: `1.76 ± 0.05`."""
    return _length(x) + ("" if x is None or se is None else f" ± {se:.2f}")


def _count(prompts: int | None) -> str:
    return "" if prompts is None else f" ({prompts} prompt{'s' * (prompts != 1)})"


def verdict(run: Run, anchor: str):
    """Stage 06's line of the run summary from eval/report.json: (EvalNumbers, verdict, figures, notes);
    failed when the drafter changed greedy outputs or nothing was measured."""
    from . import results   # it reads this module's files

    r = read_file(run, read_report, run)
    n = EvalNumbers("vllm" if r.get("engine") else "decoder", "eagle3", results.headlines(results.results(r)),
                    headline=results.run_headline(r))
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
        if v and v[0] == results.Versus.BELOW:
            gap, margin = v[1], v[2]
            notes.append(Note(Reason.BELOW_NGRAM, f"the drafter is below ngram beyond noise on {row.prompt_set} "
                              f"T={row.temperature:g}: {_length(row.drafter)} vs {_length(row.ngram)}, gap {gap:+.2f}"
                              + (f" (beyond 2 standard errors of the difference, {margin:.2f})" if margin is not None
                                 else " (no standard error recorded: any gap counts)")))
    if not n.rows:
        notes.append(Note(Reason.NOTHING_MEASURED, "no acceptance length was measured"))
    outcome = Verdict.FAILED if lossy or not n.rows else Verdict.WARNING if notes else Verdict.OK
    return n, outcome, figures, notes
