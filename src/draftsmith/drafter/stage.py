"""Stage 05 as notebook 05 runs it (`run`): train the run's drafters on its stage-04 hidden states.

The training settings are notebook 05's parameters under its names, the fields of `TrainConfig`;
`drafter_kinds` lists the drafters trained in turn on the same features (eagle3, dflash), each into
its own folder (`outputs.drafter_dir`); `train_nproc`, `nnodes` and `rdzv_endpoint` choose where it
runs (`train.launch`: this process, or torchrun processes on one node or several).
"""

from __future__ import annotations

from .. import parameters
from ..hidden.outputs import hidden_dir
from ..paths import Run
from ..targets.checkpoint import resolve_target
from . import outputs, train
from .config import TrainConfig


def run(run: Run, *, target_model_path: str, drafter_kinds: list[str], train_nproc: int, nnodes: int,
        rdzv_endpoint: str, log=print, **settings) -> dict[str, dict]:
    """Train each kind (resuming from its latest checkpoint when `train_resume`), export, and return
    the summaries by kind (`outputs.write_summary`). `settings` are the `TrainConfig` fields notebook
    05 declares."""
    parameters.check_bounds({"train_nproc": train_nproc, "nnodes": nnodes})
    if not drafter_kinds or len(set(drafter_kinds)) != len(drafter_kinds) \
            or not set(drafter_kinds) <= set(outputs.KINDS):
        raise ValueError(f"drafter_kinds must list distinct kinds of {outputs.KINDS}, got {drafter_kinds!r}")
    cfgs = [TrainConfig(hidden_dir=str(hidden_dir(run)), target_path=str(resolve_target(target_model_path)),
                        out_dir=str(outputs.drafter_dir(run, kind)), drafter_kind=kind, **settings)
            for kind in drafter_kinds]
    for cfg in cfgs:   # every kind's settings before the first trains
        cfg.check()
    return {cfg.drafter_kind: train.launch(cfg, train_nproc=train_nproc, nnodes=nnodes,
                                           rdzv_endpoint=rdzv_endpoint, log=log) for cfg in cfgs}
