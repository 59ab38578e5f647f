"""The stage runner: parameter checks, execution through papermill, failures that name the cell."""

import dataclasses
import json
from pathlib import Path

import nbformat
import pytest
import yaml

from draftsmith import cli, config, parameters, runner
from draftsmith.paths import NOTEBOOKS_DIR, REPO_ROOT

from conftest import wait_until

pytestmark = pytest.mark.unit

PARAMS = sorted((REPO_ROOT / "params").glob("*.yaml"))


def toy(**settings):
    """A toy stage's config: name=(default, help) or (default, help, {bound as pydantic's Field takes it})."""
    return dataclasses.make_dataclass("Toy", [(n, type(v[0]), config.setting(v[0], v[1], **(v[2:] or [{}])[0]))
                                              for n, v in settings.items()])


RUN = {"run_name": ("x", "the run"), "outputs_dir": ("outputs", "")}
TOY = {"01": ("first", toy(**RUN, count=(3, "how many"), rate=(0.5, ""))),
       "02": ("second", toy(**RUN, flag=(False, ""), items=([], "")))}


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
    return parameters.discover(d, TOY)


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
    stages = parameters.discover()
    for f in PARAMS:
        values = parameters.effective_params(stages, str(f), [])
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
        parameters.parameters_cell(nb)  # exactly one
        for c in nb.cells:
            if c.cell_type == "code":
                assert not c.outputs and c.execution_count is None, f"{p.name} has stored outputs"
    parameters.declared(parameters.discover())  # same type for a name everywhere


def test_each_notebooks_parameters_cell_and_the_docs_table_are_written_from_its_stage_config():
    """The configs are the one source: a cell that differs (an edited default, a setting added to a
    notebook alone) fails here; `python -m draftsmith.parameters --write-cells` writes them."""
    for stage in parameters.discover():
        nb = parameters.read_notebook(stage.path)
        assert nb["cells"][parameters.parameters_cell(nb)]["source"] == parameters.cell_source(stage), stage.title
    assert (REPO_ROOT / "docs" / "parameters.md").read_text() == parameters.reference()
    stage = parameters.select(parameters.discover(), "02")[0]
    stage.params["concurrency"].default = 7
    assert "concurrency = 7  # [1, inf) requests in flight" in parameters.cell_source(stage)


def test_each_stage_is_one_call_taking_the_run_and_its_typed_config():
    """Notebook NN calls `stage.run(run, parameters.stage_config("NN", globals()))`: the config its cell
    holds, built and checked from the cell's names, and nothing else."""
    import importlib
    import inspect

    from draftsmith import config

    packages = {"01": "providers", "02": "generate", "03": "tokens", "04": "hidden", "05": "drafter", "06": "evaluate"}
    for number, (_, cls) in config.STAGES.items():
        run = importlib.import_module(f"draftsmith.{packages[number]}.stage").run
        required = [n for n, p in inspect.signature(run).parameters.items()
                    if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD]
        assert required == ["run", "cfg"] and inspect.signature(run).parameters["cfg"].annotation == cls.__name__
        nb = parameters.read_notebook(REPO_ROOT / "notebooks" / f"{number}_{config.STAGES[number][0]}.ipynb")
        assert f'stage.run(run, parameters.stage_config("{number}", globals()))' in "".join(
            c["source"] for c in nb["cells"])
        cells = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                 for f in dataclasses.fields(cls)}
        assert parameters.stage_config(number, {**cells, "unrelated": 1}) == cls()
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        parameters.stage_config("02", {**{f.name: getattr(config.GenerateConfig(), f.name)
                                          for f in dataclasses.fields(config.GenerateConfig)}, "concurrency": 0})


def test_the_library_takes_its_defaults_and_bounds_without_the_notebooks_folder(tmp_path):
    """As installed from a wheel: the package alone, no notebooks/ beside it."""
    import shutil
    import subprocess
    import sys

    shutil.copytree(REPO_ROOT / "src" / "draftsmith", tmp_path / "draftsmith")
    script = ("from draftsmith import parameters, paths\n"
              "assert not paths.NOTEBOOKS_DIR.exists(), paths.NOTEBOOKS_DIR\n"
              "from draftsmith.config import GenerateConfig\n"
              "print(GenerateConfig().max_attempts, parameters.declaration('concurrency').default)\n"
              "GenerateConfig(concurrency=0)\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    defaults = parameters.select(parameters.discover(), "02")[0].params
    assert r.stdout.split() == [str(defaults["max_attempts"].default), str(defaults["concurrency"].default)], r.stderr
    assert "concurrency must be at least 1" in r.stderr


@pytest.mark.notebook
def test_runner_passes_only_declared_parameters_with_absolute_paths(toy_stages, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"run_name": "r1", "outputs_dir": "out", "count": 5, "flag": False}))
    values = parameters.effective_params(toy_stages, str(f), [("rate", "2")])
    assert values["outputs_dir"] == str(tmp_path / "out") and values["rate"] == 2
    run = runner.run_stages(toy_stages, values, echo=False)
    assert json.loads((run.root / "first.json").read_text()) == {"count": 5, "rate": 2, "outputs_dir": str(tmp_path / "out")}
    executed = nbformat.read(run.root / "notebooks" / "02_second.ipynb", as_version=4)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(injected) == 1 and "count" not in injected[0].source and "flag = False" in injected[0].source
    assert "first done 5" in (run.root / "logs" / "01_first.log").read_text()
    report = (run.root / "report.html").read_text()
    assert "first done 5" in report and "Path(outputs_dir" not in report  # outputs shown, inputs hidden


