"""Stage 02 before and after the keep-alive rules, the bill of unreadable bodies and the cache
header, side by side in one run: each case runs the stage of a git revision (`--before`, default
HEAD, exported to a temporary folder) and of the working tree against the same stand-in, the local
emulator of the working tree (a fresh process and account per run, the stand-in of a bad day).

Cases (`--prompts` prompts, `--concurrency` in flight, answers instant otherwise):
  stream-stall   stream: true, request_timeout_s 5; 4% of requests stall behind
                 `: OPENROUTER PROCESSING` comments for --stall-s seconds, then a 524
  json-stall     stream: false (the real job's default), the same stalls behind whitespace padding
  bad-bytes      stream: false; 4% of answers billed in full but not UTF-8
  cache-preset   the key's preset turns OpenRouter's response cache on; a second run over the same
                 prompts (a second sample per prompt); "rows" counts its rows, "copies" those that
                 are the first run's answers again

Per run: wall time, rows written, the spend the manifest reports and the emulator's ledger.

Run: .venv/bin/python bench/bench_stalls.py [--before HEAD] [--prompts 200] [--stall-s 60]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from bench_generate import write_prompts  # noqa: E402
from draftsmith.emulator import KEY_ENV, emulator_process, new_key, read_ledger  # noqa: E402
from draftsmith.emulator.config import load_config  # noqa: E402
from draftsmith.generate.outputs import RESPONSES  # noqa: E402
from draftsmith.targets.checkpoint import resolve_target  # noqa: E402

MODEL = "moonshotai/kimi-k2.5"

# One run of stage 02 in a child process on the source tree given by PYTHONPATH: prints the result.
CHILD = r"""
import inspect, json, sys, time
from pathlib import Path
import draftsmith
from draftsmith.generate.stage import run_at
from draftsmith.openrouter.apikey import ApiKey
from draftsmith.paths import Run
a = json.loads(sys.argv[1])
t0 = time.monotonic()
args = [ApiKey(a["key"], "bench"), Run(Path(a["root"]), a["name"])]
if "cfg" in inspect.signature(run_at).parameters:      # a revision with stage configs
    from draftsmith.config import GenerateConfig, split
    settings, knobs = split(GenerateConfig, a["params"])
    args.append(GenerateConfig(datasets=a["datasets"], target_model_path=None, **settings))
else:
    args.append(a["datasets"])
    knobs = a["params"]
r = run_at(a["base"], *args, log=lambda *x: None, **knobs)
print(json.dumps({"wall_s": time.monotonic() - t0, "spent": r.spent_usd, "status": r.status,
                  "kinds": r.session.get("errors_by_kind", {}), "src": draftsmith.__file__}))
"""


def export(rev: str, into: Path) -> Path:
    """The `src` and `notebooks` of git revision `rev` (the parameters' defaults live in notebooks)."""
    tar = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src", "notebooks"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into / "src"


def provider(**faults) -> list[dict]:
    return [{"slug": "bench", "name": "Bench", "quantization": "int4", "prompt_price": 0.6,
             "completion_price": 2.5, "faults": faults}]


def stage(src: Path, base: str, key: str, root: Path, name: str, data: Path, params: dict, timeout_s: float) -> dict:
    arg = json.dumps({"base": base, "key": key, "root": str(root), "name": name,
                      "datasets": [{"name": "p", "path": str(data)}], "params": params})
    env = dict(os.environ, PYTHONPATH=str(src), DRAFTSMITH_PROGRESS="off")
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, arg], env=env, capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"wall_s": time.monotonic() - t0, "spent": None, "status": f"killed at {timeout_s:.0f}s", "kinds": {}}
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert Path(out["src"]).resolve().is_relative_to(src.resolve()), (out["src"], src)   # the tree asked for
    return out


