"""The test tiers hold: every test file declares its tier (`pytestmark`), each a tier pyproject.toml
registers, and `pytest -m TIER` collects its tier's tests without importing the files of the others
(they import torch, vLLM, the notebooks' machinery); a test marked apart is in its own tier only."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TIER_NAMES, declared_tiers

pytestmark = pytest.mark.unit

TESTS = REPO / "tests"
FILES = sorted(TESTS.glob("test_*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_test_file_declares_a_registered_tier(path: Path):
    file_tier, _ = declared_tiers(path)
    assert file_tier in TIER_NAMES, f"{path.name}: no `pytestmark = pytest.mark.TIER` after its imports (tiers: {TIER_NAMES})"


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
    ids, torch = collect("network_resolver")
    files = [p for p in FILES if declared_tiers(p)[0] == "network_resolver"]
    assert len(files) == 1 and {i.split("::")[0] for i in ids} == {f"tests/{files[0].name}"}
    assert torch == "torch imported: False"


def test_tests_marked_apart_are_collected_in_their_own_tier_and_not_in_their_files():
    named = {f"{p.name}::{test}" for p in FILES for test, tier in declared_tiers(p)[1].items() if tier == "crash"}
    assert named and all(declared_tiers(TESTS / key.split("::")[0])[0] != "crash" for key in named)
    crash, _ = collect("crash")
    assert {i[len("tests/"):].split("[")[0] for i in crash} == named
    emulator, _ = collect("emulator")
    assert not named & {i[len("tests/"):].split("[")[0] for i in emulator}
