"""Every file that crosses a stage boundary has one owner module: only it names the file, so only it
writes and reads it; stages, benches and notebooks ask the owner. Checked on the code itself: a
string literal that is such a file name (docstrings aside) may appear only in its owner."""

from __future__ import annotations

import ast
import json
import re

from draftsmith.paths import REPO_ROOT

import pytest

pytestmark = pytest.mark.unit

LIB = REPO_ROOT / "src" / "draftsmith"

# file name -> the modules (under src/draftsmith) allowed to name it, in stage order
OWNERS = {
    # stage 01
    "routing.json": {"providers/outputs.py"}, "spend.json": {"providers/outputs.py"},
    "endpoints.csv": {"providers/outputs.py"}, "cost_plan.csv": {"providers/outputs.py"},
    # stage 02
    "raw_responses.jsonl": {"generate/outputs.py"}, "errors.jsonl": {"generate/outputs.py"}, "manifest.json": {"generate/outputs.py"},
    "timeline.jsonl": {"generate/outputs.py"}, "writer.lock": {"generate/outputs.py"},
    # stage 03 (report.json: stage 03's and stage 06's, each in its own folder)
    "report.json": {"tokens/outputs.py", "evaluate/outputs.py"},
    # stage 04
    "index.json": {"hidden/outputs.py"}, "extract_config.json": {"hidden/stage.py"}, "check.json": {"hidden/outputs.py"},
    # summary.json: stage 01's, stage 04's and stage 05's, each in its own folder,
    # and the run's own, beside report.html (summary.py)
    "summary.json": {"providers/outputs.py", "hidden/outputs.py", "drafter/outputs.py", "summary.py"},
    # stage 05
    "heldout.json": {"drafter/outputs.py"}, "metrics.jsonl": {"drafter/outputs.py"},
    "exports.json": {"drafter/outputs.py"}, "vocab.safetensors": {"drafter/outputs.py"},
    "supervision.safetensors": {"drafter/outputs.py"}, "train_config.json": {"drafter/outputs.py"},
    # an export folder in the engines' format; a target checkpoint in Hugging Face's
    "model.safetensors": {"drafter/export.py"},
    "config.json": {"drafter/export.py", "targets/checkpoint.py", "targets/tiny.py", "emulator/__init__.py"},
    "tokenizer_config.json": {"targets/checkpoint.py", "targets/kimi_mini.py"},
    "draftsmith_target.json": {"targets/tiny.py"},
    # stage 06
    "rounds.jsonl": {"evaluate/outputs.py"}, "engine_rounds.jsonl": {"evaluate/outputs.py"},
    "engine_job.json": {"evaluate/outputs.py"}, "bench_prompts_sharegpt.json": {"evaluate/outputs.py"},
    # the runner's
    # run_params.yaml: written by the runner, hashed into the run's summary (`meta`)
    "run_params.yaml": {"runner.py", "summary.py"}, "report.html": {"report.py"},
}
FILE = re.compile(r"[\w.*-]+\.(?:jsonl?|csv|safetensors|yaml|html)")


def _names(text: str) -> set[str]:
    """The owned file names a string literal spells (as itself or as the last part of a path)."""
    if " " in text.strip():
        return set()
    last = text.strip().rstrip("/").split("/")[-1]
    return {last} if last in OWNERS else set()


def _literals(source: str) -> set[str]:
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found |= _names(node.value)
    return found


def _users() -> dict[str, dict[str, set[str]]]:
    """file name -> {where it is named: ...}, over the library, the benches and the notebooks' code."""
    users: dict[str, set[str]] = {name: set() for name in OWNERS}
    sources = [(str(p.relative_to(LIB)), p.read_text()) for p in sorted(LIB.rglob("*.py"))]
    sources += [(f"bench/{p.name}", p.read_text()) for p in sorted((REPO_ROOT / "bench").glob("*.py"))]
    for nb in sorted((REPO_ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        sources.append((f"notebooks/{nb.name}", "\n".join(l for l in code.splitlines() if not l.lstrip().startswith(("%", "!")))))
    for where, text in sources:
        for name in _literals(text):
            users[name].add(where)
    return users


def test_every_stage_boundary_file_is_named_only_by_its_owner():
    users = _users()
    strays = {name: sorted(where - OWNERS[name]) for name, where in users.items() if where - OWNERS[name]}
    assert not strays, f"named outside their owner (ask the owner instead): {strays}"
    unused = sorted(name for name, where in users.items() if not where)
    assert not unused, f"owned names no module uses any more (drop them from OWNERS): {unused}"


def test_the_check_sees_a_path_built_by_hand():
    """The scan is not blind: a reader building an owned path the way stages used to is caught."""
    assert _literals('p = run.root / "providers" / "routing.json"\n') == {"routing.json"}
    assert _literals('p = Path(folder) / "generate/x/raw_responses.jsonl"\n') == {"raw_responses.jsonl"}
    assert _literals('"""Reads routing.json."""\nmsg = "see providers/routing.json for why"\n') == set()
