"""What the planned output budget costs, against the money there is.

Only what stage 02 will request is priced: prompts that an import file answers (`imports`, see
imports.py) are counted apart and never priced, so a dataset answered elsewhere costs nothing
(`imported_line` names them). `cost_plan` prices each dataset's output budget (prompt tokens
counted with the target tokenizer over the prompts left to ask) at the cheapest allowed endpoint,
at the expected routing mix (OpenRouter's default weights 1/price^2) and at the most expensive
one, and says how much of it the usable money (the lower of the balance and `spend_limit_usd`)
buys; `plan_verdict` says so in one sentence before anything is spent on generation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from ..datasets import DatasetReader, DatasetSpec, stable_id
from ..imports import answered, parse_imports
from ..progress import Progress


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
