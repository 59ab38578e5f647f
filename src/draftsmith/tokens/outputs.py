"""Stage 03's files: the only module that knows their names. It writes them and reads them back.

  tokens/<dataset>.jsonl         every kept sample: its checks and `input_ids` (prompt + response),
                                 `loss_mask` (1 on response tokens), `output_ids`; what stage 04 reads
                                 (`token_files`, `read_tokens`)
  tokens/checks/<dataset>.jsonl  the checks of every sample, kept or not (`read_checks`)
  tokens/report.json             per dataset, provider and source (`write_report`, `read_report`)
  tokens/.work/                  pass-1 results per source file, so an interrupted stage resumes
                                 (`Work`); removed once the stage is done

The two JSONL files of a dataset are streamed to temporary names and renamed once whole (they
are too large to hold as one string); report.json is written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..datasets import stable_id
from ..files import read_jsonl, replacing, write_json_atomic
from ..paths import Run
from ..progress import Progress
from .rebuild import Rebuilt
from .responses import Response

FORMAT_VERSION = 3  # 3: check rows carry the layout a sample took
REPORT = "report.json"


# ---- writing -------------------------------------------------------------------------------------

def check_row(r: Response, b: Rebuilt, checks: dict) -> dict:
    """The line of tokens/checks/<dataset>.jsonl for one sample (its ids are added for the kept ones)."""
    return {"sample_id": r.sample_id, "dataset": r.dataset, "source": r.source, "provider": r.provider,
            "prompt_hash": stable_id(r.messages),
            "generation_id": r.generation_id, "finish_reason": r.finish_reason,
            "billed_completion_tokens": r.billed_completion, "reconstructed_completion_tokens": len(b.output_ids),
            "billed_prompt_tokens": r.billed_prompt, "reconstructed_prompt_tokens": len(b.prompt_ids),
            "flagged": False, "excluded": False, "checks": checks}


def ids_line(b: Rebuilt) -> str:
    """The ids part of an output line, built from string pieces (JSON of 60M ints is the stage's
    second cost after tokenizing)."""
    prompt, output = json.dumps(b.prompt_ids), json.dumps(b.output_ids)
    inputs = prompt[:-1] + ", " + output[1:] if b.prompt_ids and b.output_ids else (output if b.output_ids else prompt)
    mask = "[" + ("0, " * len(b.prompt_ids) + "1, " * len(b.output_ids))[:-2] + "]"
    return f'{{"input_ids": {inputs}, "loss_mask": {mask}, "output_ids": {output}}}\n'


class Work:
    """Pass-1 results of one source file of a dataset (`name` = dataset.unit) under tokens/.work/:
    ids lines and check rows in step, and a fingerprint written last. A rerun with the same file
    and settings reuses them, so an interrupted stage redoes only the files it had not finished."""

    def __init__(self, run: Run, name: str, fingerprint: dict):
        d = run.dir("tokens/.work")
        self.ids, self.rows, self.done = d / f"{name}.ids.jsonl", d / f"{name}.rows.jsonl", d / f"{name}.done.json"
        self.fingerprint = fingerprint

    def finished(self) -> bool:
        try:
            done = json.loads(self.done.read_text())
            done.pop("problems", None)
            return done == self.fingerprint and self.ids.is_file() and self.rows.is_file()
        except (OSError, ValueError):
            return False

    @contextmanager
    def writer(self):
        """A function that writes one sample's check row and ids to the work files, in step."""
        with open(self.ids, "w", encoding="utf-8") as ids_f, open(self.rows, "w", encoding="utf-8") as rows_f:
            def write(row: dict, b: Rebuilt) -> None:
                ids_f.write(ids_line(b))
                rows_f.write(json.dumps(row, ensure_ascii=False) + "\n")

            yield write

    def finish(self, problems: list[str]) -> None:
        write_json_atomic(self.done, {**self.fingerprint, "problems": problems})

    def load_rows(self) -> tuple[list[dict], list[str]]:
        data = json.loads(self.done.read_text())
        return [row for _, row in read_jsonl(self.rows)], data.get("problems", [])

    def remove(self) -> None:
        for p in (self.ids, self.rows, self.done):
            p.unlink(missing_ok=True)


