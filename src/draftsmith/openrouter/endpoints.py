"""The model's endpoints as a table, and the precision policy: which of them stage 02 may route to,
and why not the others. The endpoint list itself is read by `pricing.fetch_endpoints` (stage 01
through `api.Api.endpoints`).

`apply_policy` marks each endpoint allowed or excluded, with the reason: below the native
precision (`pricing.below_native`), `unknown` (excluded unless allowed), down, or not listing
a parameter we send (we send `require_parameters: true`, so that an endpoint cannot silently drop
temperature or top_p; OpenRouter then never routes to such an endpoint, so it must not be planned
or priced either - set `seed: null` if too few endpoints take a seed). `routing_object` is the
OpenRouter `provider` object stage 02 sends; `policy_routing` builds the same object for stage 02
when stage 01 did not run.
"""

from __future__ import annotations

import pandas as pd

from .pricing import BITS, Prices, below_native, default_prices, lacks_parameters, worst_prices


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


def table_worst_prices(table: pd.DataFrame) -> list[Prices]:
    """Each endpoint's worst prices (`pricing.worst_prices`), read back from the table's columns."""
    return [Prices(r["price_in_worst"] / 1e6, r["price_out_worst"] / 1e6, r["price_request"])
            for _, r in table.iterrows()]


def apply_policy(table: pd.DataFrame, native_precision: str, allow_unknown_quantization: bool,
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
        elif q == "unknown" and not allow_unknown_quantization:
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


def routing_object(policy: pd.DataFrame, native_precision: str, allow_unknown_quantization: bool) -> dict:
    """The OpenRouter `provider` object that restricts routing to the allowed endpoints."""
    tags = policy.loc[policy["allowed"], "tag"].tolist()
    if not tags:
        reasons = "; ".join(f"{r['tag']}: {r['reason']}" for _, r in policy.iterrows())
        raise ValueError(f"no endpoint is allowed: {reasons}")
    quants = sorted(set(policy.loc[policy["allowed"], "quantization"]) | {native_precision}
                    | ({"unknown"} if allow_unknown_quantization else set()))
    return {"only": tags, "quantizations": quants, "allow_fallbacks": True, "require_parameters": True}


def exclusions(policy: pd.DataFrame) -> list[dict]:
    return [{"tag": r["tag"], "provider": r["provider"], "quantization": r["quantization"], "reason": r["reason"]}
            for _, r in policy.iterrows() if not r["allowed"]]


def policy_routing(eps: list[dict], native_precision: str, allow_unknown_quantization: bool,
                   sent: set[str]) -> tuple[dict, list[dict]]:
    """Stage 02 without stage 01: the same precision policy over the endpoint list, as the provider
    object and the exclusions (there is no fidelity probe here)."""
    policy = apply_policy(endpoint_table(eps), native_precision, allow_unknown_quantization, sent)
    return routing_object(policy, native_precision, allow_unknown_quantization), exclusions(policy)
