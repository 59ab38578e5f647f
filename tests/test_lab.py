"""The interactive path: `make lab` serves the notebooks with the project's kernel, and a notebook
runs top to bottom the way Lab runs it (kernel started in `notebooks/`, no papermill, no runner),
writing where the runner writes and showing no warning."""

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from conftest import free_port, get_json

REPO = Path(__file__).resolve().parents[1]


def test_make_lab_serves_the_notebooks_with_the_projects_kernel(tmp_path):
    port, token = free_port(), secrets.token_hex(16)
    args = f"--no-browser --port={port} --ServerApp.ip=127.0.0.1 --IdentityProvider.token={token}"
    if os.geteuid() == 0:  # CI containers
        args += " --allow-root"
    # -o: use the installed .venv as it is (never reinstall it from a test)
    proc = subprocess.Popen(["make", "-s", "-o", ".venv/.installed", "lab", f"LAB_ARGS={args}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path), "HOME": str(tmp_path)})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 90
        while True:
            try:
                contents = get_json(f"{base}/api/contents?token={token}")
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()[-3000:]
                time.sleep(0.5)
        names = {c["name"] for c in contents["content"]}
        assert {p.name for p in (REPO / "notebooks").glob("*.ipynb")} <= names
        specs = get_json(f"{base}/api/kernelspecs?token={token}")
        kernel = specs["kernelspecs"]["python3"]["spec"]
        assert Path(kernel["argv"][0]).resolve().parent == Path(sys.executable).resolve().parent  # .venv's python
        with urllib.request.urlopen(f"{base}/lab?token={token}", timeout=5) as r:
            assert r.status == 200 and b"JupyterLab" in r.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_a_notebook_runs_top_to_bottom_as_lab_runs_it(tmp_path, monkeypatch, tiny_target):
    """Stage 01 as a person runs it: open it, set a few values in its parameters cell, Run All.
    Relative defaults (the demo datasets) are found from `notebooks/`, outputs land where
    `draftsmith run` puts them, and no cell prints a warning."""
    monkeypatch.delenv("DRAFTSMITH_PROGRESS", raising=False)  # a person's kernel: progress bars
    nb = nbformat.read(REPO / "notebooks" / "01_providers.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    edits = {"outputs_dir": str(tmp_path), "target_model_path": "tiny-test",
             "emulator": {"time_scale": 0.0, "credits": 5.0, "max_batch": 16},
             "expected_output_tokens": 40, "probe_prompts": 2, "probe_max_tokens": 8}
    lines = cell.source.splitlines()
    for k, v in edits.items():
        i = next(i for i, line in enumerate(lines) if line.startswith(f"{k} = "))
        lines[i] = f"{k} = {v!r}"
    cell.source = "\n".join(lines)
    assert "data/demo/code.jsonl" in cell.source  # relative, as committed
    NotebookClient(nb, kernel_name="python3", timeout=600,
                   resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    assert json.loads((tmp_path / "demo" / "providers" / "routing.json").read_text())["provider"]["only"]
    streams = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
               if o.output_type == "stream" and o.name == "stderr"]
    assert not [s for s in streams if "Warning" in s], streams
