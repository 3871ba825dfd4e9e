"""TierGuard: bounds the time a slow or hung tier can cost, and takes it out of service.

A pool on a network filesystem can hang (an NFS server gone, a FUSE daemon stopped): then a
``stat`` or a read blocks for minutes. kvtier never waits for it longer than
``read_timeout_s``: reads already run on I/O threads with that timeout, and lookups of tiers
that may hang (``may_hang = True``: the shared pool) run on a small thread pool of their own
with the same timeout. A tier that timed out is *tripped*: for ``cooldown_s`` every lookup
and read skips it at once (it holds nothing, as far as callers know), so a hung pool costs
one timeout per cooldown period, not one per request. After the cooldown the next call
probes it again.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Sequence

from kvtier.keys import ChunkId
from kvtier.threads import Failures, ThreadInit, executor
from kvtier.tiers.base import Level

log = logging.getLogger(__name__)


class TierGuard:
    """Per-store state: which tiers are tripped, and the threads that time lookups."""

    def __init__(self, timeout_s: float, cooldown_s: float, lookup_threads: int = 2, *,
                 init: ThreadInit | None = None, failures: Failures | None = None) -> None:
        self.timeout_s = timeout_s
        self.cooldown_s = cooldown_s
        self._init = init
        self._failures = failures or Failures()
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()
        self._lookup_threads = lookup_threads
        self._pool: cf.ThreadPoolExecutor | None = None  # started on the first timed lookup

    def usable(self, tier: Level) -> bool:
        """False while ``tier`` is tripped."""
        until = self._until.get(tier.name)
        return until is None or time.monotonic() >= until

    def trip(self, tier: Level, what: str, why: str | None = None) -> None:
        """Take ``tier`` out of service for ``cooldown_s`` (it just timed out doing ``what``;
        ``why``: another reason, said as is)."""
        with self._lock:
            fresh = not (tier.name in self._until and time.monotonic() < self._until[tier.name])
            self._until[tier.name] = time.monotonic() + self.cooldown_s
        tier.metrics.add(timeouts=1)
        if fresh:
            why = why or f"did not answer a {what} within read_timeout_s={self.timeout_s}"
            log.warning("kvtier: the %s tier %s; skipping it for tier_cooldown_s=%s (those chunks are "
                        "recomputed)", tier.name, why, self.cooldown_s)

    def lookup(self, tier: Level, ids: Sequence[ChunkId]) -> int:
        """``tier.lookup(ids)``, bounded by the timeout for tiers that may hang; 0 if tripped, or
        if the tier raised (a tier bug is a miss, recorded, never the caller's exception)."""
        if not self.usable(tier):
            return 0
        try:
            if not tier.may_hang:
                return int(tier.lookup(ids))
            if self._pool is None:
                with self._lock:
                    if self._pool is None:
                        self._pool = executor(self._lookup_threads, "kvtier-lookup", self._init)
            future = self._pool.submit(tier.lookup, ids)
            try:
                return int(future.result(timeout=self.timeout_s))
            except cf.TimeoutError:
                self.trip(tier, "lookup")
                return 0
        except Exception:
            self._failures.record(f"the {tier.name} tier's lookup")
            return 0

    def close(self) -> None:
        if self._pool is not None:
            # A hung lookup is abandoned, not awaited (see TieredStore.close).
            self._pool.shutdown(wait=False, cancel_futures=True)
