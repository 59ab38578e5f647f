"""Stage 01: quantization policy, routing object, cost plan, probe, its files; and the stage end to end."""

import json
import subprocess
import sys

import pandas as pd
import pytest

from draftsmith.openrouter.client import BodyMaker, messages_json, request_settings
from draftsmith.emulator import running
from draftsmith.config import ProvidersConfig
from draftsmith.paths import Run
from draftsmith.providers import outputs, probe, stage
from draftsmith.openrouter import pricing
from draftsmith.openrouter.api import Api, ApiError

pytestmark = pytest.mark.emulator

MODEL = "moonshotai/kimi-k2.5"
REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def _table(rows):
    cols = ["provider", "tag", "quantization", "price_in", "price_out", "status", "uptime", "latency_p50_s",
            "throughput_p50"]
    return pd.DataFrame([dict(zip(cols, r)) for r in rows])


def _body(model, text):
    return BodyMaker(request_settings(model, 5)).body(messages_json([{"role": "user", "content": text}]))


def test_policy_excludes_below_native_unknown_and_down_with_reasons():
    t = _table([
        ("A", "a/int4", "int4", 0.5, 2.0, 0, 99, 1, 40),
        ("B", "b/fp4", "fp4", 0.4, 1.9, 0, 99, 1, 40),
        ("C", "c/nvfp4", "nvfp4", 0.4, 1.9, 0, 99, 1, 40),
        ("D", "d/mxfp4", "mxfp4", 0.4, 1.9, 0, 99, 1, 40),
        ("E", "e/fp8", "fp8", 0.6, 2.5, 0, 99, 1, 40),
        ("F", "f/unknown", "unknown", 0.5, 2.0, 0, 99, 1, 40),
        ("G", "g/int4", "int4", 0.5, 2.0, -2, 10, 1, 40),
    ])
    p = pricing.apply_policy(t, "int4", False).set_index("tag")
    assert p.loc["a/int4", "allowed"] and p.loc["e/fp8", "allowed"]  # fp8 holds int4 weights exactly
    for tag in ("b/fp4", "c/nvfp4", "d/mxfp4"):
        assert not p.loc[tag, "allowed"] and "below the native int4" in p.loc[tag, "reason"]
    assert not p.loc["f/unknown", "allowed"] and "unknown" in p.loc["f/unknown", "reason"]
    assert not p.loc["g/int4", "allowed"] and "down" in p.loc["g/int4", "reason"]
    assert pricing.apply_policy(t, "int4", allow_unknown_quantization=True).set_index("tag").loc["f/unknown", "allowed"]
    # a bf16 model: fp8 and int4 are below it
    p16 = pricing.apply_policy(t, "bf16", False).set_index("tag")
    assert not p16.loc["e/fp8", "allowed"] and not p16.loc["a/int4", "allowed"]
    with pytest.raises(ValueError, match="native_precision"):
        pricing.apply_policy(t, "int3", False)
    r = pricing.routing_object(pricing.apply_policy(t, "int4", False), "int4", False)
    assert r == {"only": ["a/int4", "e/fp8"], "quantizations": ["fp8", "int4"], "allow_fallbacks": True,
                 "require_parameters": True}
    assert {x["tag"] for x in pricing.exclusions(pricing.apply_policy(t, "int4", False))} == {"b/fp4", "c/nvfp4", "d/mxfp4", "f/unknown", "g/int4"}


