"""The stage runner: execute stage notebooks through papermill, each with the values it declares.

The values come checked from `parameters`. Executed notebooks go to
`<outputs_dir>/<run_name>/notebooks/`, their output streams to `.../logs/NN_name.log`. Cell
numbers in messages and logs count the cells of the notebook as a person sees it (papermill's
injected cell not counted); a failed cell's traceback goes to the log.

The terminal gets one line per stage (name, verdict, time, the figures that decide the verdict)
and, at the end, the run summary (`draftsmith.summary`), which is also `<run>/summary.json` and the
top of report.html. What the notebooks print stays in the logs; on a terminal, a status line that
is rewritten in place shows the stage's latest line while it runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import yaml

from . import progress
from . import summary as run_summary
from .files import write_text_atomic
from .parameters import Stage, parameters_cell, read_notebook
from .paths import EXECUTED, Run
from .report import write_report



class StageFailed(RuntimeError):
    pass


class VerdictFailed(StageFailed):
    """Every stage ran without an error, but one's verdict is failed (or warning, under `strict`):
    the CLI's exit code `EXIT_CODE`. The printed summary already says which and why."""

    EXIT_CODE = 3
    exit_code = EXIT_CODE


class Interrupted(StageFailed):
    """Ctrl-C, SIGINT or SIGTERM during a stage; `exit_code` is the shell's 128 + signal number."""

    def __init__(self, message: str, signame: str = "SIGINT"):
        super().__init__(message)
        self.exit_code = 128 + int(getattr(signal, signame, signal.SIGINT))


def _kernel_env() -> None:
    """Environment the notebook kernels inherit: plain-line progress, quiet hub bars, our kernel."""
    os.environ["DRAFTSMITH_PROGRESS"] = os.environ.get("DRAFTSMITH_PROGRESS", "log")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    share = str(Path(sys.prefix) / "share" / "jupyter")
    paths = os.environ.get("JUPYTER_PATH", "")
    if share not in paths.split(os.pathsep):
        os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (share, paths) if p)


def stage_log(run: Run, title: str) -> Path:
    """The log of stage `title` (e.g. 01_providers) in `run`: its output and, on failure, the traceback."""
    return run.dir("logs") / f"{title}.log"


def node_title(stage: Stage, values: dict) -> str:
    """The name of a stage's executed notebook and log: its title, and for a stage that runs on
    several nodes (it declares `nnodes`, and it is > 1: the same command on each, one shared run
    folder) this node's host name too, `04_hidden_states@node-a`, so that no node's record
    overwrites another's."""
    if "nnodes" in stage.params and int(values.get("nnodes") or 1) > 1:
        return f"{stage.title}@{socket.gethostname()}"
    return stage.title


def run_stages(stages: list[Stage], values: dict, echo=True, keep_going: bool = False, strict: bool = False,
               params_file: str | None = None) -> Run:
    """Execute the stages in order, then (re)write the run's summary.json and report.html from every
    executed notebook of the run and the stages' files, also when a stage failed, and print the
    summary. A stage whose verdict is failed (with `strict`, also warning) ends the chain there,
    unless `keep_going`; either way VerdictFailed is raised once the summary is written. The stages
    that did not start are in the summary with the cause. Raise StageFailed naming the notebook and
    cell when a stage raises."""
    run = Run(values["outputs_dir"], values["run_name"])
    stops = {run_summary.Verdict.FAILED} | ({run_summary.Verdict.WARNING} if strict else set())
    not_run: list[run_summary.NotRun] = []
    try:
        ran = _run_stages(run, stages, values, echo, stops, keep_going, not_run)
    finally:
        done = run_summary.build(run, not_run, params_file)
        if done.stages:   # none when refused before the first stage (another process writing the run)
            run_summary.write(run, done)
            write_report(run, done)
            if echo:
                print(f"draftsmith: outputs in {run.root}: report.html, summary.json, logs/", file=sys.stderr, flush=True)
                print("\n".join(run_summary.lines(done)), file=sys.stderr, flush=True)
    bad = [s for s in ran if s.verdict in stops]
    if bad:
        raise VerdictFailed(", ".join(f"{s.title} {s.verdict.value}" for s in bad))
    return run


def _check_no_other_writer(run: Run) -> None:
    """Refuse at once, before any stage runs or any of the run's files is touched, when another
    process is generating this run. Only a check: stage 02's kernel takes the lock itself."""
    from .generate import outputs as generate_outputs

    try:
        with generate_outputs.writer_lock(run):
            pass
    except generate_outputs.RunBusy as e:
        raise StageFailed(f"stage 02 not started: {e}") from None


