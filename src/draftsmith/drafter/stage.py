"""Stage 05 as notebook 05 runs it (`run`): train the run's drafter on its stage-04 hidden states.

The training settings are notebook 05's parameters under its names, the fields of `TrainConfig`;
`train_nproc`, `nnodes` and `rdzv_endpoint` choose where it runs (`train.launch`: this process, or
torchrun processes on one node or several).
"""

from __future__ import annotations

from .. import parameters
from ..hidden.outputs import hidden_dir
from ..paths import Run
from ..targets.checkpoint import resolve_target
from . import outputs, train
from .config import TrainConfig


def run(run: Run, *, target_model_path: str, train_nproc: int, nnodes: int, rdzv_endpoint: str, log=print,
        **settings) -> dict:
    """Train (resuming from the latest checkpoint when `train_resume`), export, and return the
    summary (`outputs.write_summary`). `settings` are the `TrainConfig` fields notebook 05 declares."""
    parameters.check_bounds({"train_nproc": train_nproc, "nnodes": nnodes})
    cfg = TrainConfig(hidden_dir=str(hidden_dir(run)), target_path=str(resolve_target(target_model_path)),
                      out_dir=str(outputs.drafter_dir(run)), **settings)
    return train.launch(cfg, train_nproc=train_nproc, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, log=log)
