"""Stage 05's files: the one module that knows their names under `<run>/drafter/` (a DFlash drafter's
under `<run>/drafter-dflash/`, the same files with `dflash` for `eagle3`), writes and reads them.

Every file is written beside and renamed over (`draftsmith.files`), so a kill leaves the old file
or the new one; metrics.jsonl is appended a whole line at a time, and a torn last line is left out.
The two caches carry the key of the inputs they were made from and read as missing when it differs."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..files import read_jsonl, replacing, write_json_atomic, write_text_atomic
from ..paths import Run
from ..verdicts import Figure, Note, Reason, Verdict, read_file
from .export import is_export
from .vocab import DraftVocab


KINDS = ("eagle3", "dflash")

# The files of a drafter folder:
#   vocab.safetensors         the draft vocabulary (d2t, t2d, used ids, training counts)
#   supervision.safetensors   cached teacher masks (`data.supervision`)
#   heldout.json              the (dataset, sample_id) pairs held out of training: stage 06 prompts with them
#   metrics.jsonl             a `train` row per step, a `heldout` row per evaluation
#   exports.json              the exports with their held-out scores; `eagle3-step-N/` and `eagle3/` folders
#   checkpoints/step-N.pt     the last two checkpoints (exact resume)
#   train_config.json         the settings handed to torchrun processes
#   summary.json              what the training run did


def drafter_dir(run_or_dir: Run | str | os.PathLike, kind: str = "eagle3", create: bool = True) -> Path:
    """The drafter folder of a run (`drafter/` for EAGLE-3, `drafter-dflash/` for DFlash: both can
    be trained on one capture), created unless `create` is false, or the folder given."""
    if kind not in KINDS:
        raise ValueError(f"drafter kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(run_or_dir, Run):
        return Path(run_or_dir)
    name = "drafter" if kind == "eagle3" else f"drafter-{kind}"
    return run_or_dir.dir(name) if create else run_or_dir.root / name


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor], key: str) -> None:
    with replacing(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"key": key})


def _load_tensors(path: Path, key: str) -> dict[str, torch.Tensor] | None:
    """The tensors of `path` if it was written for `key`, else None."""
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("key") != key:
            return None
        return {k: f.get_tensor(k) for k in f.keys()}


# -- caches ------------------------------------------------------------------------------------

def write_vocab(out: Path, vocab: DraftVocab, key: str) -> None:
    _save_tensors(out / "vocab.safetensors", vocab.tensors(), key)


def read_vocab(run_or_dir, key: str | None = None) -> DraftVocab | None:
    """The draft vocabulary stage 05 built; with `key`, None unless it was built from those inputs."""
    path = drafter_dir(run_or_dir) / "vocab.safetensors"
    if key is None:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no draft vocabulary (run stage 05 first)")
        with safe_open(str(path), framework="pt") as f:
            key = (f.metadata() or {}).get("key")
    t = _load_tensors(path, key)
    return None if t is None else DraftVocab.from_tensors(t)


def write_supervision(out: Path, flat: torch.Tensor, offsets: torch.Tensor, key: str) -> None:
    _save_tensors(out / "supervision.safetensors", {"sup": flat, "offsets": offsets}, key)


def read_supervision(out: Path, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(flat masks, offsets) cached for `key`, or None when missing or made from other inputs."""
    t = _load_tensors(out / "supervision.safetensors", key)
    return None if t is None else (t["sup"], t["offsets"])


# -- the held-out split ------------------------------------------------------------------------

def write_heldout(out: Path, pairs: list[tuple[str, str]], holdout_fraction: float) -> None:
    write_json_atomic(out / "heldout.json", {
        "holdout_fraction": holdout_fraction,
        "samples": [{"dataset": d, "sample_id": s} for d, s in pairs]})


