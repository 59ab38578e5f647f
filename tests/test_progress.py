"""What a person sees of long steps: a notebook bar that ends neutral when stage 02's work is done
short of its total (a dataset ran out of prompts), red only when it really stopped; and Ctrl-C
during a wait for another process's target build ends in one clean KeyboardInterrupt."""

import fcntl
import signal
import subprocess
import sys

import tqdm.auto
import tqdm.notebook
from test_generate_e2e import emu_config, generate, prompts_file

from draftsmith.emulator import running
from draftsmith.progress import Progress
from draftsmith.targets import tiny

import pytest

pytestmark = pytest.mark.emulator


def notebook_bars(monkeypatch) -> list:
    """Make Progress draw Jupyter's widget bar (as in Lab) and collect each bar it draws."""
    bars = []

    class Recorded(tqdm.notebook.tqdm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            bars.append(self)

    monkeypatch.setenv("DRAFTSMITH_PROGRESS", "bar")
    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    return bars


def style(bar) -> str:
    return bar.container.children[1].bar_style


def test_stage_02_bar_ends_neutral_when_a_dataset_runs_out_of_prompts_below_its_budget(tmp_path, monkeypatch):
    bars = notebook_bars(monkeypatch)
    few = prompts_file(tmp_path / "few.jsonl", 3, "few")
    with running(emu_config(credits=10.0), state_dir=tmp_path / "emu") as emu:
        r = generate(emu, tmp_path, [{"name": "few", "path": str(few), "output_token_budget": 100_000}])
    assert r.reason == "finished" and "its prompts ran out below the budget" in r.message, r.message
    [bar] = bars
    assert bar.n < bar.total and style(bar) == "info"


def test_a_bar_closed_short_of_its_total_without_ending_stays_red(monkeypatch):
    bars = notebook_bars(monkeypatch)
    stopped = Progress(total=100, desc="generate", unit="tok")
    stopped.update(73)
    stopped.close()
    full = Progress(total=100, desc="generate", unit="tok")
    full.update(100)
    full.close(ended=True)
    assert [style(b) for b in bars] == ["danger", "success"]


def test_ctrl_c_while_waiting_for_another_target_build_is_one_clean_keyboard_interrupt(tmp_path):
    out = tmp_path / tiny.variant_key("tiny-test")
    with open(tmp_path / f".{out.name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process, mid-build
        child = subprocess.Popen(
            [sys.executable, "-u", "-c", "from draftsmith.targets import tiny; import sys; "
             f"tiny.build_tiny_target('tiny-test', root=sys.argv[1])", str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = child.stdout.readline()
        assert first.startswith("[target build] waiting for another process building target 'tiny-test'"), first
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=30)
    assert child.returncode != 0
    assert err.count("Traceback") == 1 and err.rstrip().endswith("KeyboardInterrupt"), err
    assert "BlockingIOError" not in err and "During handling" not in err, err
