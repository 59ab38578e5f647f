"""The notebook chain, end to end, as a user runs it: `draftsmith run all -f params/smoke.yaml`.

One run of all six stages on the test-sized target against the local emulator; then every stage's
main output exists, the report renders with its figures, and the API key used is nowhere under
outputs/ (executed notebooks, logs, ledgers, shards included).
"""

import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("chain")
    key_path = out / "key.txt"
    import secrets

    key = "sk-or-v1-" + secrets.token_hex(32)
    key_path.write_text(key + "\n")
    cmd = [str(Path(sys.executable).with_name("draftsmith")), "run", "all", "-f", str(REPO / "params/smoke.yaml"),
           "-p", "outputs_dir", str(out / "outputs"), "-p", "api_key_file", str(key_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / "outputs" / "smoke", key, proc


def test_chain_writes_every_stage_output(smoke_run):
    run, _, _ = smoke_run
    for path in ["providers/routing.json", "generate/code/raw_responses.jsonl", "generate/chat/errors.jsonl", "generate/manifest.json",
                 "tokens/code.jsonl", "tokens/report.json", "hidden/index.json", "drafter",
                 "eval/report.json"]:
        assert (run / path).exists(), path
    for nb in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert (run / "notebooks" / nb.name).exists() and (run / "logs" / f"{nb.stem}.log").exists()


def test_chain_report_has_every_stage_and_its_figures(smoke_run):
    run, _, _ = smoke_run
    html = (run / "report.html").read_text()
    for nb in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert nb.stem in html
    assert html.count("<img") >= 6


def test_chain_never_writes_the_api_key_under_outputs(smoke_run):
    run, key, proc = smoke_run
    assert key not in proc.stdout and key not in proc.stderr
    leaked = [p for p in run.parent.parent.rglob("*") if p.is_file() and p.name != "key.txt"
              and key.encode() in p.read_bytes()]
    assert leaked == []
