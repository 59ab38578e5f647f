"""GPU check without vLLM: the INT4 `kimi-mini` through transformers on a GPU, stage 04's own check
included. Never part of CI; sized for a lent GPU machine (about 5-8 minutes).

A machine that has CUDA torch and transformers but no vLLM (and no network) can still run what
needs no serving engine, on params/kimi-mini.yaml with these settings:

  01-03  the local emulator samples kimi-mini's answers; stage 03 rebuilds and checks the token ids
  04     `target_backend hf` on the GPU: transformers loads the INT4 routed experts through
         compressed-tensors (as Kimi-K2.5 ships them); stage 04's own check compares the stored
         final state with the model's own logprobs before any shard; `verify_with_hf` as well
  05     the EAGLE-3 drafter trained on the GPU and exported
  06     `eval_backend hf`: our own decoder over transformers measures every export, greedy and T = 1

and prints one table: stage x setting -> ok / failed, seconds, the check's figures, acceptance.
bench/gpu_smoke.py is the same chain in vLLM (what the user's node runs).

  python bench/gpu_check.py [--target kimi-mini] [--run-name NAME] [--dry-run]

--dry-run needs no GPU: it prints the commands and has the CLI check their parameters.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import pandas as pd

from draftsmith.evaluate.outputs import report_path
from draftsmith.hidden import outputs as shards

from gpu_smoke import EXPERTS, PARAMS, dry_run, failed, gpus, own_check, run_plan, show_plan

NEEDED = ("torch", "transformers", "compressed_tensors", "safetensors", "tiktoken", "aiohttp", "pandas", "papermill",
          "matplotlib", "pydantic")


def settings(target: str, run_name: str, outputs_dir: str | None) -> list[tuple[str, str]]:
    s = [("run_name", run_name), ("target_model_path", target), ("target_backend", "hf"), ("device", "cuda"),
         ("verify_with_hf", "true"), ("eval_backend", "hf"), ("eval_max_new_tokens", "48"),
         ("eval_temperatures", "[0.0, 1.0]")]
    return s + ([("outputs_dir", outputs_dir)] if outputs_dir else [])


def missing_modules() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


def table(steps: dict[str, dict], run, target: str) -> pd.DataFrame:
    rows = []

    def row(stage, setting, result, seconds=None, acceptance=None):
        rows.append({"stage": stage, "setting": setting, "result": result,
                     "s": f"{seconds:.0f}" if seconds is not None else "",
                     "acceptance length": f"{acceptance:.2f}" if acceptance else ""})

    s = steps["01-03"]
    row("01-03", "emulator -> tokens", "ok" if s["rc"] == 0 else failed(s), s["seconds"])
    s = steps["04"]
    try:
        summary = shards.read_summary(shards.hidden_dir(run))
    except FileNotFoundError:
        summary = {}
    row("04", f"transformers on the GPU, {EXPERTS.get(target, target)}", "ok" if s["rc"] == 0 else failed(s),
        s["seconds"])
    row("04", "stage 04's own check (the model's own logprobs)", own_check(shards.hidden_dir(run)) or "did not run")
    if summary.get("tokens_per_s"):
        row("04", "tokens/s", f"{summary['tokens_per_s']:,.0f}")
    s = steps["05"]
    row("05", "EAGLE-3 training on the GPU, exports", "ok" if s["rc"] == 0 else failed(s), s["seconds"])
    s, path = steps["06"], report_path(run)
    report = json.loads(path.read_text()) if path.is_file() else None
    row("06", "our decoder over transformers", failed(s) if s["rc"] else "ok" if report else f"no {path}",
        s["seconds"])
    for t, part in ((report or {}).get("temperatures") or {}).items():
        for name, m in part["methods"].items():
            if m["kind"] != "none":
                row("06", f"{name}, T={t}", "failed: outputs differ from no drafter" if m.get("lossless") is False
                    else "ok", acceptance=m["acceptance_length"])
    return pd.DataFrame(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="kimi-mini", help="built-in target (kimi-mini: INT4 experts as shipped)")
    ap.add_argument("--run-name", default=None, help="run folder name; default gpu-check-<date>-<time>")
    ap.add_argument("--outputs-dir", default=None)
    ap.add_argument("--params", type=Path, default=PARAMS)
    ap.add_argument("--dry-run", action="store_true", help="print the commands and check their parameters; run nothing")
    a = ap.parse_args()

    missing = missing_modules()
    if missing:
        print(f"gpu_check: missing modules {missing} (pip install them, or carry their wheels)", file=sys.stderr)
        return 2
    if not a.dry_run and not gpus():
        print("gpu_check: no CUDA GPU visible; --dry-run prints the plan without one", file=sys.stderr)
        return 2
    overrides = settings(a.target, a.run_name or time.strftime("gpu-check-%Y%m%d-%H%M%S"), a.outputs_dir)
    plan, run = show_plan(a.params, overrides, f"{a.target} ({EXPERTS.get(a.target, '?')}) in transformers on the GPU")
    if a.dry_run:
        return dry_run(a.params, overrides)
    steps = run_plan(plan, run, stop_after_failed=("01-03",))
    print(f"\nGPU check without vLLM, {a.target}, {gpus()} GPU(s) visible, run {run.root}:")
    print(table(steps, run, a.target).to_string(index=False))
    return 0 if all(s["rc"] == 0 for s in steps.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
