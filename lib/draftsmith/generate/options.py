"""What stage 02 is told (`Options`, the notebook's parameters that shape the engine) and what it
answers (`GenerationResult`; `raise_if_incomplete` makes a stopped run fail its notebook)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Options:
    """How the engine behaves (the notebook's stage 02 parameters)."""

    concurrency: int
    spend_limit_usd: float
    balance_floor_usd: float = 0.0
    # Stop for a top-up once money keeps fewer than this share of the slots busy and cannot finish
    # the job anyway (0: spend down to the floor first, however few requests that keeps in flight).
    money_bound_stop_fraction: float = 0.5
    max_attempts: int = 6
    request_timeout_s: float = 600.0     # no byte for this long: a hung connection
    stop_grace_s: float = 30.0
    balance_poll_s: float = 15.0
    fsync_s: float = 5.0
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    recovery_patience_s: float = 120.0   # how long to keep asking /generation the cost of a lost answer
    outage_limit_s: float = 300.0        # only retryable availability errors for this long: stop (outage.py)
    target_model_path: str | None = None  # its tokenizer measures prompts that may be too long
    trust_remote_code: bool = False       # loading that tokenizer may run its own code (Kimi-K2.5)

    def __post_init__(self):
        for name in ("concurrency", "max_attempts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.request_timeout_s or self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s!r}")
        if not self.outage_limit_s or self.outage_limit_s <= 0:
            raise ValueError(f"outage_limit_s must be positive, got {self.outage_limit_s!r}")
        if not 0 <= self.money_bound_stop_fraction <= 1:
            raise ValueError(f"money_bound_stop_fraction must be between 0 and 1, got {self.money_bound_stop_fraction!r}")


@dataclass
class GenerationResult:
    status: str                 # finished | stopped
    reason: str                 # finished | nothing_to_do | balance | spend_limit | fatal | unavailable | interrupted
    #                             | write_error (the store could not write) | no_room (the disk cannot hold the plan)
    message: str
    folder: Path
    spent_usd: float
    session: dict
    datasets: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.status == "finished"

    def raise_if_incomplete(self) -> None:
        """Make a stopped run fail its notebook (so `draftsmith run all` does not go on with half the data)."""
        if not self.complete:
            raise GenerationStopped(self.message)


class GenerationStopped(RuntimeError):
    pass
