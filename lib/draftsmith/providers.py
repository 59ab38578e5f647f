"""Stage 01: which providers serve the model at its native precision, at what price, and how much
of the token budget the balance buys.

- `fetch_endpoints` reads `/models` and `/models/{model}/endpoints` into a table.
- `apply_policy` marks each endpoint allowed or excluded, with the reason: below the native
  precision (a format with fewer bits, or as many bits in another format: int4 QAT weights
  re-quantized to fp4/nvfp4 lose accuracy), `unknown` (excluded unless allowed), down, or not
  listing a parameter we send (we send `require_parameters: true`, so that an endpoint cannot
  silently drop temperature or top_p; OpenRouter then never routes to such an endpoint, so it
  must not be planned or priced either - set `seed: null` if too few endpoints take a seed).
- `routing_object` is the OpenRouter `provider` object stage 02 sends (written to
  providers/routing.json together with every exclusion and its reason); `policy_routing` builds
  the same object for stage 02 when stage 01 did not run.
- `cost_plan` prices the planned output budget per dataset (prompt tokens counted with the target
  tokenizer over the actual datasets) at the cheapest allowed endpoint, at the expected routing
  mix (OpenRouter's default weights 1/price^2) and at the most expensive one, against the balance.
- `probe` sends the same prompts at temperature 0 with a fixed seed to each endpoint pinned with
  `order` + `allow_fallbacks: false`, and scores token-level prefix agreement with the first-party
  endpoint: a provider serving a model quantized below what it declares answers differently.
  Reasoning and answer are compared apart, each over the shorter of the two: a provider that
  truncates or drops the reasoning it returns (a display quirk stage 03 diagnoses) still serves
  the same model, and must not be excluded for it.
- The pilot and the probe are paid for, so their tables are kept (`pilot.csv`, `probe.csv`) and
  reused by a re-run unless asked to refresh; what they cost is added up in `spend.json`, which
  stage 02 counts against the run's `spend_limit_usd`.
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
from .pricing import balance_from, default_prices, lacks_parameters, worst_prices
from .progress import Progress
from .retry import backoff_delay
from .files import write_json_atomic

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
            if outcome.action not in ("retry", "throttle") or attempt == self.attempts:
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
    """The model record and the endpoint table (`endpoint_table`)."""
    models = {m["id"]: m for m in api.get("/models")["data"]}
    if model not in models:
        raise ValueError(f"model {model!r} is not listed by {api.base_url}/models")
    return models[model], endpoint_table(api.get(f"/models/{model}/endpoints")["data"]["endpoints"])


def endpoint_table(eps: list[dict]) -> pd.DataFrame:
    """One row per endpoint: provider, tag, quantization, $/M in and out at the default conditions
    after any discount, the worst $/M in and out (overrides, internal reasoning) and $ per request,
    the parameters it supports, status, uptime, p50 latency (s) and p50 throughput (tokens/s)."""
    rows = []
    for e in eps:
        lat, thr = e.get("latency_last_30m") or {}, e.get("throughput_last_30m") or {}
        (p_in, p_out, _), (w_in, w_out, w_req) = default_prices(e), worst_prices(e)
        params = e.get("supported_parameters")
        rows.append({
            "provider": e["provider_name"], "tag": e["tag"], "quantization": e.get("quantization") or "unknown",
            "price_in": p_in * 1e6, "price_out": p_out * 1e6, "price_in_worst": w_in * 1e6,
            "price_out_worst": w_out * 1e6, "price_request": w_req,
            "supported_parameters": ",".join(params) if isinstance(params, list) else None,
            "status": e.get("status", 0), "uptime": e.get("uptime_last_30m"),
            "latency_p50_s": lat["p50"] / 1000 if lat.get("p50") is not None else None,
            "throughput_p50": thr.get("p50"), "context_length": e.get("context_length"),
            "max_completion_tokens": e.get("max_completion_tokens"),
        })
    return pd.DataFrame(rows)


def below_native(quantization: str, native: str) -> bool:
    """True when serving at `quantization` loses precision against `native` weights."""
    if quantization == native or quantization not in BITS:
        return False
    return BITS[quantization] <= BITS[native]


def apply_policy(table: pd.DataFrame, native_precision: str, allow_unknown: bool = False,
                 sent: set[str] = frozenset()) -> pd.DataFrame:
    """The table with `allowed` and `reason` columns; `sent`: the parameters every request sends
    (with `require_parameters: true`, an endpoint that does not list one of them is never used)."""
    if native_precision not in BITS:
        raise ValueError(f"native_precision {native_precision!r}: expected one of {sorted(BITS)}")
    allowed, reasons = [], []
    for _, row in table.iterrows():
        q = row["quantization"]
        listed = row.get("supported_parameters")
        lacking = lacks_parameters({"supported_parameters": listed.split(",") if isinstance(listed, str) else None},
                                   sent)
        if row["status"] is not None and row["status"] < 0:
            why = f"down (status {row['status']}, uptime {row['uptime']}%)"
        elif below_native(q, native_precision):
            why = f"{q} is below the native {native_precision}"
        elif q == "unknown" and not allow_unknown:
            why = "quantization unknown (allow_unknown_quantization to use it)"
        elif q not in BITS and q != "unknown":
            why = f"unrecognised quantization {q!r}"
        elif lacking:
            why = (f"does not support {', '.join(lacking)}, which every request sends with require_parameters "
                   f"(OpenRouter never routes it there; set the parameter to null to drop it)")
        else:
            why = ""
        allowed.append(not why)
        reasons.append(why)
    return table.assign(allowed=allowed, reason=reasons)


def routing_object(policy: pd.DataFrame, native_precision: str, allow_unknown: bool) -> dict:
    """The OpenRouter `provider` object that restricts routing to the allowed endpoints."""
    tags = policy.loc[policy["allowed"], "tag"].tolist()
    if not tags:
        reasons = "; ".join(f"{r['tag']}: {r['reason']}" for _, r in policy.iterrows())
        raise ValueError(f"no endpoint is allowed: {reasons}")
    quants = sorted(set(policy.loc[policy["allowed"], "quantization"]) | {native_precision}
                    | ({"unknown"} if allow_unknown else set()))
    return {"only": tags, "quantizations": quants, "allow_fallbacks": True, "require_parameters": True}


def exclusions(policy: pd.DataFrame) -> list[dict]:
    return [{"tag": r["tag"], "provider": r["provider"], "quantization": r["quantization"], "reason": r["reason"]}
            for _, r in policy.iterrows() if not r["allowed"]]


def policy_routing(eps: list[dict], native_precision: str, allow_unknown: bool,
                   sent: set[str]) -> tuple[dict, list[dict]]:
    """Stage 02 without stage 01: the same precision policy over the endpoint list, as the provider
    object and the exclusions (there is no fidelity probe here)."""
    policy = apply_policy(endpoint_table(eps), native_precision, allow_unknown, sent)
    return routing_object(policy, native_precision, allow_unknown), exclusions(policy)


# ---- balance and cost plan -----------------------------------------------------------------------

def balance(api: Api) -> tuple[float | None, str]:
    """USD left and its source, read as stage 02 reads it (`pricing.balance_from`)."""
    key = api.get("/key")["data"]
    try:
        credits, note = api.get("/credits")["data"], ""
    except ApiError as e:
        credits, note = None, f" (/credits refused: {e})"
    usd, source = balance_from(key, credits)
    return usd, source + note


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
    usable = balance_usd if by_balance else spend_limit_usd
    money = f"The balance (${usable:,.2f})" if by_balance else f"spend_limit_usd (${usable:,.2f})"
    if fit >= want:
        return f"{money} covers the plan: ${total:,.2f} at the expected mix for {want:,} output tokens."
    return (f"{money} does NOT cover the plan: ${total:,.2f} at the expected mix for "
            f"{want:,} output tokens; it buys {fit:,} of them ({100 * fit / want:.0f}%). Stage 02 will stop "
            f"when it runs out: {'top up' if by_balance else 'raise spend_limit_usd by'} about "
            f"${total - usable:,.2f} (and re-run stage 02) to finish.")


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

def _worst(endpoints: pd.DataFrame) -> tuple[pd.Series, pd.Series, pd.Series]:
    """Worst $/M in, $/M out and $ per request of each endpoint (the default prices if the table
    has no worst-case columns)."""
    zero = pd.Series(0.0, index=endpoints.index)
    return (endpoints.get("price_in_worst", endpoints["price_in"]),
            endpoints.get("price_out_worst", endpoints["price_out"]), endpoints.get("price_request", zero))


def probe_cost(endpoints: pd.DataFrame, prompt_tokens: list[int], max_tokens: int) -> float:
    """Worst-case USD of the probe: every prompt to every endpoint, every answer max_tokens long."""
    p_in, n = sum(prompt_tokens), len(prompt_tokens)
    w_in, w_out, w_req = _worst(endpoints)
    return float(((w_in * p_in + w_out * max_tokens * n) / 1e6 + w_req * n).sum())


def probe(api: Api, model: str, endpoints: pd.DataFrame, prompts: list[list[dict]], tokenizer,
          max_tokens: int, seed: int, reference_slug: str) -> pd.DataFrame:
    """Per endpoint and prompt: the answer's tokens vs the reference endpoint's (temperature 0,
    fixed seed, pinned with order + allow_fallbacks false)."""
    bodies = [(tag, {"model": model, "messages": m, "max_tokens": max_tokens, "temperature": 0, "seed": seed,
                     "provider": {"order": [tag], "allow_fallbacks": False}})
              for tag in endpoints["tag"] for m in prompts]
    answers = _run_all(api, bodies, "probe")
    toks, costs = {}, {}
    for (tag, body), (_, reply) in zip(bodies, answers):
        costs[(tag, json.dumps(body["messages"]))] = reply.usage["cost"] or 0.0
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
            rows.append({"tag": tag, "prompt": i, "tokens": sum(map(len, toks[(tag, k)])), "cost": costs[(tag, k)],
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
    # linear, so stacked segments keep their true share; a line far above the bars is named, not drawn
    top = 1.3 * max(float(bottom.max()), 1e-9)
    lines = [(spend_limit, "red", ":", "spend limit")] + ([] if balance_usd is None else
                                                           [(balance_usd, "black", "--", "balance")])
    for value, color, style, name in lines:
        label = f"{name} ${value:,.2f}"
        if value <= 3 * top:
            ax.axhline(value, color=color, linestyle=style, label=label)
            top = max(top, 1.1 * value)
        else:
            ax.plot([], [], color=color, linestyle=style, label=f"{label} (above the chart)")
    ax.set_ylim(0, top)
    ax.set_ylabel("USD")
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
    w_in, w_out, w_req = _worst(endpoints)
    n = len(prompt_tokens)
    return (sum(prompt_tokens) * w_in.max() + n * max_tokens * w_out.max()) / 1e6 + n * w_req.max()


def reuse(folder, name: str, refresh: bool) -> pd.DataFrame | None:
    """`<name>.csv` of an earlier run of this stage (the pilot or the probe, paid for already),
    unless `refresh`; None when there is none."""
    from pathlib import Path

    path = Path(folder) / f"{name}.csv"
    if refresh or not path.is_file():
        return None
    print(f"{name}: reusing {path} (paid for by an earlier run of this stage; refresh_providers: true to redo it)")
    return pd.read_csv(path)


def record_spend(folder, what: str, usd: float) -> float:
    """Add what a paid step of this stage cost to `spend.json`; returns the stage's total so far."""
    from pathlib import Path

    path = Path(folder) / "spend.json"
    doc = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"steps": {}}
    doc["steps"][what] = round(doc["steps"].get(what, 0.0) + float(usd), 10)
    doc["total_usd"] = round(sum(doc["steps"].values()), 10)
    write_json_atomic(path, doc)
    return doc["total_usd"]


def check_spend(folder, worst_usd: float, spend_limit_usd: float) -> None:
    """Refuse a paid step whose worst case would take this run past its spend limit."""
    done = spent(folder)
    if done + worst_usd > spend_limit_usd:
        raise RuntimeError(f"stage 01 has spent ${done:.4f} of spend_limit_usd ${spend_limit_usd:.2f}; the next step "
                           f"could cost ${worst_usd:.4f}: raise spend_limit_usd, or set expected_output_tokens / "
                           f"probe_prompts: 0 to skip the pilot / the probe")


def spent(folder) -> float:
    """USD stage 01 has spent in this run (its pilots and probes), 0 if it never ran."""
    from pathlib import Path

    path = Path(folder) / "spend.json"
    if not path.is_file():
        return 0.0
    try:
        return float(json.loads(path.read_text(encoding="utf-8"))["total_usd"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not the file stage 01 writes ({type(e).__name__}: {e}); "
                         f"re-run stage 01 or remove it") from None


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
