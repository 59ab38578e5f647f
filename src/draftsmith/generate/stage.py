"""Stage 02's entry: `run(run, cfg)` takes notebook 02's settings (`GenerateConfig`), opens the API (the local
emulator, or `api_base` with its key) and generates; `run_at` is the same against an API already
open at `base_url` (tests and benchmarks that start their own server). See the package's docstring.

It also keeps, per dataset in the run's manifest, the settings that shape its answers (`SHAPING`,
the precision policy, the target's chat template): a re-run under other ones would mix answers of
another kind into the same dataset, so it is refused naming each difference ("max_tokens: 48 ->
16") unless `allow_changed_settings` (`check_settings`). Two datasets of one run may differ."""


from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import signal
import threading
from pathlib import Path

from ..emulator import open_api
from ..openrouter import client
from . import outputs
from ..datasets import parse_datasets
from ..imports import answered, parse_imports
from ..config import GenerateConfig
from ..paths import Run, resolve
from ..providers import outputs as stage_01
from . import prompt_edits
from .session import GenerationResult, GenerationStopped, Session, Tuning

# the settings the manifest's `config` records beside the request, in its order
RECORDED = ("concurrency", "spend_limit_usd", "balance_floor_usd", "money_bound_stop_fraction", "max_attempts",
            "request_timeout_s", "request_deadline_s", "stop_grace_s", "outage_limit_s", "trust_remote_code")


def run(run: Run, cfg: GenerateConfig, *, log=print, **knobs) -> GenerationResult:
    """Stage 02 with notebook 02's settings: opens the API (the local emulator, or `api_base` with
    its key) and generates (`run_at`). Holds the run's writer lock from before the local emulator
    starts to the end."""
    with outputs.writer_lock(run), open_api(cfg.api_base, cfg.api_key_file, run, cfg.target_model_path,
                                            cfg.emulator, cfg.model) as (base_url, api_key):
        return run_at(base_url, api_key, run, cfg, log=log, **knobs)


