"""Stage 05 as notebook 05 runs it (`run`): train the run's drafters on its stage-04 hidden states.

`run(run, cfg)` takes notebook 05's settings (`DrafterConfig`); those that shape training become one
`TrainConfig` per kind. `drafter_kinds` lists the drafters trained in turn on the same features
(eagle3, dflash), each into its own folder (`outputs.drafter_dir`); `train_nproc`, `nnodes` and
`rdzv_endpoint` choose where it runs (`train.launch`: this process, or torchrun processes on one
node or several).
"""

from __future__ import annotations

from ..hidden.outputs import broken_shards, broken_shards_message, hidden_dir
from ..config import DrafterConfig, split
from ..paths import Run
from ..targets.checkpoint import resolve_target
from . import outputs, train
from .config import TrainConfig


def run(run: Run, cfg: DrafterConfig, *, log=print) -> dict[str, dict]:
    """Train each kind of `cfg.drafter_kinds` (resuming from its latest checkpoint when `train_resume`),
    export, and return the summaries by kind (`outputs.write_summary`). A shard of stage 04's that is
    missing or cut short is a ValueError naming it, before anything is set up."""
    kinds = cfg.drafter_kinds
    if not kinds or len(set(kinds)) != len(kinds) or not set(kinds) <= set(outputs.KINDS):
        raise ValueError(f"drafter_kinds must list distinct kinds of {outputs.KINDS}, got {kinds!r}")
    broken = broken_shards(hidden_dir(run))   # sizes and headers: seconds for thousands of shards
    if broken:
        raise ValueError(broken_shards_message(hidden_dir(run), broken, "re-run stage 04 on this run"))
    shared = split(TrainConfig, vars(cfg))[0]
    trains = [TrainConfig(**shared, hidden_dir=str(hidden_dir(run)), out_dir=str(outputs.drafter_dir(run, kind)),
                          target_path=str(resolve_target(cfg.target_model_path)), drafter_kind=kind)
              for kind in kinds]
    for train_cfg in trains:   # every kind's settings before the first trains
        train_cfg.check()
    return {t.drafter_kind: train.launch(t, train_nproc=cfg.train_nproc, nnodes=cfg.nnodes,
                                         rdzv_endpoint=cfg.rdzv_endpoint, log=log) for t in trains}
