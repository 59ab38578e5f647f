"""The settings of one training run (`TrainConfig`), checked before any work.

Every setting a user chooses is a required field: its one default is in stage 05's config
(`config.DrafterConfig`: `draft_vocab_size`, `train_lr`, ...), and each field is named as the config
names it; their bounds are checked where that config is built. Only the settings
the stage does not offer have defaults here, and DFlash's, which take the config's
(`parameters.default_field`), so an EAGLE-3 run need not name them.

A checkpoint remembers the settings that change the trained weights (`fingerprint`), so a run is
resumed only with the settings and data it was started with.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .. import layers, parameters
from .export import DTYPES


@dataclass(kw_only=True)
class TrainConfig:
    hidden_dir: str                  # stage 04's shards
    drafter_kind: str = "eagle3"     # eagle3 or dflash (notebook 05's drafter_kinds lists them)
    target_path: str                 # target checkpoint folder (embedding, lm_head, config)
    out_dir: str                     # the drafter folder
    draft_vocab_size: int
    ttt_steps: int
    train_epochs: float
    train_batch_size: int            # samples per optimizer step, all processes together
    train_micro_batch_size: int      # samples per forward pass
    train_max_len: int               # tokens of a sample used (longer ones are cut)
    train_lr: float
    train_warmup_fraction: float
    train_weight_decay: float
    train_grad_clip: float
    train_holdout_fraction: float
    seed: int
    train_fsdp: bool                 # shard the drafter over processes (FSDP2) instead of DDP
    step_weight: float = 0.8         # TTT step i weighs step_weight**i
    train_layer_ids: list[int] = parameters.default_field("train_layer_ids")  # []: the kind's own layers
    # DFlash's own settings, at notebook 05's defaults unless given (an EAGLE-3 run leaves them out)
    dflash_layers: int = parameters.default_field("dflash_layers")          # draft decoder layers
    dflash_block_size: int = parameters.default_field("dflash_block_size")  # anchor + block_size-1 drafted
    dflash_anchors: int = parameters.default_field("dflash_anchors")        # blocks per sample and epoch
    # bookkeeping: does not change the trained weights
    train_eval_every: int            # steps between held-out evaluations (0: only at exports)
    train_checkpoint_every: int
    export_fractions: list[float]
    export_engine: str               # EAGLE-3's layer-id convention; a DFlash export is vLLM's format
    export_dtype: str
    train_resume: bool
    stop_at: int = 0                 # return after this many steps (0: train to the end)

    LIBRARY_ONLY = ("hidden_dir", "target_path", "out_dir", "step_weight", "stop_at", "drafter_kind")  # no stage declares these
    DFLASH_ONLY = ("drafter_kind", "dflash_layers", "dflash_block_size", "dflash_anchors")
    BOOKKEEPING = ("train_eval_every", "train_checkpoint_every", "export_fractions", "export_engine",
                   "export_dtype", "train_resume", "stop_at", "out_dir", "hidden_dir", "target_path")

    def fingerprint(self, shards_index: dict, target_config: dict) -> dict:
        """What a checkpoint must agree with to be resumed: the settings that change the weights, and
        the data and target themselves (not their paths, so a moved run folder still resumes)."""
        # an EAGLE-3 run's fingerprint holds no DFlash setting: a checkpoint made before they
        # existed still resumes
        skip = self.BOOKKEEPING + (self.DFLASH_ONLY if self.drafter_kind == "eagle3" else ()) \
            + (("train_layer_ids",) if not self.train_layer_ids else ())
        return {**{k: v for k, v in asdict(self).items() if k not in skip},
                "data": digest(shards_index), "target": digest(target_config)}

    def check(self) -> None:
        """Settings errors, raised before any work (an export failing after training would waste it)."""
        if self.drafter_kind not in ("eagle3", "dflash"):
            raise ValueError(f"drafter kind must be eagle3 or dflash, got {self.drafter_kind!r}")
        if self.export_engine not in layers.ENGINES:
            raise ValueError(f"export_engine must be one of {layers.ENGINES}, got {self.export_engine!r}")
        if self.export_dtype not in DTYPES:
            raise ValueError(f"export_dtype must be one of {sorted(DTYPES)}, got {self.export_dtype!r}")
        if not all(0 < f <= 1 for f in self.export_fractions):
            raise ValueError(f"export_fractions must lie in (0, 1], got {self.export_fractions}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, path) -> "TrainConfig":
        raw = json.loads(Path(path).read_text())
        names = {f.name for f in fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ValueError(f"{path}: unknown training settings {sorted(unknown)}")
        return cls(**raw)


# A checkpoint written before the settings took notebook 05's names remembers them by their old
# names: its fingerprint is read through this map, so such a run still resumes.
OLD_NAMES = {old: f"train_{old}" for old in (
    "epochs", "batch_size", "micro_batch_size", "max_len", "lr", "warmup_fraction", "weight_decay", "grad_clip",
    "holdout_fraction", "fsdp", "eval_every", "checkpoint_every", "resume")}


def renamed(fingerprint: dict) -> dict:
    """A checkpoint's fingerprint with the settings under their current names."""
    return {OLD_NAMES.get(k, k): v for k, v in fingerprint.items()}


def digest(obj) -> str:
    """A short hash of a JSON-able object (the inputs a cache or checkpoint was made from)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
