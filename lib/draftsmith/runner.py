"""The stage runner: execute stage notebooks through papermill with checked parameters.

A stage is a notebook `notebooks/NN_name.ipynb`; its one cell tagged `parameters` declares the
parameters it takes as `name = literal  # help`. The runner merges the params file and `-p`
overrides over those defaults, rejects a key that no notebook declares or a value of the wrong type
(naming the file and key), turns relative paths into absolute ones (relative to where `draftsmith`
is run), and passes each notebook only what it declares. Executed notebooks go to
`<outputs_dir>/<run_name>/notebooks/`, their output streams to `.../logs/NN_name.log`. Before
anything runs, `prepare` also checks the values (see `preflight`). Cell numbers in messages and
logs count the cells of the notebook as a person sees it (papermill's injected cell not counted);
a failed cell's traceback goes to the log.
"""

from __future__ import annotations

import ast
import asyncio
import difflib
import logging
import os
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import nbformat
import yaml

from .files import write_text_atomic
from .paths import NOTEBOOKS_DIR, Run

PATH_SUFFIXES = ("_dir", "_file", "_path")
_EXECUTED = "notebooks"  # <run>/notebooks/: the executed copies


class ParamError(ValueError):
    """A parameter problem the user must fix; the message names the file and key."""


class StageFailed(RuntimeError):
    pass


class Interrupted(StageFailed):
    """Ctrl-C, SIGINT or SIGTERM during a stage; `exit_code` is the shell's 128 + signal number."""

    def __init__(self, message: str, signame: str = "SIGINT"):
        super().__init__(message)
        self.exit_code = 128 + int(getattr(signal, signame, signal.SIGINT))


@dataclass
class Param:
    name: str
    default: object
    help: str
    notebook: str

    @property
    def type_name(self) -> str:
        return "any" if self.default is None else type(self.default).__name__


@dataclass
class Stage:
    number: str
    name: str
    path: Path
    params: dict[str, Param]

    @property
    def title(self) -> str:
        return self.path.stem


def parameters_cell(nb) -> int:
    idx = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(idx) != 1:
        raise ParamError(f"expected exactly one cell tagged 'parameters', found {len(idx)}")
    return idx[0]


def read_parameters(path: Path) -> dict[str, Param]:
    """`name = literal  # help` lines of the notebook's parameters cell, in order."""
    nb = nbformat.read(path, as_version=4)
    src = nb.cells[parameters_cell(nb)].source
    tree = ast.parse(src)
    lines = src.splitlines()
    out: dict[str, Param] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise ParamError(f"{path.name}: parameters cell line {node.lineno}: only `name = literal` allowed")
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            raise ParamError(f"{path.name}: parameter {node.targets[0].id!r} must be a plain literal") from None
        line = lines[node.end_lineno - 1]
        help_ = line.split("#", 1)[1].strip() if "#" in line[node.end_col_offset:] else ""
        out[node.targets[0].id] = Param(node.targets[0].id, value, help_, path.name)
    return out


def discover(notebooks_dir: Path = NOTEBOOKS_DIR) -> list[Stage]:
    stages = []
    for p in sorted(notebooks_dir.glob("[0-9][0-9]_*.ipynb")):
        num, name = p.stem.split("_", 1)
        stages.append(Stage(num, name, p, read_parameters(p)))
    return stages


def select(stages: list[Stage], which: str) -> list[Stage]:
    if which == "all":
        return stages
    chosen = []
    for part in which.split(","):
        part = part.strip()
        hit = [s for s in stages if part in (s.number, s.name, s.title) or (part.isdigit() and int(part) == int(s.number))]
        if not hit:
            names = ", ".join(s.title for s in stages)
            raise ParamError(f"unknown stage {part!r}; stages are: {names} (or 'all')")
        chosen.extend(h for h in hit if h not in chosen)
    return chosen


def declared(stages: list[Stage]) -> dict[str, Param]:
    """Every parameter any notebook declares; the same name must have the same type everywhere."""
    out: dict[str, Param] = {}
    for s in stages:
        for name, p in s.params.items():
            q = out.get(name)
            if q is not None and q.default is not None and p.default is not None and \
                    _kind(q.default) != _kind(p.default):
                raise ParamError(f"parameter {name!r} is {q.type_name} in {q.notebook} but {p.type_name} in {p.notebook}")
            if q is None or q.default is None:
                out[name] = p
    return out


def _kind(v) -> str:
    return "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v).__name__


def check_type(name: str, value, p: Param, source: str) -> None:
    d = p.default
    if d is None:
        return
    ok = (isinstance(value, bool) if isinstance(d, bool)
          else isinstance(value, int) and not isinstance(value, bool) if isinstance(d, int)
          else isinstance(value, (int, float)) and not isinstance(value, bool) if isinstance(d, float)
          else isinstance(value, type(d)))
    if not ok:
        raise ParamError(f"{source}: parameter {name!r} must be {p.type_name} (declared in {p.notebook}), "
                         f"got {type(value).__name__} {value!r}")


