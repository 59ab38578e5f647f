"""Stage 02's token budget near its end: the overshoot paid against budget / what is in flight.

Replays stage 02's dispatch rule (`openrouter.budget.TokenBudget`: start while `can_start`, up to
`--concurrency` in flight) in simulated time against responses whose duration grows with their
length (lognormal lengths, median 400 tokens, capped at `--max-tokens`; 50 tok/s, 0.3 s to the
first token), so the requests in flight are the length-biased sample they are in a real run. The
ratio is budget / (concurrency x mean response length): how many full flights the budget holds.

  before   tail 1: E[L | still running at its age] trusted when read off a single longer response
  after    tail 100 (TAIL, what stage 02 runs): a request older than all but 100 responses seen is
           expected at max_tokens until 100 are seen, then with one draw's error of the 100 longest

Allowed: max(1% of the budget, one max_tokens). The time column is the simulated time to the
budget (the run's length), after / before: what the taper costs; the last row is the real job's
scale (a dataset's 10M tokens, 2000 in flight, max_tokens 8192).

    .venv/bin/python bench/bench_budget_overshoot.py            # ~1 minute on a busy core
    .venv/bin/python bench/bench_budget_overshoot.py --runs 3   # quicker
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics

from draftsmith.openrouter.budget import TAIL, TokenBudget


def draw(rng: random.Random, max_tokens: int) -> int:
    return max(1, min(max_tokens, int(rng.lognormvariate(math.log(400), 0.9))))


def mean_length(max_tokens: int, n: int = 200_000) -> float:
    rng = random.Random(0)
    return sum(draw(rng, max_tokens) for _ in range(n)) / n


def simulate(budget: int, concurrency: int, max_tokens: int, tail: int, seed: int) -> tuple[int, float]:
    """(tokens paid, simulated seconds to the last answer) of one run to the budget."""
    rng = random.Random(seed)
    tb = TokenBudget(budget, max_tokens, tail=tail)
    t, events = 0.0, []
    while True:
        while len(events) < concurrency and tb.can_start(now=t):
            n = draw(rng, max_tokens)
            heapq.heappush(events, (t + 0.3 + n / 50 * rng.uniform(0.7, 1.3), tb.start(now=t), n))
        if not events:
            return tb.done, t
        t, ticket, n = heapq.heappop(events)
        tb.end(ticket, n, now=t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=16, help="runs per ratio and rule (seeds 0..runs-1)")
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=2048)
    args = ap.parse_args()
    mean = mean_length(args.max_tokens)
    cases = [(r, round(r * args.concurrency * mean), args.concurrency, args.max_tokens, args.runs)
             for r in (0.5, 1.0, 2.0, 100.0)]
    # the real job (params/kimi-k2.5.yaml): 10M tokens per dataset, 2000 in flight, max_tokens 8192
    cases.append((10e6 / (2000 * mean_length(8192)), 10_000_000, 2000, 8192, 2))
    print(f"overshoot paid over the budget, % of it; {args.concurrency} in flight, max_tokens {args.max_tokens}, "
          f"mean response {mean:.0f} tokens; runs per cell as listed\n")
    print("| budget / in flight | budget (tokens) | in flight | runs | allowed | before: worst | before: runs over "
          "| after: worst | after: runs over | time after / before |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ratio, budget, conc, mt, runs in cases:
        allowed = max(math.ceil(0.01 * budget), mt)
        row = {}
        for name, tail in (("before", 1), ("after", TAIL)):
            got = [simulate(budget, conc, mt, tail, seed) for seed in range(runs)]
            over = [(paid - budget) / budget for paid, _ in got]
            row[name] = (max(over), sum(paid > budget + allowed for paid, _ in got),
                         statistics.mean(s for _, s in got))
        b, a = row["before"], row["after"]
        print(f"| {ratio:.3g}x | {budget:,} | {conc:,} | {runs} | {allowed / budget:.2%} | {b[0]:+.2%} | {b[1]} of {runs} "
              f"| {a[0]:+.2%} | {a[1]} of {runs} | {a[2] / b[2]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
