"""Checks of a run's parameter values and inputs, made before any stage starts or pays.

The runner already checks names and types; this checks what a type cannot say: counts and limits
that must be positive, prompt files that exist and hold at least one usable prompt, a source for
the API key when the API is not the local emulator, a target that exists, an outputs folder that
can be written. Only the parameters the selected stages declare are checked, and each problem is
one line naming where the value came from (the params file, `-p KEY`, or a notebook's default).
"""

from __future__ import annotations

import os
from pathlib import Path

from .apikey import api_key_for
from .datasets import DatasetReader, parse_datasets
from .paths import Run

# parameter: (is the value acceptable, what it must be)
RULES = {
    "concurrency": (lambda v: v >= 1, "at least 1 (requests in flight)"),
    "max_tokens": (lambda v: v >= 1, "at least 1 (tokens per response)"),
    "spend_limit_usd": (lambda v: v > 0, "more than 0 (dollars this run may spend)"),
    "max_attempts": (lambda v: v >= 1, "at least 1"),
    "request_timeout_s": (lambda v: v > 0, "more than 0 seconds"),
    "stop_grace_s": (lambda v: v >= 0, "0 or more seconds"),
    "balance_floor_usd": (lambda v: v >= 0, "0 or more dollars"),
    "temperature": (lambda v: v >= 0, "0 or more"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "pilot_samples": (lambda v: v >= 0, "0 or more"),
    "probe_prompts": (lambda v: v >= 0, "0 or more"),
    "probe_max_tokens": (lambda v: v >= 1, "at least 1"),
    "expected_output_tokens": (lambda v: v >= 0, "0 (measure with a pilot) or more"),
    "max_tokens_per_batch": (lambda v: v >= 1, "at least 1"),
    "shard_mb": (lambda v: v > 0, "more than 0"),
    "nproc_per_node": (lambda v: v >= 1, "at least 1"),
    "draft_vocab_size": (lambda v: v >= 1, "at least 1"),
    "ttt_steps": (lambda v: v >= 1, "at least 1"),
    "train_epochs": (lambda v: v > 0, "more than 0"),
    "train_batch_size": (lambda v: v >= 1, "at least 1"),
    "train_micro_batch_size": (lambda v: v >= 1, "at least 1"),
    "train_max_len": (lambda v: v >= 2, "at least 2"),
    "train_lr": (lambda v: v > 0, "more than 0"),
    "train_holdout_fraction": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "train_nproc": (lambda v: v >= 1, "at least 1"),
    "eval_prompts_per_dataset": (lambda v: v >= 1, "at least 1"),
    "eval_max_new_tokens": (lambda v: v >= 1, "at least 1"),
    "draft_tokens": (lambda v: v >= 1, "at least 1"),
}


def check(stages, values: dict, sources: dict[str, str]) -> list[str]:
    """Every problem of the selected stages' parameters, one line each (empty: all good)."""
    declared = {name for s in stages for name in s.params}
    where = lambda k: sources.get(k, "default")  # noqa: E731
    problems = []
    for name in sorted(declared & RULES.keys()):
        ok, must = RULES[name]
        v = values.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not ok(v):
            problems.append(f"{where(name)}: {name} must be {must}, got {v!r}")
    if "target_model_path" in declared:
        problems += _target(values["target_model_path"], where("target_model_path"))
    if any("api_base" in s.params for s in stages):  # the stages that send prompts
        problems += _datasets(values.get("datasets") or [], where("datasets"))
        if values.get("api_base") != "local":
            try:
                api_key_for(str(values.get("api_base")), values.get("api_key_file"))
            except (OSError, ValueError, RuntimeError) as e:
                key = "api_key_file" if values.get("api_key_file") else "api_base"
                problems.append(f"{where(key)}: api_base is {values.get('api_base')!r}: {e}")
    return problems


def dataset_summaries(values: dict) -> list[str]:
    """One line per prompt file: prompts found and rows skipped (with file:line), as a full read."""
    out = []
    for spec in parse_datasets(values.get("datasets") or []):
        reader = DatasetReader(spec)
        for _ in reader:
            pass
        out.append(reader.summary())
    return out


def check_outputs(values: dict, source: str) -> str | None:
    """Can the run folder be created and written? The problem, or None."""
    try:
        root = Run(values["outputs_dir"], values["run_name"]).root
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except ValueError as e:
        return f"{source}: {e}"
    except OSError as e:
        return f"{source}: outputs_dir {values['outputs_dir']!r} cannot be written: {e.strerror or e}"
    return None


def _target(path: str, where: str) -> list[str]:
    from .target.checkpoint import checkpoint_problem

    problem = checkpoint_problem(path)
    return [f"{where}: {problem}"] if problem else []


def _datasets(datasets: list, where: str) -> list[str]:
    if not datasets:
        return [f"{where}: datasets is empty: give at least one {{name, path}}"]
    problems = []
    for i, spec in enumerate(parse_datasets(datasets)):
        if not Path(spec.path).is_file():
            problems.append(f"{where}: datasets[{i}] {spec.name!r}: file not found: {spec.path}")
            continue
        reader = DatasetReader(spec)
        rows = iter(reader)
        first = next(rows, None)  # reads up to the first usable prompt only
        rows.close()
        if first is None:
            why = f"; skipped: {reader.problems[0]}" + (f" (+{len(reader.problems) - 1} more)"
                                                       if len(reader.problems) > 1 else "") if reader.problems else ""
            problems.append(f"{where}: datasets[{i}] {spec.name!r}: no usable prompt in {spec.path}"
                            f"{' (the file is empty)' if not reader.problems else ''}{why}")
    return problems
