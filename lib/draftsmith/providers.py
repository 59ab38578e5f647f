"""Stage 01: which providers serve the model at its native precision, at what price, and how much
of the token budget the balance buys.

- `fetch_endpoints` reads `/models` and `/models/{model}/endpoints` into a table.
- `apply_policy` marks each endpoint allowed or excluded, with the reason: below the native
  precision (a format with fewer bits, or as many bits in another format: int4 QAT weights
  re-quantized to fp4/nvfp4 lose accuracy), `unknown` (excluded unless allowed), down.
- `routing_object` is the OpenRouter `provider` object stage 02 sends (written to
  providers/routing.json together with every exclusion and its reason).
- `cost_plan` prices the planned output budget per dataset (prompt tokens counted with the target
  tokenizer over the actual datasets) at the cheapest allowed endpoint, at the expected routing
  mix (OpenRouter's default weights 1/price^2) and at the most expensive one, against the balance.
- `probe` sends the same prompts at temperature 0 with a fixed seed to each endpoint pinned with
  `order` + `allow_fallbacks: false`, and scores token-level prefix agreement with the first-party
  endpoint: a provider serving a model quantized below what it declares answers differently.
  Reasoning and answer are compared apart, each over the shorter of the two: a provider that
  truncates or drops the reasoning it returns (a display quirk stage 03 diagnoses) still serves
  the same model, and must not be excluded for it.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pandas as pd

from .apikey import ApiKey
from .client import Failure, Reply, classify_error, parse_completion, retry_after_seconds
from .datasets import DatasetReader, DatasetSpec
from .progress import Progress
from .retry import backoff_delay

BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "mxfp8": 8, "int8": 8, "fp6": 6,
        "int4": 4, "fp4": 4, "mxfp4": 4, "nvfp4": 4}


class ApiError(RuntimeError):
    def __init__(self, status: int | None, message: str):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status


class Api:
    """A small synchronous OpenRouter client for stage 01's few requests. Answers are classified by
    stage 02's `client` (errors inside 200s, empty answers, 402 kinds) and retried with its backoff."""

    def __init__(self, base_url: str, key: ApiKey, timeout: float = 120.0, attempts: int = 6):
        self.base_url, self.attempts = base_url.rstrip("/"), attempts
        self._http = httpx.Client(headers=key.header(), timeout=timeout)

    def get(self, path: str, **params) -> dict:
        r = self._http.get(self.base_url + path, params=params or None)
        body = _json(r)
        if r.status_code != 200:
            raise ApiError(r.status_code, _message(body))
        return body

    def chat(self, body: dict) -> Reply:
        """A usable non-streaming completion; raises ApiError on what must not be retried or after
        the last attempt."""
        for attempt in range(1, self.attempts + 1):
            try:
                r = self._http.post(self.base_url + "/chat/completions", json=body)
            except (httpx.TimeoutException, httpx.TransportError) as e:
                outcome = Failure("retry", "connection", type(e).__name__)
            else:
                outcome = parse_completion(r.content) if r.status_code == 200 else \
                    classify_error(r.status_code, _json(r).get("error"), retry_after_seconds(r.headers.get("Retry-After")))
            if isinstance(outcome, Reply):
                return outcome
            if outcome.action not in ("retry", "inflight") or attempt == self.attempts:
                raise ApiError(outcome.status, str(outcome))
            time.sleep(backoff_delay(attempt, outcome.retry_after, base=0.25, cap=8.0))
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._http.close()


def _json(r: httpx.Response) -> dict:
    try:
        return json.loads(r.content or b"{}")  # OpenRouter may pad bodies with leading whitespace
    except json.JSONDecodeError:
        return {"error": {"message": f"not JSON: {r.content[:80]!r}"}}


def _message(body: dict) -> str:
    err = body.get("error") or {}
    return str(err.get("message", body))[:300]


# ---- endpoints and policy ----------------------------------------------------------------------

def fetch_endpoints(api: Api, model: str) -> tuple[dict, pd.DataFrame]:
    """The model record and one row per endpoint: provider, tag, quantization, $/M in and out,
    status, uptime, p50 latency (s) and p50 throughput (tokens/s)."""
    models = {m["id"]: m for m in api.get("/models")["data"]}
    if model not in models:
        raise ValueError(f"model {model!r} is not listed by {api.base_url}/models")
    eps = api.get(f"/models/{model}/endpoints")["data"]["endpoints"]
    rows = []
    for e in eps:
        lat, thr = e.get("latency_last_30m") or {}, e.get("throughput_last_30m") or {}
        rows.append({
            "provider": e["provider_name"], "tag": e["tag"], "quantization": e.get("quantization") or "unknown",
            "price_in": float(e["pricing"]["prompt"]) * 1e6, "price_out": float(e["pricing"]["completion"]) * 1e6,
            "status": e.get("status", 0), "uptime": e.get("uptime_last_30m"),
            "latency_p50_s": lat["p50"] / 1000 if lat.get("p50") is not None else None,
            "throughput_p50": thr.get("p50"), "context_length": e.get("context_length"),
            "max_completion_tokens": e.get("max_completion_tokens"),
        })
    return models[model], pd.DataFrame(rows)