def read_heldout(run_or_dir) -> list[tuple[str, str]]:
    """The (dataset, sample_id) pairs stage 05 held out of training, in the order of its data."""
    path = drafter_dir(run_or_dir) / "heldout.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no held-out sample list (run stage 05 first)")
    try:
        samples = json.loads(path.read_text())["samples"]
        return [(str(s["dataset"]), str(s["sample_id"])) for s in samples]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a held-out sample list written by stage 05 ({e!r}); "
                         f"run stage 05 again") from None


# -- metrics and exports -----------------------------------------------------------------------

def read_metrics(run_or_dir) -> list[dict]:
    """The rows of metrics.jsonl ([] before training wrote any); a torn last line is left out."""
    return [row for _, row in read_jsonl(drafter_dir(run_or_dir) / "metrics.jsonl")]


class Metrics:
    """metrics.jsonl while training; on resume, rows past the checkpoint are dropped (they will be redone).
    Only the process that `writes` touches the file."""

    def __init__(self, out: Path, start: int, writes: bool):
        self.path, self.writes = out / "metrics.jsonl", writes
        self.rows = [r for r in read_metrics(out) if r["step"] <= start] if start > 0 else []
        if writes:
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.rows))

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if self.writes:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    def last(self, split: str) -> dict | None:
        return next((r for r in reversed(self.rows) if r["split"] == split), None)

    def first(self, split: str) -> dict | None:
        return next((r for r in self.rows if r["split"] == split), None)


def export_dir(out: Path, step: int, total: int, kind: str = "eagle3") -> Path:
    """Where the export at `step` goes: `eagle3/` (`dflash/`) for the end of training, else
    `eagle3-step-N/` (`dflash-step-N/`)."""
    return out / (kind if step == total else f"{kind}-step-{step:07d}")


class Exports:
    """exports.json while training: one item per export, replaced whole at each one."""

    def __init__(self, out: Path, start: int, writes: bool):
        self.path, self.writes = out / "exports.json", writes
        self.items = [e for e in json.loads(self.path.read_text()) if e["step"] <= start] \
            if self.path.is_file() and start > 0 else []

    def add(self, item: dict) -> None:
        self.items = [e for e in self.items if e["step"] != item["step"]] + [item]
        if self.writes:
            write_json_atomic(self.path, self.items)


def has_exports(run_or_dir, kind: str = "eagle3") -> bool:
    """Whether stage 05 wrote exports of `kind` (a run's folder is not created by asking)."""
    return (drafter_dir(run_or_dir, kind, create=False) / "exports.json").is_file()


def read_exports(run_or_dir) -> list[dict]:
    """The drafter's exports in training order ({step, fraction, dir}); a folder that moved with its
    run is found beside exports.json."""
    out = drafter_dir(run_or_dir)
    path = out / "exports.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no drafter exports (run stage 05 first)")
    items = sorted(json.loads(path.read_text()), key=lambda e: e["step"])
    if not items:
        raise ValueError(f"{path}: lists no exports")
    found = []
    for e in items:
        d = Path(e["dir"])
        if not is_export(d):
            d = out / d.name
        if not is_export(d):
            raise FileNotFoundError(f"{path}: export {e['dir']!r} (step {e['step']}) not found")
        found.append({"step": int(e["step"]), "fraction": float(e["fraction"]), "dir": d})
    return found


# -- checkpoints -------------------------------------------------------------------------------

def checkpoints(out: Path) -> list[Path]:
    """The checkpoints kept, oldest first."""
    return sorted((out / "checkpoints").glob("step-*.pt"))


def save_checkpoint(out: Path, step: int, state: dict, keep: int = 2) -> Path:
    """Write `state` as the checkpoint of `step`; only the `keep` latest stay."""
    path = out / "checkpoints" / f"step-{step:07d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        torch.save(state, tmp)
    for old in checkpoints(out)[:-keep]:
        old.unlink()
    return path


def remove_checkpoints(out: Path) -> None:
    for old in checkpoints(out):
        old.unlink()


# -- settings and summary ----------------------------------------------------------------------