def run_at(base_url: str, api_key, run: Run, cfg: GenerateConfig, *, log=print, **knobs) -> GenerationResult:
    """Generate responses for `cfg.datasets` into `run.dir("generate")`, resuming whatever is there.
    `knobs`: the fields of `session.Tuning` (balance_poll_s, backoff_base_s, ...), which no stage
    declares and tests and benchmarks turn. Without stage 01's routing, `native_precision` is required: the
    session then applies the precision policy itself. Prompts answered by an import file
    (`imports`, see imports.py) are not asked for: they are never paid for twice.

    One process writes a run at a time (outputs.writer_lock: a second one raises RunBusy naming the
    holder). A run that holds answers made under other settings is refused (SettingsChanged,
    naming each difference) unless `allow_changed_settings`. Saved answers are first compared with
    the prompt files as they are now (prompt_edits.py): answers to reworded prompts are set aside
    and the prompts asked again, answers to removed prompts are set aside unless
    `keep_removed_prompts`; nothing paid for is deleted. A write error at the store (a full disk)
    ends the session and raises GenerationStopped with what was paid for and not saved.

    Runs its own event loop (in a thread when one is already running, as in Jupyter). SIGINT and
    SIGTERM stop it cleanly; a second SIGINT gives up on the requests in flight at once."""
    _check_types(cfg)
    tuning = Tuning(**knobs)
    datasets = [{**d, "path": str(resolve(d["path"]))} if isinstance(d, dict) and isinstance(d.get("path"), str)
                else d for d in cfg.datasets]
    specs = parse_datasets(datasets)
    for spec in specs:
        if not Path(spec.path).is_file():
            raise FileNotFoundError(f"datasets: file of dataset {spec.name!r} not found: {spec.path}")
    # stage 01's routing with the `provider` setting laid over it; without it, the session applies
    # the same precision policy over the live endpoint list (`Session._apply_policy`)
    base_routing = stage_01.read_routing(run)
    policy = None
    if base_routing is None:
        if not cfg.native_precision:
            raise ValueError(f"no {stage_01.routing_file(run)} (stage 01 has not run for run "
                             f"{run.name!r}) and no native_precision: run stage 01 first, or set native_precision so "
                             f"that stage 02 applies the precision policy itself")
        policy = (cfg.native_precision, cfg.allow_unknown_quantization)
    settings = client.request_settings(cfg.model, cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.seed,
                                       {**(base_routing or {}), **(cfg.provider or {})}, cfg.reasoning, cfg.stream)
    config = {"base_url": base_url, "key_source": api_key.source, "datasets": datasets, "request": settings,
              "routing_source": str(stage_01.routing_file(run).relative_to(run.root)) if base_routing is not None
              else None,
              **{k: getattr(cfg, k) for k in RECORDED}, **vars(tuning)}
    import_specs = parse_imports(cfg.imports or [], [s.name for s in specs])
    shaping = data_settings(settings, policy, cfg.target_model_path)
    with outputs.writer_lock(run):
        diff = check_settings(run, [s.name for s in specs], shaping, cfg.allow_changed_settings)
        edits = prompt_edits.apply(run, specs, cfg.keep_removed_prompts)
        for e in edits:
            log(e.summary())
        session = Session(base_url, api_key, run, specs, settings, cfg, tuning, config, log, policy)
        if edits:
            session.entry["prompt_edits"] = prompt_edits.as_record(edits)
        session.manifest.settings = {**(session.manifest.settings or {}), **{s.name: shaping for s in specs}}
        if diff:
            session.entry["settings_changed"] = diff
            log(f"continuing run {run.name!r} with changed settings (allow_changed_settings): {'; '.join(diff)}")
        for d in session.datasets:
            d.answered = answered(import_specs, d.name)
            if d.answered:
                log(f"{d.name}: prompts that an import file answers are skipped (stage 03 reads that file)")
        _run_with_signals(session)
    result = session.result()
    noted = [e for e in edits if e.reworded or e.removed or e.set_aside]
    if noted:
        said = "; ".join(f"{e.dataset}: {e.reworded} reworded (asked again), {e.removed} removed ("
                         + ("passed on: keep_removed_prompts" if e.kept_removed else "not passed on")
                         + f"), {e.set_aside} answers set aside in {outputs.SUPERSEDED} (paid for, kept, not passed on)"
                         for e in noted)
        result = dataclasses.replace(result, message=f"{result.message} Against the prompt files: {said}.")
    if result.reason in ("write_error", "no_room"):     # the disk cannot take more: the notebook stops here
        raise GenerationStopped(result.message)
    return result


# ---- the settings that shape a dataset's answers ----
SHAPING = ("model", "max_tokens", "temperature", "top_p", "reasoning", "provider")


class SettingsChanged(ValueError):
    """A re-run asked for answers of another kind than the run holds."""


def data_settings(settings: dict, policy: tuple[str, bool] | None, target_model_path: str | None) -> dict:
    """What shapes this session's answers: the request settings of SHAPING, the precision policy
    (None when stage 01's routing is used) and an id of the target's chat template."""
    out = {k: settings.get(k) for k in SHAPING}
    out["reasoning"], out["provider"] = out["reasoning"] or {}, out["provider"] or {}
    out["precision_policy"] = (None if policy is None else
                               {"native_precision": policy[0], "allow_unknown_quantization": policy[1]})
    out["chat_template"] = chat_template_id(target_model_path)
    return out


def chat_template_id(target_model_path: str | None) -> str | None:
    """A checkpoint folder's `chat_template.jinja` as a short hash (the same template under another
    path is the same id); a built-in target's name, which fixes its template; None when there is
    no such file to read (then it is not compared)."""
    if not target_model_path:
        return None
    folder = Path(str(target_model_path)).expanduser()
    if not folder.is_dir():
        return str(target_model_path)
    template = folder / "chat_template.jinja"
    if not template.is_file():
        return None
    return "sha256:" + hashlib.sha256(template.read_bytes()).hexdigest()[:16]


