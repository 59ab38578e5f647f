"""The house in figures, for a git revision and the working tree side by side: lines in src/,
modules per package, the ten longest functions (lines, branches), the parameters of each stage's
`run`, the functions taking 10 or more, and the imports of the most-importing module. Nothing is run; the source is read with `ast`.

  .venv/bin/python bench/house_figures.py [--before a2bd5b8]
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.AsyncWith, ast.BoolOp, ast.IfExp,
            ast.ExceptHandler, ast.match_case, ast.comprehension)
STAGES = ("providers", "generate", "tokens", "hidden", "drafter", "evaluate")


def figures(src: Path) -> dict:
    """What the table shows, for the package under `src` (a folder holding `draftsmith/`)."""
    pkg = src / "draftsmith"
    files = sorted(pkg.rglob("*.py"))
    per_package, lines, functions, imports, runs, many = Counter(), 0, [], {}, {}, 0
    for f in files:
        text = f.read_text(encoding="utf-8")
        lines += text.count("\n")
        rel = f.relative_to(pkg)
        per_package[rel.parts[0] if len(rel.parts) > 1 else "(top)"] += 1
        tree = ast.parse(text)
        imports[str(rel)] = sum(len(n.names) if isinstance(n, ast.Import) else 1
                                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                branches = sum(isinstance(n, BRANCHES) for n in ast.walk(node))
                functions.append((size, branches, f"{rel}:{node.lineno} {node.name}"))
                a = node.args
                many += len(a.posonlyargs + a.args + a.kwonlyargs) + bool(a.kwarg) - bool(a.args and a.args[0].arg == "self") >= 10
                if node.name == "run" and rel.name == "stage.py" and rel.parts[0] in STAGES:
                    runs[rel.parts[0]] = len(a.posonlyargs + a.args + a.kwonlyargs) + bool(a.kwarg)
    top = max(imports, key=imports.get)
    return {"lines": lines, "modules": len(files), "per_package": per_package, "many": many,
            "longest": sorted(functions, reverse=True)[:10], "runs": runs, "most_imports": (top, imports[top])}


def revision(rev: str, into: Path) -> Path:
    tar = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into / "src"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="a2bd5b8", help="git revision to compare with (default a2bd5b8)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before, after = figures(revision(a.before, Path(tmp))), figures(REPO / "src")
    rows = [("lines in src/", before["lines"], after["lines"]), ("modules", before["modules"], after["modules"])]
    for p in sorted(set(before["per_package"]) | set(after["per_package"])):
        rows.append((f"modules in {p}", before["per_package"].get(p, 0), after["per_package"].get(p, 0)))
    for s in STAGES:
        rows.append((f"parameters of {s}/stage.py run", before["runs"].get(s, "-"), after["runs"].get(s, "-")))
    rows.append(("functions taking 10 or more parameters", before["many"], after["many"]))
    rows.append(("imports of the most-importing module", "{} {}".format(*before["most_imports"]),
                 "{} {}".format(*after["most_imports"])))
    w = max(len(r[0]) for r in rows)
    print(f"{'':{w}}  {a.before:>28}  {'working tree':>28}")
    for name, b, c in rows:
        print(f"{name:{w}}  {str(b):>28}  {str(c):>28}")
    print("\nthe ten longest functions (lines, branches):")
    print(f"{a.before:>58} | working tree")
    for (bl, bb, bn), (al, ab, an) in zip(before["longest"], after["longest"]):
        print(f"{bl:4} {bb:3}  {bn:48} | {al:4} {ab:3}  {an}")


if __name__ == "__main__":
    main()
