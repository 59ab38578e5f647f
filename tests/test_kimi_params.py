"""params/kimi-k2.5.yaml as its user runs it: B3-B8 sampled through OpenRouter at 10M tokens each,
B1-B2 imported from the earlier SGLang run. `--check` (the user's first command) says so, and
stage 01's cost plan prices only what stage 02 will request."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import yaml

from draftsmith import cli
from draftsmith.datasets import parse_datasets
from draftsmith.providers import stage as stage_01

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PARAMS = REPO / "params" / "kimi-k2.5.yaml"


def filled_in(tmp_path: Path, api_key_file: Path) -> Path:
    """The params file with its paths filled in: small prompt files for B3-B8, import files (the
    SGLang run's answers, with output_ids) for B1-B2."""
    params = yaml.safe_load(PARAMS.read_text())
    for d in params["datasets"]:
        path = tmp_path / Path(d["path"]).name
        with open(path, "w") as f:
            for i in range(5):
                row = {"id": f"{d['name']}-{i}", "messages": [{"role": "user", "content": f"{d['name']} q{i}"}]}
                if "output_token_budget" not in d:     # an imported dataset: its answers too
                    row |= {"reasoning": "r", "answer": "a", "output_ids": [1, 2, 3], "source": "sglang-h100"}
                f.write(json.dumps(row) + "\n")
        d["path"] = str(path)
    for i in params["imports"]:
        i["path"] = str(tmp_path / Path(i["path"]).name)
    params |= {"api_key_file": str(api_key_file), "outputs_dir": str(tmp_path / "out")}
    out = tmp_path / "kimi.yaml"
    out.write_text(yaml.safe_dump(params, sort_keys=False))
    return out


def test_the_real_job_samples_b3_to_b8_at_10m_each_and_imports_b1_b2():
    params = yaml.safe_load(PARAMS.read_text())
    budgets = {d["name"]: d.get("output_token_budget") for d in params["datasets"]}
    assert budgets == {**{f"B{i}": 10_000_000 for i in range(3, 9)}, "B1": None, "B2": None}
    assert [i["name"] for i in params["imports"]] == ["B1", "B2"]
    paths = {d["name"]: d["path"] for d in params["datasets"]}
    assert all(paths[i["name"]] == i["path"] for i in params["imports"])   # the import file is the prompt file


def test_check_of_stage_01_shows_six_datasets_to_sample_and_two_imported(tmp_path, api_key_file, capsys):
    path = filled_in(tmp_path, api_key_file[0])
    assert cli.main(["run", "01", "-f", str(path), "-p", "target_model_path", "tiny-test", "--check"]) == 0
    out = capsys.readouterr().out
    assert "6 datasets to sample through the API: B3, B4, B5, B6, B7, B8; 2 imported: B1, B2" in out
    assert "B1: 5 prompts; all answered by imports, not asked" in out
    assert api_key_file[1] not in out


def test_stage_01_prices_only_what_stage_02_will_request(tmp_path, api_key_file, target_tokenizer):
    params = yaml.safe_load(filled_in(tmp_path, api_key_file[0]).read_text())
    specs = parse_datasets(params["datasets"])
    tokens = stage_01.count_prompt_tokens(specs, target_tokenizer, params["imports"])
    assert {t.name: (t.prompts, t.imported) for t in tokens} == {
        **{f"B{i}": (5, 0) for i in range(3, 9)}, "B1": (0, 5), "B2": (0, 5)}
    assert stage_01.imported_line(tokens) == (
        "6 datasets to sample through the API: B3, B4, B5, B6, B7, B8; 2 imported, answered elsewhere and not "
        "priced: B1 (5 prompts), B2 (5 prompts)")
    # pretend each file holds enough prompts for its budget: the plan is 60M tokens, not 80M
    tokens = [stage_01.DatasetTokens(t.name, t.prompts * 10_000, t.prompt_tokens * 10_000, t.output_token_budget,
                                      0, t.imported) for t in tokens]
    allowed = pd.DataFrame({"price_in": [0.45, 0.60], "price_out": [2.20, 2.50], "price_request": [0.0, 0.0]})
    plan = stage_01.cost_plan(tokens, allowed, 2500, 100.0, params["max_tokens"])
    assert list(plan["dataset"]) == [f"B{i}" for i in range(3, 9)]
    assert plan["output_tokens"].sum() == 60_000_000
    verdict = stage_01.plan_verdict(plan, 100.0, params["spend_limit_usd"])
    assert "does NOT cover the plan" in verdict and "for 60,000,000 output tokens" in verdict
    assert f"it buys {int(plan['output_tokens_that_fit'].sum()):,} of them" in verdict
