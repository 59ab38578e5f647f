"""Stage 02's closing line says why a dataset ended below its budget: its prompts ran out."""

from test_generate_e2e import emu_config, generate, prompts_file

from draftsmith.emulator import running

import pytest

pytestmark = pytest.mark.emulator


def test_a_dataset_that_runs_out_of_prompts_says_so_and_one_at_its_budget_does_not(tmp_path):
    few = prompts_file(tmp_path / "few.jsonl", 3, "few")
    many = prompts_file(tmp_path / "many.jsonl", 200, "many")
    with running(emu_config(credits=10.0), state_dir=tmp_path / "emu") as emu:
        r = generate(emu, tmp_path, [{"name": "few", "path": str(few), "output_token_budget": 100_000},
                                     {"name": "many", "path": str(many), "output_token_budget": 300}])
    assert r.reason == "finished", r.message
    few_part, many_part = r.message.split("; ")[:2]
    assert few_part.startswith("finished: few: 3 samples") and "(its prompts ran out below the budget)" in few_part
    assert many_part.startswith("many:") and "ran out" not in many_part
