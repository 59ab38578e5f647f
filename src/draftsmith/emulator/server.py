"""The local OpenRouter: an aiohttp app speaking the OpenRouter API over simulated providers.

Endpoints (under /api/v1): POST chat/completions (JSON or SSE), GET key, credits, generation?id=,
models, models/{author}/{slug}/endpoints; POST admin/topup and GET admin/state (emulator only,
admin key). The parts, one concern each: `accounts` (keys, credits, the ledger, the 403/402 money
checks), `listing` (the public catalogue), `chat` (a request from its body to the endpoint that
answers it: `request` parses it, `routing` orders the endpoints), `cache` (OpenRouter's response
cache) and `response` (generating, pacing, faults, quirks, billing, the ledger line). The wire format is the one OpenRouter documents
(field names, error envelope, `X-Generation-Id` header, padding, SSE comments, usage chunk); every
response validates against the official SDK's models (tests/test_openrouter_conformance.py).
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from pathlib import Path

from aiohttp import web

from .accounts import Accounts
from .backends import Vocab
from .catalogue import LOGPROB_PARAMETERS
from .chat import Chat
from .config import EmulatorConfig
from .ledger import Ledger
from .listing import Listing
from .response import Responses
from .synthetic import SyntheticBackend
from .wire import API


def _tokenizer(target_model_path: str | None):
    """The target tokenizer (of the checkpoint, or the built-in one). The emulator plays the
    provider, which runs the tokenizer code a checkpoint ships (Kimi-K2.5's): it trusts that code.
    The runner never gets here with such a checkpoint unless the user set trust_remote_code
    (`draftsmith.preflight`)."""
    from ..targets.checkpoint import load_tokenizer
    from ..targets.tiny import make_tokenizer

    if not target_model_path:
        return make_tokenizer()
    return load_tokenizer(target_model_path, trust_remote_code=True, log=lambda *a: None)


@lru_cache(maxsize=4)
def _vocab(target_model_path: str | None) -> Vocab:
    """The target's tokenizer and token facts; loaded once per process."""
    return Vocab(_tokenizer(target_model_path))


class Emulator:
    """One emulator: its target, backend and ledger, and the parts that answer; `app()` serves them."""

    def __init__(self, config: EmulatorConfig, key: str, state_dir: str | Path, admin_key: str | None = None):
        if not key:
            raise ValueError("the emulator needs an API key to accept")
        self.cfg = config
        endpoints = config.endpoints()
        if config.backend == "synthetic":  # no model to compute logprobs with: no endpoint lists them
            endpoints = [e.model_copy(update={"supported_parameters": [p for p in e.supported_parameters
                                                                        if p not in LOGPROB_PARAMETERS]})
                         for e in endpoints]
        self.ledger = Ledger(state_dir, config.credits)
        self.state_dir = Path(state_dir)
        self.vocab = _vocab(config.target_model_path)
        self.tokenizer = self.vocab.tokenizer
        self.backend = self._load_backend()
        self.stats: Counter[str] = Counter()
        self.accounts = Accounts(config, key, admin_key or config.admin_key, self.ledger)
        self.listing = Listing(config.model, endpoints)
        self.chat = Chat(config, endpoints, self.vocab, self.accounts,
                         Responses(config, self.vocab, self.backend, self.ledger, self.stats), self.stats)

    def _load_backend(self):
        if self.cfg.backend == "model":
            if not self.cfg.target_model_path:
                raise ValueError("emulator config: backend 'model' needs target_model_path")
            from ..targets.checkpoint import resolve_target
            from .model import ModelBackend

            return ModelBackend(resolve_target(self.cfg.target_model_path, log=lambda *a: None), self.vocab,
                                max_batch=self.cfg.max_batch, threads=self.cfg.threads,
                                canonical=self.cfg.canonical, seed=self.cfg.seed)
        return SyntheticBackend(self.vocab, self.cfg.synthetic_tokens, self.cfg.synthetic_reasoning_fraction)

    def close(self) -> None:
        if hasattr(self.backend, "close"):
            self.backend.close()
        self.ledger.close()

    def app(self) -> web.Application:
        acc, listing = self.accounts, self.listing
        app = web.Application(middlewares=[acc.auth], client_max_size=64 * 2**20)
        app.add_routes([
            web.post(f"{API}/chat/completions", self.chat.handle),
            web.get(f"{API}/key", acc.key),
            web.get(f"{API}/credits", acc.credits),
            web.get(f"{API}/generation", acc.generation),
            web.get(f"{API}/models", listing.models),
            web.get(f"{API}/models/{{author}}/{{slug}}/endpoints", listing.model_endpoints),
            web.post(f"{API}/admin/topup", acc.admin_topup),
            web.get(f"{API}/admin/state", self.admin_state),
        ])
        return app

    async def admin_state(self, request):
        bad = self.accounts.admin_denied(request)
        if bad:
            return bad
        acc = self.accounts
        return web.json_response({"data": {
            "in_flight": acc.in_flight, "reserved": acc.reserved, "active": dict(self.chat.active),
            "balance": self.ledger.balance, "ledger_lines": self.ledger.count, "stats": dict(self.stats),
            "model_steps": getattr(self.backend, "steps", None)}})
