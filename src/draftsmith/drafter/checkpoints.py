"""What a checkpoint holds and how training continues from one exactly.

A checkpoint is the full (unsharded) model and optimizer state without the frozen embedding, the
schedule, every random generator and the step, plus the fingerprint of the settings and data it
was trained with (`TrainConfig.fingerprint`): a run resumes only from a checkpoint that matches.
Where the files live is `outputs`' business. A checkpoint
written before the settings took the notebook's names is read with them renamed (`config.renamed`).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from . import outputs
from .config import renamed


def gather_state(model, opt) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state on CPU, without the frozen embedding."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v for k, v in msd.items() if not k.endswith("embed_tokens.weight")}, osd


def save(out: Path, step: int, msd: dict, osd: dict, sched, fingerprint: dict) -> Path:
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return outputs.save_checkpoint(out, step, {"step": step, "model": msd, "optimizer": osd,
                                                 "scheduler": sched.state_dict(), "rng": rng,
                                                 "config": fingerprint})


def latest_matching(out: Path, fingerprint: dict) -> tuple[Path, dict] | None:
    """The latest checkpoint and its state, or None when there is none; an error when it was
    trained with other settings or data (checked before any long preparation)."""
    found = outputs.checkpoints(out)
    if not found:
        return None
    state = torch.load(found[-1], map_location="cpu", weights_only=False)
    state["config"] = renamed(state["config"])
    if state["config"] != fingerprint:
        diff = sorted(k for k in fingerprint if state["config"].get(k) != fingerprint[k])
        raise ValueError(f"{found[-1]}: checkpoint was trained with other settings or data ({', '.join(diff)}); "
                         f"restore them, or start over: train_resume false, or delete "
                         f"{found[-1].parent}")
    return found[-1], state


def restore(model, opt, sched, state: dict) -> int:
    """Put model, optimizer, schedule and random generators back; returns the step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(full_state_dict=True, strict=False))
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"]
