"""The house in figures, for a git revision and the working tree side by side. Nothing is run or
imported; the source is read with `ast` (src/draftsmith, bench/, tests/, notebooks/).

Rows: lines and modules (in all, per package); modules with exactly one importer and their lines;
the import graph; two settings followed through the calls; re-declared config fields; the places
that check spend_limit_usd's bound; stage 02's test files and tests; the parameters of each stage's
`run`, functions taking 10 or more, the most-importing module; then the ten longest functions.

Definitions:
- importers: the src/draftsmith and bench/ modules that import a module, at any depth of the file
  (function-level imports count). `from p import x` imports p and p.x. The runner loads each stage
  by executing its notebook (papermill, not import_module), so a notebook's imports count as
  imports by draftsmith.runner.
- import graph: nodes are the top-level modules of src/draftsmith, each package folder of it and
  bench/ as one node each; an edge is "some module of A imports one of B" (A != B). Levels: the
  longest import chain, over the graph less its edges back up. Edges back up: the back edges of a
  depth-first search in sorted order, i.e. one edge per cycle it breaks (the issue's measure).
  Cycles: strongly connected sets of modules (not folders) with more than one module.
- a setting followed (FILE:FUNCTION:PARAM): from the function, every call passing the parameter
  itself (positionally or by keyword; `cfg.x` is a value read, not the setting passed on) that
  resolves through the module's imports, or its own definitions, to a function of src/draftsmith is
  followed into the callee's matching parameter (a class: its __init__), depth-first, 12 calls deep
  at most, each (function, parameters) once. The setting under another name carries it on (a copy
  or split of it: `settings = split(Settings, vars(cfg))[0]`, `replace(cfg, ...)`; a value computed
  from it does not), `**settings` passes it into the callee's **kwargs or
  every parameter the call does not name; an object given it keeps it as `self.<param>` in all its
  methods. The moves from file to file, calls and returns, give: files entered (distinct); climbs back
  up (moves to a file on a higher level of the module import order than the one just left: the
  returns to a caller, since a call goes down an import); returns (moves to a file already entered).
- re-declared config fields: the fields (annotated class attributes) of dataclasses and pydantic
  models outside config.py that re-declare 5 or more fields of config.py's *Config classes (a copy
  of a config, not a record that happens to have a `model` or a `seed`), counted per class and field.
- spend_limit_usd's bound checked: comparisons in src/ naming spend_limit_usd, and declarations of
  its bound (`bound=`/`gt=`/`ge=` where spend_limit_usd is declared).
- stage 02 tests: test files named test_generate* or importing draftsmith.generate or
  draftsmith.openrouter at module level (a function-level import borrows a helper); tests are test
  functions times their literal parametrize cases.

  .venv/bin/python bench/house_figures.py [--before 4434b7f]
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.AsyncWith, ast.BoolOp, ast.IfExp,
            ast.ExceptHandler, ast.match_case, ast.comprehension)
STAGES = ("providers", "generate", "tokens", "hidden", "drafter", "evaluate")
FOLLOWED = {"stage 04's cfg": "draftsmith/hidden/stage.py:run:cfg",
            "stage 02's cfg": "draftsmith/generate/stage.py:run_at:cfg"}
DEPTH = 12
COPY = 5        # a class re-declaring this many fields of a stage config is a copy of it


@dataclass
class Module:
    name: str          # dotted, e.g. draftsmith.generate.stage, or bench.house_figures
    path: Path
    tree: ast.Module
    lines: int

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def modules(root: Path) -> dict[str, Module]:
    """Every module of src/draftsmith and bench/ under `root`, by dotted name."""
    out = {}
    for base, files in ((root / "src", sorted((root / "src/draftsmith").rglob("*.py"))),
                        (root, sorted((root / "bench").glob("*.py")))):
        for f in files:
            parts = f.relative_to(base).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            text = f.read_text(encoding="utf-8")
            out[name] = Module(name, f, ast.parse(text), text.count("\n"))
    return out


def imported(node: ast.AST, here: str, is_package: bool) -> list[str]:
    """The dotted names an import statement imports (modules, or names in them)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = here.split(".") if is_package else here.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        m = ".".join(base + ([node.module] if node.module else []))
    else:
        m = node.module or ""
    return [m] + [f"{m}.{a.name}" for a in node.names]


