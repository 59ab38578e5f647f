"""Stage 01's files, `<run>/providers/`: the one module that knows their names, writes them (whole
or not at all) and reads them back for the other stages, the report and the benches.

    endpoints.csv   every endpoint with its prices, the policy's `allowed` and `reason`
    routing.json    the `provider` object stage 02 sends, and every exclusion with its reason
    cost_plan.csv   the planned cost of each dataset's output budget
    pilot.csv       the pilot's replies, probe.csv the probe's answers, logprob_probe.csv the logprob
                    probe's verdict per endpoint: paid for, so reused by a re-run unless `refresh_providers`
    logprobs.jsonl  the logprob probe's usable answers with their logprobs and ids (stage 04's reference)
    spend.json      what the pilot and the probe cost (stage 02 counts it in the run's spend)
    summary.json    the stage's figures in one place
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..files import write_json_atomic, write_text_atomic
from ..paths import Run
from ..openrouter.pricing import exclusions
from ..verdicts import Figure, Note, Reason, Verdict, read_file, usd

STAGE = "providers"


def routing_file(run: Run) -> Path:
    return run.root / STAGE / "routing.json"


def read_routing(run: Run) -> dict | None:
    """The `provider` object stage 01 chose for stage 02; None if stage 01 did not run. A file
    holding only a provider object (written by hand) is read as that object."""
    path = routing_file(run)
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); re-run stage 01 or fix the file") from None
    obj = obj.get("provider", obj) if isinstance(obj, dict) else None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object (or one with a 'provider' object)")
    return obj


def read_routing_record(run: Run) -> dict:
    """routing.json whole: the provider object, and which endpoints were allowed and excluded, and why."""
    path = routing_file(run)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no routing (run stage 01 first)")
    return json.loads(path.read_text(encoding="utf-8"))


def logprobs_file(run: Run) -> Path:
    """The logprob probe's usable answers (`providers.logprobs`): stage 04's independent reference."""
    return run.root / STAGE / "logprobs.jsonl"


def read_summary(run: Run) -> dict:
    """summary.json: stage 01's figures (`stage_summary`)."""
    path = run.root / STAGE / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no stage 01 summary (run stage 01 first)")
    return json.loads(path.read_text(encoding="utf-8"))


def read_endpoints(run: Run) -> pd.DataFrame:
    """The endpoint table with the policy's verdicts, as stage 01 last wrote it."""
    return pd.read_csv(run.root / STAGE / "endpoints.csv")


def read_cost_plan(run: Run) -> pd.DataFrame:
    return pd.read_csv(run.root / STAGE / "cost_plan.csv")


def write_outputs(run: Run, model: str, native_precision: str, policy: pd.DataFrame, routing: dict,
                  plan: pd.DataFrame, summary: dict) -> None:
    """endpoints.csv, routing.json (the provider object and every exclusion), cost_plan.csv and
    summary.json."""
    folder = run.dir(STAGE)
    write_text_atomic(folder / "endpoints.csv", policy.to_csv(index=False))
    write_text_atomic(folder / "cost_plan.csv", plan.to_csv(index=False))
    write_json_atomic(folder / "routing.json", {"model": model, "native_precision": native_precision,
                                                "provider": routing, "allowed": routing["only"],
                                                "excluded": exclusions(policy)})
    write_json_atomic(folder / "summary.json", summary)


def stage_summary(run: Run, balance: tuple[float | None, str], expected_output: float, routing: dict,
                  plan: pd.DataFrame, outliers: list[str]) -> dict:
    """summary.json: the balance and its source, the response length planned with, what this stage
    spent, the allowed endpoints, the plan's cost and share that fits, the probe's outliers."""
    return {"balance_usd": balance[0], "balance_source": balance[1], "expected_output_tokens": float(expected_output),
            "stage_01_spent_usd": spent(run), "allowed": routing["only"],
            "planned_cost_mix_usd": float(plan["cost_mix"].sum()),
            "fits_fraction": float(plan["fits_fraction"].iloc[0]), "probe_outliers": outliers}


# ---- the paid tables and what they cost ----------------------------------------------------------

