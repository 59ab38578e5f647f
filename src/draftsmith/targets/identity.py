"""What names a checkpoint: one fingerprint of its config and weight files.

Stage 04 records the target's identity in the hidden-state index, so features of two different
checkpoints are never mixed in one folder; stage 06 keys its measurements by the target's and
each exported drafter's fingerprint, so a changed model is measured again. The fingerprint reads
config.json, the names and sizes of the safetensors files and their first MiB: cheap on a 1 TB
checkpoint, and it changes when the weights are replaced.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def fingerprint(folder: str | os.PathLike) -> str:
    """16 hex digits of config.json + every `*.safetensors` file's name, size and first MiB."""
    folder = Path(folder)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def target_identity(path: str | os.PathLike, trust_remote_code: bool = False) -> dict:
    """What names the target in the hidden-state index: its shape from the config, and `fingerprint`."""
    from transformers import AutoConfig

    path = Path(path)
    raw = (path / "config.json").read_bytes()
    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config()
    return {"path": str(path), "model_type": cfg.model_type,
            "config_sha256": hashlib.sha256(raw).hexdigest(), "fingerprint": fingerprint(path),
            "num_hidden_layers": int(cfg.num_hidden_layers), "hidden_size": int(cfg.hidden_size),
            "vocab_size": int(cfg.vocab_size), "pad_token_id": cfg.pad_token_id}