def _run_stages(run: Run, stages: list[Stage], values: dict, echo: bool, stops: set, keep_going: bool,
                not_run: list) -> list[run_summary.StageSummary]:
    """Run the stages; the summary of each that ran, in order. The stages after one whose verdict is
    in `stops` (unless `keep_going`), or after one that raised, are appended to `not_run`."""
    if any(stage.name == "generate" for stage in stages):
        _check_no_other_writer(run)
    ran: list[run_summary.StageSummary] = []
    for i, stage in enumerate(stages):
        try:
            done = _run_stage(run, stage, values, echo, first=i == 0, count=len(stages))
        except BaseException as e:
            cause = (run_summary.StopCause.INTERRUPTED if isinstance(e, (Interrupted, KeyboardInterrupt))
                     else run_summary.StopCause.DID_NOT_FINISH)
            not_run += [run_summary.NotRun(s.title, stage.title, cause) for s in stages[i + 1:]]
            raise
        ran.append(done)
        if done.verdict in stops and not keep_going:
            cause = run_summary.StopCause(done.verdict.value)
            not_run += [run_summary.NotRun(s.title, stage.title, cause) for s in stages[i + 1:]]
            break
    return ran


def _run_stage(run: Run, stage: Stage, values: dict, echo: bool, first: bool, count: int) -> run_summary.StageSummary:
    """Execute one stage's notebook (the first also checks the run and sets the kernels up); its summary."""
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    nb_dir = run.dir(EXECUTED)
    logger = logging.getLogger("papermill")
    if first:
        write_text_atomic(run.root / "run_params.yaml", yaml.safe_dump(values, sort_keys=False, allow_unicode=True))
        _kernel_env()
        logger.setLevel(logging.INFO)
        logger.propagate = False    # what the notebooks print goes to their logs, not to the terminal
        if echo:
            print(f"draftsmith: run {run.name}, {count} stage{'s' * (count > 1)}; what each prints goes to "
                  f"{run.root / 'logs'}/", file=sys.stderr, flush=True)
    params = {k: v for k, v in values.items() if k in stage.params}
    title = node_title(stage, values)
    out_nb, log_path = nb_dir / f"{title}.ipynb", stage_log(run, title)
    log_path.write_text("")  # every writer below appends: papermill, the kernel, the failure
    handlers = [logging.FileHandler(log_path, mode="a", encoding="utf-8")]
    if echo and sys.stderr.isatty():
        handlers.append(_StatusLine(stage.title))
    injected = parameters_cell(read_notebook(stage.path)) + 1
    for h in handlers:
        h.setFormatter(logging.Formatter("%(message)s"))
        h.addFilter(_CellNumbers(injected))
        logger.addHandler(h)
    stop = _Stop()
    try:
        stop.install()
        progress.note("papermill run")
        pm.execute_notebook(str(stage.path), str(out_nb), parameters=params, kernel_name="python3",
                            log_output=True, progress_bar=False, cwd=str(run.root),
                            kernel_manager_class=_kernel_manager(log_path, stop))
    except PapermillExecutionError as e:
        cell = e.cell_index + (e.cell_index < injected)  # 1-based, as the notebook shows its cells
        _append(log_path, f"== {stage.title} failed in cell {cell}:\n" + _plain("\n".join(e.traceback)))
        if e.ename == "KeyboardInterrupt" or stop.name:  # e.g. stage 02's GenerationStopped after a clean stop
            said = "" if e.ename == "KeyboardInterrupt" else f" ({_first_line(e.evalue)})"
            raise Interrupted(f"{stop.what} in {stage.title}, cell {cell}{said}; what was written is kept, "
                              f"re-run the same command to resume\n  log: {log_path}", stop.name or "SIGINT") from None
        raise StageFailed(
            f"stage {stage.title} failed in cell {cell}: {e.ename}: {_first_line(e.evalue)}\n"
            f"  traceback: {log_path}\n  executed notebook: {out_nb}") from None
    except KeyboardInterrupt:
        raise Interrupted(f"{stop.what} in {stage.title}; what was written is kept, re-run the same "
                          f"command to resume\n  log: {log_path}", stop.name) from None
    except Exception as e:  # kernel died, notebook unreadable, ...
        _append(log_path, f"== {stage.title} could not run:\n" + traceback.format_exc())
        raise StageFailed(f"stage {stage.title} could not run: {type(e).__name__}: {_first_line(e)}\n"
                          f"  log: {log_path}") from None
    finally:
        stop.uninstall()
        for h in handlers:
            logger.removeHandler(h)
            h.close()
    if stop.name:  # the stage's cells ended cleanly after the interrupt (stage 02 saves its work and returns)
        raise Interrupted(f"{stop.what} in {stage.title}; the stage stopped cleanly and what was written is "
                          f"kept, re-run the same command to resume\n  log: {log_path}", stop.name)
    done = run_summary.stage(run, [out_nb])
    if echo:
        print(run_summary.stage_line(done, STAGE_WIDTH), file=sys.stderr, flush=True)
    return done


