"""openrouter/retry.py: backoff honours what the server asked for; AIMD cuts once per round trip and recovers."""

import random

from draftsmith.openrouter.retry import Aimd, backoff_delay

import pytest

pytestmark = pytest.mark.unit


def test_backoff_grows_with_jitter_and_cap():
    rng = random.Random(0)
    first = [backoff_delay(1, rng=rng) for _ in range(200)]
    late = [backoff_delay(8, rng=rng) for _ in range(200)]
    assert max(first) <= 1.0 and max(late) <= 60.0
    assert sum(late) / 200 > 5 * sum(first) / 200
    assert len({round(x, 3) for x in late}) > 150            # jittered, not in step


def test_backoff_never_shorter_than_retry_after():
    rng = random.Random(1)
    assert all(backoff_delay(1, retry_after=7, rng=rng) >= 7 for _ in range(100))
    assert all(backoff_delay(1, retry_after=7, rng=rng) <= 7 * 1.2 for _ in range(100))


def test_aimd_cuts_once_per_round_trip_under_a_storm():
    a = Aimd(2000)
    a.rtt = 2.0
    cuts = [a.on_throttle(now=t / 100) for t in range(100)]   # 100 throttles within one round trip
    assert sum(cuts) == 1 and a.limit == 1400
    assert a.on_throttle(now=3.0) and a.limit in (979, 980)
    for t in range(200):
        a.on_throttle(now=10.0 + 2.5 * t)
    assert a.limit == 1                                        # floor, never zero


def test_aimd_recovers_to_the_configured_concurrency():
    a = Aimd(2000)
    a.on_throttle(now=0.0)
    a.on_throttle(now=0.1)
    assert a.limit == 1400
    n = 0
    while a.limit < 2000:
        a.on_success()
        n += 1
    # regained within a few dozen round trips (one round trip ~ `limit` successes)
    assert n < 40 * 2000
    small = Aimd(16)
    small.on_throttle(now=0.0)
    small.on_throttle(now=0.1)
    while small.limit < 16:
        small.on_success()
    assert small.limit == 16


def test_stray_429s_do_not_cut_the_limit():
    a = Aimd(2000)
    a.rtt = 10.0
    rng = random.Random(2)
    t = 0.0
    for _ in range(20000):                 # 1% of answers throttled, as a busy provider does
        t += 0.005
        a.on_throttle(now=t) if rng.random() < 0.01 else a.on_success(now=t)
    assert a.cuts == 0 and a.limit == 2000
    for _ in range(600):                   # then a storm: a quarter of the answers are 429s
        t += 0.005
        a.on_throttle(now=t) if rng.random() < 0.25 else a.on_success(now=t)
    assert 1 <= a.cuts <= 2 and a.limit < 2000          # at most one cut per round trip (10 s here)