@pytest.mark.notebook
def test_a_failing_stage_names_the_notebook_and_cell(toy_stages, tmp_path):
    values = parameters.effective_params(toy_stages, None, [("run_name", "r2"), ("outputs_dir", str(tmp_path)),
                                                         ("flag", "true")])
    with pytest.raises(runner.StageFailed) as e:
        runner.run_stages(toy_stages, values, echo=False)
    msg = str(e.value)
    assert "02_second" in msg and "cell" in msg and "AssertionError: flag was set" in msg
    assert (tmp_path / "r2" / "notebooks" / "02_second.ipynb").exists()


@pytest.mark.notebook
def test_on_several_nodes_each_node_keeps_its_own_executed_notebook_and_log(tmp_path, monkeypatch):
    """nnodes > 1: the same command on every node, one shared run folder; each node's executed
    notebook and log carry its host name, and the run's report shows them all."""
    import socket

    d = tmp_path / "nbs"
    d.mkdir()
    make_notebook(d / "03_once.ipynb", 'run_name = "x"\noutputs_dir = "outputs"\n', ["print('once')"])
    make_notebook(d / "04_nodes.ipynb", 'run_name = "x"\noutputs_dir = "outputs"\nnnodes = 1  # [1, inf) machines\n',
                  ["import socket\nprint('ran on', socket.gethostname())"])
    configs = {"03": ("once", toy(**RUN)), "04": ("nodes", toy(**RUN, nnodes=(1, "machines", {"ge": 1})))}
    stages = parameters.discover(d, configs)[1:]
    values = {"run_name": "r", "outputs_dir": str(tmp_path / "out"), "nnodes": 2}
    for host in ("node-a", "node-b"):
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        run = runner.run_stages(stages, values, echo=False)
    assert sorted(p.name for p in (run.root / "notebooks").iterdir()) == ["04_nodes@node-a.ipynb", "04_nodes@node-b.ipynb"]
    assert [p.name for p in sorted((run.root / "logs").iterdir())] == ["04_nodes@node-a.log", "04_nodes@node-b.log"]
    report = (run.root / "report.html").read_text()
    assert "04_nodes@node-a" in report and "04_nodes@node-b" in report
    runner.run_stages(stages, {**values, "run_name": "one", "nnodes": 1}, echo=False)
    assert [p.name for p in (tmp_path / "out" / "one" / "notebooks").iterdir()] == ["04_nodes.ipynb"]
    once = parameters.discover(d, configs)[:1]       # a stage that does not run on several nodes keeps its name
    runner.run_stages(once, {**values, "run_name": "once"}, echo=False)
    assert [p.name for p in (tmp_path / "out" / "once" / "notebooks").iterdir()] == ["03_once.ipynb"]


def test_stage_selection_by_number_name_and_list(toy_stages):
    assert [s.title for s in parameters.select(toy_stages, "2")] == ["02_second"]
    assert [s.title for s in parameters.select(toy_stages, "first,02")] == ["01_first", "02_second"]
    with pytest.raises(parameters.ParamError, match="unknown stage 'third'"):
        parameters.select(toy_stages, "third")


def test_a_run_without_a_params_file_is_refused_unless_defaults_is_given(capsys, monkeypatch, toy_stages):
    monkeypatch.setattr(parameters, "discover", lambda: toy_stages)
    assert cli.main(["run", "02"]) == 2
    assert "give a params file with -f" in capsys.readouterr().err
    assert cli.main(["run", "02", "--defaults", "-f", str(PARAMS[0])]) == 2


def test_bad_values_are_all_named_before_any_stage_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({
        "run_name": "v", "outputs_dir": str(tmp_path / "out"), "api_base": "https://openrouter.ai/api/v1",
        "concurrency": 0, "spend_limit_usd": 0, "max_tokens": 0, "target_model_path": "tiny-test",
        "datasets": [{"name": "a", "path": str(tmp_path / "empty.jsonl")},
                     {"name": "b", "path": str(tmp_path / "bad.jsonl")},
                     {"name": "c", "path": str(tmp_path / "missing.jsonl")}]}))
    assert cli.main(["run", "all", "-f", str(f)]) == 2
    err = capsys.readouterr().err
    for text in ["concurrency must be at least 1", "spend_limit_usd must be more than 0 (the run never spends more than this), got 0", "max_tokens must be at least 1", "datasets[0] 'a': no usable prompt", "(the file is empty)",
                 f"datasets[1] 'b': no usable prompt in {tmp_path / 'bad.jsonl'}; skipped: {tmp_path / 'bad.jsonl'}:1:",
                 "datasets[2] 'c': file not found", f"{f}: api_base is 'https://openrouter.ai/api/v1': no API key"]:
        assert text in err, text
    assert err.count(f"{f}: ") >= 7 and "Traceback" not in err
    assert not (tmp_path / "out" / "v" / "notebooks").exists()  # nothing started, nothing paid
    # a stage that declares none of them is not held up by them
    assert cli.main(["run", "05", "-f", str(f), "--check"]) == 0