class _Stop:
    """SIGINT or SIGTERM (Ctrl-C, `kill`, a scheduler's time-out) while a stage runs.

    nbclient's own answer to both is to shut the kernel down, which loses whatever the running cell
    holds (stage 02: paid requests in flight). Instead the kernel is interrupted, as Jupyter's stop
    button does: stage 02 stops cleanly and saves what is in flight, any other cell raises
    KeyboardInterrupt. A second signal interrupts again (stage 02 then gives up on its requests in
    flight at once). The run stops after the current stage. The kernel runs in its own session, so a
    terminal's Ctrl-C reaches it only this way."""

    def __init__(self):
        self.name: str | None = None
        self._old = None

    @property
    def what(self) -> str:
        return "stopped by SIGTERM" if self.name == "SIGTERM" else "interrupted"

    def note(self, signum) -> None:
        self.name = self.name or signal.Signals(signum).name

    def install(self) -> None:
        """Until the kernel is up (and after it is gone), SIGTERM acts as Ctrl-C does."""
        def on_term(signum, frame):
            self.note(signum)
            raise KeyboardInterrupt
        self._old = signal.signal(signal.SIGTERM, on_term)

    def uninstall(self) -> None:
        signal.signal(signal.SIGTERM, self._old if self._old is not None else signal.SIG_DFL)

    def take_over(self, km) -> None:
        """Replace nbclient's signal handlers on the running loop by an interrupt of the kernel."""
        loop = asyncio.get_running_loop()

        def on_signal(signum):
            self.note(signum)
            asyncio.ensure_future(km.interrupt_kernel())

        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, on_signal, s)


def _kernel_manager(log_path: Path, stop: _Stop):
    """A kernel manager whose kernel writes its own stdout/stderr (its startup warnings, a message
    handler's traceback when the run is stopped) to the stage's log rather than the terminal, and
    which a signal interrupts instead of killing (see `_Stop`)."""
    from jupyter_client import AsyncKernelManager

    class KernelWritingToLog(AsyncKernelManager):
        async def start_kernel(self, **kw):
            with open(log_path, "ab") as f:
                kw.setdefault("stdout", f)
                kw.setdefault("stderr", f)
                started = await super().start_kernel(**kw)
            stop.take_over(self)
            return started

    return KernelWritingToLog


STAGE_WIDTH = len("03_validate_tokens")  # the stage lines' first column

# What a stage's log holds that tells a person nothing while it runs: papermill's own lines (the
# notebook's paths, the kernel, each cell's start and end), the text repr of a figure or of a
# markdown display, blank lines.
CHATTER = re.compile(r"^\s*$|^(Executing|Ending) cell |^(Input|Output) Notebook: |^Working directory: "
                     r"|^Executing notebook with kernel|^<Figure size |^<IPython\.core\.display\.")


class _StatusLine(logging.Handler):
    """On a terminal, one line rewritten in place while a stage runs: its name, the time so far and
    the latest line its notebook printed (cut to the terminal's width); wiped when the stage ends.
    The same line is never rewritten twice, chatter (`CHATTER`) never shown."""

    def __init__(self, title: str):
        super().__init__(logging.INFO)
        self.title, self.t0, self.last = title, time.monotonic(), ""
        sys.stderr.write(f"{title}: running")
        sys.stderr.flush()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            lines = [x for x in _plain(record.getMessage()).splitlines() if not CHATTER.match(x)]
        except Exception:
            return
        if not lines or lines[-1].strip() == self.last:
            return
        self.last = lines[-1].strip()
        width = shutil.get_terminal_size((100, 20)).columns - 1
        text = f"{self.title}: running {time.monotonic() - self.t0:.0f} s | {self.last}"
        sys.stderr.write("\r\x1b[K" + text[:width])
        sys.stderr.flush()

    def close(self) -> None:
        if self.title:  # once: logging closes every handler again at exit
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.title = ""
        super().close()


class _CellNumbers(logging.Filter):
    """papermill counts its injected parameters cell; renumber its "Executing Cell N" lines to the
    notebook's own cells, so the log and the error message name the same cell."""

    def __init__(self, injected: int):
        super().__init__()
        self.injected = injected

    def filter(self, record: logging.LogRecord) -> bool:
        m = re.match(r"(Executing|Ending) Cell (\d+)-*$", str(record.msg))
        if m:
            n = int(m.group(2))  # 1-based in the executed copy; the injected cell is number injected+1
            label = "injected parameters" if n == self.injected + 1 else str(n - (n > self.injected + 1))
            record.msg, record.args = f"{m.group(1)} cell {label}", ()
        return True


def _append(log_path: Path, text: str) -> None:
    with open(log_path, "a", encoding="utf-8") as f:
        f.write(text.rstrip() + "\n")


def _plain(s: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", str(s))


def _first_line(s) -> str:
    s = _plain(s)
    return s.strip().splitlines()[0] if s.strip() else s