def test_cost_plan_arithmetic():
    allowed = _table([("A", "a/int4", "int4", 1.0, 2.0, 0, 99, 1, 40),
                      ("B", "b/int4", "int4", 2.0, 4.0, 0, 99, 1, 40)])
    tokens = [stage.DatasetTokens("d1", prompts=100, prompt_tokens=5000, output_token_budget=2000, skipped=0),
              stage.DatasetTokens("d2", prompts=10, prompt_tokens=1000, output_token_budget=100000, skipped=0)]
    plan = stage.cost_plan(tokens, allowed, expected_output=100, usable_usd=None, max_tokens=500).set_index("dataset")
    d1 = plan.loc["d1"]
    assert d1["samples_needed"] == 20 and d1["input_tokens"] == 1000 and d1["output_tokens"] == 2000
    assert d1["cost_cheapest"] == pytest.approx((1000 * 1 + 2000 * 2) / 1e6)
    assert d1["cost_most_expensive"] == pytest.approx((1000 * 2 + 2000 * 4) / 1e6)
    w = stage.mix_weights(allowed)  # 1/price^2: 1/9 vs 1/36 -> 0.8 / 0.2
    assert list(w) == pytest.approx([0.8, 0.2])
    assert d1["cost_mix"] == pytest.approx((1000 * 1.2 + 2000 * 2.4) / 1e6)
    d2 = plan.loc["d2"]  # only 10 prompts: the budget cannot be reached
    assert d2["samples_needed"] == 10 and d2["output_tokens"] == 1000
    assert (plan["output_tokens_that_fit"] == plan["output_tokens"]).all()
    half = plan["cost_mix"].sum() / 2
    small = stage.cost_plan(tokens, allowed, 100, half, 500).set_index("dataset")
    assert small["fits_fraction"].iloc[0] == pytest.approx(0.5)
    assert small.loc["d1", "output_tokens_that_fit"] == 1000


def test_probe_flags_the_provider_that_answers_differently(tmp_path, target_tokenizer):
    # synthetic backend: fast; its perturbed provider answers with other text, like noisy weights would
    with running({"fault_scale": 0.5, "seed": 1}, state_dir=tmp_path) as emu:
        api = Api(emu.base_url, emu.key)
        table = pricing.endpoint_table(api.endpoints(MODEL))
        policy = pricing.apply_policy(table, "int4", False)
        candidates = policy[policy["allowed"]]
        prompts = [[{"role": "user", "content": f"probe {i}"}] for i in range(3)]
        per_prompt = probe.probe(api, MODEL, candidates, prompts, target_tokenizer, 24, 0, "moonshotai")
        s = probe.probe_summary(per_prompt, 0.5).set_index("tag")
    assert s.loc["moonshotai/int4", "agreement"] == 1.0
    assert s["outlier"].sum() == 1 and s.loc["chutes/int4", "outlier"]
    # stripped whitespace, other billing, truncated reasoning and rare splits are not a different model
    assert not s.drop(index="chutes/int4")["outlier"].any()
    assert set(per_prompt["tag"]) == set(candidates["tag"])


def test_probe_does_not_flag_a_provider_that_only_cuts_or_drops_its_reasoning(tmp_path, target_tokenizer):
    base = {"quantization": "int4", "prompt_price": 1, "completion_price": 2}
    prov = [{"slug": "moonshotai", "name": "Moonshot AI", **base},
            {"slug": "cut", "name": "Cut", **base, "quirks": {"reasoning_truncate_rate": 1.0}},
            {"slug": "drop", "name": "Drop", **base, "quirks": {"reasoning_drop_rate": 1.0}},
            {"slug": "noisy", "name": "Noisy", **base, "quirks": {"perturbed_model": 0.5}}]
    with running({"providers": prov, "fault_scale": 0, "synthetic_tokens": 120}, state_dir=tmp_path) as emu:
        api = Api(emu.base_url, emu.key)
        table = pricing.endpoint_table(api.endpoints(MODEL))
        prompts = [[{"role": "user", "content": f"probe {i}"}] for i in range(3)]
        per_prompt = probe.probe(api, MODEL, table, prompts, target_tokenizer, 96, 0, "moonshotai")
        quirks = {x["provider"]: set(x["quirks"]) for x in emu.ledger_lines()}
    assert quirks["cut"] == {"reasoning_truncated"} and quirks["drop"] == {"reasoning_dropped"}
    s = probe.probe_summary(per_prompt, 0.5).set_index("tag")
    assert s.loc["cut/int4", "agreement"] == s.loc["drop/int4", "agreement"] == 1.0
    assert s.loc["cut/int4", "length_ratio"] < 1 and s.loc["drop/int4", "length_ratio"] < 1  # they did return less
    assert list(s.index[s["outlier"]]) == ["noisy/int4"]


