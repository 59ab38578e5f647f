"""Stage 02 against a bare OpenAI-compatible server (the user's own vLLM or SGLang) instead of
OpenRouter: how it is recognised, and what a request to it carries.

Such a server has no account (`GET /key` answers 404), no endpoint catalogue and no prices, so
stage 02 switches off the balance, the catalogue, routing and cost, and says so; concurrency, the
token budgets, retries and resuming work as with OpenRouter. The server's `GET /models` must list
the `model` asked for; its `owned_by` (`vllm`, `sglang`) names the samples' source, and its
`max_model_len` bounds the prompts. vLLM is asked for the ids it sampled (`return_token_ids`: the
reply carries `choices[i].token_ids` and `prompt_token_ids`), which are saved with each response
and are what stage 03 trains on.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

OPENROUTER_ONLY = ("provider", "reasoning")  # request fields only OpenRouter understands


@dataclass(frozen=True)
class BareServer:
    engine: str                  # `owned_by` of the served model: vllm, sglang, ...
    max_model_len: int | None

    @property
    def returns_ids(self) -> bool:
        return self.engine == "vllm"

    def settings(self, settings: dict) -> dict:
        """The request settings for this server: OpenRouter's own fields left out, the sampled ids
        asked for where the engine returns them, usage asked for in a stream."""
        out = {k: v for k, v in settings.items() if k not in OPENROUTER_ONLY}
        if self.returns_ids:
            out["return_token_ids"] = True
        if out.get("stream"):
            out["stream_options"] = {"include_usage": True}
        return out

    def notice(self, base: str, settings: dict) -> str:
        dropped = [k for k in OPENROUTER_ONLY if settings.get(k)]
        return (f"{base} is a bare OpenAI-compatible server ({self.engine}), not OpenRouter: no balance, no endpoint "
                f"catalogue, no cost, so spend_limit_usd and balance_floor_usd do not apply"
                + (f"; not sent: {', '.join(dropped)} (OpenRouter only)" if dropped else "")
                + ("; the sampled token ids are saved with each response" if self.returns_ids
                   else "; this engine returns no token ids: stage 03 rebuilds them from the text"))


async def probe(session: aiohttp.ClientSession, base: str, model: str) -> BareServer | None:
    """None for OpenRouter (or the local emulator); a BareServer for a server without `/key`.
    Raises ValueError when that server does not serve `model`."""
    try:
        async with session.get(f"{base}/key") as r:
            if r.status != 404:
                return None
        async with session.get(f"{base}/models") as r:
            listing = await r.json(content_type=None) if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None                  # unreachable or odd: the OpenRouter path reports it
    cards = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(cards, list):
        return None
    served = {c.get("id"): c for c in cards if isinstance(c, dict)}
    if model not in served:
        raise ValueError(f"{base} serves {sorted(map(str, served))}, not model {model!r}: set model to the "
                         f"served name (vllm serve --served-model-name)")
    card = served[model]
    length = card.get("max_model_len")
    return BareServer(str(card.get("owned_by") or "openai-compatible"),
                      length if isinstance(length, int) and length > 0 else None)
