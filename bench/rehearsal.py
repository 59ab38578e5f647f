"""Rehearsal of the real job at its real volume: `params/kimi-k2.5.yaml` against the local emulator.

The user's job: 6 datasets x 10M output tokens of Kimi-K2.5 through OpenRouter, 2000 requests in
flight, a $100 balance that cannot cover it. This runs the job's stages 01-03 exactly as a user
would (`draftsmith run STAGE -f params`), with the params file unchanged except what points it
at a local emulator: `api_base` (the emulator's URL), the key (a throwaway one, in the
environment), `target_model_path` (the built-in test target: its tokenizer stands in for Kimi's,
which is not on this machine), the prompt files (rehearsal_data.py), `run_name`/`outputs_dir`.

The emulator runs for the whole rehearsal in its own process (so its CPU is not the client's, and
the account outlives each stage as OpenRouter's does): Kimi-K2.5's endpoints with their prices,
speeds, rate limits and faults (rehearsal_data.catalogue), the synthetic backend (reasoning-model
response lengths), $100 of credits, and its clock `--time-scale` times the real one, so the job's
simulated time is measured, not waited for.

    1. stage 01 plans the cost: the $100 balance does not cover the budgets (checked);
    2. stage 02 runs until the balance floor and stops (checked); the rehearsal tops the account
       up through the emulator's admin endpoint, as a user would on the website; stage 02 again
       resumes and finishes every dataset's budget (checked);
    3. stage 03 rebuilds and validates every response.
Then it prints one table (and writes it to `<run>/rehearsal/table.md`, the numbers to
`result.json`), next to the reference run's figures.

The emulator's `in_flight` is polled every second during stage 02 (`admin/state`): what the
providers were serving, independent of what the client says about itself; slot utilisation is
read from it. Simulated wall time = real time x (1 / time_scale): only meaningful while the client
keeps up, which the utilisation shows. The client's own waits (backoff, Retry-After) are real
seconds and are not scaled, so the simulated time errs long.

    .venv/bin/python bench/rehearsal.py                       # the full volume (make rehearsal)
    .venv/bin/python bench/rehearsal.py --volume 0.01 --run-name rehearsal-1pct
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rehearsal_data  # noqa: E402

from draftsmith.generate import outputs
from draftsmith.datasets import stable_id  # noqa: E402

from draftsmith.emulator import ADMIN_KEY_ENV, KEY_ENV, emulator_process, new_key  # noqa: E402
from draftsmith.report import report_file  # noqa: E402
from draftsmith.paths import REPO_ROOT, Run  # noqa: E402
from draftsmith.providers import outputs as stage_01  # noqa: E402
from draftsmith.providers.stage import plan_verdict  # noqa: E402
from draftsmith.files import read_jsonl, write_json_atomic  # noqa: E402
from draftsmith.tokens import read_report  # noqa: E402

PARAMS = REPO_ROOT / "params" / "kimi-k2.5.yaml"
TARGET = "tiny-test"     # built in, cached: its tokenizer stands in for Kimi-K2.5's
BALANCE_USD = 100.0
REFERENCE = {"wall": "33 min", "usd": "$86", "errors": "0 in 1637 checked", "billing": "0.04%"}


class RehearsalFailed(RuntimeError):
    pass


# --- the emulator and the stages, as processes -------------------------------------------------

class Emulator:
    """`python -m draftsmith.emulator` for the whole rehearsal; `state()` polls admin/state."""

    def __init__(self, folder: Path, config: dict, key: str, admin_key: str):
        self.admin_key = admin_key
        self._process = emulator_process(folder, json.dumps(config, indent=1),
                                         {**os.environ, KEY_ENV: key, ADMIN_KEY_ENV: admin_key})
        self.proc, self.base_url = self._process.__enter__()

    def admin(self, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(f"{self.base_url}/admin/{path}", method="POST" if body else "GET",
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"Authorization": f"Bearer {self.admin_key}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["data"]

    def cpu_s(self) -> float:
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def close(self) -> None:
        self._process.__exit__(None, None, None)


class Watch:
    """CPU seconds and peak RSS of a process and all its descendants (sampled every `every` s;
    a process's last sample counts), and optionally the emulator's state over time."""

    def __init__(self, pid: int, emulator: Emulator | None = None, every: float = 0.5):
        self.cpu: dict[int, float] = {}
        self.rss = 0
        self.states: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pid, emulator, every), daemon=True)
        self._thread.start()

    def _run(self, pid: int, emulator: Emulator | None, every: float) -> None:
        try:
            root = psutil.Process(pid)
        except psutil.NoSuchProcess:
            return
        last_state = 0.0
        while not self._stop.is_set():
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            for p in procs:
                try:
                    with p.oneshot():
                        t = p.cpu_times()
                        self.cpu[p.pid] = t.user + t.system + t.children_user + t.children_system
                        self.rss = max(self.rss, p.memory_info().rss)
                except psutil.NoSuchProcess:
                    pass
            if emulator is not None and time.monotonic() - last_state >= 1.0:
                last_state = time.monotonic()
                try:
                    self.states.append({"t": time.time(), **emulator.admin("state")})
                except OSError:
                    pass
            self._stop.wait(every)

    def close(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"cpu_s": round(sum(self.cpu.values()), 1), "peak_rss_mb": round(self.rss / 2**20)}


def run_stage(stage: str, params: Path, env: dict, log: Path, emulator: Emulator | None = None,
              overrides: dict | None = None) -> dict:
    """`draftsmith run STAGE -f params [-p KEY VALUE]`: exit code, real seconds, CPU and peak RSS of
    its process tree."""
    t0 = time.monotonic()
    extra = [x for k, v in (overrides or {}).items() for x in ("-p", k, json.dumps(v))]
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "draftsmith"), "run", stage, "-f", str(params),
                                 *extra],
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=REPO_ROOT)
        watch = Watch(proc.pid, emulator)
        shown = time.monotonic()
        while (rc := proc.poll()) is None:
            time.sleep(0.5)
            if time.monotonic() - shown >= 30:     # the stage's own progress line, now and then
                shown = time.monotonic()
                line = _last_progress(log)
                if line:
                    print(f"  {stage}: {line}", flush=True)
    usage = watch.close()
    return {"stage": stage, "rc": rc, "real_s": round(time.monotonic() - t0, 1), **usage, "states": watch.states}


def _last_progress(log: Path) -> str | None:
    """The last `[desc] ...` progress line the stages printed (progress.py, log mode)."""
    with open(log, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
        lines = [x for x in f.read().decode("utf-8", "replace").splitlines() if x.startswith("[")]
    return lines[-1][:220] if lines else None


# --- the run ---------------------------------------------------------------------------------------

def derived_params(run: Run, base_url: str, datasets: list[dict], volume: float) -> Path:
    """params/kimi-k2.5.yaml with only what points it at the emulator (and the run's folder)
    changed; below full volume, its budgets and dollar amounts are scaled by `volume` too."""
    params = yaml.safe_load(PARAMS.read_text())
    changed = {"run_name": run.name, "outputs_dir": str(run.root.parent), "api_base": base_url, "api_key_file": None,
               "target_model_path": TARGET,
               "datasets": [{**d, "output_token_budget": scaled_budget(params, volume)} for d in datasets],
               "imports": []}   # the six sampled datasets stand in for B3-B8; B1-B2's imports are not rehearsed
    if volume != 1.0:
        changed |= {k: params[k] * volume for k in ("spend_limit_usd", "balance_floor_usd")}
    unknown = set(changed) - set(params) - {"outputs_dir"}  # kimi-k2.5.yaml keeps the default outputs_dir
    if unknown:
        raise RehearsalFailed(f"{PARAMS} lacks {sorted(unknown)}: the rehearsal only changes existing keys")
    path = run.dir("rehearsal") / "params.yaml"
    path.write_text("# params/kimi-k2.5.yaml pointed at the local emulator by bench/rehearsal.py\n"
                    + yaml.safe_dump({**params, **changed}, sort_keys=False))
    return path


def scaled_budget(params: dict, volume: float) -> int:
    return max(1000, round(params["datasets"][0]["output_token_budget"] * volume))


def rehearse(volume: float = 1.0, time_scale: float = 0.1, run_name: str = "rehearsal",
             outputs_dir: str | Path = "outputs", log=print) -> dict:
    """The whole rehearsal; returns result.json's content. `volume` scales the token budgets and
    the balance together (1.0: 10M tokens per dataset, $100)."""
    t_start = time.monotonic()
    run = Run(outputs_dir, run_name)
    if run.root.exists():
        raise RehearsalFailed(f"{run.root} exists (an earlier rehearsal): remove it, or give another run name")
    params = yaml.safe_load(PARAMS.read_text())
    budget = scaled_budget(params, volume)
    credits = BALANCE_USD * volume
    work = run.dir("rehearsal")
    # enough prompts that every budget is reached: the mean response is ~1.1x the median length
    per_dataset = math.ceil(1.6 * budget / rehearsal_data.MEDIAN_RESPONSE_TOKENS) + 20
    log(f"rehearsal: {len(rehearsal_data.DATASETS)} datasets x {budget:,} output tokens, ${credits:g} balance, "
        f"{params['concurrency']} in flight, emulator clock x{time_scale:g}; writing {per_dataset:,} prompts per dataset")
    datasets = rehearsal_data.write_datasets(work / "data", per_dataset)
    key, admin_key = new_key(), secrets.token_hex(16)
    emu = Emulator(run.root / "emulator", rehearsal_data.emulator_config(time_scale, credits, admin_key), key, admin_key)
    env = {**os.environ, "OPENROUTER_API_KEY": key, "DRAFTSMITH_PROGRESS": "log"}
    env.pop("DRAFTSMITH_EMULATOR_KEY", None)
    stages = []
    try:
        path = derived_params(run, emu.base_url, datasets, volume)
        logs = work / "stages.log"

        def stage(name: str, expect_ok: bool = True, watch_emulator: bool = False, **overrides) -> dict:
            log(f"rehearsal: stage {name} (log: {logs})")
            r = run_stage(name, path, env, logs, emu if watch_emulator else None, overrides)
            r["label"] = f"{name}" if name != "02" else f"02 #{sum(s['stage'] == '02' for s in stages) + 1}"
            r["t_end"] = time.time()
            stages.append(r)
            log(f"rehearsal: stage {r['label']}: exit {r['rc']} after {r['real_s']:.0f}s, "
                f"CPU {r['cpu_s']:.0f}s, peak RSS {r['peak_rss_mb']} MB")
            if expect_ok and r["rc"] != 0:
                raise RehearsalFailed(f"stage {name} failed (exit {r['rc']}); see {logs}")
            return r

        stage("01")
        plan = stage_01_plan(run, credits, yaml.safe_load(path.read_text())["spend_limit_usd"])
        if plan["tokens_that_fit"] >= plan["output_tokens"]:
            raise RehearsalFailed(f"stage 01 planned ${plan['planned_usd']:.2f}, within the ${credits:g} balance: "
                                  f"the rehearsal must run the balance out")
        log(f"rehearsal: stage 01 says: {plan['sentence']}")
        first = stage("02", expect_ok=False, watch_emulator=True)
        stop = last_session(run)
        if first["rc"] == 0 or stop.get("status") != "balance":
            raise RehearsalFailed(f"stage 02 was to stop at the balance floor; it ended {stop.get('status')!r} "
                                  f"(exit {first['rc']}): {stop.get('message')}")
        top_up = topup_amount(run, plan, emu, params["balance_floor_usd"] * volume)
        account = emu.admin("topup", {"amount": top_up})
        limit = yaml.safe_load(path.read_text())["spend_limit_usd"] + top_up
        log(f"rehearsal: stage 02 stopped at the balance floor ({stop.get('message')}); topped up ${top_up:g}, "
            f"balance now ${account['balance']:.2f}; re-running with spend_limit_usd ${limit:g}")
        stage("02", watch_emulator=True, spend_limit_usd=limit)
        stage("03")
        emulator_cpu = emu.cpu_s()
    finally:
        emu.close()
    facts = {"stages": stages, "plan": plan, "top_up": top_up, "time_scale": time_scale, "volume": volume,
             "concurrency": params["concurrency"], "emulator_cpu": emulator_cpu, "budget": budget, "credits": credits,
             "real_elapsed_s": round(time.monotonic() - t_start, 1)}
    write_json_atomic(work / "stages.json", facts)       # what measure() needs besides the run's files
    return report(run, log)


def report(run: Run, log=print) -> dict:
    """The table from a finished rehearsal's files (`--report-only` redoes it)."""
    work = run.dir("rehearsal")
    f = json.loads((work / "stages.json").read_text())
    result = measure(run, f["stages"], f["plan"], f["top_up"], f["time_scale"], f["concurrency"], f["emulator_cpu"])
    result["real_elapsed_s"] = f["real_elapsed_s"]
    result["volume"], result["budget_per_dataset"], result["initial_balance_usd"] = f["volume"], f["budget"], f["credits"]
    result["figures"] = sorted(str(p.relative_to(run.root)) for p in run.root.glob("*/figures/*.png"))
    if "generate/figures/timeline.png" not in result["figures"]:
        raise RehearsalFailed("stage 02's report drew no generate/figures/timeline.png (spend vs balance, in flight)")
    write_json_atomic(work / "result.json", result)
    table = render(result)
    (work / "table.md").write_text(table + "\n")
    log(table)
    log(f"rehearsal: the stages' report with the figures: {report_file(run)}")
    return result


def stage_01_plan(run: Run, balance: float, spend_limit: float) -> dict:
    """What stage 01's cost plan says about the balance, and whether its log said so before stage
    02 ran."""
    plan = stage_01.read_cost_plan(run)
    sentence = plan_verdict(plan, balance, spend_limit)
    if sentence not in (run.root / "logs" / "01_providers.log").read_text():
        raise RehearsalFailed(f"stage 01's log does not say: {sentence}")
    return {"planned_usd": float(plan["cost_mix"].sum()), "output_tokens": int(plan["output_tokens"].sum()),
            "tokens_that_fit": int(plan["output_tokens_that_fit"].sum()), "sentence": sentence}


def last_session(run: Run) -> dict:
    manifest = outputs.read_manifest(run)
    return manifest["sessions"][-1] if manifest.get("sessions") else {}


def topup_amount(run: Run, plan: dict, emu: Emulator, floor: float) -> float:
    """What a user would add: what stage 02's stop message says (the expected cost of what is left,
    plus a worst case per slot the rest needs, so every slot stays busy, less the money left); if it said
    nothing, the planned cost of the tokens still to do plus a quarter. Whole dollars from $10 up."""
    manifest = outputs.read_manifest(run)
    usd = manifest["sessions"][-1].get("top_up_usd") if manifest.get("sessions") else None
    if not usd:
        done = sum(d["completion_tokens"] for d in manifest["datasets"].values())
        left = max(0.0, plan["planned_usd"] * (1 - done / plan["output_tokens"]))
        usd = max(0.01, 1.25 * left - (emu.admin("state")["balance"] - floor))
    return float(math.ceil(usd)) if usd >= 10 else math.ceil(usd * 100) / 100


# --- the figures of the table ------------------------------------------------------------------

def measure(run: Run, stages: list[dict], plan: dict, top_up: float, time_scale: float, concurrency: int,
            emulator_cpu: float) -> dict:
    manifest = outputs.read_manifest(run)
    allowed = stage_01.read_routing(run)["only"]
    endpoints = {r["tag"]: r for r in stage_01.read_endpoints(run).to_dict("records")}
    keep = ("generation_id", "time", "generation_ms", "prompt_key", "billed", "cost", "error")
    ledger = [{k: r.get(k) for k in keep} for _, r in read_jsonl(run.root / "emulator" / "ledger.jsonl")]
    account = [r for _, r in read_jsonl(run.root / "emulator" / "account.jsonl")]
    runs02 = [s for s in stages if s["stage"] == "02"]
    t02 = runs02[0]["t_end"] - runs02[0]["real_s"]     # stage 02's first start: ledger lines before are stage 01's

    saved, dup = {}, 0      # sample id -> (generation id, client latency) of its saved response
    asked = Counter()       # saved samples per prompt (two samples may share a prompt)
    for name in manifest["datasets"]:
        for _, r in outputs.read_responses(run, name):
            dup += r["sample_id"] in saved
            saved[r["sample_id"]] = (r["generation_id"], r.get("latency_s"))
            asked[stable_id(r["messages"])] += 1       # the emulator's prompt_key of that request
    saved_gens = {g for g, _ in saved.values()}
    lines02 = [r for r in ledger if r["time"] - r["generation_ms"] / 1000 >= t02]
    billed = [r for r in lines02 if r["billed"] and r["cost"] > 0]
    delivered = [r for r in billed if r["error"] is None]
    lost = [r for r in delivered if r["generation_id"] not in saved_gens]
    wire = [r for r in billed if r["error"] is not None]          # billed, then hung or cut by the provider
    # paid twice: bills beyond one per saved sample of the same prompt; a bill the provider lost on
    # the wire explains one, a request still in flight when the first session stopped another
    bills, wire_bills = Counter(r["prompt_key"] for r in billed), Counter(r["prompt_key"] for r in wire)
    stop_t = runs02[0]["t_end"]
    around_stop = Counter(r["prompt_key"] for r in billed if r["error"] is None
                          and r["time"] - r["generation_ms"] / 1000 <= stop_t <= r["time"] + 5)
    twice = {k: bills[k] - asked[k] for k in bills if bills[k] > asked[k]}
    after_wire = sum(min(n, wire_bills[k]) for k, n in twice.items())
    at_stop = sum(min(n - min(n, wire_bills[k]), around_stop[k]) for k, n in twice.items())
    tokens = {name: d["completion_tokens"] for name, d in manifest["datasets"].items()}
    budgets = {name: d["budget"] for name, d in manifest["datasets"].items()}
    out_tokens = sum(tokens.values())
    in_tokens = sum(d["prompt_tokens"] for d in manifest["datasets"].values())
    spent02 = sum(r["cost"] for r in lines02)
    # the least these tokens could have cost: all of them on the one allowed endpoint cheapest for them
    cost_on = {t: (in_tokens * float(endpoints[t]["price_in"]) + out_tokens * float(endpoints[t]["price_out"])) / 1e6
               for t in allowed}
    cheapest = min(cost_on, key=cost_on.get)
    cheapest_usd = cost_on[cheapest]
    credits = [a for a in account if a.get("type") == "credits"]
    timeline = outputs.read_timeline(run)
    floor = manifest["config"]["balance_floor_usd"]
    worst = manifest["config"]["request"]["max_tokens"] * max(
        float(endpoints[t].get("price_out_worst") or endpoints[t]["price_out"]) for t in allowed) / 1e6
    sessions = [phase(s, [p for p in timeline if p["session"] == n], concurrency, floor, worst)
                for n, s in enumerate(runs02, start=len(manifest["sessions"]) - len(runs02) + 1)]
    tokens_report = read_report(run)
    t = tokens_report["totals"]
    return {
        "time_scale": time_scale, "concurrency": concurrency,
        "simulated_generation_s": round(sum(s["span_s"] for s in sessions) / time_scale, 1) if time_scale else None,
        "sessions": sessions, "lag_s": lags(saved, lines02),
        "tokens": tokens, "budgets": budgets,
        "overshoot": {n: (tokens[n] - budgets[n]) / budgets[n] for n in tokens},
        # TokenBudget's tolerance: 1% of the budget, or one max_tokens when that is more
        "overshoot_limit": max(0.01, manifest["config"]["request"]["max_tokens"] / min(budgets.values())),
        "spent_usd_run": manifest["spent_usd"], "ledger_usd": round(sum(r["cost"] for r in ledger), 6),
        "account_credits_usd": sum(a["amount"] for a in credits), "top_up_usd": top_up,
        "stage02_usd": round(spent02, 6), "usd_per_m_out": 1e6 * spent02 / max(1, out_tokens),
        "cheapest_tag": cheapest, "cheapest_usd_per_m_out": 1e6 * cheapest_usd / max(1, out_tokens),
        "plan": plan,
        "samples_saved": len(saved), "duplicated": dup, "lost": len(lost),
        "lost_usd": round(sum(r["cost"] for r in lost), 6),
        "billed_lost_on_wire": len(wire), "billed_lost_on_wire_usd": round(sum(r["cost"] for r in wire), 6),
        "paid_twice": sum(twice.values()), "paid_twice_after_wire_fault": after_wire,
        "paid_twice_in_flight_at_stop": at_stop,
        "manifest_lost_answers": sum(s.get("lost_answers", 0) for s in manifest["sessions"]),
        "manifest_lost_costed": sum(s.get("lost_answers_costed", 0) for s in manifest["sessions"]),
        "requests_at_providers": len(lines02), "stop_message": manifest["sessions"][0].get("message"),
        "client": [{k: s[k] for k in ("label", "real_s", "cpu_s", "peak_rss_mb")} for s in stages],
        "emulator_cpu_s": round(emulator_cpu, 1),
        "stage03_s": next(s["real_s"] for s in stages if s["stage"] == "03"),
        "stage03": {"samples": t["samples"], "flagged": t["flagged"], "excluded": t["excluded"],
                    "issues": t["issues"], "relative_error": t["relative_error"],
                    "exact_match_rate": t["exact_match_rate"], "billed": t["billed_completion_tokens"],
                    "rebuilt": t["reconstructed_completion_tokens"],
                    "flagged_providers": sorted(tokens_report.get("flagged_providers", {}))},
    }


def phase(stage: dict, points: list[dict], concurrency: int, floor: float, worst: float) -> dict:
    """One stage 02 session, second by second (`points`: the client's timeline.jsonl lines of
    that session; `stage["states"]`: the emulator's admin/state polls). Each second is one of:
    slots full (the client holds `concurrency` requests), money-bound (balance - floor - reserved
    is less than one more request's worst case: the engine may not start it), or winding down
    (fewer prompts or budget left than slots). Real seconds."""
    if not points:
        return {"label": stage["label"], "span_s": 0.0, "full_s": 0, "money_s": 0, "wind_s": 0, "peak_in_flight": 0}
    full = money = wind = 0
    full_at = []
    for pt in points:
        if pt["in_flight"] >= 0.98 * concurrency:
            full += 1
            full_at.append(pt["t"])
        elif pt["balance"] is not None and pt["balance"] - floor - pt["reserved"] < worst:
            money += 1
        else:
            wind += 1
    # at the providers (emulator) while the client's slots were full: requests waiting out a retry are not
    emu = [st["in_flight"] for st in stage["states"] if full_at and full_at[0] <= st["t"] <= full_at[-1]]
    return {"label": stage["label"], "span_s": round(points[-1]["t"] - points[0]["t"] + 1.0, 1),
            "full_s": full, "money_s": money, "wind_s": wind,
            "peak_in_flight": max(pt["in_flight"] for pt in points),
            "at_providers_when_full": sum(emu) / len(emu) / concurrency if emu else None}


def lags(saved: dict, ledger: list[dict]) -> dict:
    """How long after the emulator finished a response the client had it parsed: the client's
    latency minus the emulator's time for that generation (real seconds). A client that keeps up
    shows a lag that is small next to the requests' duration."""
    took = {r["generation_id"]: r["generation_ms"] / 1000 for r in ledger}
    d = sorted(lat - took[g] for g, lat in saved.values() if g in took and lat is not None)
    dur = sorted(took[g] for g, _ in saved.values() if g in took)
    if not d:
        return {}
    q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return {"p50": q(d, 0.5), "p99": q(d, 0.99), "max": d[-1], "duration_p50": q(dur, 0.5)}


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "n/a (time_scale 0)"
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def render(r: dict) -> str:
    """The one table: what was measured, next to the reference run."""
    s1, s2 = (r["sessions"] + [{}, {}])[:2]
    over = max(r["overshoot"].values())
    per_ds = ", ".join(f"{n} {t / 1e6:.3f}M" for n, t in r["tokens"].items())
    sim = (lambda sec: _dur(sec / r["time_scale"])) if r["time_scale"] else (lambda sec: "n/a")
    util = "; ".join(
        f"{x['label']}: slots full {sim(x['full_s'])}"
        + (f" ({100 * x['at_providers_when_full']:.0f}% of them at a provider; the others wait out a retry, "
           f"or hold an answer the client has not read yet)"
           if x.get("at_providers_when_full") is not None else "")
        + f", money-bound {sim(x['money_s'])}, winding down {sim(x['wind_s'])}, peak {x['peak_in_flight']}"
        for x in r["sessions"])
    lag = r.get("lag_s") or {}
    if lag:
        util += (f"; the client had each response {lag['p50']:.3f} s (p50) / {lag['p99']:.3f} s (p99) real after "
                 f"the emulator finished it (responses take {lag['duration_p50']:.1f} s real, p50)")
    c = {x["label"]: x for x in r["client"]}
    cpu = ", ".join(f"{k} {v['cpu_s']:.0f} s / {v['peak_rss_mb']} MB" for k, v in c.items())
    st3 = r["stage03"]
    rel = st3["relative_error"]
    rows = [
        ("what", "this rehearsal", "reference run"),
        ("scale", f"{len(r['tokens'])} datasets x {r['budget_per_dataset']:,} output tokens, {r['concurrency']} in flight, "
                  f"${r['initial_balance_usd']:g} balance (volume x{r['volume']:g}); emulator clock x{r['time_scale']:g}", "6 x 10M, 2000, $100"),
        ("simulated wall time of generation", f"{_dur(r['simulated_generation_s'])} (sessions: "
         + ", ".join(f"{s['label']} {_dur(s['span_s'] / r['time_scale'] if r['time_scale'] else None)}" for s in r["sessions"]) + ")",
         REFERENCE["wall"]),
        ("stage 01 plan vs balance", r["plan"]["sentence"], ""),
        ("output tokens per dataset vs budget", f"{per_ds}; largest overshoot {100 * over:+.3f}% (limit +{100 * r['overshoot_limit']:.3g}%)", ""),
        ("dollars spent (run, stage 01 included) vs emulator ledger",
         f"${r['spent_usd_run']:.2f} vs ${r['ledger_usd']:.2f} (difference ${abs(r['spent_usd_run'] - r['ledger_usd']):.4f}); "
         f"credits ${r['account_credits_usd']:.2f} = ${r['initial_balance_usd']:g} + top-up ${r['top_up_usd']:g}",
         REFERENCE["usd"]),
        ("$ per M output tokens (stage 02) vs cheapest allowed endpoint",
         f"${r['usd_per_m_out']:.3f} vs ${r['cheapest_usd_per_m_out']:.3f} ({r['cheapest_tag']}): "
         f"x{r['usd_per_m_out'] / r['cheapest_usd_per_m_out']:.3f}", ""),
        ("samples duplicated / lost / paid twice",
         f"{r['duplicated']} / {r['lost']} / {r['paid_twice']} ({r['paid_twice_in_flight_at_stop']} in flight at the stop, "
         f"{r['paid_twice_after_wire_fault']} after a provider billed and lost the answer: "
         f"{r['billed_lost_on_wire']} such, ${r['billed_lost_on_wire_usd']:.4f}, costed via /generation: "
         f"{r['manifest_lost_costed']} of {r['manifest_lost_answers']})", "0 / 0 / -"),
        ("slots: full / money-bound / winding down (simulated), client lag", util, ""),
        ("client CPU and peak RSS per stage", cpu + f"; emulator CPU {r['emulator_cpu_s']:.0f} s", ""),
        ("stage 03: time, checks, billed vs rebuilt",
         f"{_dur(r['stage03_s'])}; {st3['samples']} samples, {st3['flagged']} flagged, "
         f"{sum(st3['issues'].values())} structural issues; billed {st3['billed']:,} vs rebuilt {st3['rebuilt']:,} "
         f"({100 * rel:.4f}%), exact {100 * st3['exact_match_rate']:.2f}%" if rel is not None else "n/a",
         f"{REFERENCE['errors']}, {REFERENCE['billing']}"),
        ("real elapsed time of the rehearsal", _dur(r["real_elapsed_s"]), ""),
    ]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len(b) for _, b, _ in rows)
    lines = [f"| {a:<{w0}} | {b:<{w1}} | {c} |" for a, b, c in rows]
    lines.insert(1, f"|{'-' * (w0 + 2)}|{'-' * (w1 + 2)}|---|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--volume", type=float, default=1.0,
                    help="fraction of the real job: token budgets and the $100 balance together (default 1)")
    ap.add_argument("--time-scale", type=float, default=0.5,
                    help="emulator seconds per simulated second (default 0.5: twice as fast as real)")
    ap.add_argument("--run-name", default="rehearsal")
    ap.add_argument("--outputs-dir", default="outputs")
    ap.add_argument("--report-only", action="store_true", help="only redo the table of a finished rehearsal")
    args = ap.parse_args(argv)
    try:
        if args.report_only:
            report(Run(args.outputs_dir, args.run_name))
        else:
            rehearse(args.volume, args.time_scale, args.run_name, args.outputs_dir)
    except RehearsalFailed as e:
        print(f"rehearsal failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
