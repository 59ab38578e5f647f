"""GPU smoke check: the INT4 `kimi-mini` target through every stage, in vLLM on GPUs. Never part of CI.

What no test here covers, as vLLM's CPU build cannot run it: the INT4 compressed-tensors MoE
kernels (Kimi-K2.5's routed experts), and EAGLE-3 served over an MLA target the way the real job
serves it (bf16, tensor parallel, CUDA attention backends). On a machine with CUDA
GPUs and the vLLM environment (`make gpu-venv`), this runs the real CLI, one command per step, on
params/kimi-mini.yaml with the GPU settings:

  01-03  the local emulator samples kimi-mini's answers; stage 03 rebuilds and checks the token ids
  04     the features, captured in vLLM from the INT4 experts (tensor parallel 2 when two GPUs are
         visible), proven by stage 04's own check in the engine first, then checked against
         transformers on one sample (`verify_with_hf`); then captured again on vLLM's other model
         runner (v1 / v2, `vllm_model_runner`) into a run of its own, and the two stores compared
         sample by sample (the same kernels: they must agree to bf16), so the first GPU run says
         with a figure whether v2 may become the default. vLLM's CPU build has no Triton, so no v2
  05     the EAGLE-3 drafter trained on them and exported for vLLM and SGLang, and a DFlash drafter on
         the same capture (stage 04 stores both drafters' layers, `layer_set: both`)
  06     vLLM serving every export as EAGLE-3 over the MLA target and the DFlash export as `dflash`
         (vLLM's CPU build serves DFlash over the Llama-shaped tiny target, tests/test_eval_vllm.py;
         over MLA, like EAGLE-3, only here), beside vLLM's ngram and no drafter, greedy and T = 1;
         our decoder over transformers beside it

and prints one table: stage x setting -> ok / failed / GPU-only, tokens/s, acceptance length
(docs/gpu-runbook.md). Each run has its own run folder (outputs/gpu-smoke-<time>/), so nothing is resumed.

  .venv-gpu/bin/python bench/gpu_smoke.py [--tp N] [--target kimi-mini] [--runner v1|v2] [--run-name NAME] [--dry-run]

--runner sets `vllm_model_runner` for every engine of stages 04 and 06 (default v1, the one the CPU
build tests); the comparison capture runs on the other one. --dry-run needs no GPU and runs
nothing: it prints the commands in order, every engine they will start with its model runner, and
has the CLI check their parameters (`draftsmith run ... --check`). --cpu runs the plan on vLLM's CPU build anyway
(to check this script: the INT4 stage 04 then reads GPU-only, and stages 05-06 have no features).

--preflight checks the node alone and runs no stage (`draftsmith.node_preflight`): the NVIDIA
driver against torch's CUDA, the GPUs and their free memory, what an earlier job left on them
(processes, ECC errors, a wedged GPU, fatal Xids), the NCCL torch and vLLM load, IOMMU and PCIe
ACS, the peer-access matrix, a timed all-reduce over every visible GPU with a time-out and the
latency of decode-sized ones (in the run's engine_env), /dev/shm, and the disk where outputs_dir
points against stage 04's features; each failure is one line naming its fix, and the settings the
failures call for close the report. Give it the real job's params file:

  .venv-gpu/bin/python bench/gpu_smoke.py --preflight --params params/kimi-k2.5.yaml

The GPU run makes the same checks first, on its own settings, and stops at a failure. On a
machine without a usable GPU both say why in one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import os
import sys
import time
from pathlib import Path

import pandas as pd

from draftsmith import node_preflight, parameters
from draftsmith.hidden import outputs as shards
from draftsmith.evaluate.outputs import report_path
from draftsmith.paths import Run

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ROOT / "params" / "kimi-mini.yaml"
STEPS = [("01-03", "01,02,03"), ("04", "04"), ("05", "05"), ("06", "06")]
EXPERTS = {"kimi-mini": "INT4 experts", "kimi-mini-bf16": "bf16 experts"}
RUNNERS = ("v1", "v2")
# the two runners run the same kernels on the same ids: their stored features may differ only by bf16
# rounding of a different batch split. Per sample and layer, relative error (norm of the difference over
# the norm of the other) at most 3%: tests/test_hidden_vllm.py's bound for vLLM against transformers
RUNNER_REL_TOL = 0.03


def other_runner(runner: str) -> str:
    return RUNNERS[1 - RUNNERS.index(runner)]


def settings(target: str, tp: int, run_name: str, outputs_dir: str | None, runner: str = "v1") -> list[tuple[str, str]]:
    """The `-p` overrides every step gets: one set of settings for the whole chain."""
    s = [("run_name", run_name), ("target_model_path", target), ("vllm_model_runner", runner),
         ("target_backend", "vllm"), ("tensor_parallel_size", str(tp)), ("verify_with_hf", "true"),
         ("eval_backend", "vllm"), ("eval_tensor_parallel", str(tp)), ("eval_engine_dtype", "bfloat16"),
         ("eval_hf_crosscheck", "true"), ("eval_hf_crosscheck_all", "true"), ("eval_max_new_tokens", "64"),
         ("eval_temperatures", "[0.0, 1.0]"),
         # layer_ids empty, so that layer_set decides (a params file's own layer_ids would take precedence)
         ("layer_set", "both"), ("layer_ids", "[]"), ("drafter_kinds", '["eagle3", "dflash"]')]
    return s + ([("outputs_dir", outputs_dir)] if outputs_dir else [])


def command(stages: str, params: Path, overrides: list[tuple[str, str]], check: bool = False) -> list[str]:
    """`draftsmith run STAGES -f PARAMS -p KEY VALUE ...` with this interpreter's draftsmith."""
    cmd = [sys.executable, "-m", "draftsmith.cli", "run", stages, "-f", str(params)]
    for key, value in overrides:
        cmd += ["-p", key, value]
    return cmd + (["--check"] if check else [])


