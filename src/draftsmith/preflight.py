"""Checks of a run's parameter values and inputs, made before any stage starts or pays.

The runner already checks names and types; this checks what a type cannot say: the bounds of counts
and limits (building each chosen stage's config, which checks them), run and dataset names that are safe as folder names, prompt files that exist
and hold at least one usable prompt, import files that exist and hold at least one usable answer,
the API key each api_base needs (a key file given with `api_base: local` is read too), a target
that exists and whose tokenizer loads (one shipped as code only with trust_remote_code), an
outputs folder that can be written, and (for stages 05 and 06 run without 04) stage 04's shards
whole on disk. Only the parameters the selected stages
declare are checked, and each problem is one line naming where the value came from (the params
file, `-p KEY`, or a stage's default). `prepare` gives a run its values with every check made;
`warnings` names what is allowed but likely a mistake.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .openrouter.apikey import api_key_for, read_api_key
from .datasets import DatasetReader, parse_datasets, stable_id
from .imports import ImportSpec, answered, parse_imports, to_raw
from . import config, parameters
from .paths import Run, check_name
from .distributed import rendezvous_args
from .generate import prompt_edits


def prepare(stages_all: list[parameters.Stage], chosen: list[parameters.Stage], file: str | None,
            overrides: list[tuple[str, str]], base: Path | None = None,
            sources: dict[str, str] | None = None) -> dict:
    """`parameters.effective_params`, then every value check of the chosen stages and a writable run
    folder: one ParamError listing every problem, before anything starts or pays. `sources`, when
    given, maps each key to where its value came from."""
    sources = {} if sources is None else sources
    values = parameters.effective_params(stages_all, file, overrides, base, sources)
    problems = check(chosen, values, sources)
    if not problems:
        problem = check_outputs(values, sources.get("outputs_dir", "outputs_dir"))
        problems = [problem] if problem else []
    if not problems:
        problem = check_shards(chosen, values, repair_command(file, overrides))
        problems = [problem] if problem else []
    if problems:
        raise parameters.ParamError("\n  ".join([f"{len(problems)} problem(s), nothing was run:"] + problems))
    return values


def check(stages, values: dict, sources: dict[str, str]) -> list[str]:
    """Every problem of the selected stages' parameters, one line each (empty: all good)."""
    declared = {name for s in stages for name in s.params}
    where = lambda k: sources.get(k, "default")  # noqa: E731
    problems = [f"{where(name)}: {problem}" for name, problem in bound_problems(stages, values).items()]
    problems += _names(values, "datasets" in declared, where)
    if "nnodes" in declared and isinstance(values.get("nnodes"), int) and values["nnodes"] > 1:
        try:
            rendezvous_args(values["nnodes"], str(values.get("rdzv_endpoint") or ""), "check")
        except ValueError as e:
            problems.append(f"{where('rdzv_endpoint')}: {e}")
    if "target_model_path" in declared:
        problems += _target(values["target_model_path"], where("target_model_path"))
    if {"target_model_path", "trust_remote_code"} <= declared:
        problems += _tokenizer(values["target_model_path"], bool(values.get("trust_remote_code")), where)
    if any("api_base" in s.params for s in stages):  # the stages that send prompts
        problems += _datasets(values.get("datasets") or [], where("datasets"))
        problems += _api_key(values, where)
    if "imports" in declared:
        problems += _imports(values.get("imports") or [], values.get("datasets") or [], where("imports"))
    return problems


def bound_problems(stages, values: dict) -> dict[str, str]:
    """{setting: its line} for each value outside its bound: the stages' configs built from `values`
    say them (`config.stage_settings`), a setting several stages take named once."""
    out: dict[str, str] = {}
    for s in stages:
        try:
            s.config(**{name: values[name] for name in s.params if name in values})
        except config.BoundError as e:
            for name, line in e.problems.items():
                out.setdefault(name, line)
    return out


