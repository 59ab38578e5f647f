"""When money stops a start: which limit stopped it, what the stop says (with about how much to
add to finish), and the money-bound tail, where the run stops for a top-up rather than spend the
last of the balance a few requests at a time."""

from __future__ import annotations

import math


def block(eng, worst: float) -> None:
    left = eng.spend.balance_left
    by_balance = left is not None and left - eng.spend.floor < eng.spend.limit - eng.spend.spent
    eng.blocked = ("balance" if by_balance else "spend_limit", worst)


def blocked_message(eng) -> str:
    why, worst = eng.blocked
    top_up = round(_top_up_usd(eng, worst), 2)
    if top_up:
        eng.entry["top_up_usd"] = top_up     # what to add, for whoever re-runs it (bench/rehearsal.py)
    if why == "balance":
        floor = f" (balance_floor_usd ${eng.spend.floor:.2f})" if eng.spend.floor else ""
        return (f"the balance ran out: ${eng.spend.balance_left:.4f} left{floor}, less than the next "
                f"request could cost (${worst:.4f} at max_tokens on the dearest allowed provider)"
                + (f"; top up about ${top_up:,.2f} to finish" if top_up else ""))
    return (f"spend_limit_usd ${eng.spend.limit:.2f} reached: spent ${eng.spend.spent:.4f}, and the next "
            f"request could cost ${worst:.4f}, more than the ${eng.spend.limit - eng.spend.spent:.4f} left"
            + (f"; raise it by about ${top_up:,.2f} to finish" if top_up else ""))


# Each request is reserved at its worst case (about 3x an average one), so once the money left is
# less than `concurrency` worst cases, fewer requests fit in flight, and the last of the balance
# is spent at a trickle. When the money cannot finish the job anyway, that trickle only delays
# the top-up the job needs: below `money_bound_stop_fraction` of the slots, stop starting
# requests, let those in flight finish (they are paid for), and stop with what to top up.
# That tail is the end of a session that had every slot busy. A session whose money never filled
# the slots (it started with a small balance) has no such tail: it is all trickle, and stopping it
# would buy nothing at all, so it spends down to the floor at the concurrency its money allows and
# ends with the balance stop.
def _left_to_finish(eng) -> tuple[float, int] | None:
    """(expected dollars, requests) to finish every dataset's budget, in flight included, at the
    run's cost and length per response so far; None if unknown (nothing paid yet, or a dataset
    without a budget that still has prompts)."""
    done = sum(d.budget.done for d in eng.datasets)
    samples = sum(d.store.totals.samples for d in eng.datasets)
    if done <= 0 or samples <= 0 or eng.spend.spent <= 0:
        return None
    left = 0
    for d in eng.datasets:
        if d.spec.output_token_budget is None:
            if d.exhausted:
                continue
            return None
        left += max(0, d.spec.output_token_budget - d.budget.done)
    return left * eng.spend.spent / done, math.ceil(left * samples / done)


def _top_up_usd(eng, worst: float, left: tuple[float, int] | None = None) -> float:
    """About what to add to finish with every slot busy to the end: the expected cost of what is
    left, plus a worst case for each slot it will use, less the money left."""
    left = left or _left_to_finish(eng)
    if left is None:
        return 0.0
    usd, requests = left
    return max(0.0, usd + min(eng.opts.concurrency, requests) * worst - max(0.0, eng.spend.left))


def maybe_wind_down(eng) -> None:
    fraction = eng.opts.money_bound_stop_fraction
    if (eng.winding_down or not fraction or not eng.was_full
            or eng.in_flight >= fraction * min(eng.opts.concurrency, eng.aimd.limit)):
        return
    left = _left_to_finish(eng)
    if left is None or left[0] <= eng.spend.left:
        return
    need = left[0]
    why, worst = eng.blocked
    top_up = _top_up_usd(eng, worst, left)
    money = (f"${eng.spend.balance_left - eng.spend.floor:.2f} above the balance floor" if why == "balance"
             else f"${eng.spend.limit - eng.spend.spent:.2f} below spend_limit_usd")
    action = "top up" if why == "balance" else "raise spend_limit_usd by"
    message = (f"money keeps only {eng.in_flight} of {eng.opts.concurrency} requests in flight ({money}; each "
               f"is reserved at its worst case, ${worst:.4f}) and cannot finish the job (about ${need:,.2f} "
               f"more at the cost per token so far): {action} about ${top_up:,.2f} (what is left, plus a worst "
               f"case per slot it needs, so every slot stays busy) and re-run stage 02 "
               f"(money_bound_stop_fraction: 0 spends the rest first)")
    eng.winding_down = (why, message)
    eng.entry["top_up_usd"] = round(top_up, 2)
    eng.log(f"winding down: {message}; starting nothing new, letting the {eng.in_flight} requests in flight finish")
