"""When a pool's eviction round starts (``tiers/evict.py``): ahead of the budget by what the
pool's writers add while one round runs.

Writers refuse past the cap, ``budget + budget / 16`` (``tiers/pool.py``). A round that starts
only once the total passes the budget must finish before the writers add that sixteenth; on a
network filesystem a round takes seconds (listings and unlinks are round trips), so a pool
written at tens of MB/s would refuse chunks during every round. A round therefore starts
``lead`` bytes below the budget: the write rate seen between the evictor's looks times the
recent rounds' length, times ``LEAD_FACTOR``, at most ``MAX_LEAD`` of the budget (the pool then
settles lower, between ``low watermark - lead`` and ``budget - lead``: a pool written fast
keeps fewer old chunks rather than refusing new ones). While the total is below that start, the
evictor looks again before the writers can reach it at that rate (``next_look_s``), rather than
every ``TICK_S``. Pure arithmetic on what the evictor observes: no I/O.
"""

from __future__ import annotations

LEAD_FACTOR = 1.5  # margin over one round's worth of writes
MAX_LEAD = 0.1  # of the budget: a round never starts below 90% of it
MIN_SPAN_S = 0.5  # looks closer together than this say nothing reliable about the rate
SMOOTHING = 0.5  # weight of the newest observation (rate, round length)
MIN_PACED_LOOK_S = 1.0


class Pace:
    """What the evictor of one pool tier learnt of the write rate and its rounds' length."""

    def __init__(self) -> None:
        self.rate = 0.0  # bytes per second added to the pool, smoothed
        self.round_s = 0.0  # a round's length, smoothed
        self._last: tuple[float, int] | None = None  # (monotonic time, total) at the last look

    def look(self, now: float, total: int) -> None:
        """The total as seen at a look at ``now`` (monotonic seconds)."""
        if self._last is not None:
            span = now - self._last[0]
            if span < MIN_SPAN_S:
                return  # measured from the earlier look, once enough time has passed
            growth = max(0.0, (total - self._last[1]) / span)
            self.rate = (1 - SMOOTHING) * self.rate + SMOOTHING * growth
        self._last = (now, total)

    def round_ended(self, seconds: float) -> None:
        """A round ran for ``seconds``: the total fell meanwhile, so the rate is measured
        afresh from the next look."""
        self.round_s = seconds if not self.round_s else (1 - SMOOTHING) * self.round_s + SMOOTHING * seconds
        self._last = None

    def lead(self, budget: int) -> int:
        """How far below ``budget`` the next round starts: before this evictor has timed a
        round, the most, as soon as it sees the pool written (a new pool fills at the writers'
        full rate, and its first round is a count)."""
        if not self.round_s:
            return int(MAX_LEAD * budget) if self.rate > 0 else 0
        return int(min(MAX_LEAD * budget, LEAD_FACTOR * self.rate * self.round_s))

    def start_at(self, budget: int) -> int:
        """The total above which a round starts."""
        return budget - self.lead(budget)

    def next_look_s(self, total: int, budget: int, longest_s: float) -> float:
        """Seconds to the next look: half the time the writers take, at the rate seen, from
        ``total`` to the start of a round, at least ``MIN_PACED_LOOK_S`` (a look is a sync: a
        listing and a read per instance) and at most ``longest_s``. Only an evictor that has run
        a round looks early: in a fleet, every engine process has an evictor, and their looks
        would otherwise multiply."""
        if self.rate <= 0 or not self.round_s:
            return longest_s
        return min(longest_s, max(MIN_PACED_LOOK_S, (self.start_at(budget) - total) / self.rate / 2))