def warnings(stages, values: dict, sources: dict[str, str]) -> list[str]:
    """What is allowed but likely a mistake, one line each: two datasets of the stages that send
    prompts reading one file (each of its prompts is asked, and paid for, once per dataset)."""
    if not any("api_base" in s.params for s in stages):
        return []
    by_file: dict[Path, list[str]] = {}
    for spec in parse_datasets(values.get("datasets") or []):
        by_file.setdefault(Path(spec.path).resolve(), []).append(spec.name)
    return [f"{sources.get('datasets', 'default')}: datasets {names} read the same file {path}: each of its prompts "
            f"is asked, and paid for, once per dataset" for path, names in by_file.items() if len(names) > 1]


def dataset_summaries(values: dict) -> list[str]:
    """One line per prompt file: prompts found and rows skipped (with file:line), as a full read,
    and those an import answers (stage 02 never asks them); then which datasets stage 02 samples."""
    specs = parse_datasets(values.get("datasets") or [])
    imports = parse_imports(values.get("imports") or [], [s.name for s in specs])
    out, sample, imported = [], [], []
    for spec in specs:
        reader = DatasetReader(spec)
        done = answered(imports, spec.name)
        n = sum(1 for p in reader if done and (p.sample_id in done or stable_id(p.messages) in done))
        line = reader.summary()
        if n:
            line += f"; {'all' if n == reader.count else n} answered by imports, not asked"
        out.append(line)
        (imported if n and n == reader.count else sample).append(spec.name)
    out.append(f"{len(sample)} datasets to sample through the API: {', '.join(sample) or 'none'}; "
               f"{len(imported)} imported: {', '.join(imported) or 'none'}")
    try:    # a re-run: the prompt files as they are now against the answers saved (generate/prompt_edits.py)
        out += [e.summary() for e in prompt_edits.preview(Run(values["outputs_dir"], values["run_name"]), specs,
                                                         bool(values.get("keep_removed_prompts")))]
    except ValueError as e:
        out.append(f"saved answers not compared with the prompt files: {e}")
    return out


def check_shards(stages, values: dict, repair: str) -> str | None:
    """When the stages read stage 04's features (05, 06) and stage 04 is not among them, every shard
    hidden/index.json lists must be there and whole (`hidden.outputs.broken_shards`: sizes and
    headers, no tensor read). The problem, naming the shards and `repair`, or None."""
    numbers = {s.number for s in stages}
    if "04" in numbers or not numbers & {"05", "06"}:
        return None
    from .hidden import outputs as hidden_outputs

    folder = Run(values["outputs_dir"], values["run_name"]).root / "hidden"
    broken = hidden_outputs.broken_shards(folder)
    return hidden_outputs.broken_shards_message(folder, broken, repair) if broken else None


def repair_command(file: str | None, overrides: list[tuple[str, str]]) -> str:
    """`draftsmith run 04` with the same params file and -p overrides as this command."""
    import shlex

    return " ".join(["draftsmith run 04", f"-f {shlex.quote(file)}" if file else "--defaults"]
                    + [f"-p {shlex.quote(k)} {shlex.quote(str(v))}" for k, v in overrides])


def check_outputs(values: dict, source: str) -> str | None:
    """Can the run folder be created and written (run_name already checked)? The problem, or None."""
    try:
        root = Run(values["outputs_dir"], values["run_name"]).root
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return f"{source}: outputs_dir {values['outputs_dir']!r} cannot be written: {e.strerror or e}"
    return None


def _names(values: dict, datasets: bool, where) -> list[str]:
    """The run name, and the dataset names when the stages use datasets, name folders and files."""
    named = [("run_name", values.get("run_name"), where("run_name"))]
    if datasets:
        named += [(f"datasets[{i}] name", d.get("name"), where("datasets"))
                  for i, d in enumerate(values.get("datasets") or [])]
    problems = []
    for field, name, source in named:
        try:
            check_name(field, name)
        except ValueError as e:
            problems.append(f"{source}: {e}")
    return problems