def notebook_imports(root: Path) -> list[ast.AST]:
    """The import statements of the stage notebooks' code cells."""
    out = []
    for nb in sorted((root / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "code":
                for line in "".join(cell["source"]).splitlines():
                    if line.lstrip().startswith(("import ", "from ")):
                        try:
                            out += ast.parse(line.strip()).body
                        except SyntaxError:
                            pass
    return out


def import_edges(mods: dict[str, Module], root: Path) -> dict[str, set[str]]:
    """importer -> the modules it imports (of `mods`); the notebooks' imports are the runner's."""
    edges = defaultdict(set)
    stmts = [(m.name, m.is_package, n) for m in mods.values() for n in ast.walk(m.tree)]
    stmts += [("draftsmith.runner", False, n) for n in notebook_imports(root)]
    for name, pkg, n in stmts:
        for t in imported(n, name, pkg):
            if t in mods and t != name:
                edges[name].add(t)
    return edges


def sccs(graph: dict[str, set[str]], nodes) -> list[list[str]]:
    """Tarjan's strongly connected components."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def back_edges(graph: dict[str, set[str]], nodes) -> set[tuple[str, str]]:
    """The back edges of a depth-first search in sorted order."""
    state, back = {}, set()

    def visit(v):
        state[v] = 1
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                back.add((v, w))
            elif w not in state:
                visit(w)
        state[v] = 2
    for v in sorted(nodes):
        if v not in state:
            visit(v)
    return back


def levels(graph: dict[str, set[str]], nodes, drop: set) -> dict[str, int]:
    """Each node's level: 1 + the highest level it imports (over `graph` less `drop`)."""
    memo: dict[str, int] = {}

    def level(v):
        if v not in memo:
            memo[v] = 1 + max((level(w) for w in graph.get(v, ()) if (v, w) not in drop), default=0)
        return memo[v]
    return {v: level(v) for v in nodes}


def graph_figures(mods: dict[str, Module], edges: dict[str, set[str]]) -> dict:
    is_pkg_folder = {m.name.split(".")[1] for m in mods.values() if m.name.count(".") >= 2}

    def node(name):
        parts = name.split(".")
        if parts[0] == "bench":
            return "bench/"
        if len(parts) == 1:
            return "draftsmith"
        return parts[1] + "/" if parts[1] in is_pkg_folder else parts[1]
    folded = defaultdict(set)
    for a, bs in edges.items():
        for b in bs:
            if node(a) != node(b):
                folded[node(a)].add(node(b))
    nodes = {node(m) for m in mods}
    back = back_edges(folded, nodes)
    lv = levels(folded, nodes, back)
    cycles = [c for c in sccs(edges, mods) if len(c) > 1]
    mod_back = back_edges(edges, mods)
    return {"nodes": len(nodes), "levels": max(lv.values()), "edges": sum(map(len, folded.values())),
            "back": len(back), "cycles": cycles, "module_levels": levels(edges, mods, mod_back)}


# --- a setting followed through the calls -------------------------------------------------------

def definitions(m: Module) -> dict[str, ast.AST]:
    return {n.name: n for n in m.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def bindings(m: Module, mods: dict[str, Module]) -> dict[str, str]:
    """Local name -> dotted target (a module, or module.name) from the module's imports, at any depth."""
    out = {}
    for n in ast.walk(m.tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(n, ast.ImportFrom):
            base = imported(n, m.name, m.is_package)[0]
            for a in n.names:
                out[a.asname or a.name] = f"{base}.{a.name}"
    return out


def resolve(target: str, mods: dict[str, Module], seen=0):
    """(module, definition) of a dotted `module.name`, following re-exports; None if not ours."""
    mod, _, name = target.rpartition(".")
    if mod not in mods or seen > 5:
        return None
    d = definitions(mods[mod]).get(name)
    if d is not None:
        return mods[mod], d
    b = bindings(mods[mod], mods).get(name)
    return resolve(b, mods, seen + 1) if b else None


def params(fn) -> list[str]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    return names[1:] if names and names[0] in ("self", "cls") else names


def callee(call: ast.Call, m: Module, mods):
    """(module, function or class) a call resolves to in src/draftsmith, or None."""
    f, local = call.func, definitions(m)
    if isinstance(f, ast.Name):
        if f.id in local:
            found = m, local[f.id]
        else:
            b = bindings(m, mods).get(f.id)
            found = resolve(b, mods) if b else None
    elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        b = bindings(m, mods).get(f.value.id)
        found = resolve(f"{b}.{f.attr}", mods) if b in mods else None
    else:
        found = None
    return found


def whole(expr: ast.AST, carriers: set[str]) -> bool:
    """`expr` uses a carrier itself (a name, or `self.x`), not only an attribute of it: `cfg.x` is a value read."""
    reads = {id(a.value) for a in ast.walk(expr) if isinstance(a, ast.Attribute)}
    return any(isinstance(n, (ast.Name, ast.Attribute)) and id(n) not in reads and ast.unparse(n) in carriers
               for n in ast.walk(expr))


REPACK = ("replace", "vars", "asdict", "dict", "split", "model_copy", "copy")


def repacked(expr: ast.AST, carriers: set[str]) -> bool:
    """`expr` is the setting again under another name: a carrier itself, or a copy or split of it
    (`replace(cfg, ...)`, `vars(cfg)`, `split(Settings, vars(cfg))[0]`); a value computed from it is not."""
    while isinstance(expr, ast.Subscript):
        expr = expr.value
    if isinstance(expr, (ast.Name, ast.Attribute)):
        return ast.unparse(expr) in carriers
    if isinstance(expr, ast.Call):
        name = expr.func.attr if isinstance(expr.func, ast.Attribute) else getattr(expr.func, "id", "")
        return name in REPACK and any(repacked(a, carriers) for a in [*expr.args, *(k.value for k in expr.keywords)])
    return False


def follow(start: str, mods: dict[str, Module]) -> list[tuple[str, str]] | None:
    """The steps ("call" or "return", module) following FILE:FUNCTION:PARAM; None if the function is gone."""
    path, func, param = start.split(":")
    name = path[:-3].replace("/", ".")
    if name not in mods or func not in definitions(mods[name]):
        return None
    steps, done = [], set()

    def walk(m: Module, fn, carriers: frozenset, depth: int):
        steps.append(("call", m.name))
        if (m.name, fn.name, carriers) in done or depth >= DEPTH:
            return
        done.add((m.name, fn.name, carriers))
        held = set(carriers)
        for _ in range(2):              # the setting under another name carries it on
            for n in ast.walk(fn):
                if isinstance(n, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and n.value is not None \
                        and repacked(n.value, held):
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                    held |= {ast.unparse(x) for t in targets for x in ast.walk(t) if isinstance(x, ast.Name)}
                    held |= {ast.unparse(t) for t in targets if isinstance(t, ast.Attribute)}
        calls = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call)), key=lambda c: (c.lineno, c.col_offset))
        for call in calls:
            def carried(x):
                return isinstance(x, (ast.Name, ast.Attribute)) and ast.unparse(x) in held
            passed = [i for i, a in enumerate(call.args) if carried(a)]
            by_kw = [k.arg for k in call.keywords if k.arg and carried(k.value)]
            spread = any(k.arg is None and whole(k.value, held) for k in call.keywords)
            if not (passed or by_kw or spread):
                continue
            found = callee(call, m, mods)
            if not found:
                continue
            cm, target = found
            cls = target if isinstance(target, ast.ClassDef) else None
            init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None) \
                if cls else target
            if init is not None:
                a = init.args
                names, kwonly, kwarg = params(init), [x.arg for x in a.kwonlyargs], a.kwarg and a.kwarg.arg
            else:               # a dataclass or pydantic model: its fields
                names, kwonly, kwarg = fields(cls), [], None
            into = {names[i] for i in passed if i < len(names)} | {k for k in by_kw if k in names + kwonly}
            if spread:          # `**settings`: into **kwargs, or every parameter the call does not name
                bound = set(names[:len(call.args)]) | {k.arg for k in call.keywords if k.arg}
                into |= {kwarg} if kwarg else set(names + kwonly) - bound
            if not into:
                continue
            if cls is None:
                walk(cm, target, frozenset(into), depth + 1)
            else:               # the object keeps the setting as self.<name>: every method reads it
                steps.append(("call", cm.name))
                for meth in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
                    walk(cm, meth, frozenset({f"self.{q}" for q in into} | (into if meth is init else set())),
                         depth + 1)
            steps.append(("return", m.name))
    walk(mods[name], definitions(mods[name])[func], frozenset([param]), 0)
    return steps


def walk_figures(steps: list[tuple[str, str]] | None, level: dict[str, int]) -> str:
    """Files entered; moves (calls or returns) to a file on a higher level than the one just left;
    moves to a file already entered. Steps within one file are not moves."""
    if steps is None:
        return "-"
    moves = [s for i, s in enumerate(steps) if i == 0 or s[1] != steps[i - 1][1]]
    files = [f for _, f in moves]
    climbs = sum(level[f] > level[files[i - 1]] for i, f in enumerate(files) if i)
    returns = sum(f in files[:i] for i, f in enumerate(files))
    return f"{len(set(files))} files, {climbs} climbs, {returns} returns"


# --- fields, bounds, tests ----------------------------------------------------------------------

def is_model(c: ast.ClassDef) -> bool:
    """A dataclass, or a pydantic model (a base named BaseModel, Strict or *Config/*Model)."""
    deco = any("dataclass" in ast.unparse(d) for d in c.decorator_list)
    return deco or any(ast.unparse(b).split(".")[-1] in ("BaseModel", "Strict") for b in c.bases)


def fields(c: ast.ClassDef) -> list[str]:
    return [n.target.id for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def redeclared(mods: dict[str, Module]) -> list[str]:
    config = mods["draftsmith.config"].tree
    stage = {f for c in config.body if isinstance(c, ast.ClassDef) and c.name.endswith("Config") for f in fields(c)}
    copies = [(m, c, [f for f in fields(c) if f in stage]) for m in mods.values()
              if m.name.startswith("draftsmith.") and m.name != "draftsmith.config"
              for c in ast.walk(m.tree) if isinstance(c, ast.ClassDef) and is_model(c)]
    return [f"{m.name}.{c.name}.{f}" for m, c, same in copies if len(same) >= COPY for f in same]


def spend_bounds(mods: dict[str, Module]) -> list[str]:
    """Places that check spend_limit_usd's bound: a bound checker's definition (`*check_bounds`), a
    call of one (or of `parameters.check`) in a module that handles spend_limit_usd, and a comparison
    of spend_limit_usd with a number."""
    def names(n):
        return any((isinstance(x, ast.Name) and x.id.lower() == "spend_limit_usd")
                   or (isinstance(x, ast.Attribute) and x.attr == "spend_limit_usd")
                   or (isinstance(x, ast.Constant) and x.value == "spend_limit_usd") for x in ast.walk(n))

    def checker(f):
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        return name.endswith("check_bounds") or (isinstance(f, ast.Attribute) and f.attr == "check"
                                                 and getattr(f.value, "id", "") == "parameters")
    out = []
    for m in mods.values():
        if not m.name.startswith("draftsmith"):
            continue
        handles = names(m.tree)
        for n in ast.walk(m.tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.endswith("check_bounds"):
                out.append(f"{m.name}:{n.lineno} {n.name}")
            elif isinstance(n, ast.Call) and handles and checker(n.func):
                out.append(f"{m.name}:{n.lineno} {ast.unparse(n.func)}()")
            elif isinstance(n, ast.Compare) and names(n) and any(
                    isinstance(x, ast.Constant) and type(x.value) in (int, float) for x in (n.left, *n.comparators)):
                out.append(f"{m.name}:{n.lineno} {ast.unparse(n)}")
    return out


def cases(fn) -> int:
    n = 1
    for d in fn.decorator_list:
        if isinstance(d, ast.Call) and ast.unparse(d.func).endswith("parametrize") and len(d.args) >= 2 \
                and isinstance(d.args[1], (ast.List, ast.Tuple)):
            n *= len(d.args[1].elts)
    return n


def stage_02_tests(root: Path) -> tuple[int, int]:
    """(test files, tests) of stage 02."""
    files = tests = 0
    for f in sorted((root / "tests").glob("test_*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"))
        targets = [t for n in tree.body for t in imported(n, "tests." + f.stem, False)]
        if not (f.name.startswith("test_generate")
                or any(t.startswith(("draftsmith.generate", "draftsmith.openrouter")) for t in targets)):
            continue
        files += 1
        tests += sum(cases(n) for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_"))
    return files, tests


# --- the table ----------------------------------------------------------------------------------

def figures(root: Path) -> dict:
    """What the table shows, for the tree under `root` (holding src/draftsmith, bench/, tests/, notebooks/)."""
    mods = modules(root)
    pkg = root / "src" / "draftsmith"
    per_package, lines, functions, imports, runs, many = Counter(), 0, [], {}, {}, 0
    for m in mods.values():
        if not m.name.startswith("draftsmith"):
            continue
        lines += m.lines
        rel = m.path.relative_to(pkg)
        per_package[rel.parts[0] if len(rel.parts) > 1 else "(top)"] += 1
        imports[str(rel)] = sum(len(n.names) if isinstance(n, ast.Import) else 1
                                for n in ast.walk(m.tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in ast.walk(m.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                branches = sum(isinstance(n, BRANCHES) for n in ast.walk(node))
                functions.append((size, branches, f"{rel}:{node.lineno} {node.name}"))
                a = node.args
                many += len(a.posonlyargs + a.args + a.kwonlyargs) + bool(a.kwarg) - bool(a.args and a.args[0].arg == "self") >= 10
                if node.name == "run" and rel.name == "stage.py" and rel.parts[0] in STAGES:
                    runs[rel.parts[0]] = len(a.posonlyargs + a.args + a.kwonlyargs) + bool(a.kwarg)
    edges = import_edges(mods, root)
    importers = defaultdict(set)
    for a, bs in edges.items():
        for b in bs:
            importers[b].add(a)
    single = [m for m in mods.values() if m.name.startswith("draftsmith") and len(importers[m.name]) == 1]
    graph = graph_figures(mods, edges)
    top = max(imports, key=imports.get)
    return {"lines": lines, "modules": sum(per_package.values()),
            "per_package": per_package, "many": many, "longest": sorted(functions, reverse=True)[:10], "runs": runs,
            "most_imports": (top, imports[top]), "single": (len(single), sum(m.lines for m in single)),
            "graph": graph, "walks": {k: walk_figures(follow(v, mods), graph["module_levels"])
                                      for k, v in FOLLOWED.items()},
            "redeclared": len(redeclared(mods)), "spend_bounds": len(spend_bounds(mods)),
            "stage_02_tests": stage_02_tests(root)}


def revision(rev: str, into: Path) -> Path:
    tar = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src", "bench", "tests", "notebooks"],
                         check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="4434b7f", help="git revision to compare with (default 4434b7f)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before, after = figures(revision(a.before, Path(tmp))), figures(REPO)

    def graph(f):
        g = f["graph"]
        return f"{g['nodes']} nodes, {g['levels']} levels"
    rows = [("lines in src/", before["lines"], after["lines"]), ("modules", before["modules"], after["modules"])]
    for p in sorted(set(before["per_package"]) | set(after["per_package"])):
        rows.append((f"modules in {p}", before["per_package"].get(p, 0), after["per_package"].get(p, 0)))
    rows.append(("modules with one importer (lines)", "{} ({:,})".format(*before["single"]),
                 "{} ({:,})".format(*after["single"])))
    rows.append(("import graph, folders as one node", graph(before), graph(after)))
    rows.append(("  edges", before["graph"]["edges"], after["graph"]["edges"]))
    rows.append(("  edges back up the order", before["graph"]["back"], after["graph"]["back"]))
    rows.append(("module cycles (modules in them)",
                 "{} ({})".format(len(before["graph"]["cycles"]), sum(map(len, before["graph"]["cycles"]))),
                 "{} ({})".format(len(after["graph"]["cycles"]), sum(map(len, after["graph"]["cycles"])))))
    for k in FOLLOWED:
        rows.append((f"{k} followed", before["walks"][k], after["walks"][k]))
    rows.append(("re-declared config fields", before["redeclared"], after["redeclared"]))
    rows.append(("places checking spend_limit_usd's bound", before["spend_bounds"], after["spend_bounds"]))
    rows.append(("stage 02 test files (tests)", "{} ({})".format(*before["stage_02_tests"]),
                 "{} ({})".format(*after["stage_02_tests"])))
    for s in STAGES:
        rows.append((f"parameters of {s}/stage.py run", before["runs"].get(s, "-"), after["runs"].get(s, "-")))
    rows.append(("functions taking 10 or more parameters", before["many"], after["many"]))
    rows.append(("imports of the most-importing module", "{} {}".format(*before["most_imports"]),
                 "{} {}".format(*after["most_imports"])))
    w = max(len(r[0]) for r in rows)
    print(f"{'':{w}}  {a.before:>30}  {'working tree':>30}")
    for name, b, c in rows:
        print(f"{name:{w}}  {str(b):>30}  {str(c):>30}")
    print("\nthe ten longest functions (lines, branches):")
    print(f"{a.before:>58} | working tree")
    for (bl, bb, bn), (al, ab, an) in zip(before["longest"], after["longest"]):
        print(f"{bl:4} {bb:3}  {bn:48} | {al:4} {ab:3}  {an}")


if __name__ == "__main__":
    main()
