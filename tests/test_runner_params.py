"""Params files: one default per setting (the notebook's), a params file holds only overrides, and
the demo still runs on exactly the values it ran on before the files were trimmed."""

import dataclasses
import re

import pytest
import yaml

from draftsmith import cli, config, parameters
from draftsmith.paths import REPO_ROOT

pytestmark = pytest.mark.unit

PARAMS = sorted((REPO_ROOT / "params").glob("*.yaml"))

# What every stage of `make demo` ran on at commit 0fec386, when params/demo.yaml restated 76 keys:
# that file over the notebooks' defaults, written down once by hand. The demo's figures depend on them.
# Changed on purpose since, for the demo's time (docs/demo-time.md): the emulator's model backend on
# both cores (threads 2) and 32 new tokens per held-out prompt in stage 06 (was 40); stage 03
# leaves flagged data out (exclude_flagged true, was false), as the real job does; and so that most of
# the data is still kept, the 4 quirky providers serve 4 requests at a time (emulator capacities).
DEMO_0FEC386 = {
    "run_name": "demo", "outputs_dir": "outputs", "api_base": "local", "api_key_file": None,
    "model": "moonshotai/kimi-k2.5", "native_precision": "int4", "target_model_path": "tiny",
    "trust_remote_code": False,
    "emulator": {"time_scale": 0.05, "hang_s": 5.0, "credits": 10.0, "threads": 2, "capacities": {
        "parasail/int4": 4, "novita/int4": 4, "together/int4": 4, "siliconflow/int4": 4}},
    "datasets": [{"name": "code", "path": "data/demo/code.jsonl", "output_token_budget": 8000},
                 {"name": "chat", "path": "data/demo/chat.jsonl", "output_token_budget": 20000}],
    "imports": [], "concurrency": 64, "max_tokens": 192, "temperature": 1.0, "top_p": 1.0, "seed": 0,
    "provider": {}, "reasoning": {}, "spend_limit_usd": 1.0,
    # stage 01
    "allow_unknown_quantization": False, "expected_output_tokens": 0, "pilot_samples": 4, "probe_prompts": 4,
    "probe_max_tokens": 32, "probe_min_agreement": 0.5, "probe_reference": "", "exclude_probe_outliers": True,
    "refresh_providers": False,
    # stage 02
    "stream": False, "max_attempts": 6, "request_timeout_s": 60.0, "balance_floor_usd": 0.0, "stop_grace_s": 30.0,
    # stage 03
    "chat_template_file": None, "sample_tolerance": 0.01, "min_clean_rate": 0.95, "max_relative_error": 0.005,
    "exclude_flagged": True,
    # stage 04
    "hidden_dtype": "bf16", "layer_ids": [], "layer_convention": "output", "max_tokens_per_batch": 8192,
    "shard_mb": 8.0, "nproc_per_node": 1, "device": "auto", "target_backend": "vllm", "tensor_parallel_size": 1,
    "gpu_memory_utilization": None, "max_num_batched_tokens": None, "verify_with_hf": True,
    # stage 05
    "draft_vocab_size": 2048, "ttt_steps": 7, "train_epochs": 2.0, "train_batch_size": 8,
    "train_micro_batch_size": 8, "train_max_len": 1024, "train_lr": 0.01, "train_warmup_fraction": 0.015,
    "train_grad_clip": 0.5, "train_weight_decay": 0.0, "train_holdout_fraction": 0.05, "train_eval_every": 20,
    "train_checkpoint_every": 50, "train_nproc": 1, "train_fsdp": False, "train_resume": True,
    "export_fractions": [0.25, 0.5, 1.0], "export_engine": "sglang", "export_dtype": "bfloat16",
    # stage 06
    "drafter_dir": "", "eval_prompts_per_dataset": 4, "eval_max_new_tokens": 32, "draft_tokens": 3,
    "eval_temperatures": [0.0, 1.0], "lookup_max_ngram": 3, "lookup_min_ngram": 1, "draft_cost_ratio": 0.05,
    "eval_backend": "vllm", "eval_hf_crosscheck": True, "eval_engine_dtype": "float32", "eval_tensor_parallel": 1,
}


def test_params_files_hold_only_overrides_of_what_the_notebooks_declare():
    known = parameters.declared(parameters.discover())
    for f in PARAMS:
        for key, value in yaml.safe_load(f.read_text()).items():
            assert key in known, f"{f.name}: {key!r} is declared by no notebook"
            assert value != known[key].default, \
                f"{f.name}: {key}: {value!r} is already the default of {known[key].notebook}: leave it out"


