"""Stage 03's files: the only module that knows their names. It writes them and reads them back.

  tokens/<dataset>.jsonl         every kept sample: its checks and `input_ids` (prompt + response),
                                 `loss_mask` (1 on response tokens), `output_ids`; what stage 04 reads
                                 (`token_files`, `read_tokens`)
  tokens/checks/<dataset>.jsonl  the checks of every sample, kept or not (`read_checks`)
  tokens/report.json             per dataset, provider and source (`write_report`, `read_report`)
  tokens/.work/                  pass-1 results per source file, so an interrupted stage resumes
                                 (`Work`); removed once the stage is done

The two JSONL files of a dataset are streamed to temporary names and renamed once whole (they
are too large to hold as one string); report.json is written atomically. Beside its files the stage
says its verdict, once, from report.json: is the data as kept fit to train on (`harmful_providers`),
as the notebook's line (`verdict_line`) and as the run summary's (`verdict`).
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
from ..verdicts import Figure, Note, Reason, Verdict, read_file
from ..targets.rebuild import Rebuilt, Response

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


# ---- the verdict: is the data as kept fit to train on (the notebook's line, the run summary's) ----

# Causes that leave the text as the target wrote it: the provider only counts (bills) it otherwise,
# or sampled a token split the rebuilt ids spell canonically. Training ids are rebuilt from the
# text with the target's own template, so samples flagged only for these are fit to train on.
BILLING_ONLY = ("other_tokenizer", "billing_offset", "non_canonical_split")


def harmful_providers(report: dict) -> dict[str, str]:
    """{flagged provider: its cause} of those whose text is unlike the target's (not only its count)."""
    return {p: f["cause"] or (f["reasons"] or ["flagged"])[0] for p, f in report["flagged_providers"].items()
            if f["cause"] not in BILLING_ONLY}


def verdict_line(report: dict) -> str:
    """The notebook's one line: is the data as kept fit to train on, why, and what to do when it is not."""
    t, flagged = report["totals"], report["flagged_providers"]
    if not t["flagged"] and not flagged:
        return "verdict: fit to train on: no sample and no provider is flagged"
    if report["exclude_flagged"]:
        return (f"verdict: fit to train on: exclude_flagged leaves the {t['flagged']} flagged samples and every "
                f"sample of a flagged provider out ({t['excluded']} excluded, {t['kept']} kept)")
    harmful = harmful_providers(report)
    if harmful:
        kept = sum(report["providers"][p]["samples"] for p in harmful)
        return ("verdict: NOT fit to train on as kept: " + ", ".join(f"{p} ({c})" for p, c in harmful.items())
                + f" returned text unlike the target's, and their {kept} samples are kept because exclude_flagged "
                f"is off; re-run stage 03 with -p exclude_flagged true (or leave them out of stage 02's routing)")
    if flagged:
        causes = sorted({f["cause"] for f in flagged.values()})
        return (f"verdict: fit to train on as kept: the flagged providers differ from the target only in how "
                f"they count tokens ({', '.join(causes)}); the text is the target's, and the training ids are "
                f"rebuilt from it with the target's own template")
    return (f"verdict: fit to train on as kept: no provider is flagged; {t['flagged']} samples "
            f"({t['flagged'] / t['samples']:.1%}) are flagged one by one (a count off by more than the "
            f"tolerance, or an issue) and kept because exclude_flagged is off; set it to leave them out")


@dataclass
class TokensNumbers:
    samples: int
    kept: int
    excluded: int
    flagged_samples: int
    exclude_flagged: bool
    providers_used: list[str]
    providers_flagged: dict[str, str]   # provider -> cause
    providers_excluded: list[str]       # flagged providers whose samples are left out
    billed_tokens: int                  # completion tokens billed, over `tokens_scope`
    rebuilt_tokens: int                 # ... and rebuilt from the text
    tokens_scope: str                   # "kept" (what stage 04 reads), or "all samples" in an older report
    response_tokens_kept: int


def verdict(run: Run, anchor: str):
    """Stage 03's line of the run summary from tokens/report.json: (TokensNumbers, verdict, figures,
    notes); failed when a provider whose text is unlike the target's is kept, or no sample is."""
    r = read_file(run, read_report, run)
    t, flagged = r["totals"], r["flagged_providers"]
    kept_totals = r.get("totals_kept")
    scope = kept_totals or t
    excluded_providers = sorted(flagged) if r["exclude_flagged"] else []
    n = TokensNumbers(samples=t["samples"], kept=t["kept"], excluded=t["excluded"], flagged_samples=t["flagged"],
                      exclude_flagged=r["exclude_flagged"], providers_used=sorted(r["providers"]),
                      providers_flagged={p: f["cause"] or (f["reasons"] or ["flagged"])[0] for p, f in flagged.items()},
                      providers_excluded=excluded_providers, billed_tokens=scope["billed_completion_tokens"],
                      rebuilt_tokens=scope["reconstructed_completion_tokens"],
                      tokens_scope="kept" if kept_totals else "all samples",
                      response_tokens_kept=t["response_tokens_kept"])
    flagged_text = ", ".join(f"{p} ({c})" for p, c in n.providers_flagged.items()) or "none"
    figures = [Figure(f"{len(n.providers_used)} providers, flagged: {flagged_text}", anchor),
               Figure(f"{n.kept:,} of {n.samples:,} samples kept ({n.response_tokens_kept:,} response tokens)", anchor),
               Figure(f"billed vs rebuilt on {n.tokens_scope}: {n.billed_tokens:,} vs {n.rebuilt_tokens:,} tokens", anchor)]
    if n.excluded:   # the flagged providers' samples, and samples flagged one by one from the other providers
        left_out = sum(r["providers"][p]["samples"] for p in excluded_providers)
        why = ([f"{left_out:,} from the flagged providers ({', '.join(excluded_providers)})"] if excluded_providers
               else []) + ([f"{n.excluded - left_out:,} flagged one by one from the others"]
                           if n.exclude_flagged and n.excluded > left_out else [])
        figures.append(Figure(f"excluded {n.excluded:,} samples" + (f": {' + '.join(why)}" if why else ""), anchor))
    notes = []
    harmful = harmful_providers(r)
    if harmful and not n.exclude_flagged:
        notes.append(Note(Reason.FLAGGED_KEPT, "not fit to train on as kept: " + ", ".join(
            f"{p} ({c})" for p, c in harmful.items())
            + " returned text unlike the target's and their samples are kept; set exclude_flagged: true"))
    if not n.kept:
        notes.append(Note(Reason.NO_SAMPLE_KEPT, "no sample is kept"))
    malformed = {name: d["malformed_lines"] for name, d in r["datasets"].items() if d.get("malformed_lines")}
    if malformed:
        notes.append(Note(Reason.MALFORMED_LINES,
                          "malformed lines skipped: " + ", ".join(f"{k} {v}" for k, v in malformed.items())))
    outcome = (Verdict.FAILED if (harmful and not n.exclude_flagged) or not n.kept
               else Verdict.WARNING if notes else Verdict.OK)
    return n, outcome, figures, notes
