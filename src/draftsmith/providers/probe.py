"""The fidelity probe: does each endpoint really serve the model it declares?

The same short prompts go at temperature 0 with a fixed seed to each endpoint, pinned with `order`
+ `allow_fallbacks: false`, and each answer's tokens are compared with the reference endpoint's
(the first party, by default) as the length of their common prefix: a provider serving a model
quantized below what it declares answers differently. Reasoning and answer are compared apart,
each over the shorter of the two: a provider that truncates or drops the reasoning it returns (a
display quirk stage 03 diagnoses) still serves the same model, and must not be excluded for it.
The probe is paid for like the pilot: worst case checked first, cost recorded, table reused.
"""

from __future__ import annotations

import json
from itertools import islice

import pandas as pd

from ..openrouter.client import BodyMaker, messages_json, request_settings
from ..datasets import DatasetReader, DatasetSpec
from ..paths import Run
from . import outputs
from ..openrouter.api import Api
from ..openrouter.pricing import table_worst_prices


def reference_provider(model: str, probe_reference: str) -> str:
    """The provider slug answers are compared with: `probe_reference`, else the model's author."""
    return probe_reference or model.split("/")[0]


def shortest_prompts(datasets: list[DatasetSpec], n: int, scan: int = 50) -> list[list[dict]]:
    """The `n` shortest prompts among the first `scan` of each dataset: cheap to probe with."""
    pool = [p.messages for spec in datasets for p in islice(DatasetReader(spec), scan)]
    return sorted(pool, key=lambda m: len(json.dumps(m)))[:n]


def probe(api: Api, model: str, endpoints: pd.DataFrame, prompts: list[list[dict]], tokenizer,
          probe_max_tokens: int, seed: int, reference_slug: str) -> pd.DataFrame:
    """Per endpoint and prompt: the answer's tokens vs the reference endpoint's (temperature 0,
    fixed seed, pinned with order + allow_fallbacks false)."""
    tags = list(endpoints["tag"])
    ref_tags = [t for t in tags if t.split("/")[0] == reference_slug]
    if not ref_tags:
        raise ValueError(f"probe: no endpoint of the first-party provider {reference_slug!r} among {tags}")
    bodies = []
    for tag in tags:
        pinned = BodyMaker(request_settings(model, probe_max_tokens, 0, None, seed, {"order": [tag], "allow_fallbacks": False}))
        bodies += [pinned.body(messages_json(m)) for m in prompts]
    replies = iter(api.chat_all(bodies, "probe"))
    toks, costs = {}, {}                      # (tag, prompt index) -> [reasoning ids, answer ids] / cost
    for tag in tags:
        for i in range(len(prompts)):
            reply = next(replies)
            costs[tag, i] = reply.usage["cost"] or 0.0
            toks[tag, i] = [tokenizer.encode((text or "").strip(), add_special_tokens=False)
                            for text in (reply.reasoning, reply.content)]
    ref = ref_tags[0]
    rows = []
    for tag in tags:
        for i in range(len(prompts)):
            common = compared = 0
            for a, b in zip(toks[ref, i], toks[tag, i]):  # reasoning, then answer
                n = min(len(a), len(b))
                common += next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), n)
                compared += n
            rows.append({"tag": tag, "prompt": i, "tokens": sum(map(len, toks[tag, i])), "cost": costs[tag, i],
                         "reference_tokens": sum(map(len, toks[ref, i])),
                         # nothing to compare (e.g. a provider that drops the reasoning of an answer
                         # that is all reasoning) is no evidence either way: NaN, left out of the median
                         "prefix_agreement": common / compared if compared else float("nan")})
    return pd.DataFrame(rows)


def probe_summary(per_prompt: pd.DataFrame, probe_min_agreement: float) -> pd.DataFrame:
    """Median agreement per endpoint over the answers that could be compared (robust to one odd
    answer) and the outlier flag (never for an endpoint none of whose answers could be compared)."""
    s = per_prompt.groupby("tag").agg(agreement=("prefix_agreement", "median"),
                                      mean_agreement=("prefix_agreement", "mean"),
                                      length_ratio=("tokens", "sum")).reset_index()
    ref_len = per_prompt.groupby("tag")["reference_tokens"].sum().reindex(s["tag"]).to_numpy()
    s["length_ratio"] = s["length_ratio"] / ref_len.clip(min=1)
    s["outlier"] = s["agreement"] < probe_min_agreement
    return s


def run_probe(api: Api, run: Run, model: str, policy: pd.DataFrame, datasets: list[DatasetSpec], tokenizer,
              probe_prompts: int, probe_max_tokens: int, seed: int, reference: str, probe_min_agreement: float,
              spend_limit_usd: float, refresh_providers: bool) -> pd.DataFrame | None:
    """The probe's summary per endpoint (None when `probe_prompts` is 0) over the allowed endpoints
    and those of unknown quantization that are up; the probe of an earlier run is reused unless
    `refresh_providers`."""
    if probe_prompts <= 0:
        return None
    candidates = policy[policy["allowed"] | ((policy["quantization"] == "unknown") & (policy["status"] >= 0))]
    per_prompt = outputs.reuse(run, "probe", refresh_providers)
    if per_prompt is None:
        chosen = shortest_prompts(datasets, probe_prompts)
        p_tokens = sum(len(tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False))
                       for m in chosen)
        n = len(chosen)
        worst = sum(p.cost(p_tokens, probe_max_tokens * n, n) for p in table_worst_prices(candidates))
        print(f"probe: {n} prompts x {len(candidates)} endpoints, at most ${worst:.4f}")
        outputs.check_spend(run, worst, spend_limit_usd)
        per_prompt = probe(api, model, candidates, chosen, tokenizer, probe_max_tokens, seed, reference)
        outputs.keep_paid(run, "probe", per_prompt)
    summary = probe_summary(per_prompt, probe_min_agreement)
    print("flagged (answers differ from the reference):", outliers(summary) or "none")
    return summary


def outliers(summary: pd.DataFrame | None) -> list[str]:
    return [] if summary is None else summary.loc[summary["outlier"], "tag"].tolist()


def apply_probe(policy: pd.DataFrame, summary: pd.DataFrame | None, exclude_probe_outliers: bool,
                probe_min_agreement: float, reference: str) -> pd.DataFrame:
    """The policy after the probe: when `exclude_probe_outliers`, the endpoints it flagged are excluded, each with
    its agreement as the reason."""
    if not exclude_probe_outliers:
        return policy
    policy = policy.copy()
    agreement = {} if summary is None else dict(zip(summary["tag"], summary["agreement"]))
    for tag in outliers(summary):
        policy.loc[policy["tag"] == tag, ["allowed", "reason"]] = [
            False, f"fidelity probe: agreement {float(agreement[tag]):.2f} < {probe_min_agreement} with {reference}"]
    return policy