def write_train_config(out: Path, config: dict) -> Path:
    path = out / "train_config.json"
    write_json_atomic(path, config)
    return path


def write_summary(out: Path, summary: dict) -> None:
    write_json_atomic(out / "summary.json", summary)


def read_summary(run_or_dir) -> dict:
    path = drafter_dir(run_or_dir) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training summary (run stage 05 first)")
    return json.loads(path.read_text())


# ---- the stage's verdict, for the run summary (`draftsmith.summary` assembles the stages') ----

def _num(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


@dataclass
class DrafterNumbers:
    kind: str                           # eagle3 | dflash
    steps: int
    total_steps: int
    finished: bool
    train_loss: float | None            # the last training step's, first draft position, nats (stage 05's table)
    train_accuracy: float | None        # ... its first draft position's accuracy
    heldout_loss: float | None          # the held-out split at the end (first draft position, nats)
    heldout_accuracy: float | None
    heldout_loss_start: float | None    # ... and before the first step
    heldout_accuracy_start: float | None


@dataclass
class DrafterStageNumbers:
    drafters: list[DrafterNumbers]      # eagle3, and dflash where it was trained too


def _drafter_numbers(run: Run, kind: str) -> DrafterNumbers:
    where = drafter_dir(run, kind, create=False)
    s = read_file(run, read_summary, where)
    train = [row for row in read_metrics(where) if row.get("split") == "train"]
    last, end, start = (train[-1] if train else {}), s.get("heldout") or {}, s.get("heldout_start") or {}

    def acc(row):
        return row["acc_i"][0] if row.get("acc_i") else None

    def loss(row):   # the first draft position's, as stage 05's table has it (`loss` sums every TTT step's)
        return row["loss_i"][0] if row.get("loss_i") else row.get("loss")

    return DrafterNumbers(kind=s.get("kind", kind), steps=s["steps"], total_steps=s["total_steps"],
                          finished=bool(s["finished"]), train_loss=loss(last), train_accuracy=acc(last),
                          heldout_loss=loss(end), heldout_accuracy=acc(end),
                          heldout_loss_start=loss(start), heldout_accuracy_start=acc(start))


def verdict(run: Run, anchor: str):
    """Stage 05's line of the run summary from each drafter's summary.json and metrics: (DrafterStageNumbers,
    verdict, figures, notes); a warning when training stopped early or the held-out loss did not fall."""
    kinds = ["eagle3"]
    try:   # DFlash beside it when it was trained too
        read_summary(drafter_dir(run, "dflash", create=False))
        kinds.append("dflash")
    except FileNotFoundError:
        pass
    n = DrafterStageNumbers([_drafter_numbers(run, kind) for kind in kinds])
    figures, notes = [], []
    for d in n.drafters:
        figures += [Figure(f"{d.kind}: {d.steps}/{d.total_steps} steps, final train loss {_num(d.train_loss)} nat, "
                           f"accuracy {_pct(d.train_accuracy)}", anchor),
                    Figure(f"held-out loss {_num(d.heldout_loss_start)} -> {_num(d.heldout_loss)} nat, accuracy "
                           f"{_pct(d.heldout_accuracy_start)} -> {_pct(d.heldout_accuracy)} (first draft token)", anchor)]
        if not d.finished:
            notes.append(Note(Reason.TRAINING_UNFINISHED, f"{d.kind}: training stopped at step {d.steps} of "
                              f"{d.total_steps}; re-run stage 05 to resume"))
        if d.heldout_loss is not None and d.heldout_loss_start is not None and d.heldout_loss >= d.heldout_loss_start:
            notes.append(Note(Reason.LOSS_DID_NOT_FALL, f"{d.kind}: the held-out loss did not fall "
                              f"({_num(d.heldout_loss_start)} -> {_num(d.heldout_loss)})"))
    return n, Verdict.WARNING if notes else Verdict.OK, figures, notes
