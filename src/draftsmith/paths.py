"""Where things live: the repository, and the folder of one run under `outputs_dir`.

`draftsmith run` hands notebooks absolute paths. A notebook opened by hand in Jupyter gets the
relative defaults of its parameters cell; those are taken relative to the repository root, so
nothing depends on the working directory either way.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"

STAGES = ("providers", "generate", "tokens", "hidden", "drafter", "eval")


# A run or dataset name becomes a folder or file name under the run: no separator, no `.`/`..`.
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_name(field: str, name) -> None:
    """Raise ValueError naming `field` unless `name` is safe as one folder or file name."""
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name):
        raise ValueError(f"{field} {name!r}: use letters, digits, '.', '_' and '-', starting with a letter or "
                         f"digit (it names a folder of the run)")


def resolve(path: str | Path, base: Path = REPO_ROOT) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


EXECUTED = "notebooks"  # <run>/notebooks/: the runner's executed copies of the stage notebooks


class Run:
    """The folder of run `run_name`: `<outputs_dir>/<run_name>/`, one subfolder per stage."""

    def __init__(self, outputs_dir: str | Path, run_name: str):
        check_name("run_name", run_name)
        self.name = run_name
        self.root = resolve(outputs_dir) / run_name

    def dir(self, stage: str) -> Path:
        """The folder of a stage (or of notebooks/logs/figures/emulator), created on first use."""
        d = self.root / stage
        d.mkdir(parents=True, exist_ok=True)
        return d

    def figure(self, stage: str, name: str) -> Path:
        return self.dir(f"{stage}/figures") / name

    def executed_notebooks(self) -> list[Path]:
        """The executed copies of the stage notebooks the runner saved here, in stage order (on
        several nodes, one per node: `04_hidden_states@<host>.ipynb`, runner.node_title)."""
        return sorted((self.root / EXECUTED).glob("[0-9][0-9]_*.ipynb"))

    def __repr__(self) -> str:
        return f"Run({str(self.root)!r})"
