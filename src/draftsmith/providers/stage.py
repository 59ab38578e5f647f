"""Stage 01's one entry point: `run(run, cfg)` with notebook 01's settings (`ProvidersConfig`), in the order the
notebook tells it: the model's endpoints, the precision policy, the balance and the cost plan (a
paid pilot measures the response length unless it is given), the paid fidelity probe, the paid logprob
probe (stage 04's independent reference, `logprobs`), and the routing stage 02 sends. It writes `<run>/providers/` (outputs.py) and returns what the notebook's
tables and figures show. Below `run`, its steps in that order:

The cost plan prices only what stage 02 will request (prompts an import file answers are counted
apart, `imported_line`): each dataset's output budget at the cheapest allowed endpoint, at the
expected routing mix (OpenRouter's weights 1/price^2) and at the dearest, against the usable money
(the lower of the balance and `spend_limit_usd`); `plan_verdict` says it in one sentence.

The pilot measures the response length (unless `expected_output_tokens` gives it) with real
completions routed as stage 02 will route them. It is paid like the probes (probe.py, logprobs.py):
worst case checked against the spend limit first, cost recorded, table reused by a re-run (outputs.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import islice

import pandas as pd

from ..datasets import DatasetReader, DatasetSpec, parse_datasets, stable_id
from ..imports import answered, parse_imports
from ..emulator import open_api
from ..openrouter import client, pricing
from ..openrouter.api import Api
from ..openrouter.client import BodyMaker, messages_json
from ..openrouter.pricing import highest, table_worst_prices
from ..config import ProvidersConfig
from ..paths import Run
from ..progress import Progress
from ..targets.checkpoint import load_tokenizer
from . import logprobs, outputs, probe


def run(run: Run, cfg: ProvidersConfig) -> dict:
    """Stage 01 over `run`; returns summary.json's figures and the tables behind them: `endpoints`
    (as listed), `policy` (the precision policy's verdicts), `policy_after_probe` (as endpoints.csv),
    `plan`, `pilot`, `probe` and `logprob_probe` (None when not run), `routing` and `balance` (USD, source)."""
    specs = parse_datasets(cfg.datasets)
    with open_api(cfg.api_base, cfg.api_key_file, run, cfg.target_model_path, cfg.emulator,
                  cfg.model) as (base_url, api_key):
        api = Api(base_url, api_key)
        tokenizer = load_tokenizer(cfg.target_model_path, cfg.trust_remote_code)
        table = pricing.endpoint_table(api.endpoints(cfg.model))

        settings = client.request_settings(cfg.model, cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.seed, None,
                                           cfg.reasoning)
        policy = pricing.apply_policy(table, cfg.native_precision, cfg.allow_unknown_quantization,
                                        client.sent_parameters(settings))

        balance = api.balance()
        print(balance_line(*balance))
        routing = pricing.routing_object(policy, cfg.native_precision, cfg.allow_unknown_quantization)
        allowed = policy[policy["allowed"]]
        tokens = count_prompt_tokens(specs, tokenizer, cfg.imports)
        print(imported_line(tokens))
        per_sample, pilot_table = expected_output(api, run, {**settings, "provider": routing}, specs, tokens,
                                                        allowed, cfg.expected_output_tokens, cfg.pilot_samples,
                                                        cfg.spend_limit_usd, cfg.refresh_providers)
        plan = cost_plan(tokens, allowed, per_sample, usable_usd(balance[0], cfg.spend_limit_usd),
                                   cfg.max_tokens)
        print(plan_verdict(plan, balance[0], cfg.spend_limit_usd))

        reference = probe.reference_provider(cfg.model, cfg.probe_reference)
        probe_table = probe.run_probe(api, run, cfg.model, policy, specs, tokenizer, cfg.probe_prompts,
                                        cfg.probe_max_tokens, cfg.seed, reference, cfg.probe_min_agreement,
                                        cfg.spend_limit_usd, cfg.refresh_providers)
        final = probe.apply_probe(policy, probe_table, cfg.exclude_probe_outliers, cfg.probe_min_agreement,
                                  reference)
        logprob_table = logprobs.run_logprob_probe(api, run, cfg.model, final, specs, tokenizer, cfg.logprob_prompts,
                                                   cfg.logprob_max_tokens, cfg.seed, cfg.reasoning,
                                                   cfg.spend_limit_usd, cfg.refresh_providers)
    routing = pricing.routing_object(final, cfg.native_precision, cfg.allow_unknown_quantization)
    summary = outputs.stage_summary(run, balance, per_sample, routing, plan, probe.outliers(probe_table))
    outputs.write_outputs(run, cfg.model, cfg.native_precision, final, routing, plan, summary)
    return {**summary, "endpoints": table, "policy": policy, "policy_after_probe": final, "plan": plan,
            "pilot": pilot_table, "probe": probe_table, "logprob_probe": logprob_table, "routing": routing,
            "balance": balance}


# ---- the cost plan ----
@dataclass
class DatasetTokens:
    name: str
    prompts: int
    prompt_tokens: int
    output_token_budget: int | None
    skipped: int
    imported: int = 0   # prompts an import file answers: stage 02 does not ask them


def count_prompt_tokens(datasets: list[DatasetSpec], tokenizer,
                        imports: list[dict] | None = None) -> list[DatasetTokens]:
    """Prompt tokens, with the target tokenizer and chat template, of every prompt stage 02 will
    ask: those an import file answers are only counted (`imported`), as stage 02 skips them."""
    specs = parse_imports(imports or [], [s.name for s in datasets])
    out = []
    for spec in datasets:
        reader = DatasetReader(spec)
        done = answered(specs, spec.name)
        total = imported = 0
        with Progress(desc=f"tokens {spec.name}", unit="prompt") as bar:
            for p in reader:
                bar.update()
                if done and (p.sample_id in done or stable_id(p.messages) in done):
                    imported += 1
                    continue
                total += len(tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        if reader.problems:
            print(reader.summary())
        out.append(DatasetTokens(spec.name, reader.count - imported, total, spec.output_token_budget,
                                 len(reader.problems), imported))
    return out


def imported_line(tokens: list[DatasetTokens]) -> str:
    """Which datasets stage 02 samples and which the imports answer (not priced)."""
    sample = [t.name for t in tokens if t.prompts]
    whole = [f"{t.name} ({t.imported:,} prompts)" for t in tokens if t.imported and not t.prompts]
    part = [f"{t.name} ({t.imported:,} of {t.imported + t.prompts:,} prompts)" for t in tokens
            if t.imported and t.prompts]
    line = f"{len(sample)} datasets to sample through the API: {', '.join(sample) or 'none'}"
    if whole:
        line += f"; {len(whole)} imported, answered elsewhere and not priced: {', '.join(whole)}"
    if part:
        line += f"; answered in part by imports (those prompts not priced): {', '.join(part)}"
    return line


def mix_weights(allowed: pd.DataFrame) -> pd.Series:
    """OpenRouter's default routing shares: weight 1/price^2 (price = $/M in + out)."""
    w = 1.0 / (allowed["price_in"] + allowed["price_out"]) ** 2
    return w / w.sum()


def balance_line(usd: float | None, source: str) -> str:
    return f"balance: {'unknown' if usd is None else f'${usd:,.4f}'} ({source})"


def usable_usd(balance_usd: float | None, spend_limit_usd: float) -> float:
    """What the run may spend: the spend limit, or the balance when it is lower."""
    return spend_limit_usd if balance_usd is None else min(balance_usd, spend_limit_usd)


def cost_plan(tokens: list[DatasetTokens], allowed: pd.DataFrame, expected_output: float,
              usable_usd: float | None, max_tokens: int) -> pd.DataFrame:
    """Per dataset: samples needed for the output budget, tokens in and out, cost at the cheapest
    / expected mix / most expensive allowed endpoint, and the output tokens the money covers."""
    w = mix_weights(allowed)
    price = {"cheapest": allowed.loc[(allowed["price_in"] + allowed["price_out"]).idxmin()],
             "most_expensive": allowed.loc[(allowed["price_in"] + allowed["price_out"]).idxmax()]}
    mix_in, mix_out = float((w * allowed["price_in"]).sum()), float((w * allowed["price_out"]).sum())
    mix_req = float((w * allowed["price_request"]).sum()) if "price_request" in allowed else 0.0
    per_sample = max(1.0, min(float(expected_output), float(max_tokens)))
    rows = []
    for d in tokens:
        if d.prompts == 0:
            continue
        budget = d.output_token_budget or int(d.prompts * per_sample)
        samples = min(d.prompts, math.ceil(budget / per_sample))
        out_tokens = min(budget, samples * per_sample)
        in_tokens = samples * d.prompt_tokens / d.prompts
        row = {"dataset": d.name, "prompts": d.prompts, "mean_prompt_tokens": d.prompt_tokens / d.prompts,
               "output_token_budget": budget, "samples_needed": samples, "input_tokens": in_tokens,
               "output_tokens": out_tokens}
        for name in ("cheapest", "most_expensive"):
            e = price[name]
            row[f"cost_{name}"] = ((in_tokens * e["price_in"] + out_tokens * e["price_out"]) / 1e6
                                   + samples * e.get("price_request", 0.0))
        row["cost_mix"] = (in_tokens * mix_in + out_tokens * mix_out) / 1e6 + samples * mix_req
        rows.append(row)
    plan = pd.DataFrame(rows)
    plan = plan[[c for c in plan.columns if not c.startswith("cost_")] + ["cost_cheapest", "cost_mix",
                                                                          "cost_most_expensive"]]
    total = plan["cost_mix"].sum()
    share = 1.0 if usable_usd is None or total <= usable_usd else max(0.0, usable_usd / total)
    plan["fits_fraction"] = share
    plan["output_tokens_that_fit"] = (plan["output_tokens"] * share).round().astype(int)
    return plan


def plan_verdict(plan: pd.DataFrame, balance_usd: float | None, spend_limit_usd: float) -> str:
    """One sentence, said before anything is spent on generation: does the money cover the cost
    plan, and if not, how many of the planned output tokens it buys."""
    total, want = float(plan["cost_mix"].sum()), int(plan["output_tokens"].sum())
    fit = int(plan["output_tokens_that_fit"].sum())
    by_balance = balance_usd is not None and balance_usd <= spend_limit_usd
    usable = usable_usd(balance_usd, spend_limit_usd)
    money = f"The balance (${usable:,.2f})" if by_balance else f"spend_limit_usd (${usable:,.2f})"
    if fit >= want:
        return f"{money} covers the plan: ${total:,.2f} at the expected mix for {want:,} output tokens."
    return (f"{money} does NOT cover the plan: ${total:,.2f} at the expected mix for "
            f"{want:,} output tokens; it buys {fit:,} of them ({100 * fit / want:.0f}%). Stage 02 will stop "
            f"when it runs out: {'top up' if by_balance else 'raise spend_limit_usd by'} about "
            f"${total - usable:,.2f} (and re-run stage 02) to finish.")


# ---- the pilot: the response length ----
def pilot(api: Api, settings: dict, datasets: list[DatasetSpec], pilot_samples: int) -> pd.DataFrame:
    """Real completions of the first `pilot_samples` prompts of each dataset, sent with stage 02's
    request `settings` (`client.request_settings`, its routing included)."""
    bodies, names, requests = BodyMaker(settings), [], []
    for spec in datasets:
        for p in islice(DatasetReader(spec), pilot_samples):
            names.append(spec.name)
            requests.append(bodies.body(messages_json(p.messages)))
    replies = api.chat_all(requests, "pilot")
    return pd.DataFrame([{"dataset": name, "provider": reply.provider,
                          "completion_tokens": reply.usage["completion_tokens"], "cost": reply.usage["cost"] or 0.0}
                         for name, reply in zip(names, replies)])


def expected_output(api: Api, run: Run, settings: dict, datasets: list[DatasetSpec], tokens: list[DatasetTokens],
                    allowed: pd.DataFrame, expected_output_tokens: float, pilot_samples: int,
                    spend_limit_usd: float, refresh_providers: bool) -> tuple[float, pd.DataFrame | None]:
    """The mean response length in tokens and the pilot's table (None when the user gave the length).
    The pilot of an earlier run of this stage is reused unless `refresh_providers`."""
    if expected_output_tokens > 0:
        return float(expected_output_tokens), None
    table = outputs.reuse(run, "pilot", refresh_providers)
    if table is None:
        datasets = [s for s, t in zip(datasets, tokens) if t.prompts]   # not those the imports answer
        n = pilot_samples * len(datasets)
        mean_prompt = sum(t.prompt_tokens for t in tokens) / max(1, sum(t.prompts for t in tokens))
        worst = highest(table_worst_prices(allowed)).cost(mean_prompt * n, settings["max_tokens"] * n, n)
        print(f"pilot: {n} requests, at most ${worst:.4f}")
        outputs.check_spend(run, worst, spend_limit_usd)
        table = pilot(api, settings, datasets, pilot_samples)
        outputs.keep_paid(run, "pilot", table)
    per_sample = float(table["completion_tokens"].mean())
    print(f"pilot: mean {per_sample:.0f} completion tokens per response, cost ${table['cost'].sum():.6f}")
    return per_sample, table
