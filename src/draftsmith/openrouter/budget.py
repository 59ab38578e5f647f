"""The two budgets that decide whether one more request may start: output tokens per dataset, dollars per run.

`TokenBudget` lets a dataset overshoot its `output_token_budget` by at most max(1% of it, one
`max_tokens`). `SpendBudget` reserves each request at its worst case before it starts and settles
it with what it cost, so the spend limit holds even if every request in flight comes back at its
longest on the most expensive provider, and the balance stays above its floor."""

from __future__ import annotations

import bisect
import math
import time
from collections import deque

from .pricing import Prices

MIN_SAMPLES = 30
TAIL = 100    # fewer longer responses seen than this: a request in flight is in the tail (see TokenBudget)


class TokenBudget:
    """A dataset's output tokens. With budget B and tolerance T = max(1% of B, one `max_tokens`), a
    request may start when
      - (until MIN_SAMPLES lengths are known) it is safe outright: completed + (in flight + 1) x the
        longest possible response <= B + T;
      - (then) it is expected to fit: completed + the expected tokens of the requests in flight + one
        mean <= B, and the same plus three standard deviations of that sum (its spread, and the error
        of estimating each expectation from a finite sample) <= B + T.
    A request in flight is not an average one: the longer it has run, the longer its response is
    likely to be. So each is expected to end at E[L | a response still running at its age], read off
    past (duration, length) pairs; one older than any seen is assumed to come back at max_tokens.
    A mean of a few long responses has an error its own spread does not show (trusted, it overran a
    budget of a few flights' worth by up to 15% where 2-7% were allowed: bench/bench_budget_overshoot.py).
    So a request older than all but `tail` of the responses seen (the tail) is expected at max_tokens
    while fewer than `tail` lengths are known, then at the mean of the longer ones with the spread of
    the `tail` longest as the error of that mean (one draw's, not a mean's). Near the budget the
    requests in flight are the old ones, so dispatch tapers off there.
    The past pairs are not an unbiased draw either (short responses come back first), so only a
    complete cohort counts: requests all of whose predecessors have ended.
    With nothing in flight the test reads only the tokens done and every length known (their count,
    sum and sum of squares, exact), so a run that ends for want of room leaves a state that a re-run,
    given the same saved lengths (`add`), judges the same: nothing to do."""

    def __init__(self, budget: int | None, max_tokens: int, history: int = 20000, refresh_s: float = 0.25,
                 tail: int = TAIL):
        self.budget = budget
        self.tail = max(1, tail)     # 1: every mean of longer responses trusted as it is (bench: "before")
        self.max_tokens = max_tokens
        self.tolerance = max(math.ceil(0.01 * budget), max_tokens) if budget else 0
        self.done = 0          # completion tokens of completed samples (all sessions)
        self.longest = 0
        self.refresh_s = refresh_s
        # the cohort the statistics come from (see `end`): (duration, tokens), the latest `history`
        self.cohort: deque[tuple[float, int]] = deque(maxlen=history)
        self._n = self._s1 = self._s2 = 0     # every length that joined the cohort: count, sum, sum of squares
        self._next = 0         # dispatch sequence numbers
        self._open: dict[int, float] = {}      # ticket -> start time
        self._ended: dict[int, tuple[float, int] | None] = {}
        self._low = 0
        # (sorted durations, then per duration: mean, variance and standard error of the lengths of the
        # responses that ran longer)
        self._model = None
        self._model_at = -math.inf
        self._model_count = -1
        self._model_built = -math.inf
        self._est: dict[int, tuple[float, float, float]] = {}   # ticket -> (expected tokens, variance, error)
        self._est_sum = self._var_sum = self._err_sum = 0.0

    @property
    def in_flight(self) -> int:
        return len(self._open)

    @property
    def count(self) -> int:
        return len(self.cohort)

    def add(self, tokens: int, duration: float = 0.0) -> None:
        """A sample completed in an earlier session (or otherwise known in full)."""
        self.done += tokens
        self.longest = max(self.longest, tokens)
        self._join((duration, tokens))

    def _join(self, pair: tuple[float, int]) -> None:
        self.cohort.append(pair)
        self._n += 1
        self._s1 += pair[1]
        self._s2 += pair[1] * pair[1]

    def _overall(self) -> tuple[float, float, float]:
        """Mean, variance and standard error of every length known (`_join`), from exact sums."""
        mean = self._s1 / self._n
        var = max(0.0, self._s2 / self._n - mean * mean)
        return mean, var, math.sqrt(var / self._n)

    @property
    def worst(self) -> int:
        return max(self.max_tokens, self.longest)

    def can_start(self, now: float | None = None) -> bool:
        if self.budget is None:
            return True
        if self.count < MIN_SAMPLES:
            return (self.in_flight + 1) * self.worst <= self.budget + self.tolerance - self.done
        now = time.monotonic() if now is None else now
        if now - self._model_at >= self.refresh_s:
            self._refresh(now)
        mean, var, err = self._overall()
        expected = self.done + self._est_sum + mean
        # the sum's own spread, and the error of the estimated means (shared by all, so it adds up)
        spread = 3 * math.sqrt(self._var_sum + var + (self._err_sum + err) ** 2)
        return expected <= self.budget and expected + spread <= self.budget + self.tolerance

    def _refresh(self, now: float) -> None:
        """Re-estimate every request in flight from its age: E[L | still running after `age`]."""
        k = len(self.cohort)
        if k != self._model_count and (k > 1.05 * self._model_count or now - self._model_built >= 5.0):
            pairs = sorted(self.cohort)
            durs = [d for d, _ in pairs]
            k = len(pairs)
            means, variances, errors = [0.0] * k, [0.0] * k, [0.0] * k
            s1 = s2 = 0.0
            for j in range(k - 1, -1, -1):
                t = pairs[j][1]
                s1 += t
                s2 += t * t
                m = s1 / (k - j)
                means[j], variances[j] = m, max(0.0, s2 / (k - j) - m * m)
                errors[j] = math.sqrt(variances[j] / (k - j))     # how far off that mean may be
            self._model = (durs, means, variances, errors)
            self._model_count, self._model_built = k, now
        est, total, total_var, total_err = {}, 0.0, 0.0, 0.0
        for ticket, t0 in self._open.items():
            e = est[ticket] = self._expect(now - t0)
            total += e[0]
            total_var += e[1]
            total_err += e[2]
        self._est, self._est_sum, self._var_sum, self._err_sum = est, total, total_var, total_err
        self._model_at = now

    def _expect(self, age: float) -> tuple[float, float, float]:
        """(expected tokens, variance, error) of a request in flight for `age` seconds, by the last model."""
        durs, means, variances, errors = self._model
        k = len(durs)
        j = bisect.bisect_right(durs, age)
        if j >= k or (k - j < self.tail and k < self.tail):    # older than any seen, or a tail not yet known
            return float(self.worst), 0.0, 0.0
        if k - j < self.tail:
            v = max(variances[j], variances[k - self.tail])
            return means[j], v, math.sqrt(v)
        return means[j], variances[j], errors[j]

    def start(self, now: float | None = None) -> int:
        """A request starts; returns its ticket for `end`."""
        seq = self._next
        self._next += 1
        if self.budget is None:            # no budget: only the count in flight matters
            self._open[seq] = 0.0
            return seq
        self._open[seq] = time.monotonic() if now is None else now
        if self._model is not None:        # until the next refresh, as a request of age 0
            e = self._est[seq] = self._expect(0.0)
            self._est_sum += e[0]
            self._var_sum += e[1]
            self._err_sum += e[2]
        return seq

    def end(self, ticket: int, tokens: int | None = None, now: float | None = None) -> None:
        """A request left flight; `tokens` if it completed (None if it failed or was abandoned).

        Its tokens count at once, but its length joins the statistics only when every request
        started before it has ended too: short responses finish first, so the lengths seen early
        in a run are biased short, while a cohort of all requests started before some moment is not."""
        t0 = self._open.pop(ticket)
        if self.budget is None:
            if tokens is not None:
                self.done += tokens
            return
        e = self._est.pop(ticket, None)
        if not self._open:          # exactly nothing in flight, not a rounding residue
            self._est_sum = self._var_sum = self._err_sum = 0.0
        elif e is not None:
            self._est_sum -= e[0]
            self._var_sum -= e[1]
            self._err_sum -= e[2]
        if tokens is not None:
            self.done += tokens
            self.longest = max(self.longest, tokens)
        now = time.monotonic() if now is None else now
        self._ended[ticket] = None if tokens is None else (now - t0, tokens)
        while self._low < self._next and self._low not in self._open:
            pair = self._ended.pop(self._low, None)
            if pair is not None:
                self._join(pair)
            self._low += 1

    @property
    def reached(self) -> bool:
        """Nothing more will start, and nothing is in flight."""
        return self.in_flight == 0 and not self.can_start()