def check_settings(run: Run, datasets: list[str], new: dict, allow_changed_settings: bool) -> list[str]:
    """How `new` differs, per dataset of `datasets` that holds saved answers, from what they were
    made under (the datasets named); raises SettingsChanged naming the differences, unless `allow_changed_settings`.
    Datasets of one run may differ from each other (answers from two sources, say)."""
    manifest = outputs.read_manifest(run)
    by_diff: dict[tuple, list[str]] = {}
    for name in datasets:
        old = remembered(manifest, name)
        path = outputs.responses_file(run, name)
        if old and path.exists() and path.stat().st_size:
            diff = tuple(changes(old, new))
            if diff:
                by_diff.setdefault(diff, []).append(name)
    said = [f"{'; '.join(diff)} (dataset{'s' * (len(names) > 1)} {', '.join(names)})" for diff, names in by_diff.items()]
    if said and not allow_changed_settings:
        raise refusal(run.name, said)
    return said


def remembered(manifest: dict, dataset: str) -> dict | None:
    """The settings the saved answers of `dataset` were made under: the manifest's `settings`, or
    for a run written before they were kept, the request settings of its config."""
    if (manifest.get("settings") or {}).get(dataset):
        return manifest["settings"][dataset]
    request = (manifest.get("config") or {}).get("request")
    if not request:
        return None
    # its provider may be the one the precision policy made of the endpoints: not comparable
    return {k: (request.get(k) or {}) if k == "reasoning" else request.get(k) for k in SHAPING if k != "provider"}


def changes(old: dict, new: dict) -> list[str]:
    """Each setting that differs, as "name: old -> new"; a chat template that one side could not
    read is not compared."""
    out = []
    for k, v in new.items():
        if k not in old or old[k] == v or (k == "chat_template" and None in (old[k], v)):
            continue
        out.append(f"{k}: {_show(old[k])} -> {_show(v)}")
    return out


def refusal(run_name: str, diff: list[str]) -> SettingsChanged:
    return SettingsChanged(
        f"run {run_name!r} holds answers made with other settings ({'; '.join(diff)}): new answers would be "
        f"mixed with them in the same datasets. Give a new run_name for the new settings, or set "
        f"allow_changed_settings: true to continue this run with them")


def _show(v) -> str:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) or v is None else str(v)


def _check_types(cfg: GenerateConfig) -> None:
    """What the bounds do not say: counts are ints, a request deadline is seconds > 0 or None."""
    for name in ("concurrency", "max_attempts"):
        if not isinstance(getattr(cfg, name), int):
            raise ValueError(f"{name} must be an int, got {getattr(cfg, name)!r}")
    d = cfg.request_deadline_s
    if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not d > 0):
        raise ValueError(f"request_deadline_s must be a number of seconds > 0, or None (derived from max_tokens), "
                         f"got {d!r}")


def _run_with_signals(session: Session) -> None:
    """Run the session's event loop; SIGINT/SIGTERM ask it to stop (a second one: at once)."""
    state = {"loop": None, "signals": 0}

    def stop(loop) -> None:
        if state["signals"] == 1:
            loop.call_soon_threadsafe(session.request_stop, "interrupted", f"{state['name']} received")
        else:
            loop.call_soon_threadsafe(session.cancel_all)

    def on_signal(signum, frame=None) -> None:
        state["signals"] += 1
        state["name"] = signal.Signals(signum).name
        if state["loop"] is not None:
            stop(state["loop"])

    async def body() -> None:
        state["loop"] = asyncio.get_running_loop()
        if state["signals"]:            # a signal came before the loop did
            stop(state["loop"])
        await session.main()

    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, on_signal)
    try:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(body())         # a script, or papermill's kernel cell without a loop
            return
        # Jupyter already runs a loop in this thread: run ours in another, wait here (signals land here).
        errors: list[BaseException] = []

        def target() -> None:
            try:
                asyncio.run(body())
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)

        th = threading.Thread(target=target, name="draftsmith-generate", daemon=True)
        th.start()
        while th.is_alive():
            th.join(0.2)
        if errors:
            raise errors[0]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
