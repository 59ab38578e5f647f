"""What stage 02 is told (`Options`, the notebook's parameters that shape a session) and what it
answers (`GenerationResult`; `raise_if_incomplete` makes a stopped run fail its notebook)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .. import parameters


@dataclass
class Options:
    """How a session behaves: notebook 02's parameters of that name, and the few knobs below
    that no stage declares (benchmarks and tests turn them)."""

    concurrency: int
    spend_limit_usd: float
    balance_floor_usd: float = parameters.default_field("balance_floor_usd")
    money_bound_stop_fraction: float = parameters.default_field("money_bound_stop_fraction")
    max_attempts: int = parameters.default_field("max_attempts")
    request_timeout_s: float = parameters.default_field("request_timeout_s")
    request_deadline_s: float | None = parameters.default_field("request_deadline_s")
    stop_grace_s: float = parameters.default_field("stop_grace_s")
    balance_poll_s: float = 15.0
    fsync_s: float = 5.0
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    recovery_patience_s: float = 120.0   # how long to keep asking /generation the cost of a lost answer
    outage_limit_s: float = parameters.default_field("outage_limit_s")
    target_model_path: str | None = None  # its tokenizer measures prompts that may be too long (None: not measured)
    trust_remote_code: bool = parameters.default_field("trust_remote_code")

    def __post_init__(self):
        for name in ("concurrency", "max_attempts"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be an int, got {getattr(self, name)!r}")
        d = self.request_deadline_s
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not d > 0):
            raise ValueError(f"request_deadline_s must be a number of seconds > 0, or None (derived from max_tokens), "
                             f"got {d!r}")


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
