"""What one session of stage 02 counted, each field named as its line in the manifest's `sessions`
names it (outputs.Manifest): the session and attempts.py add to it, bookkeeping.py writes it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Counts:
    samples: int = 0                    # answers saved
    completion_tokens: int = 0          # their output tokens
    cost: float = 0.0                   # what they cost
    attempts: int = 0                   # requests sent
    errors_by_kind: dict[str, int] = field(default_factory=dict)    # failed attempts, by kind
    failed_attempts_cost: float = 0.0   # what billed failures cost
    peak_in_flight: int = 0
    exhausted_samples: int = 0          # out of attempts this session (a re-run tries them again)
    permanent_samples: int = 0          # failed for good (errors.jsonl)
    lost_answers: int = 0               # answers lost after billing could start
    lost_answers_costed: int = 0        # ... of which GET /generation told the cost
    unknown_bills: int = 0              # ... of which the cost stayed unknown (counted at the worst case)
    abandoned_reserved_usd: float = 0.0  # that worst case, summed
    unsaved_answers: int = 0            # answers paid for that the store could not write
    unsaved_cost: float = 0.0

    def entry(self) -> dict:
        """The manifest's fields: dollars rounded to 1e-8, the dict copied."""
        d = asdict(self)
        for k in ("cost", "failed_attempts_cost", "abandoned_reserved_usd", "unsaved_cost"):
            d[k] = round(d[k], 8)
        return d