def rows(root: Path, name: str) -> list[dict]:
    path = root / name / "generate" / "p" / RESPONSES
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def case(src: Path, work: Path, emulator: dict, params: dict, data: Path, second_run: bool,
         timeout_s: float) -> dict:
    key = new_key()
    cfg = load_config({"backend": "synthetic", "synthetic_tokens": 24, "time_scale": 0.0, "padding_interval_s": 1.0,
                       "target_model_path": str(resolve_target("tiny-test", log=lambda *a: None)), **emulator})
    state = work / "emu"
    env = dict(os.environ, **{KEY_ENV: key})
    since = 0.0
    with emulator_process(state, cfg.model_dump_json(), env) as (_, base):
        res = stage(src, base, key, work, "first", data, params, timeout_s)
        if second_run:
            first = {r["sample_id"]: r["content"] for r in rows(work, "first")}
            since = time.time()
            res = stage(src, base, key, work, "second", data, params, timeout_s)
            saved = rows(work, "second")
            res["copies"] = sum(first.get(r["sample_id"]) == r["content"] for r in saved)
            res["rows"] = len(saved)
        else:
            res["rows"] = len(rows(work, "first"))
    res["ledger"] = sum(x["cost"] for x in read_ledger(state) if x["time"] >= since)   # this run's bills
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="HEAD", help="git revision of the 'before' column")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--stall-s", type=float, default=60.0)
    args = ap.parse_args()
    base = dict(model=MODEL, max_tokens=64, concurrency=args.concurrency, spend_limit_usd=5.0, native_precision="int4",
                max_attempts=8, request_timeout_s=5.0, backoff_base_s=0.1, backoff_cap_s=1.0, balance_poll_s=1.0,
                target_model_path="tiny-test")
    cases = {
        "stream-stall": ({"providers": provider(stall=0.04), "stall_s": args.stall_s}, {"stream": True}, False),
        "json-stall": ({"providers": provider(stall=0.04), "stall_s": args.stall_s}, {"stream": False}, False),
        "bad-bytes": ({"providers": provider(bad_bytes=0.04)}, {"stream": False}, False),
        "cache-preset": ({"providers": provider(), "response_cache": "preset"}, {"stream": False}, True),
    }
    with tempfile.TemporaryDirectory(prefix="bench-stalls-") as tmp:
        tmp = Path(tmp)
        (tmp / "before").mkdir()
        trees = {"before": export(args.before, tmp / "before"), "after": REPO / "src"}
        data = write_prompts(tmp / "p.jsonl", args.prompts)
        print(f"{args.prompts} prompts, {args.concurrency} in flight, request_timeout_s 5, max_tokens 64 "
              f"(after: deadline 5 + 64/10 = 11.4 s), stalls {args.stall_s:.0f}s then a 524; before = {args.before}")
        head = f"{'case':<13} {'version':<7} {'run s':>7} {'rows':>5} {'copies':>6} {'spent $':>10} {'ledger $':>10} " \
               f"{'spent/ledger':>12}  errors"
        print(head)
        print("-" * len(head))
        for name, (emu, params, second) in cases.items():
            results = {}
            for version, src in trees.items():
                work = tmp / name / version
                work.mkdir(parents=True)
                results[version] = r = case(src, work, emu, {**base, **params}, data, second,
                                            timeout_s=args.stall_s * 10)
                spent = "-" if r["spent"] is None else f"{r['spent']:.6f}"
                ratio = "-" if not r["spent"] or not r["ledger"] else f"{r['spent'] / r['ledger']:.4f}"
                kinds = ",".join(f"{k}:{v}" for k, v in sorted(r["kinds"].items()))
                print(f"{name:<13} {version:<7} {r['wall_s']:>7.1f} {r['rows']:>5} {r.get('copies', '-')!s:>6} "
                      f"{spent:>10} {r['ledger']:>10.6f} {ratio:>12}  {kinds}")
            b, a = results["before"], results["after"]
            print(f"{'':<13} {'ratio':<7} {b['wall_s'] / a['wall_s']:>6.1f}x  (run time before / after)")


if __name__ == "__main__":
    main()