def shown(cmd: list[str]) -> str:
    """The command as a person types it in the repository (`draftsmith run ...`)."""
    return shlex.join(["draftsmith", *(str(Path(c).relative_to(ROOT)) if c.startswith(f"{ROOT}/") else c
                                       for c in cmd[3:])])


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def engine_problem() -> str | None:
    """Why this environment cannot run the plan on GPUs (None when it can)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
    except PackageNotFoundError:
        return "no CUDA vLLM in this environment (`make gpu-venv`, then .venv-gpu/bin/python bench/gpu_smoke.py)"
    return node_preflight.no_gpu()


def preflight(params: Path, overrides: list[tuple[str, str]], timeout_s: float) -> int:
    """The node's checks on the run `params` and `overrides` describe, printed; 0 when all pass,
    1 when one fails, 2 without a usable GPU (one line) or with parameters that do not read."""
    problem = node_preflight.no_gpu()
    if problem:
        print(f"gpu_smoke: {problem}")
        return 2
    try:
        values = parameters.effective_params(parameters.discover(), str(params), overrides)
    except parameters.ParamError as e:
        print(f"gpu_smoke: parameter error: {e}")
        return 2
    print(f"node preflight, {shown_path(params)}{''.join(f' -p {k} {v}' for k, v in overrides)}:", flush=True)
    findings = node_preflight.node_checks(values, timeout_s)
    print("\n".join(node_preflight.render(findings)))
    return 1 if node_preflight.failed(findings) else 0


def shown_path(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def run_of(overrides: list[tuple[str, str]]) -> Run:
    values = dict(overrides)
    return Run(values.get("outputs_dir", "outputs"), values["run_name"])


def failed(step: dict) -> str:
    return f"failed (exit {step['rc']}; logs in {step['logs']})"


def own_check(hidden_dir: Path) -> str | None:
    """Stage 04's own check as one cell: passed or failed, with its figures (None if it did not run)."""
    path = hidden_dir / shards.CHECK
    if not path.is_file():
        return None
    r = json.loads(path.read_text())
    figures = (f"logprob error mean {r['logprob_mean_abs_err']:.3g}, max {r['logprob_max_abs_err']:.3g}, "
               f"top-1 {r['top1_agreement']:.3f}, {r['positions']} positions")
    return f"passed ({figures})" if r["passed"] else f"FAILED: {r.get('cause')} ({figures})"


