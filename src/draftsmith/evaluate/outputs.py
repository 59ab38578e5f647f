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
from pathlib import Path

from ..files import read_jsonl, repair_tail, write_json_atomic, write_text_atomic
from ..paths import Run

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