def below_native(quantization: str, native: str) -> bool:
    """True when serving at `quantization` loses precision against `native` weights."""
    if quantization == native or quantization not in BITS:
        return False
    return BITS[quantization] <= BITS[native]


def apply_policy(table: pd.DataFrame, native_precision: str, allow_unknown: bool = False) -> pd.DataFrame:
    """The table with `allowed` and `reason` columns."""
    if native_precision not in BITS:
        raise ValueError(f"native_precision {native_precision!r}: expected one of {sorted(BITS)}")
    allowed, reasons = [], []
    for _, row in table.iterrows():
        q = row["quantization"]
        if row["status"] is not None and row["status"] < 0:
            why = f"down (status {row['status']}, uptime {row['uptime']}%)"
        elif below_native(q, native_precision):
            why = f"{q} is below the native {native_precision}"
        elif q == "unknown" and not allow_unknown:
            why = "quantization unknown (allow_unknown_quantization to use it)"
        elif q not in BITS and q != "unknown":
            why = f"unrecognised quantization {q!r}"
        else:
            why = ""
        allowed.append(not why)
        reasons.append(why)
    return table.assign(allowed=allowed, reason=reasons)


def routing_object(policy: pd.DataFrame, native_precision: str, allow_unknown: bool) -> dict:
    """The OpenRouter `provider` object that restricts routing to the allowed endpoints."""
    tags = policy.loc[policy["allowed"], "tag"].tolist()
    if not tags:
        raise ValueError("no endpoint is allowed: every one is down, below native precision or unknown")
    quants = sorted(set(policy.loc[policy["allowed"], "quantization"]) | {native_precision}
                    | ({"unknown"} if allow_unknown else set()))
    return {"only": tags, "quantizations": quants, "allow_fallbacks": True, "require_parameters": True}


def exclusions(policy: pd.DataFrame) -> list[dict]:
    return [{"tag": r["tag"], "provider": r["provider"], "quantization": r["quantization"], "reason": r["reason"]}
            for _, r in policy.iterrows() if not r["allowed"]]


# ---- balance and cost plan -----------------------------------------------------------------------

def balance(api: Api) -> tuple[float | None, str]:
    """USD left: `/key` limit_remaining, else `/credits` credits - usage; None if neither says."""
    key = api.get("/key")["data"]
    if key.get("limit_remaining") is not None:
        return float(key["limit_remaining"]), "/key limit_remaining"
    try:
        c = api.get("/credits")["data"]
    except ApiError as e:
        return None, f"/key has no limit and /credits refused ({e})"
    return float(c["total_credits"]) - float(c["total_usage"]), "/credits total_credits - total_usage"


def mix_weights(allowed: pd.DataFrame) -> pd.Series:
    """OpenRouter's default routing shares: weight 1/price^2 (price = $/M in + out)."""
    w = 1.0 / (allowed["price_in"] + allowed["price_out"]) ** 2
    return w / w.sum()


@dataclass
class DatasetTokens:
    name: str
    prompts: int
    prompt_tokens: int
    output_token_budget: int | None
    skipped: int


