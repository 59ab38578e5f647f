"""The stage runner: parameter checks, execution through papermill, failures that name the cell."""

import json
from pathlib import Path

import nbformat
import pytest
import yaml

from draftsmith import cli, runner
from draftsmith.paths import NOTEBOOKS_DIR, REPO_ROOT

PARAMS = sorted((REPO_ROOT / "params").glob("*.yaml"))


def make_notebook(path: Path, params_src: str, body: list[str]) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cell = nbformat.v4.new_code_cell(params_src)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# toy"), cell] + [nbformat.v4.new_code_cell(b) for b in body]
    nbformat.write(nb, path)
    return path


@pytest.fixture
def toy_stages(tmp_path):
    d = tmp_path / "nbs"
    d.mkdir()
    make_notebook(d / "01_first.ipynb",
                  'run_name = "x"  # the run\noutputs_dir = "outputs"\ncount = 3  # how many\nrate = 0.5\n',
                  ["from pathlib import Path\n"
                   "Path(outputs_dir, run_name, 'first.json').write_text(__import__('json').dumps("
                   "{'count': count, 'rate': rate, 'outputs_dir': outputs_dir}))",
                   "print('first done', count)"])
    make_notebook(d / "02_second.ipynb",
                  'run_name = "x"\noutputs_dir = "outputs"\nflag = False\nitems = []\n',
                  ["x = 1", "assert not flag, 'flag was set'"])
    return runner.discover(d)


def test_runner_rejects_an_unknown_key_naming_it(tmp_path, capsys):
    f = tmp_path / "p.yaml"
    f.write_text("run_name: t\nconcurrancy: 10\n")
    assert cli.main(["run", "all", "-f", str(f)]) == 2
    err = capsys.readouterr().err
    assert "unknown parameter 'concurrancy'" in err and str(f) in err and "did you mean 'concurrency'" in err
    assert cli.main(["run", "all", "-f", str(f.with_name("none.yaml"))]) == 2


def test_runner_rejects_a_wrongly_typed_value_naming_it(tmp_path, capsys):
    f = tmp_path / "p.yaml"
    f.write_text("run_name: t\nconcurrency: many\n")
    assert cli.main(["run", "all", "-f", str(f)]) == 2
    err = capsys.readouterr().err
    assert "'concurrency' must be int" in err and "got str 'many'" in err
    assert cli.main(["run", "all", "-f", str(PARAMS[0]), "-p", "temperature", "[1]"]) == 2
    assert "'temperature' must be float" in capsys.readouterr().err
    assert cli.main(["run", "all", "-f", str(PARAMS[0]), "-p", "datasets", "[{name: a}]"]) == 2
    assert "path" in capsys.readouterr().err


def test_every_params_file_passes_the_runner_checks():
    stages = runner.discover()
    for f in PARAMS:
        values = runner.effective_params(stages, str(f), [])
        assert values["run_name"] and Path(values["outputs_dir"]).is_absolute(), f


def test_runner_list_shows_stages_and_parameters(capsys):
    assert cli.main(["run", "--list"]) == 0
    out = capsys.readouterr().out
    for nb in sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb")):
        assert nb.stem in out
    assert "run_name" in out


def test_notebooks_have_one_parameters_cell_python3_kernel_and_no_outputs():
    nbs = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
    assert nbs, "no notebooks"
    for p in nbs:
        nb = nbformat.read(p, as_version=4)
        assert nb.metadata["kernelspec"]["name"] == "python3", p.name
        runner.parameters_cell(nb)  # exactly one
        for c in nb.cells:
            if c.cell_type == "code":
                assert not c.outputs and c.execution_count is None, f"{p.name} has stored outputs"
        runner.read_parameters(p)  # plain literals only
    runner.declared(runner.discover())  # same type for a name everywhere


def test_runner_passes_only_declared_parameters_with_absolute_paths(toy_stages, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"run_name": "r1", "outputs_dir": "out", "count": 5, "flag": False}))
    values = runner.effective_params(toy_stages, str(f), [("rate", "2")])
    assert values["outputs_dir"] == str(tmp_path / "out") and values["rate"] == 2
    run = runner.run_stages(toy_stages, values, echo=False)
    assert json.loads((run.root / "first.json").read_text()) == {"count": 5, "rate": 2, "outputs_dir": str(tmp_path / "out")}
    executed = nbformat.read(run.root / "notebooks" / "02_second.ipynb", as_version=4)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(injected) == 1 and "count" not in injected[0].source and "flag = False" in injected[0].source
    assert "first done 5" in (run.root / "logs" / "01_first.log").read_text()
    report = (run.root / "report.html").read_text()
    assert "first done 5" in report and "Path(outputs_dir" not in report  # outputs shown, inputs hidden


def test_a_failing_stage_names_the_notebook_and_cell(toy_stages, tmp_path):
    values = runner.effective_params(toy_stages, None, [("run_name", "r2"), ("outputs_dir", str(tmp_path)),
                                                         ("flag", "true")])
    with pytest.raises(runner.StageFailed) as e:
        runner.run_stages(toy_stages, values, echo=False)
    msg = str(e.value)
    assert "02_second" in msg and "cell" in msg and "AssertionError: flag was set" in msg
    assert (tmp_path / "r2" / "notebooks" / "02_second.ipynb").exists()


def test_stage_selection_by_number_name_and_list(toy_stages):
    assert [s.title for s in runner.select(toy_stages, "2")] == ["02_second"]
    assert [s.title for s in runner.select(toy_stages, "first,02")] == ["01_first", "02_second"]
    with pytest.raises(runner.ParamError, match="unknown stage 'third'"):
        runner.select(toy_stages, "third")
