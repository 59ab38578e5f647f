"""The stages and their settings, and the values a run gives them.

Each stage's settings are declared once, in its typed config (`draftsmith.config`): type, default,
bound and one line of help. `discover` turns the configs into `Stage`s (the notebook a stage runs
is only where the runner finds it); the notebooks' parameters cells are written from the configs
(`python -m draftsmith.parameters --write-cells`) and a test holds them equal. A params file (and
`-p` overrides) hold only what differs: they are merged over the defaults, a key no stage declares
or a value of the wrong type is rejected (naming the file and key), relative paths become absolute
(`effective_params`); `preflight.prepare` then builds the chosen stages' configs (each checks its
bounds as it is built) and checks what a bound cannot say.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import config
from .paths import NOTEBOOKS_DIR

PATH_SUFFIXES = ("_dir", "_file", "_path")


class ParamError(ValueError):
    """A parameter problem the user must fix; the message names the file and key."""


@dataclass
class Param:
    name: str
    default: object
    help: str
    notebook: str
    bound: config.Bound | None = None
    annotation: str | None = None   # the config's type, e.g. "str | None"

    @property
    def type_name(self) -> str:
        if self.annotation:
            return self.annotation
        return "any" if self.default is None else type(self.default).__name__


@dataclass
class Stage:
    number: str
    name: str
    path: Path                       # the notebook the runner executes
    params: dict[str, Param]
    config: type | None = None       # its typed config (draftsmith.config)

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


@functools.cache
def _shipped() -> tuple[list[Stage], dict[str, Param]]:
    """The repository's stages and every setting they declare, read once per process."""
    stages = discover()
    return stages, declared(stages)


def declaration(name: str) -> Param:
    """The one declaration of setting `name` (the stages' configs)."""
    params = _shipped()[1]
    if name not in params:
        raise KeyError(f"no stage declares {name!r}")
    return params[name]


def default_field(name: str):
    """A dataclass field whose default is setting `name`'s one default (its stage config's), for the
    library's settings classes: no second default to drift from it."""
    return field(default_factory=lambda: copy.deepcopy(declaration(name).default))


def stage_config(number: str, namespace: dict):
    """Stage `number`'s config (`config.STAGES`) from `namespace`, a notebook's globals: what its
    stage's `run(run, cfg)` takes, its bounds checked as it is built."""
    cls = config.STAGES[number][1]
    return cls(**{f.name: namespace[f.name] for f in dataclasses.fields(cls)})


def discover(notebooks_dir: Path = NOTEBOOKS_DIR, configs: dict | None = None) -> list[Stage]:
    """The stages of `configs` ({number: (name, config class)}, `config.STAGES` by default), their
    settings read from the config classes; `notebooks_dir` only says where each stage's notebook,
    `NN_name.ipynb`, lies for the runner."""
    stages = []
    for number, (name, cls) in sorted((configs or config.STAGES).items()):
        path = Path(notebooks_dir) / f"{number}_{name}.ipynb"
        stages.append(Stage(number, name, path, config_parameters(cls, path.name), cls))
    return stages


def config_parameters(cls, notebook: str) -> dict[str, Param]:
    """The settings a config class declares, in order, with their bounds (a config checks its own
    defaults against them as it is declared: `config.stage_settings`)."""
    out: dict[str, Param] = {}
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        bound = config.Bound.of(f.metadata["bound"]) if f.metadata.get("bound") else None
        out[f.name] = Param(f.name, default, f.metadata.get("help", ""), notebook, bound, str(f.type))
    return out


def literal(v) -> str:
    """`v` as the Python literal a parameters cell writes: strings in double quotes."""
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(x)}" for k, x in v.items()) + "}"
    return repr(v)


def cell_source(stage: Stage) -> str:
    """The parameters cell of `stage`'s notebook, written from its config: `name = literal  # help`."""
    lines = []
    for p in stage.params.values():
        help_ = " ".join(x for x in (p.bound and p.bound.written, p.help) if x)
        lines.append(f"{p.name} = {literal(p.default)}" + (f"  # {help_}" if help_ else ""))
    return "\n".join(lines) + "\n"


def reference(stages: list[Stage] | None = None) -> str:
    """docs/parameters.md: every stage's settings as tables (name, type, default, bound, help)."""
    out = ["# Parameters", "", "Every setting of every stage, written from the stages' configs (`src/draftsmith/config.py`) by",
           "`python -m draftsmith.parameters --write-cells`; a params file names only what differs from these.", ""]
    for stage in stages or discover():
        out += [f"## {stage.title}", "", "| setting | type | default | bound | what it is |", "|---|---|---|---|---|"]
        for p in stage.params.values():
            cells = [f"`{p.name}`", f"`{p.type_name}`", f"`{literal(p.default)}`", p.bound.written if p.bound else "",
                     p.help]
            cells = [c.replace("|", "\\|") for c in cells]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def write_cells(stages: list[Stage] | None = None) -> list[Path]:
    """Rewrite each stage notebook's parameters cell from its config; the notebooks changed."""
    changed = []
    for stage in stages or discover():
        nb = json.loads(stage.path.read_text(encoding="utf-8"))
        cell = nb["cells"][parameters_cell(read_notebook(stage.path))]
        src = cell_source(stage)
        current = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if current != src:
            cell["source"] = src.splitlines(keepends=True)
            stage.path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            changed.append(stage.path)
    return changed


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
    """Every parameter any stage declares; the same name must have the same type everywhere."""
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
    """Params file + `-p` overrides, checked against what the stages declare. `sources`, when
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
        raise ParamError(f"{source}: unknown parameter {key!r}: no stage declares it{hint} "
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
    """Defaults of every stage, overlaid by the params file and the overrides, paths absolute.
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


if __name__ == "__main__":   # python -m draftsmith.parameters --write-cells: cells and docs from the configs
    import sys

    if sys.argv[1:] != ["--write-cells"]:
        sys.exit("usage: python -m draftsmith.parameters --write-cells")
    for path in write_cells():
        print(f"rewrote the parameters cell of {path}")
    docs = NOTEBOOKS_DIR.parent / "docs" / "parameters.md"
    if not docs.exists() or docs.read_text(encoding="utf-8") != reference():
        docs.write_text(reference(), encoding="utf-8")
        print(f"rewrote {docs}")
