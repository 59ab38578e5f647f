"""Stage 04 as notebook 04 runs it: in this process, or as torchrun ranks fed one JSON config.

`run_stage` takes the notebook's parameters and picks the way: `nproc_per_node` > 1 (`hf` on
several GPUs, or gloo processes on a CPU) runs `launch`, anything else `extract` here. `launch`
writes every setting into `extract_config.json` in the output folder and starts
`python -m draftsmith.hidden CONFIG.json` as torchrun ranks (`draftsmith.torchrun`), as stage 05's
training does with its config: the settings are declared once (`extract.Settings`). A failed
torchrun is started again; it resumes from the whole shards.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from .. import shards
from ..files import write_json_atomic
from ..paths import Run
from ..tokens.outputs import token_files
from ..torchrun import torchrun
from .extract import Settings, extract

CONFIG = "extract_config.json"


def run_stage(run: Run, target: str | os.PathLike, datasets: list | None = None, *, nproc_per_node: int = 1,
              engine_options: dict | None = None, log=print, **settings) -> dict:
    """Extract the run's stage-03 tokens (of `datasets`, or all) into its hidden-state folder and
    return the summary. `engine_options` reach the engine only when `backend` is vllm."""
    files = token_files(run, datasets)
    if settings.get("backend") == "vllm":
        settings["engine_options"] = dict(engine_options or {})
    if nproc_per_node > 1:
        return launch(nproc_per_node, target, files, shards.hidden_dir(run), log=log, **settings)
    return extract(target, files, shards.hidden_dir(run), log=log, **settings)


def write_config(target, files, out_dir, **settings) -> Path:
    """The one file a torchrun child reads: where, what, and every `Settings` field."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CONFIG
    write_json_atomic(path, {"target": str(target), "token_files": [str(f) for f in files], "out_dir": str(out_dir),
                             "settings": asdict(Settings(**settings))})
    return path


def launch(nproc: int, target, files, out_dir, *, attempts: int = 2, log=print, **settings) -> dict:
    """Run `extract` as `nproc` torchrun ranks on this machine (one per GPU, or gloo on CPU); returns
    rank 0's summary. A failed torchrun is started again (`attempts` in all); whole shards are kept."""
    config = write_config(target, files, out_dir, **settings)
    shards.remove_summary(out_dir)
    torchrun(nproc, "draftsmith.hidden", [str(config)], attempts=attempts, log=log)
    return shards.read_summary(out_dir)


def main(argv: list[str] | None = None) -> int:
    """`[torchrun ...] python -m draftsmith.hidden CONFIG.json` (a config `write_config` wrote)."""
    from ..target.checkpoint import resolve_target

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc-per-node N -m draftsmith.hidden CONFIG.json", file=sys.stderr)
        return 2
    cfg = json.loads(Path(argv[0]).read_text())
    extract(resolve_target(cfg["target"], log=lambda *m: None), cfg["token_files"], cfg["out_dir"],
            log=lambda m: print(m, flush=True), **cfg["settings"])
    return 0