def count_prompt_tokens(datasets: list[DatasetSpec], tokenizer) -> list[DatasetTokens]:
    """Prompt tokens of every dataset with the target tokenizer and chat template."""
    out = []
    for spec in datasets:
        reader = DatasetReader(spec)
        total = 0
        with Progress(desc=f"tokens {spec.name}", unit="prompt") as bar:
            for p in reader:
                total += len(tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
                bar.update()
        if reader.problems:
            print(reader.summary())
        out.append(DatasetTokens(spec.name, reader.count, total, spec.output_token_budget, len(reader.problems)))
    return out


def cost_plan(tokens: list[DatasetTokens], allowed: pd.DataFrame, expected_output: float,
              usable_usd: float | None, max_tokens: int) -> pd.DataFrame:
    """Per dataset: samples needed for the output budget, tokens in and out, cost at the cheapest
    / expected mix / most expensive allowed endpoint, and the output tokens the money covers."""
    w = mix_weights(allowed)
    price = {"cheapest": allowed.loc[(allowed["price_in"] + allowed["price_out"]).idxmin()],
             "most_expensive": allowed.loc[(allowed["price_in"] + allowed["price_out"]).idxmax()]}
    mix_in, mix_out = float((w * allowed["price_in"]).sum()), float((w * allowed["price_out"]).sum())
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
        row["cost_cheapest"] = (in_tokens * price["cheapest"]["price_in"] + out_tokens * price["cheapest"]["price_out"]) / 1e6
        row["cost_mix"] = (in_tokens * mix_in + out_tokens * mix_out) / 1e6
        row["cost_most_expensive"] = (in_tokens * price["most_expensive"]["price_in"]
                                      + out_tokens * price["most_expensive"]["price_out"]) / 1e6
        rows.append(row)
    plan = pd.DataFrame(rows)
    total = plan["cost_mix"].sum()
    share = 1.0 if usable_usd is None or total <= usable_usd else max(0.0, usable_usd / total)
    plan["fits_fraction"] = share
    plan["output_tokens_that_fit"] = (plan["output_tokens"] * share).round().astype(int)
    return plan


def pilot(api: Api, model: str, datasets: list[DatasetSpec], samples: int, routing: dict, max_tokens: int,
          temperature: float, top_p: float, seed: int, reasoning: dict) -> pd.DataFrame:
    """Real completions of the first `samples` prompts of each dataset, routed as stage 02 will."""
    bodies = []
    for spec in datasets:
        for i, p in enumerate(DatasetReader(spec)):
            if i >= samples:
                break
            bodies.append((spec.name, {"model": model, "messages": p.messages, "max_tokens": max_tokens,
                                       "temperature": temperature, "top_p": top_p, "seed": seed,
                                       "provider": routing, **({"reasoning": reasoning} if reasoning else {})}))
    rows = _run_all(api, bodies, "pilot")
    return pd.DataFrame([{"dataset": name, "provider": reply.provider,
                          "completion_tokens": reply.usage["completion_tokens"], "cost": reply.usage["cost"] or 0.0}
                         for name, reply in rows])


def _run_all(api: Api, bodies: list[tuple[str, dict]], desc: str) -> list[tuple[str, Reply]]:
    with Progress(total=len(bodies), desc=desc, unit="req") as bar, ThreadPoolExecutor(16) as pool:
        def one(item):
            name, body = item
            reply = api.chat(body)
            bar.update()
            return name, reply
        return list(pool.map(one, bodies))


# ---- fidelity probe --------------------------------------------------------------------------------

def probe_cost(endpoints: pd.DataFrame, prompt_tokens: list[int], max_tokens: int) -> float:
    """Worst-case USD of the probe: every prompt to every endpoint, every answer max_tokens long."""
    p_in, n = sum(prompt_tokens), len(prompt_tokens)
    return float(((endpoints["price_in"] * p_in + endpoints["price_out"] * max_tokens * n) / 1e6).sum())


def probe(api: Api, model: str, endpoints: pd.DataFrame, prompts: list[list[dict]], tokenizer,
          max_tokens: int, seed: int, reference_slug: str) -> pd.DataFrame:
    """Per endpoint and prompt: the answer's tokens vs the reference endpoint's (temperature 0,
    fixed seed, pinned with order + allow_fallbacks false)."""
    bodies = [(tag, {"model": model, "messages": m, "max_tokens": max_tokens, "temperature": 0, "seed": seed,
                     "provider": {"order": [tag], "allow_fallbacks": False}})
              for tag in endpoints["tag"] for m in prompts]
    answers = _run_all(api, bodies, "probe")
    toks = {}
    for (tag, body), (_, reply) in zip(bodies, answers):
        toks[(tag, json.dumps(body["messages"]))] = [
            tokenizer.encode((text or "").strip(), add_special_tokens=False) for text in (reply.reasoning, reply.content)]
    ref_tags = [t for t in endpoints["tag"] if t.split("/")[0] == reference_slug]
    if not ref_tags:
        raise ValueError(f"probe: no endpoint of the first-party provider {reference_slug!r} among "
                         f"{list(endpoints['tag'])}")
    ref = ref_tags[0]
    rows = []
    for tag in endpoints["tag"]:
        for i, m in enumerate(prompts):
            k = json.dumps(m)
            common = compared = 0
            for a, b in zip(toks[(ref, k)], toks[(tag, k)]):  # reasoning, then answer
                n = min(len(a), len(b))
                common += next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), n)
                compared += n
            rows.append({"tag": tag, "prompt": i, "tokens": sum(map(len, toks[(tag, k)])),
                         "reference_tokens": sum(map(len, toks[(ref, k)])),
                         "prefix_agreement": common / max(1, compared)})
    return pd.DataFrame(rows)


