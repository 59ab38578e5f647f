"""Stage 01's one entry point: `run(run, **params)` with notebook 01's parameters, in the order the
notebook tells it: the model's endpoints, the precision policy, the balance and the cost plan (a
paid pilot measures the response length unless it is given), the paid fidelity probe, and the
routing stage 02 sends. It writes `<run>/providers/` (outputs.py) and returns what the notebook's
tables and figures show."""

from __future__ import annotations

from .. import parameters
from ..datasets import parse_datasets
from ..local import open_api
from ..openrouter import client, endpoints
from ..openrouter.api import Api
from ..paths import Run
from ..targets.checkpoint import load_tokenizer
from . import cost_plan, outputs, pilot, probe


def run(run: Run, *, api_base: str, api_key_file: str | None, model: str, native_precision: str,
        target_model_path: str, trust_remote_code: bool, emulator: dict, datasets: list[dict], imports: list[dict],
        max_tokens: int, temperature: float, top_p: float, seed: int, reasoning: dict, spend_limit_usd: float,
        allow_unknown_quantization: bool, expected_output_tokens: float, pilot_samples: int, probe_prompts: int,
        probe_max_tokens: int, probe_min_agreement: float, probe_reference: str, exclude_probe_outliers: bool,
        refresh_providers: bool) -> dict:
    """Stage 01 over `run`; returns summary.json's figures and the tables behind them: `endpoints`
    (as listed), `policy` (the precision policy's verdicts), `policy_after_probe` (as endpoints.csv),
    `plan`, `pilot` and `probe` (None when not run), `routing` and `balance` (USD, source)."""
    parameters.check_bounds({name: value for name, value in locals().items() if name != "run"})  # every setting
    specs = parse_datasets(datasets)
    with open_api(api_base, api_key_file, run, target_model_path, emulator, model) as (base_url, api_key):
        api = Api(base_url, api_key)
        tokenizer = load_tokenizer(target_model_path, trust_remote_code)
        table = endpoints.endpoint_table(api.endpoints(model))

        settings = client.request_settings(model, max_tokens, temperature, top_p, seed, None, reasoning)
        policy = endpoints.apply_policy(table, native_precision, allow_unknown_quantization,
                                        client.sent_parameters(settings))

        balance = api.balance()
        print(cost_plan.balance_line(*balance))
        routing = endpoints.routing_object(policy, native_precision, allow_unknown_quantization)
        allowed = policy[policy["allowed"]]
        tokens = cost_plan.count_prompt_tokens(specs, tokenizer, imports)
        print(cost_plan.imported_line(tokens))
        per_sample, pilot_table = pilot.expected_output(api, run, {**settings, "provider": routing}, specs, tokens,
                                                        allowed, expected_output_tokens, pilot_samples,
                                                        spend_limit_usd, refresh_providers)
        plan = cost_plan.cost_plan(tokens, allowed, per_sample, cost_plan.usable_usd(balance[0], spend_limit_usd),
                                   max_tokens)
        print(cost_plan.plan_verdict(plan, balance[0], spend_limit_usd))

        reference = probe.reference_provider(model, probe_reference)
        probe_summary = probe.run_probe(api, run, model, policy, specs, tokenizer, probe_prompts, probe_max_tokens,
                                        seed, reference, probe_min_agreement, spend_limit_usd, refresh_providers)
    final = probe.apply_probe(policy, probe_summary, exclude_probe_outliers, probe_min_agreement, reference)
    routing = endpoints.routing_object(final, native_precision, allow_unknown_quantization)
    summary = outputs.stage_summary(run, balance, per_sample, routing, plan, probe.outliers(probe_summary))
    outputs.write_outputs(run, model, native_precision, final, routing, plan, summary)
    return {**summary, "endpoints": table, "policy": policy, "policy_after_probe": final, "plan": plan,
            "pilot": pilot_table, "probe": probe_summary, "routing": routing, "balance": balance}