def load_params(file: str | None, overrides: list[tuple[str, str]], known: dict[str, Param],
                sources: dict[str, str] | None = None) -> dict:
    """Params file + `-p` overrides, checked against what the notebooks declare. `sources`, when
    given, is filled with where each value came from (the file, or `-p KEY`)."""
    values: dict = {}
    sources = {} if sources is None else sources
    if file:
        path = Path(file)
        if not path.is_file():
            raise ParamError(f"params file {file!r} not found")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ParamError(f"{file}: not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ParamError(f"{file}: must be a mapping of parameter names to values")
        for k, v in loaded.items():
            _check_known(k, known, file)
            check_type(k, v, known[k], file)
            values[k], sources[k] = v, file
    for k, raw in overrides:
        _check_known(k, known, "-p")
        v = yaml.safe_load(raw) if raw != "" else ""
        if isinstance(known[k].default, str) and not isinstance(v, str):
            v = raw
        check_type(k, v, known[k], f"-p {k}")
        values[k], sources[k] = v, f"-p {k}"
    if "datasets" in values and values["datasets"] is not None:
        from .datasets import parse_datasets

        try:
            parse_datasets(values["datasets"])
        except ValueError as e:
            raise ParamError(f"{file or '-p'}: {e}") from None
    return values


def _check_known(key, known: dict[str, Param], source: str) -> None:
    if key not in known:
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ParamError(f"{source}: unknown parameter {key!r}: no notebook declares it{hint} "
                         f"(see `draftsmith run --list`)")


def absolutize(values: dict, base: Path) -> dict:
    """Relative paths (keys ending in _dir/_file/_path, and datasets[].path) made absolute."""
    from .target.tiny import VARIANTS

    def fix(v):
        if isinstance(v, str) and v and v not in VARIANTS and not os.path.isabs(os.path.expanduser(v)):
            return str((base / v).resolve())
        return os.path.expanduser(v) if isinstance(v, str) else v

    out = dict(values)
    for k, v in values.items():
        if k.endswith(PATH_SUFFIXES):
            out[k] = fix(v)
    if isinstance(out.get("datasets"), list):
        out["datasets"] = [{**d, "path": fix(d["path"])} if isinstance(d, dict) and "path" in d else d
                           for d in out["datasets"]]
    return out


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


def executed_notebooks(run: Run) -> list[Path]:
    """The executed copies of the stage notebooks saved in `run`, in stage order."""
    return sorted((run.root / _EXECUTED).glob("[0-9][0-9]_*.ipynb"))


def run_stages(stages: list[Stage], values: dict, echo=True) -> Run:
    """Execute the stages in order, then (re)write the run's report.html from every executed
    notebook of the run, also when a stage failed. Raise StageFailed naming the notebook and cell."""
    run = Run(values["outputs_dir"], values["run_name"])
    try:
        _run_stages(run, stages, values, echo)
    finally:
        from .report import write_report

        path = write_report(run)
        if path and echo:
            print(f"== report: {path}", file=sys.stderr, flush=True)
    return run


def _run_stages(run: Run, stages: list[Stage], values: dict, echo: bool) -> None:
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    nb_dir = run.dir(_EXECUTED)
    write_text_atomic(run.root / "run_params.yaml", yaml.safe_dump(values, sort_keys=False, allow_unicode=True))
    _kernel_env()
    logger = logging.getLogger("papermill")
    logger.setLevel(logging.INFO)
    for stage in stages:
        params = {k: v for k, v in values.items() if k in stage.params}
        out_nb, log_path = nb_dir / stage.path.name, stage_log(run, stage.title)
        log_path.write_text("")  # every writer below appends: papermill, the kernel, the failure
        handlers = [logging.FileHandler(log_path, mode="a", encoding="utf-8")]
        if echo:
            handlers.append(logging.StreamHandler(sys.stderr))
        injected = parameters_cell(nbformat.read(stage.path, as_version=4)) + 1
        for h in handlers:
            h.setFormatter(logging.Formatter("%(message)s"))
            h.addFilter(_CellNumbers(injected))
            logger.addHandler(h)
        t0 = time.time()
        print(f"== {stage.title}: running, log {log_path}", file=sys.stderr, flush=True)
        stop = _Stop()
        try:
            stop.install()
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
        print(f"== {stage.title}: done in {time.time() - t0:.0f}s -> {out_nb}", file=sys.stderr, flush=True)


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


def effective_params(stages_all: list[Stage], file: str | None, overrides: list[tuple[str, str]],
                     base: Path | None = None, sources: dict[str, str] | None = None) -> dict:
    """Defaults of every notebook, overlaid by the params file and the overrides, paths absolute.
    `sources`, when given, maps each key to where its value came from."""
    known = declared(stages_all)
    values = {name: p.default for name, p in known.items()}
    given: dict[str, str] = {}
    values.update(load_params(file, overrides, known, given))
    if sources is not None:
        sources.update({name: f"default of {p.notebook}" for name, p in known.items()}, **given)
    if not values.get("run_name"):
        raise ParamError(f"{file or '-p'}: run_name is required")
    return absolutize(values, base or Path.cwd())


def prepare(stages_all: list[Stage], chosen: list[Stage], file: str | None,
            overrides: list[tuple[str, str]], base: Path | None = None,
            sources: dict[str, str] | None = None) -> dict:
    """`effective_params`, then every value check of the chosen stages and a writable run folder:
    one ParamError listing every problem, before anything starts or pays. `sources`, when given,
    maps each key to where its value came from."""
    from . import preflight

    sources = {} if sources is None else sources
    values = effective_params(stages_all, file, overrides, base, sources)
    problems = preflight.check(chosen, values, sources)
    if not problems:
        problem = preflight.check_outputs(values, sources.get("outputs_dir", "outputs_dir"))
        problems = [problem] if problem else []
    if problems:
        raise ParamError("\n  ".join([f"{len(problems)} problem(s), nothing was run:"] + problems))
    return values
