"""The scheduler's lookup threads, and the lookups waiting for them.

A lookup no request waits for any more (its request finished or was aborted, it timed out, or
vLLM's own hit grew past it) is cancelled: a queued one never runs, so a burst of requests
against a slow pool cannot leave a backlog that makes the next lone request time out too. At
most ``MAX_QUEUED`` lookups wait for a thread (each holds its request); past that a request is
scheduled without a hit (``lookup_overflows``). ``TRIP_AFTER`` lookup timeouts in a row with no
lookup answered in time between them trip the shared pool in the ``TierGuard``: for
``tier_cooldown_s`` lookups skip it and answer from the local tiers, and the backlog drains.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvtier.integrations.vllm.counters import count
from kvtier.integrations.vllm.requests import PendingLookup, RequestState, Tail
from kvtier.threads import executor
from kvtier.tiers.base import Level
from kvtier.tiers.guard import TierGuard

LOOKUP_THREADS = 2
MAX_QUEUED = 64  # a TP=8 engine at concurrency 32 asks for at most one per waiting request
TRIP_AFTER = 3  # lookup timeouts in a row that trip the pool

Find = Callable[[RequestState, int], tuple[list[str], Tail | None]]


class LookupQueue:
    """Starts, cancels and counts the scheduler's background lookups (thread-safe)."""

    def __init__(self, find: Find, guard: TierGuard, pool: Callable[[], Level | None], counters: dict[str, int],
                 threads: int = LOOKUP_THREADS, max_queued: int = MAX_QUEUED) -> None:
        self._find, self._guard, self._pool, self._counters = find, guard, pool, counters
        self._threads = executor(threads, "kvtier-lookup")
        self._max_queued = max_queued
        self._mutex = threading.Lock()
        self._queued = 0  # submitted, not yet started or cancelled
        self._timeouts = 0  # in a row

    def start(self, state: RequestState, first: int) -> PendingLookup | None:
        """The request's lookup of chunks ``first..`` on a lookup thread; None when ``MAX_QUEUED``
        wait already (counted: the request goes on without a hit)."""
        with self._mutex:
            if self._queued >= self._max_queued:
                count(self._counters, "lookup_overflows")
                return None
            self._queued += 1
        future = self._threads.submit(self._run, state, first)
        return PendingLookup(first, time.monotonic(), future)

    def _run(self, state: RequestState, first: int) -> tuple[list[str], Tail | None]:
        with self._mutex:
            self._queued -= 1
        return self._find(state, first)

    def abandon(self, lookup: PendingLookup | None) -> None:
        """No request waits for ``lookup`` any more: cancel it (a running one ends on its own)."""
        if lookup is not None and lookup.future.cancel():
            with self._mutex:
                self._queued -= 1
            count(self._counters, "cancelled_lookups")

    def answered(self) -> None:
        """A lookup was answered within ``lookup_timeout_s``."""
        self._timeouts = 0

    def timed_out(self) -> None:
        """A lookup passed ``lookup_timeout_s``; the ``TRIP_AFTER``-th in a row trips the pool."""
        self._timeouts += 1
        pool = self._pool()
        if self._timeouts >= TRIP_AFTER and pool is not None and self._guard.usable(pool):
            self._timeouts = 0
            self._guard.trip(pool, "lookup", f"kept {TRIP_AFTER} lookups in a row waiting past lookup_timeout_s")

    @property
    def queued(self) -> int:
        with self._mutex:
            return self._queued

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
