"""The account behind the API key: who may call, what a request may spend, what was billed.

The user's key guards every endpoint but the public catalogue; the admin key guards the top-up.
GET key, credits and generation?id= answer from the credit ledger, POST admin/topup adds to it.
Before a chat request is served it passes the money checks here: 403 when the key lacks
permission or its own budget is spent, 402 when its worst-case cost does not fit the key's whole
limit, the balance, or the in-flight budget (a share of the balance held by the requests running;
`hold` reserves a request's worst case while it runs). Every 402 carries the `limit_source` and a
`remedy_hint`; the in-flight budget's also `Retry-After`, and only its `limit_source`
(`openrouter_in_flight_budget`) tells it from a balance shortage: its message is the same "can
only afford" text, as 402s met in the wild are.

The state behind it (`Ledger`, `read_ledger`, `top_up`: account.jsonl and ledger.jsonl in the
state folder, surviving restarts) is the file's second half.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import secrets
import time
from contextlib import contextmanager
from pathlib import Path

from aiohttp import web

from .catalogue import Endpoint, prices, worst_case
from .config import EmulatorConfig
from .wire import API, error_response


_REMEDY = {
    "openrouter_credits": "Add credits at https://openrouter.ai/settings/credits, or lower max_tokens.",
    "openrouter_key_limit": "Raise this API key's credit limit, or lower max_tokens.",
    "openrouter_in_flight_budget": "Retry after your in-flight requests settle (see the Retry-After header). "
                                   "Adding credits raises your in-flight budget, up to a capped ceiling.",
}


def _payment_required(message: str, limit_source: str, reason: str | None = None, retry_after: int | None = None):
    meta = {"error_type": "payment_required", "limit_source": limit_source, "remedy_hint": _REMEDY[limit_source]}
    headers = None
    if reason is not None:
        meta |= {"reason": reason, "code": reason}  # `code`: the name the emulator used before
    if retry_after is not None:
        meta["retry_after_seconds"] = retry_after
        headers = {"Retry-After": str(retry_after)}
    return error_response(402, message, meta, headers)


class Accounts:
    """Keys, credits and the requests' money checks of one emulator."""

    def __init__(self, cfg: EmulatorConfig, key: str, admin_key: str | None, ledger: Ledger):
        self.cfg, self.ledger = cfg, ledger
        self._key, self._admin_key = key, admin_key
        self.reserved = 0.0  # worst-case USD of the requests in flight
        self.in_flight = 0

    # ---- keys ------------------------------------------------------------------------------------

    @web.middleware
    async def auth(self, request: web.Request, handler):
        path = request.path
        if path.startswith(f"{API}/models") or path.startswith(f"{API}/admin/"):
            return await handler(request)  # the catalogue is public; admin checks its own key
        auth = request.headers.get("Authorization", "")
        if not auth:
            return error_response(401, "No auth credentials found")
        if not auth.startswith("Bearer ") or not secrets.compare_digest(auth[7:].strip(), self._key):
            return error_response(401, "User not found.")
        return await handler(request)

    def admin_denied(self, request):
        if not self._admin_key:
            return error_response(403, "admin endpoint disabled: no admin_key configured")
        auth = request.headers.get("Authorization", "")
        if not secrets.compare_digest(auth[7:].strip() if auth.startswith("Bearer ") else "", self._admin_key):
            return error_response(401, "admin key required")
        return None

    # ---- what the account answers ----------------------------------------------------------------

    def _key_budget(self) -> dict | None:
        """The key's own limit as a `/key` budget entry: `key_budget_usd`, else (with `key_capped`)
        the credits; None when the key is uncapped."""
        led = self.ledger
        _ = led.balance  # picks up top-ups written by another process
        limit = self.cfg.key_budget_usd
        if limit is None and self.cfg.key_capped:
            limit = led.total_credits
        if limit is None:
            return None
        return {"budget_id": None, "guardrail_id": None, "include_byok": False, "limit_usd": limit,
                "remaining_usd": max(0.0, limit - led.total_usage), "reset_interval": None, "resets_at": None,
                "scope": "key_limit", "spend_usd": led.total_usage}

    async def key(self, request):
        led = self.ledger
        budget = self._key_budget()
        return web.json_response({"data": {
            "label": self.cfg.label, "limit": budget["limit_usd"] if budget else None,
            "limit_remaining": budget["remaining_usd"] if budget else None, "limit_reset": None,
            "budgets": [budget] if budget else [], "effective_budget": budget,
            "include_byok_in_limit": False, "usage": led.total_usage, "usage_daily": led.usage_daily,
            "usage_weekly": led.total_usage, "usage_monthly": led.total_usage,
            "byok_usage": led.byok_usage, "byok_usage_daily": led.byok_usage_daily,
            "byok_usage_weekly": led.byok_usage, "byok_usage_monthly": led.byok_usage,
            "is_free_tier": False, "is_management_key": False, "is_provisioning_key": False,
            "allowed_data_regions": ["global"], "creator_user_id": None, "organization_id": None,
            "workspace_id": None, "free_model_daily_requests": {"limit": 1000, "remaining": 1000, "used": 0},
            "rate_limit": {"requests": -1, "interval": "10s", "note": "deprecated: always -1"}}})

    async def credits(self, request):
        if self.cfg.credits_need_management_key:
            return error_response(403, "Only management keys can fetch credits")
        led = self.ledger
        _ = led.balance  # picks up top-ups written by another process
        return web.json_response({"data": {"total_credits": led.total_credits, "total_usage": led.total_usage}})

    async def generation(self, request):
        gen_id = request.query.get("id", "")
        if not gen_id:
            return error_response(400, "Missing required query parameter: id")
        rec = self.ledger.generation(gen_id)
        if rec is None:
            return error_response(404, f"Generation {gen_id} not found")
        return web.json_response({"data": {
            "id": rec["generation_id"], "total_cost": rec["cost"], "usage": rec["cost"],
            "upstream_inference_cost": rec.get("upstream_inference_cost"), "is_byok": rec.get("is_byok", False),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rec["time"])),
            "model": rec["model"], "origin": "", "upstream_id": None, "cache_discount": None,
            "app_id": None, "streamed": rec["stream"], "cancelled": rec["cancelled"], "api_type": "completions",
            "provider_name": rec["provider_name"], "latency": rec.get("latency_ms"), "moderation_latency": None,
            "generation_time": rec.get("generation_ms"), "finish_reason": rec["finish_reason"],
            "native_finish_reason": rec.get("native_finish_reason"),
            "tokens_prompt": rec["prompt_tokens"], "tokens_completion": rec["completion_tokens"],
            "native_tokens_prompt": rec["prompt_tokens"], "native_tokens_completion": rec["completion_tokens"],
            "native_tokens_reasoning": rec["reasoning_tokens"], "native_tokens_cached": 0,
            "native_tokens_completion_images": None, "num_media_prompt": None, "num_media_completion": None,
            "num_search_results": None, "num_fetches": None, "num_input_audio_prompt": None,
            "provider_responses": [{"status": a["status"], "endpoint_id": a["provider"]} for a in rec["attempts"]],
            "data_region": "global", "external_user": None, "http_referer": None, "preset_id": None,
            "router": None, "service_tier": None, "user_agent": None, "web_search_engine": None,
            "workspace_id": None}})

    async def admin_topup(self, request):
        bad = self.admin_denied(request)
        if bad:
            return bad
        try:
            body = await request.json()
            amount = body["amount"]
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
                raise ValueError
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            return error_response(400, 'body must be {"amount": <positive USD>}')
        self.ledger.top_up(float(amount))
        led = self.ledger
        return web.json_response({"data": {"total_credits": led.total_credits, "total_usage": led.total_usage,
                                           "balance": led.balance}})

    # ---- a chat request's money ------------------------------------------------------------------

    def key_denied(self):
        """403 before routing: the key lacks permission, or its own budget is spent."""
        if self.cfg.key_forbidden:
            return error_response(403, "This API key is not allowed to make this request.",
                                  {"error_type": "permission_denied"})
        limit, spent = self.cfg.key_budget_usd, self.ledger.total_usage
        if limit is not None and spent >= limit:
            return error_response(403, f"Key limit exceeded: this key has spent ${spent:.6f} of its ${limit:.6f} limit.",
                                  {"error_type": "permission_denied", "limit_source": "openrouter_key_limit",
                                   "scope": "key_limit", "limit_usd": limit, "spend_usd": spent,
                                   "resets_at": None})
        return None

    def worst_case(self, candidates: list[Endpoint], prompt_tokens: int, max_tokens: int) -> float:
        """What the request may cost this account at most, over the endpoints it may be served by."""
        worst = max(worst_case(e, prompt_tokens, max_tokens) for e in candidates)
        if self.cfg.byok:  # the provider bills the user; OpenRouter holds only its fee
            worst *= self.cfg.byok_fee_rate
        return worst

    def credit_check(self, candidates, prompt_tokens: int, max_tokens: int, worst: float):
        """402 when this request's worst case does not fit: the key's whole limit, the balance, or
        the in-flight budget (a share of the balance held by the requests running)."""
        balance = self.ledger.balance
        limit = self.cfg.key_budget_usd
        if limit is not None and worst > limit:  # (a key budget merely spent is a 403, see key_denied)
            return _payment_required(f"Request weight (${worst:.6f} worst case) exceeds this key's whole "
                                     f"limit (${limit:.6f}).", "openrouter_key_limit", "weight_exceeds_budget")
        if worst > balance:
            return _payment_required(self._cannot_afford(candidates, prompt_tokens, max_tokens, balance),
                                     "openrouter_credits")
        if self.cfg.in_flight_budget is not None and not self.cfg.byok:
            budget = balance * self.cfg.in_flight_budget
            if worst > budget:
                return _payment_required(f"Request weight (${worst:.6f} worst case) exceeds your in-flight "
                                         f"spending budget (${budget:.6f}).", "openrouter_credits",
                                         "weight_exceeds_budget")
            if self.reserved + worst > budget:
                left = max(0.0, budget - self.reserved)
                return _payment_required(self._cannot_afford(candidates, prompt_tokens, max_tokens, left),
                                         "openrouter_in_flight_budget", retry_after=1)
        return None

    def _cannot_afford(self, candidates, prompt_tokens: int, max_tokens: int, usd: float) -> str:
        dearest = max(candidates, key=lambda e: worst_case(e, prompt_tokens, max_tokens))
        p = prices(dearest, prompt_tokens)
        per_token = max(p.completion, p.reasoning) * (self.cfg.byok_fee_rate if self.cfg.byok else 1.0)
        afford = max(0, math.floor((usd - prompt_tokens * p.prompt / 1e6) * 1e6 / per_token))
        return ("This request requires more credits, or fewer max_tokens. You requested up "
                f"to {max_tokens} tokens, but can only afford {afford}. To increase, visit "
                "https://openrouter.ai/settings/credits and add more credits")

    @contextmanager
    def hold(self, worst: float):
        """The request's worst case counts against the in-flight budget while it runs."""
        self.reserved += worst
        self.in_flight += 1
        try:
            yield
        finally:
            self.reserved -= worst
            self.in_flight -= 1


