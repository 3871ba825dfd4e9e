"""Session retention: chunks kept in the disk tier and the pool ahead of unretained ones.

``TieredStore.retain`` records, per chunk key, the time until which it is retained, and hands
the chunks already stored to the tiers on a thread of its own (never behind, or dropped by, a
full write queue). Chunks written later under a retained key are retained as they land: the
store's background writer calls ``Retention.landed`` after each chunk a tier stored. The tiers
keep the retention themselves (a file's mtime, see ``tiers/files.py``); host DRAM and Redis
do not retain.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Sequence

from kvtier.keys import ChunkId, ChunkKey
from kvtier.tiers.base import Tier

log = logging.getLogger(__name__)

PRUNE_AT = 1 << 16  # retained keys remembered before expired ones are dropped


class Retention:
    """Retained keys and the thread that retains chunks already stored. Thread-safe."""

    def __init__(self) -> None:
        self._until: dict[ChunkKey, float] = {}  # key -> until (epoch s): applied to chunks written later too
        self._lock = threading.Lock()
        self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="kvtier-retain")

    def retain(self, ids: Sequence[ChunkId], until: float, tiers: Sequence[Tier]) -> None:
        """Retain ``ids`` until ``until`` (a later time wins) in ``tiers`` now, and in any tier
        that stores one of them later. Never waits for I/O."""
        now = time.time()
        with self._lock:
            if len(self._until) > PRUNE_AT:
                self._until = {k: t for k, t in self._until.items() if t > now}
            for cid in ids:
                self._until[cid.key] = max(until, self._until.get(cid.key, 0.0))
        if tiers:
            self._thread.submit(_retain_present, [cid.key for cid in ids], until, list(tiers))

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


def _retain_present(keys: Sequence[ChunkKey], until: float, tiers: Sequence[Tier]) -> None:
    for tier in tiers:
        for key in keys:
            try:
                tier.retain(key, until)  # a no-op in tiers that do not retain (TierBase)
            except Exception:  # best effort: a tier bug must not stop the others
                log.exception("tier %s raised on retain", tier.name)
