"""How long the responses will be: `expected_output_tokens` when the user knows it, else measured
by a pilot, real completions of the first prompts of each dataset routed as stage 02 will route
them. The pilot is paid for: its worst case is checked against the spend limit before it is sent,
its cost is recorded, and its table is reused by a re-run (outputs.py)."""

from __future__ import annotations

from itertools import islice

import pandas as pd

from ..openrouter.client import BodyMaker, messages_json
from ..datasets import DatasetReader, DatasetSpec
from ..paths import Run
from ..openrouter.pricing import highest
from . import outputs
from ..openrouter.api import Api
from .cost_plan import DatasetTokens
from ..openrouter.endpoints import table_worst_prices


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