# ------------------------------------------------------------------------------------------------
# The emulator's persistent state: the account and the request ledger, in one state folder.
#
#     <state_dir>/account.jsonl   one line per credit event: {"time", "type": "credits", "amount", "note"}
#     <state_dir>/ledger.jsonl    one line per request that reached a provider (see LEDGER_FIELDS)
#
# Balance = sum of credit events - sum of ledger costs, so it survives a restart and two emulators
# started one after the other on the same folder (stage 01, then stage 02) see the same account.
# Every line is written with one `write` on an O_APPEND descriptor; a line cut short by a crash is
# dropped when the folder is next opened. `top_up(state_dir, usd)` adds credits while the server is
# stopped or running (a running server notices the new line at its next balance check).


LEDGER_FIELDS = ("generation_id", "time", "status", "provider", "endpoint", "provider_name", "model",
                 "prompt_key", "prompt_tokens", "completion_tokens", "reasoning_tokens", "cost",
                 "output_ids", "finish_reason", "cancelled", "billed", "stream", "attempts", "quirks", "error")


def _append(path: Path, record: dict) -> None:
    line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _read_lines(path: Path, offsets: list[int] | None = None) -> list[dict]:
    """Whole JSON lines of `path` (and, into `offsets`, where each starts); a torn last line
    (crash mid-write) is cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    out, at = [], 0
    for i, line in enumerate(data.split(b"\n")[:-1], 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: corrupt line: {e}") from None
            if offsets is not None:
                offsets.append(at)
        at += len(line) + 1
    return out


def top_up(state_dir: str | os.PathLike, usd: float, note: str = "top-up") -> None:
    """Add `usd` of credits to the account in `state_dir` (server running or not)."""
    if not (isinstance(usd, (int, float)) and usd > 0):
        raise ValueError(f"top-up amount must be a positive number of USD, got {usd!r}")
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    _append(d / "account.jsonl", {"time": time.time(), "type": "credits", "amount": float(usd), "note": note})


def read_ledger(state_dir: str | os.PathLike) -> list[dict]:
    """Every ledger line of `state_dir` (for tests and for checking what was billed)."""
    return _read_lines(Path(state_dir) / "ledger.jsonl")


class Ledger:
    """Account totals and ledger of one state folder, held open by one server at a time."""

    def __init__(self, state_dir: str | os.PathLike, initial_credits: float):
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.dir / "emulator.lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(f"emulator state dir {self.dir} is in use by another running emulator") from None
        self._ledger_fd = None
        self.account_path = self.dir / "account.jsonl"
        self.ledger_path = self.dir / "ledger.jsonl"
        if not self.account_path.exists():
            self.account_path.touch()
            if initial_credits > 0:
                top_up(self.dir, initial_credits, "initial credits")
        self.total_credits = 0.0
        self._account_size = 0
        self._refresh_credits()
        self.total_usage = 0.0
        self.usage_daily = 0.0
        self.byok_usage = 0.0  # upstream cost paid with the user's own provider keys
        self.byok_usage_daily = 0.0
        self.count = 0
        # id -> (byte offset of its ledger line, visible from this monotonic time): /generation reads
        # the line back, so memory stays an int per request however long the run
        self.generations: dict[str, tuple[int, float]] = {}
        day0, offsets = _day_start(), []
        for rec, at in zip(_read_lines(self.ledger_path, offsets), offsets):
            self._account(rec, day0)
            self.generations[rec["generation_id"]] = (at, 0.0)
        self._ledger_fd = os.open(self.ledger_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._ledger_fd).st_size

    def _refresh_credits(self) -> None:
        size = self.account_path.stat().st_size
        if size != self._account_size:
            self.total_credits = sum(e["amount"] for e in _read_lines(self.account_path) if e.get("type") == "credits")
            self._account_size = self.account_path.stat().st_size

    def _account(self, rec: dict, day0: float) -> None:
        self.count += 1
        cost = rec.get("cost") or 0.0
        byok = (rec.get("upstream_inference_cost") or 0.0) if rec.get("is_byok") else 0.0
        self.total_usage += cost
        self.byok_usage += byok
        if rec.get("time", 0) >= day0:
            self.usage_daily += cost
            self.byok_usage_daily += byok

    @property
    def balance(self) -> float:
        self._refresh_credits()
        return self.total_credits - self.total_usage

    def top_up(self, usd: float, note: str = "top-up (admin endpoint)") -> None:
        top_up(self.dir, usd, note)
        self._refresh_credits()

    def record(self, rec: dict, visible_after_s: float = 0.0) -> None:
        missing = [f for f in LEDGER_FIELDS if f not in rec]
        if missing:
            raise ValueError(f"ledger record lacks {missing}")
        line = (json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        os.write(self._ledger_fd, line)
        self._account(rec, _day_start())
        self.generations[rec["generation_id"]] = (self._size, time.monotonic() + visible_after_s)
        self._size += len(line)

    def generation(self, gen_id: str) -> dict | None:
        """The ledger line of `gen_id`, or None while it is unknown or not yet visible."""
        hit = self.generations.get(gen_id)
        if hit is None or time.monotonic() < hit[1]:
            return None
        with open(self.ledger_path, "rb") as f:
            f.seek(hit[0])
            return json.loads(f.readline())

    def close(self) -> None:
        if self._ledger_fd is not None:
            os.close(self._ledger_fd)
            self._ledger_fd = None
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()


def _day_start() -> float:
    t = time.gmtime()
    return time.time() - (t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec)
