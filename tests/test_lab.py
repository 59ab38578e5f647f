"""The interactive path: `make lab` serves working copies of the notebooks with the project's
kernel, so Lab's autosave never edits the tracked notebooks whose parameters cells the CLI reads
(and the CLI refuses a stage notebook that was run and saved in place); a notebook runs top to
bottom the way Lab runs it (no papermill, no runner), writing where the runner writes and showing
no warning."""

import json
import os
import secrets
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from conftest import free_port, get_json, wait_until

from draftsmith import cli, parameters

import pytest

pytestmark = pytest.mark.notebook

REPO = Path(__file__).resolve().parents[1]


def test_make_lab_serves_copies_of_the_notebooks_with_the_projects_kernel(tmp_path):
    """Lab's autosave (a PUT of the whole notebook, outputs and edited values included) lands in the
    copy; a copy already there is the user's work and is kept as it is."""
    port, token = free_port(), secrets.token_hex(16)
    args = f"--no-browser --port={port} --ServerApp.ip=127.0.0.1 --IdentityProvider.token={token}"
    if os.geteuid() == 0:  # CI containers
        args += " --allow-root"
    lab, tracked = tmp_path / "lab", {p.name: p.read_bytes() for p in (REPO / "notebooks").glob("*.ipynb")}
    lab.mkdir()
    (lab / "02_generate.ipynb").write_bytes(tracked["02_generate.ipynb"].replace(b'"max_tokens = ', b'"max_tokens = 7 or '))
    # -o: use the installed .venv as it is (never reinstall it from a test)
    proc = subprocess.Popen(["make", "-s", "-o", ".venv/.installed", "lab", f"LAB_ARGS={args}", f"LAB_DIR={lab}"],
                            cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path), "HOME": str(tmp_path)})
    try:
        base = f"http://127.0.0.1:{port}"

        def contents_or_error():
            try:
                return get_json(f"{base}/api/contents?token={token}")
            except OSError as e:
                return e
        contents = wait_until(contents_or_error, lambda c: not isinstance(c, OSError), what=f"Lab serving on {base}",
                              timeout_s=180, proc=proc, interval_s=0.5)
        names = {c["name"] for c in contents["content"]}
        assert set(tracked) <= names
        assert (lab / "01_providers.ipynb").read_bytes() == tracked["01_providers.ipynb"]
        assert b'"max_tokens = 7 or ' in (lab / "02_generate.ipynb").read_bytes()  # the user's copy, kept
        model = get_json(f"{base}/api/contents/01_providers.ipynb?token={token}")
        cell = next(c for c in model["content"]["cells"] if "parameters" in c["metadata"].get("tags", []))
        cell["source"] = cell["source"].replace("\nmax_tokens = ", "\nmax_tokens = 5 or ")
        cell["execution_count"] = 1
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "ran\n"}]
        put = urllib.request.Request(f"{base}/api/contents/01_providers.ipynb?token={token}", method="PUT",
                                     data=json.dumps({"type": "notebook", "format": "json",
                                                      "content": model["content"]}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(put, timeout=60) as r:
            assert r.status == 200
        assert b"max_tokens = 5 or " in (lab / "01_providers.ipynb").read_bytes()
        assert {p.name: p.read_bytes() for p in (REPO / "notebooks").glob("*.ipynb")} == tracked
        specs = get_json(f"{base}/api/kernelspecs?token={token}")
        kernel = specs["kernelspecs"]["python3"]["spec"]
        assert Path(kernel["argv"][0]).resolve().parent == Path(sys.executable).resolve().parent  # .venv's python
        with urllib.request.urlopen(f"{base}/lab?token={token}", timeout=60) as r:
            assert r.status == 200 and b"JupyterLab" in r.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_a_notebook_runs_top_to_bottom_as_lab_runs_it(tmp_path, monkeypatch, tiny_target):
    """Stage 01 as a person runs it: open it, set a few values in its parameters cell, Run All.
    The kernel starts beside the copy `make lab` made (here a folder outside the repository):
    relative defaults (the demo datasets) are still found, outputs land where
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
    lab = tmp_path / "lab"
    lab.mkdir()
    NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(lab)}}).execute()
    assert json.loads((tmp_path / "demo" / "providers" / "routing.json").read_text())["provider"]["only"]
    streams = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
               if o.output_type == "stream" and o.name == "stderr"]
    assert not [s for s in streams if "Warning" in s], streams


def test_a_stage_notebook_run_and_saved_in_place_changes_no_default(tmp_path, capsys, monkeypatch):
    """A notebook Lab ran and saved where it lies may hold one session's values in its parameters
    cell: a run still takes every default from the stage's config."""
    for p in (REPO / "notebooks").glob("*.ipynb"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    default = parameters.declaration("exclude_flagged").default
    nb = nbformat.read(tmp_path / "03_validate_tokens.ipynb", as_version=4)
    cell = nb.cells[parameters.parameters_cell(nb)]
    assert f"exclude_flagged = {default}" in cell.source
    cell.source = cell.source.replace(f"exclude_flagged = {default}", f"exclude_flagged = {not default}")
    cell.execution_count = 2
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="ran\n")]
    nbformat.write(nb, tmp_path / "03_validate_tokens.ipynb")
    discover = parameters.discover
    monkeypatch.setattr(parameters, "discover", lambda: discover(tmp_path))
    assert cli.main(["run", "03", "--defaults", "--check"]) == 0
    assert f"exclude_flagged = {default}  # default of 03_validate_tokens.ipynb" in capsys.readouterr().out