def table(steps: dict[str, dict], run: Run, target: str, tp: int) -> pd.DataFrame:
    """One row per stage and setting, from the exit codes and what the stages wrote."""
    rows = []

    def row(stage, setting, result, tokens_per_s=None, acceptance=None, seconds=None):
        rows.append({"stage": stage, "setting": setting, "result": result,
                     "tokens/s": f"{tokens_per_s:,.0f}" if tokens_per_s else "",
                     "acceptance length": f"{acceptance:.2f}" if acceptance else "",
                     "s": f"{seconds:.0f}" if seconds is not None else ""})

    s = steps["01-03"]
    row("01-03", "emulator -> tokens", "ok" if s["rc"] == 0 else failed(s), seconds=s["seconds"])
    s = steps["04"]
    try:
        summary = shards.read_summary(shards.hidden_dir(run))
    except FileNotFoundError:
        summary = {}
    result = summary.get("gpu_only") or ("ok" if s["rc"] == 0 else failed(s))
    row("04", f"vLLM, {EXPERTS.get(target, target)}, tp {tp}, checked against transformers", result,
        summary.get("tokens_per_s"), seconds=s["seconds"])
    own = own_check(shards.hidden_dir(run))
    if own:
        row("04", f"stage 04's own check in vLLM, tp {tp}", own)
    runner = next((k.split()[1] for k in steps if k.startswith("04 ")), None)
    if runner:
        s, other = steps[f"04 {runner}"], Run(run.root.parent, f"{run.name}-{runner}")
        if s["rc"]:
            result = (f"{runner} needs Triton, which vLLM's CPU build lacks (GPU-only)" if runner == "v2"
                      and not gpus() else failed(s))
        else:
            c = compare_runners(shards.hidden_dir(run), shards.hidden_dir(other))
            result = (f"{'agree' if c['agree'] else 'DIFFER'}: {c['samples']} samples, worst relative error aux "
                      f"{c['aux']:.2%}, last {c['last']:.2%} (bound {RUNNER_REL_TOL:.0%})" +
                      (f"; {c['missing']} samples missing" if c["missing"] else ""))
        row("04", f"stored features, model runner {other_runner(runner)} vs {runner}", result, seconds=s["seconds"])
    s = steps["05"]
    row("05", "EAGLE-3 and DFlash training on one capture, exports", "ok" if s["rc"] == 0 else failed(s),
        seconds=s["seconds"])
    s, path = steps["06"], report_path(run)
    report = json.loads(path.read_text()) if path.is_file() else None
    row("06", "the stage: every engine, then our decoder", failed(s) if s["rc"] else
        "ok" if report is not None else f"no {path}", seconds=s["seconds"])
    if report is None:
        return pd.DataFrame(rows)
    engine = report.get("engine") or {}
    for name, line in (engine.get("gpu_only") or {}).items():
        row("06", f"vLLM {name}, tp {tp}", line)
    for t, part in (engine.get("temperatures") or {}).items():
        for name, m in part["methods"].items():
            bad = m.get("lossless") is False
            row("06", f"vLLM {name}, T={t}, tp {tp}",
                f"{len(m['mismatched_samples'])} outputs differ from no drafter's (a few are expected in bf16, "
                f"docs/gpu-runbook.md)" if bad else "ok",
                m.get("tokens_per_s"), m["acceptance_length"] if m["kind"] != "none" else None)
    for t, part in (report.get("temperatures") or {}).items():
        for name, m in part["methods"].items():
            row("06", f"our decoder {name}, T={t}", "outputs differ from no drafter's (a few are expected in bf16)"
                if m.get("lossless") is False else "ok", None, m["acceptance_length"] if m["kind"] != "none" else None)
    return pd.DataFrame(rows)


def show_plan(params: Path, overrides: list[tuple[str, str]], what: str, compare_runners: bool = False):
    """Every step's command, printed under `what`: (plan, the run). `compare_runners`: after stage 04,
    stage 04 again on the other model runner, in the run `comparison_overrides` names."""
    plan = [(name, command(stages, params, overrides)) for name, stages in STEPS]
    if compare_runners:
        other = comparison_overrides(overrides)
        plan.insert(2, (f"04 {dict(other)['vllm_model_runner']}", command("04", params, other)))
    run = run_of(overrides)
    print(f"plan: {what}, run folder {run.root}")
    for name, cmd in plan:
        print(f"  {name}: {shown(cmd)}")
    return plan, run


