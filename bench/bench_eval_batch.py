"""Stage 06 in vLLM on the demo, each engine's prompts decoded one at a time against many in flight.

Stage 06 batches its engines' requests (`eval_engine_concurrency`): acceptance is counted per
request from vLLM's verify steps, so it must not change, while the decode time falls. This runs
`draftsmith run 06 -f params/demo.yaml` (engine numbers only: `eval_hf_crosscheck false`) on
copies of one demo run, once with `eval_engine_concurrency 1` and once with the default, alternating
the two over `--rounds` on the same box, and prints per engine and temperature the acceptance length
over every prompt it decoded (held-out and benchmark) and its decode seconds (the stage log's
`decoded in` lines, engine start-ups apart), each mode side by side with their ratio; then the
stage's wall time, and the time each mode estimated before decoding (`evaluate.engine.Workload`) against
what its engines took. Greedy acceptance must be equal; at T = 1 the two draw other random numbers
in other batches, and agree in distribution only.

A run to measure: `--run OUTPUTS/RUN` (a demo run through stage 05), else stages 01-05 of the demo
are run first into a temporary folder (about 10 minutes on 2 cores).

    .venv/bin/python bench/bench_eval_batch.py [--run outputs/demo] [--rounds 1] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.evaluate import metrics, outputs
from draftsmith.files import read_jsonl
from draftsmith.paths import REPO_ROOT, Run

DECODED = re.compile(r"^(?P<method>.+): T=(?P<t>[\d.]+), (?P<n>\d+) prompts decoded in (?P<s>[\d.]+)s")
ESTIMATED = re.compile(r"estimated time of the \d+ engine\(s\): (?P<est>[^(]+) \(")
UP = re.compile(r"^engine '(?P<method>.+)' up in (?P<s>\d+)s")
DRAFTSMITH = [str(Path(sys.executable).parent / "draftsmith")]   # the venv's command, beside its python


def demo_run(outputs: Path) -> Path:
    """Stages 01-05 of the demo into `outputs/demo`."""
    subprocess.run(DRAFTSMITH + ["run", "01,02,03,04,05", "-f", str(REPO_ROOT / "params" / "demo.yaml"),
                                 "-p", "outputs_dir", str(outputs), "-p", "run_name", "demo"], check=True)
    return outputs / "demo"


def stage_06(run: Path, where: Path, concurrency: int | None) -> dict:
    """Stage 06 on a copy of `run` (its eval folder left out) under `where`; what it measured."""
    copy = where / run.name
    shutil.copytree(run, copy, ignore=lambda d, names: [n for n in names if Path(d) == run and n in ("eval", "logs")])
    more = ["-p", "eval_engine_concurrency", str(concurrency)] if concurrency else []
    t0 = time.perf_counter()
    subprocess.run(DRAFTSMITH + ["run", "06", "-f", str(REPO_ROOT / "params" / "demo.yaml"), "-p", "outputs_dir",
                                 str(where), "-p", "run_name", run.name, "-p", "eval_hf_crosscheck", "false", *more],
                   check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    log = (copy / "logs" / "06_evaluate.log").read_text()
    decode, estimate, starts = {}, None, []
    for line in log.splitlines():
        line = line.split("[draftsmith] ", 1)[-1].strip()
        m = DECODED.match(line)
        if m:
            decode[(m["method"], float(m["t"]))] = float(m["s"])
        m = UP.match(line)
        if m:
            starts.append(float(m["s"]))
        m = ESTIMATED.search(line)
        if m and estimate is None:
            estimate = m["est"].strip()
    measured = Run(copy.parent, copy.name)
    rows = [row for _, row in read_jsonl(outputs.engine_rounds_file(measured))]
    acceptance = {}
    for key in decode:
        mine = [r for r in rows if (r["method"], r["temperature"]) == key]
        acceptance[key] = metrics.engine_acceptance(mine, len(mine[0]["counters"]["per_pos"]) or 3)
    report = outputs.read_report(measured)
    return {"wall": wall, "decode": decode, "acceptance": acceptance, "estimate": estimate,
            "estimated_part": sum(decode.values()) + sum(starts[1:]),
            "concurrency": report["engine"]["concurrency"],
            "outputs": {(r["method"], r["temperature"], r["dataset"], r["sample_id"]): r["output"] for r in rows}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", help="a demo run through stage 05 (default: run stages 01-05 of the demo first)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=None, help="the batched mode's eval_engine_concurrency "
                                                                   "(default: the notebook's)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-eval-batch-") as tmp:
        run = Path(args.run) if args.run else demo_run(Path(tmp) / "outputs")
        modes = {"one at a time": 1, "batched": args.concurrency}
        got: dict[str, list[dict]] = {m: [] for m in modes}
        for i in range(args.rounds):
            for name in (modes if i % 2 == 0 else list(modes)[::-1]):
                got[name].append(stage_06(run, Path(tmp) / f"{name.replace(' ', '-')}-{i}", modes[name]))
                print(f"round {i + 1}, {name}: {got[name][-1]['wall']:.0f} s", flush=True)
    one, many = got["one at a time"], got["batched"]
    print(f"\nstage 06 on the demo (engine numbers only), {args.rounds} round(s); batched: up to "
          f"{many[0]['concurrency']} in flight; acceptance = 1 + accepted / drafts over every prompt of the engine; "
          f"decode s: median over rounds, engine start-ups apart\n")
    head = (f"{'engine':<12}{'T':>4}{'accept. 1':>11}{'accept. N':>11}{'ratio':>8}{'same tokens':>13}"
            f"{'decode s 1':>12}{'decode s N':>12}{'speed-up':>10}")
    print(head + "\n" + "-" * len(head))

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2]

    for key in one[0]["decode"]:
        a1, an = one[0]["acceptance"][key]["acceptance_length"], many[0]["acceptance"][key]["acceptance_length"]
        same = sum(one[0]["outputs"][k] == many[0]["outputs"][k] for k in one[0]["outputs"] if k[:2] == key)
        total = sum(1 for k in one[0]["outputs"] if k[:2] == key)
        s1, sn = median([g["decode"][key] for g in one]), median([g["decode"][key] for g in many])
        print(f"{key[0]:<12}{key[1]:>4g}{a1:>11.4f}{an:>11.4f}{an / a1:>8.3f}{f'{same}/{total}':>13}"
              f"{s1:>12.1f}{sn:>12.1f}{s1 / sn if sn else float('inf'):>9.1f}x")
    d1, dn = median([sum(g["decode"].values()) for g in one]), median([sum(g["decode"].values()) for g in many])
    w1, wn = median([g["wall"] for g in one]), median([g["wall"] for g in many])
    print("-" * len(head))
    print(f"{'all engines, decode':<49}{d1:>12.1f}{dn:>12.1f}{d1 / dn:>9.1f}x")
    print(f"{'stage 06 wall (engine starts, probes included)':<49}{w1:>12.1f}{wn:>12.1f}{w1 / wn:>9.1f}x")
    print(f"\nestimated when the first engine was up (round 1), against what its estimate covers (every decode, "
          f"the later engines' starts): one at a time {one[0]['estimate']} / took {one[0]['estimated_part']:.0f} s; "
          f"batched {many[0]['estimate']} / took {many[0]['estimated_part']:.0f} s")
    greedy_equal = all(one[0]["acceptance"][k]["acceptance_length"] == many[0]["acceptance"][k]["acceptance_length"]
                       for k in one[0]["decode"] if k[1] == 0)
    print(f"greedy acceptance equal in both modes: {greedy_equal}")
    return 0 if greedy_equal else 1


if __name__ == "__main__":
    sys.exit(main())
