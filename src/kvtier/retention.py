"""Session retention: chunks kept in the disk tier and the pool ahead of unretained ones.

``TieredStore.retain`` records, per chunk key, the time until which it is retained, and hands
the chunks already stored to the tiers on a thread of its own (never behind, or dropped by, a
full write queue). Chunks written later under a retained key are retained as they land: the
store's background writer calls ``Retention.landed`` after each chunk a tier stored. The tiers
keep the retention themselves (a file's mtime, see ``tiers/files.py``); host DRAM and Redis
do not retain.

Bounded whatever clients ask, at O(1) amortized per key on the caller's thread (the engine's):
past ``max_keys`` retained keys, the thread drops the expired ones (a pass over the table, off
the caller's thread, at most once per ``max_keys // 8`` new keys), and past ``max_keys`` plus that
slack the caller drops the oldest retained, one by one. At most ``max_pending`` retentions wait
for the thread; what does not fit is dropped and counted (``dropped_retentions``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence

from kvtier.keys import ChunkId, ChunkKey
from kvtier.metrics import TierMetrics
from kvtier.threads import Failures, ThreadInit, executor
from kvtier.tiers.base import Tier

log = logging.getLogger(__name__)

MAX_KEYS = 1 << 18  # retained keys remembered (about 100 B each)
MAX_PENDING = 1024  # retentions of chunks already stored, waiting for the thread


def check_until(until: object) -> float:
    """``until`` as epoch seconds, or ValueError: a finite number that ``os.utime`` can set."""
    if isinstance(until, bool) or not isinstance(until, (int, float)) or not math.isfinite(until) \
            or not 0 <= until < 1 << 40:
        raise ValueError(f"retain until: expected epoch seconds (a finite number), got {until!r}")
    return float(until)


class Retention:
    """Retained keys and the thread that retains chunks already stored. Thread-safe."""

    def __init__(self, metrics: TierMetrics | None = None, failures: Failures | None = None,
                 init: ThreadInit | None = None, max_keys: int = MAX_KEYS, max_pending: int = MAX_PENDING) -> None:
        self._until: dict[ChunkKey, float] = {}  # key -> until (epoch s), oldest retained first
        self._lock = threading.Lock()
        self._metrics = metrics or TierMetrics("store")
        self._failures = failures or Failures(self._metrics)
        self._max_keys, self._max_pending = max_keys, max_pending
        self._hard_keys = max_keys + max(1, max_keys // 8)
        self._pending = 0
        self._sweeping = False
        self._thread = executor(1, "kvtier-retain", init)

    def retain(self, ids: Sequence[ChunkId], until: float, tiers: Sequence[Tier]) -> None:
        """Retain ``ids`` until ``until`` (a later time wins) in ``tiers`` now, and in any tier
        that stores one of them later. Never waits for I/O. ValueError for a bad ``until``."""
        until = check_until(until)
        dropped = 0
        with self._lock:
            for cid in ids:
                previous = self._until.pop(cid.key, 0.0)  # re-inserted: the newest retention last
                self._until[cid.key] = max(until, previous)
            while len(self._until) > self._hard_keys:  # the sweep is behind: the oldest go
                del self._until[next(iter(self._until))]
                dropped += 1
            sweep = len(self._until) > self._max_keys and not self._sweeping
            self._sweeping |= sweep
            queue = bool(tiers) and self._pending < self._max_pending
            if queue:
                self._pending += 1
        if dropped:
            self._metrics.add(dropped_retentions=dropped)
        if sweep:
            self._thread.submit(self._sweep)
        if not tiers:
            return
        if not queue:
            self._metrics.add(dropped_retentions=len(ids))
            return
        self._thread.submit(self._retain_present, [cid.key for cid in ids], until, list(tiers))

    def landed(self, tier: Tier, key: ChunkKey) -> None:
        """``tier`` just stored (or already had) ``key``: retain it there if it is retained."""
        until = self._until.get(key)
        if until is not None and until > time.time():
            tier.retain(key, until)

    def flush(self) -> None:
        """Block until every retention asked for so far has been attempted."""
        self._thread.submit(lambda: None).result()  # one thread, in order: the ones before are done

    def close(self) -> None:
        """Stop the thread without waiting: best effort, like a read, so a hung filesystem never
        hangs exit."""
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _sweep(self) -> None:
        """Drop expired keys, then the oldest retained, down to ``max_keys`` (on the thread: the
        pass over the table never runs on the caller's). The lock is held for a copy of the
        values and for the removals, never for the scan."""
        try:
            now = time.time()
            with self._lock:
                snapshot = list(self._until.items())
            expired = [k for k, t in snapshot if t <= now]
            dropped = 0
            with self._lock:
                for key in expired:
                    if self._until.get(key, math.inf) <= now:  # not retained again since
                        del self._until[key]
                while len(self._until) > self._max_keys:
                    del self._until[next(iter(self._until))]
                    dropped += 1
            if dropped:
                self._metrics.add(dropped_retentions=dropped)
        finally:
            with self._lock:
                self._sweeping = False

    def _retain_present(self, keys: Sequence[ChunkKey], until: float, tiers: Sequence[Tier]) -> None:
        try:
            for tier in tiers:
                for key in keys:
                    # A no-op in tiers that do not retain (TierBase); a tier bug must not stop the others.
                    self._failures.call(f"the {tier.name} tier's retain", tier.retain, key, until)
        finally:
            with self._lock:
                self._pending -= 1
