"""Stage 01's one entry point: `run(run, cfg)` with notebook 01's settings (`ProvidersConfig`), in the order the
notebook tells it: the model's endpoints, the precision policy, the balance and the cost plan (a
paid pilot measures the response length unless it is given), the paid fidelity probe, the paid logprob
probe (stage 04's independent reference, `logprobs`), and the routing stage 02 sends. It writes `<run>/providers/` (outputs.py) and returns what the notebook's
tables and figures show."""

from __future__ import annotations

from ..datasets import parse_datasets
from ..emulator import open_api
from ..openrouter import client, endpoints
from ..openrouter.api import Api
from ..config import ProvidersConfig
from ..paths import Run
from ..targets.checkpoint import load_tokenizer
from . import cost_plan, logprobs, outputs, pilot, probe


def run(run: Run, cfg: ProvidersConfig) -> dict:
    """Stage 01 over `run`; returns summary.json's figures and the tables behind them: `endpoints`
    (as listed), `policy` (the precision policy's verdicts), `policy_after_probe` (as endpoints.csv),
    `plan`, `pilot`, `probe` and `logprob_probe` (None when not run), `routing` and `balance` (USD, source)."""
    specs = parse_datasets(cfg.datasets)
    with open_api(cfg.api_base, cfg.api_key_file, run, cfg.target_model_path, cfg.emulator,
                  cfg.model) as (base_url, api_key):
        api = Api(base_url, api_key)
        tokenizer = load_tokenizer(cfg.target_model_path, cfg.trust_remote_code)
        table = endpoints.endpoint_table(api.endpoints(cfg.model))

        settings = client.request_settings(cfg.model, cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.seed, None,
                                           cfg.reasoning)
        policy = endpoints.apply_policy(table, cfg.native_precision, cfg.allow_unknown_quantization,
                                        client.sent_parameters(settings))

        balance = api.balance()
        print(cost_plan.balance_line(*balance))
        routing = endpoints.routing_object(policy, cfg.native_precision, cfg.allow_unknown_quantization)
        allowed = policy[policy["allowed"]]
        tokens = cost_plan.count_prompt_tokens(specs, tokenizer, cfg.imports)
        print(cost_plan.imported_line(tokens))
        per_sample, pilot_table = pilot.expected_output(api, run, {**settings, "provider": routing}, specs, tokens,
                                                        allowed, cfg.expected_output_tokens, cfg.pilot_samples,
                                                        cfg.spend_limit_usd, cfg.refresh_providers)
        plan = cost_plan.cost_plan(tokens, allowed, per_sample, cost_plan.usable_usd(balance[0], cfg.spend_limit_usd),
                                   cfg.max_tokens)
        print(cost_plan.plan_verdict(plan, balance[0], cfg.spend_limit_usd))

        reference = probe.reference_provider(cfg.model, cfg.probe_reference)
        probe_summary = probe.run_probe(api, run, cfg.model, policy, specs, tokenizer, cfg.probe_prompts,
                                        cfg.probe_max_tokens, cfg.seed, reference, cfg.probe_min_agreement,
                                        cfg.spend_limit_usd, cfg.refresh_providers)
        final = probe.apply_probe(policy, probe_summary, cfg.exclude_probe_outliers, cfg.probe_min_agreement,
                                  reference)
        logprob_table = logprobs.run_logprob_probe(api, run, cfg.model, final, specs, tokenizer, cfg.logprob_prompts,
                                                   cfg.logprob_max_tokens, cfg.seed, cfg.reasoning,
                                                   cfg.spend_limit_usd, cfg.refresh_providers)
    routing = endpoints.routing_object(final, cfg.native_precision, cfg.allow_unknown_quantization)
    summary = outputs.stage_summary(run, balance, per_sample, routing, plan, probe.outliers(probe_summary))
    outputs.write_outputs(run, cfg.model, cfg.native_precision, final, routing, plan, summary)
    return {**summary, "endpoints": table, "policy": policy, "policy_after_probe": final, "plan": plan,
            "pilot": pilot_table, "probe": probe_summary, "logprob_probe": logprob_table, "routing": routing,
            "balance": balance}
