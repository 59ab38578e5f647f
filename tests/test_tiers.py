"""The test tiers hold: every test file and every single test conftest's TIERS names exists and has a
tier pyproject.toml registers, and `pytest -m TIER` collects its tier's tests without importing the
files of the others (they import torch, vLLM, the notebooks' machinery)."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import REPO, TIERS

TESTS = REPO / "tests"


def defined_tests(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}


def test_every_test_file_and_each_test_named_apart_has_a_registered_tier():
    registered = {line.split(":")[0] for line in tomllib.loads((REPO / "pyproject.toml").read_text())
                  ["tool"]["pytest"]["ini_options"]["markers"]}
    files = {p.name for p in TESTS.glob("test_*.py")}
    assert files - TIERS.keys() == set(), "test files without a tier in tests/conftest.py TIERS"
    for key, tier in TIERS.items():
        file, _, test = key.partition("::")
        assert file in files, f"TIERS names {file}, which is not in tests/"
        assert not test or test in defined_tests(TESTS / file), f"TIERS names {key}, which is not a test there"
        assert tier in registered, f"{key}: tier {tier!r} is not among pyproject.toml's markers"


def collect(marks: str) -> tuple[list[str], str]:
    """Test ids `pytest --collect-only -m marks` lists, and whether torch was imported meanwhile."""
    script = ("import sys, pytest\n"
              f"code = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', '-m', {marks!r}])\n"
              "print('torch imported:', 'torch' in sys.modules)\n"
              "sys.exit(code)")
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [line for line in r.stdout.splitlines() if "::" in line], r.stdout.splitlines()[-1]


def test_a_tier_collects_its_tests_and_imports_no_file_of_the_other_tiers():
    ids, torch = collect("network-resolver")
    file = next(f for f, tier in TIERS.items() if tier == "network-resolver")
    assert ids and {i.split("::")[0] for i in ids} == {f"tests/{file}"}
    assert {i.split("::")[1].split("[")[0] for i in ids} == defined_tests(TESTS / file)
    assert torch == "torch imported: False"


def test_tests_named_apart_are_collected_in_their_own_tier_and_not_in_their_files():
    named = {key for key, tier in TIERS.items() if tier == "crash"}
    assert named and all("::" in key and TIERS[key.split("::")[0]] != "crash" for key in named)
    crash, _ = collect("crash")
    assert {i[len("tests/"):].split("[")[0] for i in crash} == named