def prompt_tokens_bound(messages: list[dict]) -> int:
    """More tokens than the prompt can have: a byte-level BPE token is at least one byte, plus the
    chat template's markers."""
    return 32 + sum(16 + len(m["content"].encode("utf-8")) for m in messages)


class SpendBudget:
    """The run's dollars: the spend limit, the balance above its floor, what is reserved; which of
    the two limits binds, and what to add to finish. Each request is reserved at its worst case
    (`prompt_tokens_bound`, max_tokens, the highest prices among the endpoints routing may pick,
    plus a per-request price) before it starts, and settled with what it cost when it ends; when
    its answer was lost, once `/generation` has told what it cost (until then the reservation
    stays). A request may start only if the run's spend plus all reservations stays within the
    limit, and the balance (last polled, minus what was spent since that poll was sent) stays
    above the floor."""

    def __init__(self, limit_usd: float, floor_usd: float = 0.0, spent: float = 0.0):
        if limit_usd is None:
            raise ValueError("spend_limit_usd is required")
        self.limit = float(limit_usd)
        self.floor = float(floor_usd or 0.0)
        self.spent = float(spent)       # the run's known spend, all sessions
        self.reserved = 0.0
        self.balance: float | None = None   # account balance at the last poll (None: unknown / uncapped)
        self.spent_at_poll = 0.0
        self.prices = Prices(0.0, 0.0, 0.0)    # the worst USD per token and per request

    def set_prices(self, prompt: float, completion: float, request: float | None = None) -> None:
        self.prices = Prices(float(prompt), float(completion),
                             self.prices.request if request is None else float(request))

    def worst_cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return self.prices.cost(prompt_tokens, completion_tokens)

    def set_balance(self, balance: float | None, spent_when_asked: float | None = None) -> None:
        """The account's balance as a poll read it. `spent_when_asked`: the run's spend when the poll
        was sent (default: now). A request the server billed before it answered the poll may be
        settled here while the answer is on its way; counting from the spend at sending subtracts
        it again (until the next poll) rather than never."""
        self.balance = balance
        self.spent_at_poll = self.spent if spent_when_asked is None else spent_when_asked

    @property
    def balance_left(self) -> float | None:
        if self.balance is None:
            return None
        return self.balance - (self.spent - self.spent_at_poll)

    @property
    def limit_left(self) -> float:
        """Dollars under `spend_limit_usd`."""
        return self.limit - self.spent

    @property
    def binding(self) -> str:
        """Which limit `left` is: "balance" (the balance above its floor) or "spend_limit"."""
        b = self.balance_left
        return "balance" if b is not None and b - self.floor < self.limit_left else "spend_limit"

    @property
    def left(self) -> float:
        """Dollars the run may still spend, reservations aside: under the limit and above the floor."""
        room = self.limit_left
        if self.balance_left is not None:
            room = min(room, self.balance_left - self.floor)
        return room

    def top_up(self, usd_to_finish: float, requests: int, slots: int, worst: float) -> float:
        """About what to add to finish with every slot busy to the end: the expected cost of what
        is left (`usd_to_finish`, over `requests`), plus a worst case for each of the `slots` it will
        use, less the money left."""
        return max(0.0, usd_to_finish + min(slots, requests) * worst - max(0.0, self.left))

    def headroom(self) -> float:
        """Dollars a new request may still reserve."""
        return self.left - self.reserved

    def try_reserve(self, amount: float) -> bool:
        if amount > self.headroom():
            return False
        self.reserved += amount
        return True

    def settle(self, reserved: float, cost: float, prompt_tokens: int | None = None,
               completion_tokens: int | None = None) -> None:
        """A request ended: release its reservation, count what it cost. If it cost more than the
        worst case priced for its tokens, the prices were wrong: raise them for the next ones."""
        self.reserved = max(0.0, self.reserved - reserved)
        self.spent += cost
        if prompt_tokens is not None and completion_tokens is not None and cost > 0:
            p = self.prices
            priced = self.worst_cost(prompt_tokens, completion_tokens) - p.request
            if cost - p.request > priced * 1.0001:
                scale = (cost - p.request) / priced if priced > 0 else None
                if scale:
                    self.set_prices(p.prompt * scale, p.completion * scale)
                else:
                    per = cost / max(1, prompt_tokens + completion_tokens)
                    self.set_prices(max(p.prompt, per), max(p.completion, per))