def test_every_stage_of_the_demo_runs_on_the_values_it_ran_on_before_the_trim():
    stages = parameters.discover()
    values = parameters.effective_params(stages, str(REPO_ROOT / "params" / "demo.yaml"), [], REPO_ROOT)
    before = parameters.absolutize(DEMO_0FEC386, REPO_ROOT)
    for stage in stages:
        given = {k: values[k] for k in stage.params if k in before}
        assert given == {k: before[k] for k in given}, stage.title
    for key in ("emulator", "datasets", "max_tokens", "request_timeout_s", "shard_mb", "draft_vocab_size",
                "train_batch_size", "eval_temperatures", "target_backend", "eval_backend"):
        assert any(key in s.params for s in stages), f"{key} is declared by no notebook any more"


def test_check_prints_every_value_a_stage_uses_and_where_it_comes_from(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    demo = str(REPO_ROOT / "params" / "demo.yaml")
    assert cli.main(["run", "04", "-f", demo, "--check", "-p", "outputs_dir", "out"]) == 0
    out = capsys.readouterr().out
    lines = {line.split("=")[0].strip(): line for line in out.splitlines() if " = " in line}
    assert set(lines) == set(parameters.select(parameters.discover(), "04")[0].params)
    assert lines["shard_mb"].split("#")[1].strip() == demo and "8.0" in lines["shard_mb"]
    assert lines["hidden_dtype"].endswith("# default of 04_hidden_states.ipynb") and "'bf16'" in lines["hidden_dtype"]
    assert lines["outputs_dir"] == f"    outputs_dir = {str(tmp_path / 'out')!r}  # -p outputs_dir"  # made absolute
    assert "parameters of 04_hidden_states: ok" in out


def test_a_setting_several_notebooks_declare_has_one_default():
    defaults: dict[str, dict[str, str]] = {}
    for stage in parameters.discover():
        for name, p in stage.params.items():
            defaults.setdefault(name, {})[stage.path.stem] = repr(p.default)
    two = {name: by for name, by in defaults.items() if len(set(by.values())) > 1}
    assert not two, f"declared with different defaults: {two}"


def test_a_bound_is_declared_once_on_its_field_and_preflight_names_the_params_file(tmp_path, capsys):
    p = parameters.declaration("top_p")
    assert str(p.bound) == "in (0, 1]" and p.bound.written == "(0, 1]" and p.help == "nucleus sampling (pilot)"
    assert cli.main(["run", "02", "-f", str(PARAMS[0]), "--check", "-p", "top_p", "1.5"]) == 2
    assert "-p top_p: top_p must be in (0, 1] (nucleus sampling), got 1.5" in capsys.readouterr().err
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"run_name": "b", "outputs_dir": str(tmp_path / "out"), "train_holdout_fraction": 1}))
    assert cli.main(["run", "05", "-f", str(f), "--check"]) == 2
    assert f"{f}: train_holdout_fraction must be in [0, 1) (" in capsys.readouterr().err


def _bounded():
    """(config, setting, its bound) for every bounded setting of every stage config."""
    return [pytest.param(cls, f.name, config.Bound.of(f.metadata["bound"]), id=f"{cls.__name__}.{f.name}")
            for _, cls in config.STAGES.values() for f in dataclasses.fields(cls) if f.metadata.get("bound")]


@pytest.mark.parametrize("cls, name, bound", _bounded())
def test_every_stage_config_refuses_a_value_just_outside_a_bound_naming_it_and_takes_the_bound(cls, name, bound):
    """Building a stage config (what preflight, a notebook and a direct call do) is where a bound is
    checked: just outside it is refused, naming the setting and the bound; the bound itself (or, where
    it is open, just inside it) is taken."""
    step = 1 if isinstance(getattr(cls(), name), int) else 1e-6
    edges = [(bound.low, bound.low_closed, -step)] + ([(bound.high, bound.high_closed, step)]
                                                      if bound.high != float("inf") else [])
    for edge, closed, out in edges:
        outside = edge + out if closed else edge
        with pytest.raises(config.BoundError, match=rf"^{name} must be {re.escape(str(bound))} \(.*\), got "):
            cls(**{name: type(getattr(cls(), name))(outside)})
        inside = edge if closed else edge - out
        assert getattr(cls(**{name: type(getattr(cls(), name))(inside)}), name) == inside


def test_a_config_whose_default_breaks_its_own_bound_or_bounds_a_string_is_refused_as_it_is_declared():
    with pytest.raises(config.BoundError, match=r"concurrency must be at least 1 \(help\), got 0"):
        @config.stage_settings
        class Zero:
            concurrency: int = config.setting(0, "help", ge=1)
    with pytest.raises(config.BoundError, match=r"model must be a number at least 1 \(help\), got 'm'"):
        @config.stage_settings
        class Named:
            model: str = config.setting("m", "help", ge=1)
