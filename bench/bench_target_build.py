"""The tiny target's training steps on the CPU with glibc's default malloc thresholds (every step's
freed logits and gradients handed back to the OS and faulted in again) and inside
`targets.tiny.keep_freed_buffers` (as the build runs).

Each build is a new process, building the `tiny` variant cut to `--steps` steps; rounds alternate
the two so both see the same box. Prints seconds per training step (after the first), the minor
page faults per step, the final loss and a digest of the saved weights (they must be equal), and the
ratio, measured in this run (absolute times mean little on a shared box).

    .venv/bin/python bench/bench_target_build.py                # 40 steps, 2 rounds
    .venv/bin/python bench/bench_target_build.py --steps 60 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def child(mode: str, steps: int) -> None:
    import contextlib
    import dataclasses
    import hashlib
    import resource
    import tempfile
    import time
    from pathlib import Path

    from draftsmith.targets import tiny

    if mode == "default":
        tiny.keep_freed_buffers = contextlib.nullcontext
    tiny.VARIANTS["bench"] = dataclasses.replace(tiny.VARIANTS["tiny"], steps=steps)
    marks, losses = {}, []

    def log(line: str) -> None:
        if "step " in line:
            step = int(line.split("step ")[1].split("/")[0])
            marks[step] = (time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
            losses.append(float(line.split("loss ")[1].split()[0]))

    out = Path(tempfile.mkdtemp())
    tiny._build("bench", out, log, checkpoint_every=steps)
    (t1, f1), (t2, f2) = marks[1], marks[steps]
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(out.glob("*.safetensors")))).hexdigest()[:12]
    print("[result] " + json.dumps({"s_per_step": (t2 - t1) / (steps - 1), "faults_per_step": (f2 - f1) / (steps - 1),
                                    "loss": losses[-1], "weights": digest}), flush=True)


def run(mode: str, steps: int) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(steps)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{mode} build failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("[result] ")).split(" ", 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=["default", "kept"])
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.steps)
    got: dict[str, list[dict]] = {"default": [], "kept": []}
    for i in range(args.rounds):
        for mode in (("default", "kept") if i % 2 == 0 else ("kept", "default")):
            got[mode].append(run(mode, args.steps))
            print(f"round {i + 1} {mode}: {got[mode][-1]}", flush=True)
    med = {m: statistics.median(r["s_per_step"] for r in rows) for m, rows in got.items()}
    print(f"\ntiny target, {args.steps} training steps, {args.rounds} rounds (median)")
    print(f"{'malloc':<34}{'s/step':>8}{'faults/step':>13}{'final loss':>12}{'weights':>14}")
    for mode, label in (("default", "glibc defaults"), ("kept", "keep_freed_buffers (the build's)")):
        rows = got[mode]
        print(f"{label:<34}{med[mode]:>8.3f}{statistics.median(r['faults_per_step'] for r in rows):>13,.0f}"
              f"{rows[0]['loss']:>12.3f}{rows[0]['weights']:>14}")
    same = len({r["weights"] for rows in got.values() for r in rows}) == 1
    print(f"speed-up {med['default'] / med['kept']:.2f}x; same weights in every build: {same}")


if __name__ == "__main__":
    main()