def test_api_retries_faults_and_stops_on_permanent_errors(tmp_path):
    prov = [{"slug": "a", "name": "A", "quantization": "int4", "prompt_price": 1, "completion_price": 2,
             "faults": {"rate_limit": 0.3, "error_200": 0.2, "empty_200": 0.2}}]
    with running({"providers": prov, "seed": 2}, state_dir=tmp_path) as emu:
        api = Api(emu.base_url, emu.key, attempts=20)
        for i in range(10):
            reply = api.chat(_body(MODEL, f"x{i}"))
            assert reply.finish_reason in ("stop", "length")
        assert sum(1 for x in emu.ledger_lines() if x["error"] or x["status"] != 200) > 0
        with pytest.raises(ApiError) as e:
            api.chat(_body("no/such", "x"))
        assert e.value.status == 400


@pytest.mark.notebook
def test_stage_01_end_to_end_excludes_fp4_and_flags_the_perturbed_provider(tmp_path, api_key_file):
    """`draftsmith run 01` on the smoke params: the emulator serves the tiny target (model backend),
    the policy drops nvfp4/fp4/down/unknown, the probe catches the provider with noisy weights."""
    key_path, key = api_key_file
    r = subprocess.run([sys.executable, "-m", "draftsmith.cli", "run", "01", "-f", str(REPO / "params/smoke.yaml"),
                        "-p", "outputs_dir", str(tmp_path), "-p", "api_key_file", str(key_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "smoke" / "providers"
    routing = json.loads((out / "routing.json").read_text())
    reasons = {x["tag"]: x["reason"] for x in routing["excluded"]}
    assert "below the native int4" in reasons["fireworks/nvfp4"] and "below the native int4" in reasons["deepinfra/fp4"]
    assert "down" in reasons["baseten/fp4"]
    assert "unknown" in reasons["atlas-cloud/unknown"] and "unknown" in reasons["gmicloud/unknown"]
    assert "fidelity probe" in reasons["chutes/int4"]
    assert "moonshotai/int4" in routing["provider"]["only"] and "chutes/int4" not in routing["provider"]["only"]
    assert not {"fp4", "nvfp4", "mxfp4"} & set(routing["provider"]["quantizations"])
    plan = pd.read_csv(out / "cost_plan.csv")
    assert set(plan["dataset"]) == {"code", "chat"} and (plan["cost_cheapest"] <= plan["cost_mix"]).all()
    assert (plan["cost_mix"] <= plan["cost_most_expensive"]).all()
    for f in ("endpoints.csv", "probe.csv", "summary.json", "figures/price_vs_throughput.png",
              "figures/cost_vs_balance.png"):
        assert (out / f).is_file(), f
    # the notebook's tables are for people: no index column, units in the headers, routing as a table
    shown = json.dumps(json.loads((tmp_path / "smoke" / "notebooks" / "01_providers.ipynb").read_text())["cells"])
    assert "price out ($/M tokens)" in shown and "allow_fallbacks" in shown and "row_heading" not in shown
    # the key never reaches anything saved
    for path in (tmp_path / "smoke").rglob("*"):
        if path.is_file() and path.suffix in (".ipynb", ".json", ".csv", ".log", ".yaml", ".html", ".jsonl"):
            assert key not in path.read_text(errors="ignore"), path


def test_paid_tables_are_reused_unless_refreshed_and_their_spend_is_checked(tmp_path):
    run = Run(tmp_path, "r")
    assert outputs.reuse(run, "pilot", refresh_providers=False) is None and outputs.spent(run) == 0.0
    outputs.keep_paid(run, "pilot", pd.DataFrame([{"dataset": "d", "provider": "A", "completion_tokens": 10,
                                                   "cost": 0.002}]))
    assert outputs.reuse(run, "pilot", refresh_providers=False)["cost"].sum() == pytest.approx(0.002)
    assert outputs.reuse(run, "pilot", refresh_providers=True) is None
    assert outputs.spent(run) == pytest.approx(0.002)
    outputs.check_spend(run, 0.003, spend_limit_usd=0.01)
    with pytest.raises(RuntimeError, match="spend_limit_usd"):
        outputs.check_spend(run, 0.009, spend_limit_usd=0.01)
    (run.dir("providers") / "spend.json").write_text("{not json")
    with pytest.raises(ValueError, match="spend.json"):
        outputs.spent(run)
    with pytest.raises(ValueError, match="spend.json"):      # nor is it written over
        outputs.record_spend(run, "probe", 0.001)


def test_the_routing_written_is_the_routing_stage_02_reads(tmp_path):
    run = Run(tmp_path, "r")
    assert outputs.read_routing(run) is None                     # stage 01 did not run
    t = _table([("A", "a/int4", "int4", 0.5, 2.0, 0, 99, 1, 40), ("B", "b/fp4", "fp4", 0.4, 1.9, 0, 99, 1, 40)])
    policy = pricing.apply_policy(t, "int4", False)
    routing = pricing.routing_object(policy, "int4", False)
    plan = pd.DataFrame([{"dataset": "d", "cost_mix": 0.5, "fits_fraction": 1.0}])
    outputs.write_outputs(run, MODEL, "int4", policy, routing, plan,
                          outputs.stage_summary(run, (3.0, "/key limit_remaining"), 40, routing, plan, []))
    assert outputs.read_routing(run) == routing
    assert list(outputs.read_endpoints(run)["allowed"]) == [True, False]
    assert outputs.read_cost_plan(run)["cost_mix"].sum() == 0.5
    path = outputs.routing_file(run)
    path.write_text(json.dumps({"only": ["a/int4"]}))            # a provider object written by hand
    assert outputs.read_routing(run) == {"only": ["a/int4"]}
    path.write_text('{"provider": ')
    with pytest.raises(ValueError, match="routing.json"):
        outputs.read_routing(run)


def test_an_answer_with_nothing_to_compare_is_no_evidence_of_another_model():
    """A provider that drops the reasoning of an answer that is all reasoning leaves nothing to
    compare: that prompt is left out of its median, so it is not flagged for it."""
    import pandas as pd

    nan = float("nan")
    rows = [{"tag": t, "prompt": i, "tokens": 10, "cost": 0.0, "reference_tokens": 10, "prefix_agreement": a}
            for t, agreements in (("ref/int4", (1.0, 1.0, 1.0)), ("drops/int4", (nan, nan, 1.0)),
                                  ("other/int4", (0.1, 0.0, 1.0)), ("silent/int4", (nan, nan, nan)))
            for i, a in enumerate(agreements)]
    s = probe.probe_summary(pd.DataFrame(rows), 0.5).set_index("tag")
    assert s.loc["drops/int4", "agreement"] == 1.0
    assert probe.outliers(s.reset_index()) == ["other/int4"]


def test_a_name_stage_01_does_not_declare_is_no_setting_of_its_config():
    with pytest.raises(TypeError):
        ProvidersConfig(lr=1)


def test_stage_01_calls_work_under_a_running_event_loop_and_name_an_unlisted_model(tmp_path):
    """A Jupyter kernel runs an event loop in the notebook's thread: stage 01's synchronous calls
    run theirs in a worker thread, so they work there too."""
    import asyncio

    with running({"fault_scale": 0, "credits": 4.0}, state_dir=tmp_path) as emu:
        api = Api(emu.base_url, emu.key)

        async def in_a_kernel():
            return api.balance(), api.endpoints(MODEL)

        balance, eps = asyncio.run(in_a_kernel())
        assert balance == (4.0, "/key limit_remaining") and {e["tag"] for e in eps} >= {"moonshotai/int4"}
        with pytest.raises(ValueError, match="'no/such' is not listed by"):
            api.endpoints("no/such")
