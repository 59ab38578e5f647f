"""The stages and their parameters: what each notebook declares, and the values a run gives them.

A stage is a notebook `notebooks/NN_name.ipynb`; its one cell tagged `parameters` declares the
parameters it takes as `name = literal  # help`, and that literal is the setting's one default.
A number's help may start with its bound, an interval: `concurrency = 64  # [1, inf) requests in
flight` (`(0, 1]`, `[0, inf)`, ...). That line is the setting's one declaration: the runner's
preflight and the library (`check_bounds`, called where a stage takes its settings) read it, and a
stage's `run(run, **params)` takes the notebook's names end to end (`given` picks them out of a
notebook's namespace).
A params file (and `-p` overrides) hold only what differs: they are merged over the defaults, a
key that no notebook declares or a value of the wrong type is rejected (naming the file and key),
relative paths (`datasets` and `imports` entries too) become absolute, relative to where
`draftsmith` is run (`effective_params`); `preflight.prepare` then checks every value of the
chosen stages before anything starts or pays.
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .paths import NOTEBOOKS_DIR

PATH_SUFFIXES = ("_dir", "_file", "_path")


class ParamError(ValueError):
    """A parameter problem the user must fix; the message names the file and key."""


BOUND = re.compile(r"^([\[(])\s*(-?inf|-?[\d.]+(?:e-?\d+)?)\s*,\s*(inf|-?[\d.]+(?:e-?\d+)?)\s*([\])])\s*")


@dataclass(frozen=True)
class Bound:
    """An interval a number must lie in, as its declaration writes it: `[1, inf)`, `(0, 1]`."""
    low: float
    high: float
    low_closed: bool
    high_closed: bool

    def holds(self, v) -> bool:
        return ((v >= self.low if self.low_closed else v > self.low) and
                (v <= self.high if self.high_closed else v < self.high))

    def __str__(self) -> str:
        low = f"{self.low:g}"
        if self.high == float("inf"):
            return f"at least {low}" if self.low_closed else f"more than {low}"
        return f"in {'[' if self.low_closed else '('}{low}, {self.high:g}{']' if self.high_closed else ')'}"


def parse_bound(help_: str) -> tuple[Bound | None, str]:
    """(the bound a help text starts with, or None; the rest of the text)."""
    m = BOUND.match(help_)
    if not m:
        return None, help_
    return Bound(float(m[2]), float(m[3]), m[1] == "[", m[4] == "]"), help_[m.end():]


@dataclass
class Param:
    name: str
    default: object
    help: str
    notebook: str
    bound: Bound | None = None

    @property
    def type_name(self) -> str:
        return "any" if self.default is None else type(self.default).__name__

    def problem(self, value) -> str | None:
        """What is wrong with a number outside the declared bound (None: nothing)."""
        if self.bound is None or not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        if self.bound.holds(value):
            return None
        return f"{self.name} must be {self.bound} ({self.help}), got {value!r}"


@dataclass
class Stage:
    number: str
    name: str
    path: Path
    params: dict[str, Param]

    @property
    def title(self) -> str:
        return self.path.stem


def read_notebook(path: Path) -> dict:
    """A notebook file as its JSON (`cells` with their `source` as one string). An .ipynb is JSON;
    this reads it without nbformat, whose import alone costs about a second (its schema validator
    builds a grammar), which every stage's import and every `draftsmith` command would pay."""
    try:
        nb = json.loads(Path(path).read_text(encoding="utf-8"))
        cells = nb["cells"]
        for c in cells:
            if isinstance(c.get("source"), list):
                c["source"] = "".join(c["source"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ParamError(f"{path}: not a notebook ({type(e).__name__}: {e})") from None
    return nb


def parameters_cell(nb) -> int:
    """The index of the notebook's one cell tagged `parameters` (`nb`: read_notebook's, or nbformat's)."""
    idx = [i for i, c in enumerate(nb["cells"]) if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(idx) != 1:
        raise ParamError(f"expected exactly one cell tagged 'parameters', found {len(idx)}")
    return idx[0]


def read_parameters(path: Path) -> dict[str, Param]:
    """`name = literal  # help` lines of the notebook's parameters cell, in order. A stage notebook
    carrying outputs was run and saved in place (Jupyter's autosave), so its parameters cell may
    hold one session's values instead of the shipped defaults: it is refused, not read."""
    nb = read_notebook(path)
    ran = [i + 1 for i, c in enumerate(nb["cells"])
           if c.get("cell_type") == "code" and (c.get("outputs") or c.get("execution_count") is not None)]
    if ran:
        raise ParamError(f"{path}: cell {ran[0]} holds outputs: the notebook was run and saved in place, so its "
                         f"parameters cell may no longer hold the defaults; restore it as shipped (in a git clone: "
                         f"git checkout -- {path}) and explore in `make lab`, which opens copies in lab/")
    src = nb["cells"][parameters_cell(nb)]["source"]
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
        bound, help_ = parse_bound(help_)
        if bound is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
            raise ParamError(f"{path.name}: parameter {node.targets[0].id!r}: a bound is for numbers, "
                             f"its default is {value!r}")
        param = out[node.targets[0].id] = Param(node.targets[0].id, value, help_, path.name, bound)
        problem = param.problem(value)
        if problem:
            raise ParamError(f"{path.name}: {problem} (its own default)")
    return out


@functools.cache
def _shipped() -> tuple[list[Stage], dict[str, Param]]:
    """The repository's stages and every setting they declare, read once per process."""
    stages = discover()
    return stages, declared(stages)


def declaration(name: str) -> Param:
    """The one declaration of setting `name` (the notebooks' parameters cells, read once)."""
    params = _shipped()[1]
    if name not in params:
        raise KeyError(f"no notebook declares {name!r}")
    return params[name]


def default_field(name: str):
    """A dataclass field whose default is setting `name`'s one default (its notebook declaration),
    for the library's settings classes: no second default to drift from the notebook's."""
    return field(default_factory=lambda: copy.deepcopy(declaration(name).default))


def check_bounds(values: dict) -> None:
    """Raise ValueError naming the first setting of `values` outside its declared bound; the
    library calls this where a stage takes its settings, so a direct call is held to the same
    bounds as a `draftsmith run`."""
    for name, value in values.items():
        problem = declaration(name).problem(value)
        if problem:
            raise ValueError(problem)


def given(number: str, namespace: dict) -> dict:
    """Notebook `number`'s parameters (their current values in `namespace`, the notebook's
    globals), without the two that name the run folder: what its stage's `run(run, **params)` takes."""
    stage = next(s for s in _shipped()[0] if s.number == number)
    return {name: namespace[name] for name in stage.params if name not in ("run_name", "outputs_dir")}


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
            raise ParamError(f"{sources['datasets']}: {e}") from None
    return values


def _check_known(key, known: dict[str, Param], source: str) -> None:
    if key not in known:
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ParamError(f"{source}: unknown parameter {key!r}: no notebook declares it{hint} "
                         f"(see `draftsmith run --list`)")


def absolutize(values: dict, base: Path) -> dict:
    """Relative paths (keys ending in _dir/_file/_path, datasets[].path, imports[].path,
    eval_benchmarks[].path) made absolute; a built-in target's name stays a name."""
    from .targets.checkpoint import BUILT_IN_TARGETS as VARIANTS

    def fix(v):
        if isinstance(v, str) and v and v not in VARIANTS and not os.path.isabs(os.path.expanduser(v)):
            return str((base / v).resolve())
        return os.path.expanduser(v) if isinstance(v, str) else v

    out = dict(values)
    for k, v in values.items():
        if k.endswith(PATH_SUFFIXES):
            out[k] = fix(v)
    for k in ("datasets", "imports", "eval_benchmarks"):
        if isinstance(out.get(k), list):
            out[k] = [{**d, "path": fix(d["path"])} if isinstance(d, dict) and isinstance(d.get("path"), str) else d
                      for d in out[k]]
    return out


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
        raise ParamError(f"{given.get('run_name', file or '-p')}: run_name is required")
    return absolutize(values, base or Path.cwd())
