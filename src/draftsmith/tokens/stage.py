"""Stage 03's entry point (`run`): every source of every dataset rebuilt and checked, then analysed together.

Pass 1 (`rebuild_source`) turns each source file into ids and check rows under tokens/.work/,
resumable per file. Then duplicates, sources and providers are settled over all rows (`checks`),
and the outputs and report are written (`outputs`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from ..datasets import parse_datasets
from ..generate import outputs as generate_outputs
from ..generate.outputs import responses_file
from ..imports import parse_imports, source_files, to_raw
from ..config import TokensConfig
from ..paths import Run
from ..progress import Progress
from ..targets.rebuild import BadLine, Reconstructor, Response, load_reconstructor
from .checks import Thresholds, analyse, check, drop_answered_elsewhere, mark_duplicates, source_report, totals
from .outputs import FORMAT_VERSION, Work, check_row, write_dataset, write_report


def _fingerprint(src: Path, rec: Reconstructor, thresholds: Thresholds) -> dict:
    st = src.stat()
    return {"version": FORMAT_VERSION, "source": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "tokenizer": rec.source, "template": hashlib.sha256(rec.chat_template.encode()).hexdigest()[:16],
            "thresholds": asdict(thresholds)}


def rebuild_source(rec: Reconstructor, run: Run, name: str, unit: str, src: Path, work: Work,
                   thresholds: Thresholds, batch_size: int = 256) -> tuple[list[dict], list[str]]:
    """Pass 1 over one source of dataset `name` (stage 02's responses, or an import file): ids to
    the work file, check rows returned. Malformed lines are skipped and returned as
    'file:line: reason'."""
    if work.finished():
        return work.load_rows()
    total = sum(1 for _ in open(src, "rb"))
    vocab = len(rec.tokenizer)
    rows, problems, batch = [], [], []
    with work.writer() as write, Progress(total=total, desc=f"tokens {name}", unit="samples") as bar:
        n_tokens = 0

        def flush():
            nonlocal n_tokens
            for r, b in zip(batch, rec.rebuild(batch)):
                row = check_row(r, b, check(r, b, rec.layout, thresholds))
                row["dataset"] = row["dataset"] or name
                write(row, b)
                rows.append(row)
                n_tokens += len(b.prompt_ids) + len(b.output_ids)
            bar.update(len(batch))
            bar.set(tokens=n_tokens)
            batch.clear()

        for lineno, item in read_responses(run, name, unit, src):
            if not isinstance(item, BadLine):
                try:
                    item.prompt = rec.prompt_text(item.messages)
                except Exception as e:  # the template has no place for this conversation (a role, ...)
                    item = BadLine(f"chat template: {type(e).__name__}: {e}")
            if not isinstance(item, BadLine):
                top = max((max(v) for v in (item.output_ids, item.prompt_ids) if v), default=-1)
                if top >= vocab:
                    item = BadLine(f"token id {top} in output_ids/prompt_ids is outside the target's "
                                   f"vocabulary ({vocab}): ids from another tokenizer?")
            if isinstance(item, BadLine):
                problems.append(f"{src}:{lineno}: {item}")
                bar.update(1)
                continue
            batch.append(item)
            if len(batch) >= batch_size:
                flush()
        if batch:
            flush()
    work.finish(problems)
    return rows, problems


def run(run: Run, cfg: TokensConfig, *, batch_size: int = 256, log=print) -> dict:
    """Stage 03 end to end: rebuild every dataset from stage 02's responses and the files in
    `cfg.imports` (see `draftsmith.imports`), analyse, write outputs and report.json (returned)."""
    from ..targets.checkpoint import resolve_target

    datasets = parse_datasets(cfg.datasets)
    thresholds = Thresholds(cfg.sample_tolerance, cfg.min_clean_rate, cfg.max_relative_error)
    specs = parse_imports(list(cfg.imports), [s.name for s in datasets])
    rec = load_reconstructor(str(resolve_target(cfg.target_model_path, log=log)), cfg.chat_template_file,
                             cfg.trust_remote_code)
    log(f"tokenizer: {type(rec.tokenizer).__name__} ({rec.encoder.kind}), vocabulary {rec.encoder.vocab_size:,}")
    parts, problems = {}, {}
    for spec in datasets:
        parts[spec.name], problems[spec.name] = [], []
        for unit, src in source_files(responses_file(run, spec.name), spec.name, specs):
            work = Work(run, f"{spec.name}.{unit}", _fingerprint(src, rec, thresholds))
            rows_, probs = rebuild_source(rec, run, spec.name, unit, src, work, thresholds, batch_size)
            parts[spec.name].append((rows_, work))
            problems[spec.name] += probs
    per_ds = {name: [r for rows_, _ in ps for r in rows_] for name, ps in parts.items()}
    rows = [r for name in per_ds for r in per_ds[name]]
    mark_duplicates(rows)
    drop_answered_elsewhere(rows)
    providers = analyse(rows, thresholds)
    bad = {p for p, s in providers.items() if s["flagged"]}
    for r in rows:
        r["excluded"] = (r["excluded"] or "no_output" in r["checks"]["issues"]
                         or (cfg.exclude_flagged and (r["flagged"] or r["provider"] in bad)))
    outputs = {name: write_dataset(run, name, parts[name]) for name in parts}
    report = {
        "format": f"draftsmith-tokens/{FORMAT_VERSION}",
        "target": {"tokenizer": rec.source, "chat_template": rec.template_origin,
                   "tokenizer_kind": rec.encoder.kind, "tokenizer_class": type(rec.tokenizer).__name__,
                   "vocab_size": rec.encoder.vocab_size, "tool_call_tokens": rec.tool_tokens,
                   "tool_call_opening": rec.tool_open,
                   "think_end": rec.layout.think_end, "think_end_ids": rec.think_end_ids,
                   "end_of_turn": rec.layout.end_of_turn, "end_of_turn_ids": rec.end_of_turn_ids},
        "thresholds": asdict(thresholds),
        "exclude_flagged": cfg.exclude_flagged,
        "totals": totals(rows),
        "totals_unflagged_providers": totals([r for r in rows if r["provider"] not in bad]),
        "totals_kept": totals([r for r in rows if not r["excluded"]]),   # what stage 04 reads (the run summary)
        "datasets": {name: {**totals(per_ds[name]), "output": str(outputs[name]),
                            "malformed_lines": len(problems[name]), "problems": problems[name][:20]}
                     for name in per_ds},
        "sources": source_report(rows),
        "providers": providers,
        "flagged_providers": {p: {"cause": providers[p]["cause"], "reasons": providers[p]["reasons"]} for p in sorted(bad)},
    }
    write_report(run, report)
    for ps in parts.values():
        for _, w in ps:
            w.remove()
    return report


# ---- reading the answers of one source ----

def read_responses(run: Run, dataset: str, unit: str, path: Path):
    """(line number, Response or BadLine) per line of one source of `dataset`. Stage 02's responses
    (`unit` "generate") come through stage 02's own reader: a torn last line (a run still writing,
    or killed) is left out, a line that is not JSON is an error naming file:line. An import file
    (`path`) is the user's: every line that cannot be used, torn last line included, is reported."""
    if unit == "generate":
        for lineno, row in generate_outputs.read_responses(run, dataset):
            yield lineno, _parse(row, None)
        return
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if not raw.endswith(b"\n"):
                yield lineno, BadLine("torn last line (no newline)")
                return
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield lineno, BadLine(f"not valid JSON: {e}")
                continue
            yield lineno, _parse(row, dataset)


def _parse(row, import_of: str | None) -> Response | BadLine:
    try:
        if import_of is not None:
            row = to_raw(row, import_of)
        return Response.parse(row, imported=import_of is not None)
    except BadLine as e:
        return e
    except ValueError as e:  # the import shape
        return BadLine(str(e))