def _api_key(values: dict, where) -> list[str]:
    """The key the stages will read (openrouter/apikey.py). With `api_base: local` a key file, when given, is
    read as emulator.open_api reads it; without one the emulator gets a throwaway key."""
    base, key_file = str(values.get("api_base")), values.get("api_key_file")
    try:
        if base != "local":
            api_key_for(base, key_file)
        elif key_file:
            read_api_key(key_file)
    except (OSError, ValueError, RuntimeError) as e:
        return [f"{where('api_key_file' if key_file else 'api_base')}: api_base is {base!r}: {e}"]
    return []


def _imports(imports: list, datasets: list, where: str) -> list[str]:
    """Each import file exists, names a dataset (imports.parse_imports) and holds an answer
    stage 03 can use (imports.to_raw), read up to the first one."""
    try:
        specs = parse_imports(imports, [d["name"] for d in datasets])
    except (OSError, ValueError) as e:
        return [f"{where}: {e}"]
    return [f"{where}: {p}" for p in map(_no_answer, specs) if p]


def _no_answer(spec: ImportSpec) -> str | None:
    skipped = []
    with open(spec.path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                to_raw(json.loads(raw), spec.name)
                return None
            except ValueError as e:  # bad JSON and bytes that are not UTF-8 are ValueErrors too
                skipped.append(f"{spec.path}:{lineno}: {e}")
    why = (f"; skipped: {skipped[0]}" + (f" (+{len(skipped) - 1} more)" if len(skipped) > 1 else "")
           if skipped else " (the file is empty)")
    return f"imports[{spec.index}] {spec.name!r}: no usable answer in {spec.path}{why}"


def _target(path: str, where: str) -> list[str]:
    from .targets.checkpoint import checkpoint_problem

    problem = checkpoint_problem(path)
    return [f"{where}: {problem}"] if problem else []


def _tokenizer(path: str, trust_remote_code: bool, where) -> list[str]:
    """A checkpoint folder's tokenizer loads as the stages will load it: one shipped as code is
    refused without trust_remote_code (naming the field), and an error in that code (an import
    that moved, ...) shows now, before anything runs or pays. Built-in targets are left to their build."""
    import sys

    from .targets.checkpoint import BUILT_IN_TARGETS, checkpoint_problem, load_tokenizer, remote_code_refusal, \
        tokenizer_code

    if str(path) in BUILT_IN_TARGETS:  # known without building: the Kimi-shaped ones ship tokenizer code
        from .targets import kimi_mini
        from .targets.kimi_mini import tokenizer_config

        if str(path) in kimi_mini.VARIANTS and not trust_remote_code:
            code = tokenizer_config()["auto_map"]["AutoTokenizer"][0]
            return [f"{where('trust_remote_code')}: {remote_code_refusal(path, code)}"]
        return []
    if checkpoint_problem(path):
        return []
    folder = Path(str(path)).expanduser()
    try:
        code = tokenizer_code(folder)
        if code and not trust_remote_code:
            return [f"{where('trust_remote_code')}: {remote_code_refusal(folder, code)}"]
        load_tokenizer(folder, trust_remote_code, log=lambda m: print(f"draftsmith: {m}", file=sys.stderr))
    except Exception as e:  # the checkpoint's own code may raise anything
        return [f"{where('target_model_path')}: target_model_path {str(path)!r}: its tokenizer does not load: "
                f"{type(e).__name__}: {e}"]
    return []


def _datasets(datasets: list, where: str) -> list[str]:
    if not datasets:
        return [f"{where}: datasets is empty: give at least one {{name, path}}"]
    problems = []
    for i, spec in enumerate(parse_datasets(datasets)):
        if not Path(spec.path).is_file():
            problems.append(f"{where}: datasets[{i}] {spec.name!r}: file not found: {spec.path}")
            continue
        reader = DatasetReader(spec)
        rows = iter(reader)
        first = next(rows, None)  # reads up to the first usable prompt only
        rows.close()
        if first is None:
            why = f"; skipped: {reader.problems[0]}" + (f" (+{len(reader.problems) - 1} more)"
                                                       if len(reader.problems) > 1 else "") if reader.problems else ""
            problems.append(f"{where}: datasets[{i}] {spec.name!r}: no usable prompt in {spec.path}"
                            f"{' (the file is empty)' if not reader.problems else ''}{why}")
    return problems
