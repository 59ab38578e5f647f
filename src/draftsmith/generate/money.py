"""When money stops a start: what the stop says (with about how much to add to finish), and the
money-bound tail, where the run stops for a top-up rather than spend the last of the balance a
few requests at a time. Which limit binds and the top-up itself are the budget's
(openrouter/budget.py SpendBudget); the session records what these return."""

from __future__ import annotations

import math


def blocked_message(session, why: str, worst: float) -> tuple[str, float]:
    """(the stop's message, the top-up to finish rounded to cents, 0.0 if unknown) for a start of
    worst case `worst` that the `why` limit (balance | spend_limit) refused."""
    spend = session.spend
    top_up = round(_top_up_usd(session, worst), 2)
    if why == "balance":
        floor = f" (balance_floor_usd ${spend.floor:.2f})" if spend.floor else ""
        return (f"the balance ran out: ${spend.balance_left:.4f} left{floor}, less than the next "
                f"request could cost (${worst:.4f} at max_tokens on the dearest allowed provider)"
                + (f"; top up about ${top_up:,.2f} to finish" if top_up else "")), top_up
    return (f"spend_limit_usd ${spend.limit:.2f} reached: spent ${spend.spent:.4f}, and the next "
            f"request could cost ${worst:.4f}, more than the ${spend.limit_left:.4f} left"
            + (f"; raise it by about ${top_up:,.2f} to finish" if top_up else "")), top_up


# Each request is reserved at its worst case (about 3x an average one), so once the money left is
# less than `concurrency` worst cases, fewer requests fit in flight, and the last of the balance
# is spent at a trickle. When the money cannot finish the job anyway, that trickle only delays
# the top-up the job needs: below `money_bound_stop_fraction` of the slots, stop starting
# requests, let those in flight finish (they are paid for), and stop with what to top up.
# That tail is the end of a session that had every slot busy. A session whose money never filled
# the slots (it started with a small balance) has no such tail: it is all trickle, and stopping it
# would buy nothing at all, so it spends down to the floor at the concurrency its money allows and
# ends with the balance stop.
def _left_to_finish(session) -> tuple[float, int] | None:
    """(expected dollars, requests) to finish every dataset's budget, in flight included, at the
    run's cost and length per response so far; None if unknown (nothing paid yet, or a dataset
    without a budget that still has prompts)."""
    done = sum(d.budget.done for d in session.datasets)
    samples = sum(d.store.totals.samples for d in session.datasets)
    if done <= 0 or samples <= 0 or session.spend.spent <= 0:
        return None
    left = 0
    for d in session.datasets:
        if d.spec.output_token_budget is None:
            if d.exhausted:
                continue
            return None
        left += max(0, d.spec.output_token_budget - d.budget.done)
    return left * session.spend.spent / done, math.ceil(left * samples / done)


def _top_up_usd(session, worst: float, left: tuple[float, int] | None = None) -> float:
    left = left or _left_to_finish(session)
    return 0.0 if left is None else session.spend.top_up(*left, session.opts.concurrency, worst)


def wind_down(session, why: str, worst: float) -> tuple[str, float] | None:
    """(the message, the top-up rounded to cents) when the run should stop for a top-up now that
    `why` refused a start of worst case `worst`; None while it should go on."""
    fraction = session.opts.money_bound_stop_fraction
    if (not fraction or not session.was_full
            or session.in_flight >= fraction * min(session.opts.concurrency, session.aimd.limit)):
        return None
    left = _left_to_finish(session)
    if left is None or left[0] <= session.spend.left:
        return None
    need = left[0]
    top_up = round(_top_up_usd(session, worst, left), 2)
    money = (f"${session.spend.left:.2f} above the balance floor" if why == "balance"
             else f"${session.spend.left:.2f} below spend_limit_usd")
    action = "top up" if why == "balance" else "raise spend_limit_usd by"
    return (f"money keeps only {session.in_flight} of {session.opts.concurrency} requests in flight ({money}; each "
            f"is reserved at its worst case, ${worst:.4f}) and cannot finish the job (about ${need:,.2f} "
            f"more at the cost per token so far): {action} about ${top_up:,.2f} (what is left, plus a worst "
            f"case per slot it needs, so every slot stays busy) and re-run stage 02 "
            f"(money_bound_stop_fraction: 0 spends the rest first)"), top_up
