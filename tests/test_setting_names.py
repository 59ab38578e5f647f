"""A setting keeps its notebook name inside its package: a module that hands a setting (a variable
named as a notebook declares it) to a function of another module of the same package passes it
under that name, by keyword or into a parameter of that name. So `grep draft_tokens` follows the
setting from notebook 06 down to where it is used. Shared rooms called by several stages
(distributed.torchrun, openrouter.client, the readers of another stage's files) take general names,
and the emulator is a stand-in server with OpenRouter's names: calls across packages are not
counted, nor calls inside one module (an algorithm's own `k`)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil

import draftsmith
from draftsmith import parameters

import pytest

pytestmark = pytest.mark.unit


def _package(module_name: str) -> str:
    parts = module_name.split(".")
    return ".".join(parts[:2])


def relays(module, settings: set[str]) -> list[str]:
    """`module:line: setting -> function(parameter=)` for each setting handed on under another name."""
    def callee(node):
        if isinstance(node, ast.Name):
            return getattr(module, node.id, None)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return getattr(getattr(module, node.value.id, None), node.attr, None)
        return None

    found = []
    for call in (n for n in ast.walk(ast.parse(inspect.getsource(module))) if isinstance(n, ast.Call)):
        f = callee(call.func)
        home = getattr(f, "__module__", None) or ""
        if not callable(f) or home == module.__name__ or _package(home) != _package(module.__name__):
            continue
        try:
            params = list(inspect.signature(f).parameters)
        except (TypeError, ValueError):
            continue
        passed = [(params[i] if i < len(params) else "*args", a) for i, a in enumerate(call.args)]
        passed += [(kw.arg, kw.value) for kw in call.keywords if kw.arg]
        found += [f"{module.__name__}:{call.lineno}: {value.id} -> {f.__name__}({name}=)" for name, value in passed
                  if isinstance(value, ast.Name) and value.id in settings and name != value.id]
    return found


def _modules():
    for m in pkgutil.walk_packages(draftsmith.__path__, "draftsmith."):
        if m.name.endswith("__main__") or m.name.startswith("draftsmith.emulator"):
            continue
        yield importlib.import_module(m.name)


def test_every_package_hands_a_setting_on_under_its_notebook_name():
    settings = set(parameters.declared(parameters.discover()))
    modules = list(_modules())
    assert len(modules) > 60 and {"draft_tokens", "concurrency", "train_nproc"} <= settings
    assert [r for m in modules for r in relays(m, settings)] == []


def test_the_check_finds_a_setting_handed_on_under_another_name(tmp_path, monkeypatch):
    """The check can fail: a module of stage 06 that hands `draft_tokens` on as `k` is caught; a
    call into another package (a shared room) is not counted."""
    package = tmp_path / "draftsmith" / "evaluate"
    package.mkdir(parents=True)
    (package / "relay_probe.py").write_text(
        "from draftsmith.evaluate import benchmarks, metrics\n"
        "from draftsmith.distributed import torchrun\n\n\n"
        "def f(rows, methods, draft_tokens, eval_temperatures, eval_tensor_parallel, train_nproc):\n"
        "    benchmarks.serving_commands('e', 't', 'b', draft_tokens=draft_tokens, eval_tensor_parallel=2,\n"
        "                                trust_remote_code=False)\n"
        "    metrics.acceptance(rows, draft_tokens)\n"
        "    torchrun(train_nproc, 'm', [])\n"
        "    return metrics.engine_report(rows, methods, None, draft_tokens, eval_temperatures, 'float32',\n"
        "                                 tp=eval_tensor_parallel)\n")
    monkeypatch.setattr(draftsmith.evaluate, "__path__", [*draftsmith.evaluate.__path__, str(package)])
    probe = importlib.import_module("draftsmith.evaluate.relay_probe")
    try:
        found = relays(probe, set(parameters.declared(parameters.discover())))
        assert sorted(r.split(": ", 1)[1] for r in found) == \
            ["draft_tokens -> acceptance(k=)", "eval_tensor_parallel -> engine_report(tp=)"]
    finally:
        import sys
        sys.modules.pop("draftsmith.evaluate.relay_probe", None)
