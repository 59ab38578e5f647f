"""Notebook 02 the way a user runs it: `draftsmith run 02 -f params/smoke.yaml`, with a key file.
The key must appear in no file under the outputs folder (executed notebook, logs, manifest,
responses, emulator state), and the stage's outputs must be there."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.notebook

REPO = Path(__file__).resolve().parents[1]


def test_stage_02_runs_from_params_and_never_writes_the_key(tmp_path, api_key_file):
    key_path, key = api_key_file
    out = tmp_path / "outputs"
    cmd = [str(Path(sys.executable).with_name("draftsmith")), "run", "02", "-f", "params/smoke.yaml",
           "-p", "outputs_dir", str(out), "-p", "api_key_file", str(key_path),
           "-p", "emulator", '{"backend": "synthetic", "synthetic_tokens": 24}']
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert key not in p.stdout + p.stderr
    run = out / "smoke"
    for name in ("code", "chat"):
        rows = [json.loads(x) for x in (run / "generate" / name / "raw_responses.jsonl").read_text().splitlines()]
        assert rows and len({r["sample_id"] for r in rows}) == len(rows)
    manifest = json.loads((run / "generate" / "manifest.json").read_text())
    assert manifest["sessions"][-1]["status"] == "finished"
    for figure in ("overview.png", "timeline.png"):
        assert (run / "generate" / "figures" / figure).stat().st_size > 10_000
    files = [f for f in out.rglob("*") if f.is_file()]
    assert any(f.suffix == ".ipynb" for f in files) and any(f.name == "ledger.jsonl" for f in files)
    leaks = [str(f) for f in files if key.encode() in f.read_bytes()]
    assert not leaks, f"the API key was written to {leaks}"