def probe_summary(per_prompt: pd.DataFrame, min_agreement: float) -> pd.DataFrame:
    """Median agreement per endpoint (robust to one odd answer) and the outlier flag."""
    s = per_prompt.groupby("tag").agg(agreement=("prefix_agreement", "median"),
                                      mean_agreement=("prefix_agreement", "mean"),
                                      length_ratio=("tokens", "sum")).reset_index()
    ref_len = per_prompt.groupby("tag")["reference_tokens"].sum().reindex(s["tag"]).to_numpy()
    s["length_ratio"] = s["length_ratio"] / ref_len.clip(min=1)
    s["outlier"] = s["agreement"] < min_agreement
    return s


# ---- plots ---------------------------------------------------------------------------------------

def plot_price_throughput(policy: pd.DataFrame, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (q, g) in enumerate(policy.groupby("quantization")):
        color = f"C{i}"
        for allowed, marker in ((True, "o"), (False, "x")):
            part = g[g["allowed"] == allowed]
            if len(part):
                ax.scatter(part["throughput_p50"], part["price_out"], s=60, color=color, marker=marker,
                           label=q if allowed or not g["allowed"].any() else None)
        for _, r in g.iterrows():
            ax.annotate(r["tag"], (r["throughput_p50"], r["price_out"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xlabel("throughput p50 (tokens/s per stream)")
    ax.set_ylabel("$ per million output tokens")
    ax.set_title("Endpoints: price vs throughput (x = excluded)")
    ax.legend(title="quantization", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_cost_vs_balance(plan: pd.DataFrame, balance_usd: float | None, spend_limit: float, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    cols = ["cost_cheapest", "cost_mix", "cost_most_expensive"]
    bottom = pd.Series(0.0, index=cols)
    for _, r in plan.iterrows():
        vals = r[cols].astype(float)
        ax.bar(["cheapest", "expected mix", "most expensive"], vals.to_numpy(), bottom=bottom.to_numpy(),
               label=r["dataset"])
        bottom += vals.to_numpy()
    for x, total in enumerate(bottom.to_numpy()):
        ax.annotate(f"${total:,.4g}", (x, total), ha="center", xytext=(0, 3), textcoords="offset points", fontsize=8)
    if balance_usd is not None:
        ax.axhline(balance_usd, color="black", linestyle="--", label=f"balance ${balance_usd:,.2f}")
    ax.axhline(spend_limit, color="red", linestyle=":", label=f"spend limit ${spend_limit:,.2f}")
    ax.set_yscale("log")  # a small plan and a large balance both stay visible
    ax.set_ylabel("USD (log scale)")
    ax.set_title("Planned cost of the output budget vs the money available")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- stage plumbing ------------------------------------------------------------------------------

def probe_prompts(datasets: list[DatasetSpec], n: int, scan: int = 50) -> list[list[dict]]:
    """The `n` shortest prompts among the first `scan` of each dataset: cheap to probe with."""
    pool = []
    for spec in datasets:
        for i, p in enumerate(DatasetReader(spec)):
            if i >= scan:
                break
            pool.append(p.messages)
    return sorted(pool, key=lambda m: len(json.dumps(m)))[:n]


def worst_case_cost(prompt_tokens: list[int], max_tokens: int, endpoints: pd.DataFrame) -> float:
    """USD if every prompt went to the priciest of `endpoints` and answered max_tokens tokens."""
    return (sum(prompt_tokens) * endpoints["price_in"].max() + len(prompt_tokens) * max_tokens
            * endpoints["price_out"].max()) / 1e6


def write_outputs(folder, model: str, native_precision: str, policy: pd.DataFrame, routing: dict,
                  probe_table: pd.DataFrame | None, plan: pd.DataFrame, summary: dict) -> None:
    """providers/endpoints.csv, routing.json (the provider object and every exclusion), cost_plan.csv,
    probe.csv, summary.json."""
    from pathlib import Path

    folder = Path(folder)
    policy.to_csv(folder / "endpoints.csv", index=False)
    plan.to_csv(folder / "cost_plan.csv", index=False)
    if probe_table is not None:
        probe_table.to_csv(folder / "probe.csv", index=False)
    doc = {"model": model, "native_precision": native_precision, "provider": routing,
           "allowed": routing["only"], "excluded": exclusions(policy)}
    (folder / "routing.json").write_text(json.dumps(doc, indent=1))
    (folder / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