def test_check_names_skipped_rows_by_file_and_line(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    row = b'{"messages": [{"role": "user", "content": "hello"}]}\n'
    data.write_bytes(row + b'{"messages": [{"role": "user", "content": "h\xe9"}]}\n' + row)
    assert cli.main(["run", "02", "-f", str(PARAMS[0]), "--check", "-p", "outputs_dir", str(tmp_path),
                     "-p", "datasets", json.dumps([{"name": "d", "path": str(data)}])]) == 0
    out = capsys.readouterr().out
    assert f"d: 1 prompts, 2 rows skipped: {data}:2: not UTF-8 text" in out
    assert f"{data}:3: duplicate: same prompt as line 1" in out


def test_an_unwritable_outputs_folder_is_one_line_not_a_traceback(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert cli.main(["run", "05", "-f", str(PARAMS[0]), "-p", "outputs_dir", str(tmp_path / "file" / "out")]) == 2
    err = capsys.readouterr().err
    assert "-p outputs_dir: outputs_dir" in err and "cannot be written: Not a directory" in err
    assert "Traceback" not in err


@pytest.mark.notebook
def test_a_failing_stage_points_to_its_traceback_in_the_log_with_the_same_cell_number(
        toy_stages, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(parameters, "discover", lambda: toy_stages)
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"run_name": "r3", "outputs_dir": str(tmp_path), "flag": True}))
    assert cli.main(["run", "all", "-f", str(f)]) == 1
    err = capsys.readouterr().err
    failure = err[err.index("draftsmith: stage"):]
    assert "stage 02_second failed in cell 4: AssertionError: flag was set" in failure and "Traceback" not in err
    summary = err[err.index("run r3: failed (02_second failed)"):err.index("draftsmith: stage")]  # the summary, then why
    assert "  ! 02_second: stopped: AssertionError: flag was set" in summary and "Executing cell" not in err
    assert json.loads((tmp_path / "r3" / "summary.json").read_text())["verdict"] == "failed"
    log = tmp_path / "r3" / "logs" / "02_second.log"
    assert f"traceback: {log}" in failure
    text = log.read_text()
    assert "Executing cell 4" in text and "Executing cell injected parameters" in text
    assert "== 02_second failed in cell 4:" in text and "assert not flag, 'flag was set'" in text
    source = nbformat.read(toy_stages[1].path, as_version=4)
    assert "assert not flag" in source.cells[4 - 1].source  # cell 4 as the notebook shows it


@pytest.mark.notebook
def test_ctrl_c_stops_the_run_with_one_line_and_exit_130(toy_stages, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    make_notebook(toy_stages[0].path, 'run_name = "x"\noutputs_dir = "outputs"\n',
                  ["import time\nprint('sleeping', flush=True)\ntime.sleep(60)"])
    script = ("import sys\nfrom pathlib import Path\nfrom draftsmith import cli, parameters\n"
              f"sys.path.insert(0, {str(Path(__file__).parent)!r})\nfrom test_runner import TOY\n"
              f"stages = parameters.discover(Path({str(toy_stages[0].path.parent)!r}), TOY)\n"
              "parameters.discover = lambda: stages\n"
              f"sys.exit(cli.main(['run', '01', '--defaults', '-p', 'outputs_dir', {str(tmp_path)!r}]))")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = tmp_path / "x" / "logs" / "01_first.log"
    wait_until(lambda: log.read_text() if log.exists() else "", lambda text: "sleeping" in text,
               what=f"'sleeping' in {log}", timeout_s=120, proc=proc)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted in 01_first" in err and "re-run the same command" in err


def test_notebooks_opened_by_hand_run_the_demos_datasets_and_budgets():
    """Run All in Lab with the defaults and `make demo` generate the same samples into the same run."""
    demo = yaml.safe_load((REPO_ROOT / "params" / "demo.yaml").read_text())
    stages = parameters.discover()
    known = parameters.declared(stages)  # the default the runner uses for a key no params file sets
    for key in ("run_name", "outputs_dir", "datasets", "model", "max_tokens"):
        assert key not in demo, key
        for stage in stages:
            if key in stage.params and stage.params[key].default != []:  # 04: [] = every dataset
                assert stage.params[key].default == known[key].default, (stage.title, key)
    budgets = {d["name"]: d["output_token_budget"] for d in known["datasets"].default}
    assert budgets == {"code": 8000, "chat": 20000}  # code stops at its budget, chat runs out of prompts