def comparison_overrides(overrides: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Stage 04's overrides for the capture on the other model runner: a run of its own
    (`<run_name>-<runner>`, its tokens copied from the main run), no transformers check."""
    values = dict(overrides)
    other = other_runner(values.get("vllm_model_runner", "v1"))
    changed = {"run_name": f"{values['run_name']}-{other}", "vllm_model_runner": other, "verify_with_hf": "false"}
    return [(k, changed.get(k, v)) for k, v in overrides]


def planned_engines(params: Path, overrides: list[tuple[str, str]], compare_runners: bool) -> list[str]:
    """One line per vLLM engine the plan starts, with the model runner it is given: stage 04's
    capture (and the comparison's), and stage 06's, one per method (`evaluate.methods`' names)."""
    values = parameters.effective_params(parameters.discover(), str(params), overrides)
    runner = values["vllm_model_runner"]
    fractions = sorted(values["export_fractions"])
    exports = [f"eagle3 {f:.0%}" for f in fractions[:-1]] + ["eagle3"]
    stage06 = ["none", "ngram", *exports, *(["dflash"] if "dflash" in values["drafter_kinds"] else [])]
    lines = [f"04: capture, model runner {runner}"]
    if compare_runners:
        lines.append(f"04 {other_runner(runner)}: capture, model runner {other_runner(runner)} (the comparison)")
    lines += [f"06: {name}, model runner {runner}" for name in stage06]
    return lines


def copy_tokens(overrides: list[tuple[str, str]]) -> None:
    """The main run's stage 03 tokens into the comparison run (stage 04 reads them from its own run)."""
    import shutil

    src, dst = run_of(overrides).root / "tokens", run_of(comparison_overrides(overrides)).root / "tokens"
    if src.is_dir():  # else stages 01-03 failed, and so does the comparison's stage 04, saying why
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)


def compare_runners(a: Path, b: Path) -> dict:
    """Two stage 04 stores of the same samples (hidden folders), sample by sample: the worst relative
    error per stored tensor (aux: every captured layer side by side; last) over all samples."""
    from draftsmith.hidden.outputs import HiddenShards

    x, y = HiddenShards(a), HiddenShards(b)
    keys = lambda h: [(r.dataset, r.sample_id) for r in h.samples]
    where = {k: i for i, k in enumerate(keys(y))}
    worst = {"aux": 0.0, "last": 0.0}
    missing = [k for k in keys(x) if k not in where]
    for i, k in enumerate(keys(x)):
        if k in where:
            s, t = x.sample(i), y.sample(where[k])
            for name in worst:
                u, v = s[name].float(), t[name].float()
                worst[name] = max(worst[name], float((u - v).norm() / v.norm().clamp_min(1e-30)))
    return {"samples": len(keys(x)) - len(missing), "missing": len(missing), **worst,
            "agree": not missing and max(worst.values()) <= RUNNER_REL_TOL}


def dry_run(params: Path, overrides: list[tuple[str, str]]) -> int:
    """Have the CLI check every step's parameters (`--check`); print its last line; its exit code."""
    check = command(",".join(s for _, s in STEPS), params, overrides, check=True)
    done = subprocess.run(check, cwd=ROOT, capture_output=True, text=True)
    print(done.stdout.strip().splitlines()[-1] if done.returncode == 0 else done.stderr.strip())
    return done.returncode


def run_plan(plan, run: Run, stop_after_failed: tuple[str, ...] = (), say=None, before=None) -> dict[str, dict]:
    """Each step's command in order: {step: rc, seconds, logs}; a failed step in `stop_after_failed`
    ends the plan (the later steps read rc -1). `say`, when given, gets every line the commands print;
    `before`: step -> what to do before its command."""
    steps, echo = {}, say or (lambda line: print(line, flush=True))
    for name, cmd in plan:
        if name in (before or {}):
            before[name]()
        echo(f"== {name}: {shown(cmd)}")
        t0 = time.monotonic()
        if say is None:
            rc = subprocess.run(cmd, cwd=ROOT).returncode
        else:
            with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
                for line in p.stdout:
                    say(line.rstrip("\n"))
            rc = p.returncode
        steps[name] = {"rc": rc, "seconds": time.monotonic() - t0, "logs": f"{run.root}/logs/"}
        if rc and name in stop_after_failed:
            break
    return {name: steps.get(name, {"rc": -1, "seconds": 0.0, "logs": f"{run.root}/logs/"}) for name, _ in plan}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="kimi-mini", help="built-in target (kimi-mini: INT4 experts as shipped)")
    ap.add_argument("--tp", type=int, default=None, help="tensor parallel size; default 2 when two GPUs are visible, else 1 "
                    "(kimi-mini has 2 attention heads: at most 2)")
    ap.add_argument("--run-name", default=None, help="run folder name; default gpu-smoke-<date>-<time>")
    ap.add_argument("--outputs-dir", default=None, help="where the run folder goes (default: the params file's)")
    ap.add_argument("--params", type=Path, default=PARAMS)
    ap.add_argument("--runner", choices=RUNNERS, default="v1", help="vllm_model_runner of every engine (default v1, "
                    "the one the CPU build tests); stage 04 is captured again on the other and the two compared")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and check their parameters; run nothing")
    ap.add_argument("--cpu", action="store_true", help="run on vLLM's CPU build anyway (checks this script)")
    ap.add_argument("--preflight", action="store_true", help="check the node for the run --params describes "
                    "(driver, GPUs, peer access, all-reduce, disk); run no stage")
    ap.add_argument("--all-reduce-timeout", type=float, default=180.0, metavar="S",
                    help="seconds the preflight's all-reduce may take before it counts as hung (default 180)")
    a = ap.parse_args()
    if a.preflight:
        return preflight(a.params, [(k, v) for k, v in (("run_name", a.run_name), ("outputs_dir", a.outputs_dir))
                                    if v], a.all_reduce_timeout)

    problem = None if a.dry_run or a.cpu else engine_problem()
    if problem:
        print(f"gpu_smoke: {problem}; --dry-run prints the plan without a GPU", file=sys.stderr)
        return 2
    tp = a.tp or (2 if gpus() >= 2 else 1)
    overrides = settings(a.target, tp, a.run_name or time.strftime("gpu-smoke-%Y%m%d-%H%M%S"), a.outputs_dir,
                         a.runner)
    plan, run = show_plan(a.params, overrides, f"{a.target} ({EXPERTS.get(a.target, '?')}), tensor parallel {tp}",
                          compare_runners=True)
    if a.dry_run:
        rc = dry_run(a.params, overrides)
        if rc == 0:
            print("vLLM engines it starts:")
            print("\n".join(f"  {line}" for line in planned_engines(a.params, overrides, True)))
            print(f"each engine's environment at tensor parallel {tp}, beyond this shell's:")
            print("\n".join(f"  {line}" for line in engine_environment(tp)))
        return rc
    if not a.cpu and preflight(a.params, overrides, a.all_reduce_timeout):
        print("gpu_smoke: the node failed its preflight (above); no stage was run", file=sys.stderr)
        return 2
    steps = run_plan(plan, run, before={plan[2][0]: lambda: copy_tokens(overrides)})
    result = table(steps, run, a.target, tp)
    print(f"\nGPU smoke check, {a.target}, tensor parallel {tp} ({gpus()} GPUs visible), run {run.root}:")
    print(result.to_string(index=False))
    return 0 if all(s["rc"] == 0 for s in steps.values()) else 1


def engine_environment(tp: int) -> list[str]:
    """What `targets.vllm.vllm_env` adds to this shell's environment for an engine of `tp` ranks,
    one `NAME=value  # why` a line, and where its engine core runs."""
    from draftsmith.targets.vllm import vllm_env

    why = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "collective_rpc carries stage 04's and 06's record functions",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "one rank: the engine core in the caller's process",
           "VLLM_CPU_OMP_THREADS_BIND": "vLLM's CPU build: a core group a rank (not set on GPUs)",
           "VLLM_CPU_KVCACHE_SPACE": "vLLM's CPU build: KV cache GiB (ignored on GPUs)",
           "LD_PRELOAD": "vLLM's CPU build: Intel OpenMP (ignored on GPUs)",
           "TOKENIZERS_PARALLELISM": "no tokenizer threads in the engine"}
    env = vllm_env(tensor_parallel_size=tp)
    lines = [f"{k}={env[k]}  # {why.get(k, '')}" for k in sorted(env) if os.environ.get(k) != env[k]]
    core = "in the caller's process" if env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else "in its own process"
    return lines + [f"engine core {core}, {tp} worker rank(s)"]


if __name__ == "__main__":
    sys.exit(main())