def reuse(run: Run, name: str, refresh_providers: bool) -> pd.DataFrame | None:
    """The `name` table (pilot or probe) of an earlier run of this stage, paid for already, unless
    `refresh_providers`; None when there is none."""
    path = run.root / STAGE / f"{name}.csv"
    if refresh_providers or not path.is_file():
        return None
    print(f"{name}: reusing {path} (paid for by an earlier run of this stage; refresh_providers: true to redo it)")
    return pd.read_csv(path)


def keep_paid(run: Run, name: str, table: pd.DataFrame) -> None:
    """Count what a paid step cost (its table's `cost` column), then keep its table for `reuse`."""
    record_spend(run, name, float(table["cost"].sum()))
    write_text_atomic(run.dir(STAGE) / f"{name}.csv", table.to_csv(index=False))


def record_spend(run: Run, what: str, usd: float) -> float:
    """Add what a paid step of this stage cost to spend.json; returns the stage's total so far."""
    path = run.dir(STAGE) / "spend.json"
    doc = {"steps": {}} if not path.is_file() else _spend_doc(path)
    doc["steps"][what] = round(doc["steps"].get(what, 0.0) + float(usd), 10)
    doc["total_usd"] = round(sum(doc["steps"].values()), 10)
    write_json_atomic(path, doc)
    return doc["total_usd"]


def spent(run: Run) -> float:
    """USD stage 01 has spent in this run (its pilots and probes), 0 if it never ran."""
    path = run.root / STAGE / "spend.json"
    return float(_spend_doc(path)["total_usd"]) if path.is_file() else 0.0


def _spend_doc(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        doc["total_usd"], doc["steps"] = float(doc["total_usd"]), dict(doc["steps"])
        return doc
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not the file stage 01 writes ({type(e).__name__}: {e}); "
                         f"re-run stage 01 or remove it") from None


def check_spend(run: Run, worst_usd: float, spend_limit_usd: float) -> None:
    """Refuse a paid step whose worst case would take this run past its spend limit."""
    done = spent(run)
    if done + worst_usd > spend_limit_usd:
        raise RuntimeError(f"stage 01 has spent ${done:.4f} of spend_limit_usd ${spend_limit_usd:.2f}; the next step "
                           f"could cost ${worst_usd:.4f}: raise spend_limit_usd, or set expected_output_tokens / "
                           f"probe_prompts / logprob_prompts: 0 to skip the pilot / the probe / the logprob probe")


# ---- the stage's verdict, for the run summary (`draftsmith.summary` assembles the stages') ----

@dataclass
class ProvidersNumbers:
    allowed: list[str]
    excluded: dict[str, str]            # endpoint tag -> why it is left out
    balance_usd: float | None
    spent_usd: float
    fits_fraction: float                # share of the planned cost the balance and the limit cover


def verdict(run: Run, anchor: str):
    """Stage 01's line of the run summary: (ProvidersNumbers, verdict, figures, notes); failed when no
    endpoint is allowed, a warning when the money does not cover the plan."""
    s = read_file(run, read_summary, run)
    routing = read_file(run, read_routing_record, run)
    n = ProvidersNumbers(allowed=list(routing["allowed"]),
                         excluded={e["tag"]: e["reason"] for e in routing.get("excluded", [])},
                         balance_usd=s["balance_usd"], spent_usd=s["stage_01_spent_usd"],
                         fits_fraction=s["fits_fraction"])
    figures = [Figure(f"{len(n.allowed)} endpoints allowed, {len(n.excluded)} excluded", anchor),
               Figure(f"balance {usd(n.balance_usd)}, the plan fits {n.fits_fraction:.0%}", anchor)]
    notes = []
    if not n.allowed:
        notes.append(Note(Reason.NO_ENDPOINT, "no endpoint is allowed: stage 02 has nowhere to send a request"))
    elif n.fits_fraction < 1:
        notes.append(Note(Reason.PLAN_NOT_COVERED, f"the balance and spend limit cover {n.fits_fraction:.0%} of the "
                          f"planned cost: stage 02 will stop short of the budgets"))
    outcome = Verdict.FAILED if not n.allowed else Verdict.WARNING if notes else Verdict.OK
    return n, outcome, figures, notes
