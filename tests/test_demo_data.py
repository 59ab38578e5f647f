"""The README's claim about data/: data/make_demo_data.py writes the demo prompt files exactly as
they are committed."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def test_the_demo_data_script_rewrites_the_committed_prompt_files_byte_for_byte(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "data" / "make_demo_data.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for name in ("code.jsonl", "chat.jsonl"):
        assert (tmp_path / name).read_bytes() == (REPO / "data" / "demo" / name).read_bytes(), name
