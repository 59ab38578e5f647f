"""The settings that shape a dataset's answers, remembered per dataset in the run's manifest.

Model, max_tokens, temperature, top_p, reasoning, the provider routing (the `provider` parameter
over stage 01's routing, or the precision policy stage 02 applies without it) and the target's chat
template decide what an answer is. A re-run of stage 02 under other ones would append answers of
another kind to the same datasets, and stage 03 and training would take them as one: so it is
refused, naming each difference ("max_tokens: 48 -> 16"), unless the user gives a new run_name or
says to continue (`allow_changed_settings`; the session then records what changed). Two datasets
of one run may hold answers of different settings (a user's own engine for one, OpenRouter for
another); it is one dataset that must not mix them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from . import outputs
from ..paths import Run

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


def check(run: Run, datasets: list[str], new: dict, allow_changed_settings: bool) -> list[str]:
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