def write_dataset(run: Run, name: str, parts: list[tuple[list[dict], Work]]) -> Path:
    """tokens/<name>.jsonl (kept samples: checks + ids) and tokens/checks/<name>.jsonl (every
    sample, kept or not) from the (rows, work) of each source file of the dataset, each written
    whole or not at all (`files.replacing`)."""
    out_dir = run.dir("tokens")
    (out_dir / "checks").mkdir(exist_ok=True)
    final, checks = out_dir / f"{name}.jsonl", out_dir / "checks" / f"{name}.jsonl"
    with replacing(final) as tmp, replacing(checks) as tmp_checks, \
            open(tmp, "w", encoding="utf-8") as out, open(tmp_checks, "w", encoding="utf-8") as out_checks:
        for rows, work in parts:
            with open(work.ids, encoding="utf-8") as ids_f:
                for row, ids in zip(rows, ids_f, strict=True):
                    meta = json.dumps({k: v for k, v in row.items() if k != "excluded"}, ensure_ascii=False)
                    out_checks.write(json.dumps(row, ensure_ascii=False) + "\n")
                    if not row["excluded"]:
                        out.write(meta[:-1] + ", " + ids[1:])  # two JSON objects' members, one object
    return final


def write_report(run: Run, report: dict) -> None:
    write_json_atomic(run.dir("tokens") / REPORT, report)


# ---- reading -------------------------------------------------------------------------------------


def read_report(run: Run) -> dict:
    """tokens/report.json of `run`."""
    path = run.root / "tokens" / REPORT
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (run stage 03 first)")
    return json.loads(path.read_text(encoding="utf-8"))


def read_checks(run: Run, datasets: list[str]) -> list[dict]:
    """The check rows of every sample of `datasets`, kept or not, in dataset then file order."""
    return [row for name in datasets for _, row in read_jsonl(run.dir("tokens") / "checks" / f"{name}.jsonl")]


@dataclass(frozen=True)
class Sample:
    dataset: str
    sample_id: str
    input_ids: torch.Tensor   # int32 [L]
    loss_mask: torch.Tensor   # uint8 [L]
    digest: str               # of input_ids and loss_mask: a changed sample invalidates its shard
    source: str = ""          # where its answer came from (stage 03's `source`): per-sample index metadata

    @property
    def key(self) -> tuple[str, str]:
        return self.dataset, self.sample_id

    def __len__(self) -> int:
        return len(self.input_ids)


def token_files(run: Run, datasets: list | None = None) -> list[Path]:
    """`tokens/<name>.jsonl` of `run` for each dataset (dicts with a `name`, or names); all of them if none."""
    tokens_dir = run.dir("tokens")
    if not datasets:
        files = sorted(tokens_dir.glob("*.jsonl"))
        if not files:
            raise FileNotFoundError(f"{tokens_dir}: no tokens/<dataset>.jsonl files (run stage 03 first)")
        return files
    files = [tokens_dir / f"{d['name'] if isinstance(d, dict) else d}.jsonl" for d in datasets]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: not found (run stage 03 for this dataset first)")
    return files


def _digest(ids: torch.Tensor, mask: torch.Tensor) -> str:
    return hashlib.blake2b(ids.numpy().tobytes() + mask.numpy().tobytes(), digest_size=8).hexdigest()


def read_tokens(files: list[str | os.PathLike], vocab_size: int | None = None) -> list[Sample]:
    """Every sample not marked `"excluded": true`, in file order. A malformed line is an error naming
    its file and line: stage 03 writes whole lines, so one that is not means something is wrong."""
    samples: list[Sample] = []
    seen: dict[tuple[str, str], str] = {}
    total = sum(Path(f).stat().st_size for f in files)
    with Progress(total=total, desc="read tokens", unit="B") as bar:
        for path in map(Path, files):
            with open(path, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    bar.update(len(line))
                    if not line.strip():
                        continue
                    where = f"{path}:{lineno}"
                    sample = _parse_line(line, where, path.stem, vocab_size)
                    if sample is None:
                        continue
                    if sample.key in seen:
                        raise ValueError(f"{where}: sample {sample.sample_id!r} of dataset {sample.dataset!r} "
                                         f"already appeared at {seen[sample.key]}")
                    seen[sample.key] = where
                    samples.append(sample)
    return samples


def _parse_line(line: str, where: str, default_dataset: str, vocab_size: int | None) -> Sample | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if row.get("excluded"):
        return None
    sid = row.get("sample_id")
    if not isinstance(sid, str) or not sid:
        raise ValueError(f"{where}: missing or empty 'sample_id'")
    ids, mask = row.get("input_ids"), row.get("loss_mask")
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise ValueError(f"{where}: 'input_ids' must be a non-empty list of token ids")
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
        raise ValueError(f"{where}: 'loss_mask' must be a list of 0/1 as long as 'input_ids' ({len(ids)})")
    if vocab_size is not None and max(ids) >= vocab_size:
        raise ValueError(f"{where}: token id {max(ids)} is outside the target's vocabulary ({vocab_size})")
    t_ids = torch.tensor(ids, dtype=torch.int32)
    t_mask = torch.tensor(mask, dtype=torch.uint8)
    return Sample(str(row.get("dataset") or default_dataset), sid, t_ids, t_mask, _digest(t_ids, t_mask),
                  str(row.get("source") or ""))
