"""How long stage 06's engines will decode, estimated from a timed probe of the live engine.

The engine process (`engine_child`) times each engine on a probe before it decodes (`Probe`: a
batch of the job's own prompts, as many as will be in flight, first to one token, then to `tokens`
tokens each without stopping at an end id), and says what the engine's decodes (`Workload`) will
take at that rate before it starts them, and, at the first engine, what every engine of the job
will. The figure is an estimate: every answer is taken to run to its max_new_tokens (most stop
earlier), and a step is timed at the probe's short contexts (long ones cost more per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Probe:
    """One engine's timing of `requests` prompts decoded together: `prefill_s` to take them in and
    emit a first token each, `decode_s` for `tokens` - 1 more tokens each (every step a token of
    every request; a drafter's engine emits more per step, which the rate then holds)."""

    requests: int
    prefill_s: float
    tokens: int
    decode_s: float

    def __post_init__(self):
        if self.requests < 1 or self.tokens < 2 or self.prefill_s < 0 or self.decode_s < 0:
            raise ValueError(f"a probe needs a request and two tokens, and times >= 0: {self}")

    @property
    def step_s(self) -> float:
        """Seconds per token of every request in flight."""
        return self.decode_s / (self.tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        return self.requests / self.step_s if self.step_s else math.inf


@dataclass(frozen=True)
class Workload:
    """What one engine decodes: its passes (one per temperature, one after the other), each a set
    of conversations, each the max_new_tokens of its turns (asked one after the other), and how
    many requests it keeps in flight."""

    passes: tuple[tuple[tuple[int, ...], ...], ...]
    concurrency: int

    @property
    def turns(self) -> int:
        return sum(len(c) for p in self.passes for c in p)

    @property
    def tokens(self) -> int:
        return sum(sum(c) for p in self.passes for c in p)

    def seconds(self, probe: Probe) -> float:
        """Estimated seconds at the probe's rate. Per pass: every turn's prefill at the probe's cost
        per request, then steps of up to `concurrency` requests (charged as the probe's step, or per
        request in flight beyond the probe's count): as many as its tokens packed that wide, and
        never fewer than its longest conversation, whose turns follow one another."""
        total = 0.0
        for conversations in self.passes:
            if not conversations:
                continue
            in_flight = min(self.concurrency, len(conversations))
            step = probe.step_s if in_flight <= probe.requests else probe.step_s / probe.requests * in_flight
            tokens, longest = sum(sum(c) for c in conversations), max(sum(c) for c in conversations)
            total += (sum(len(c) for c in conversations) * probe.prefill_s / probe.requests
                      + max(math.ceil(tokens / in_flight), longest) * step)
        return total


def duration(seconds: float) -> str:
    """`42 s`, `12 min`, `3.4 h`."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def job_line(workloads: dict[str, Workload], probe: Probe, startup_s: float, probed: str) -> str:
    """What the job's engines will take at the rate `probed`'s probe measured, its start-up time
    counted for every engine not started yet (the first, `probed`, is up)."""
    decode = sum(w.seconds(probe) for w in workloads.values())
    starts = startup_s * (len(workloads) - 1)
    tokens = sum(w.tokens for w in workloads.values())
    return (f"estimated time of the {len(workloads)} engine(s): {duration(decode + starts)} "
            f"({sum(w.turns for w in workloads.values())} decodes of up to {tokens} tokens in all, at the "
            f"{probe.tokens_per_s:.0f} tok/s engine {probed} decoded in its probe with {probe.requests} in flight, "
            f"plus {duration(startup_s)} per engine start; every answer taken to its max tokens, each engine "
            f"estimates its own when it is up)")
