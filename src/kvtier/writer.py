"""Background write-down of chunks to the lower tiers, through a bounded queue.

``submit`` never blocks: when the queue is full the write is dropped and counted against
every tier it was meant for. Writer threads hold a reference to the chunk tensor, so a chunk
evicted from host DRAM before it reached disk is still written.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

from kvtier.format import ChunkSpec
from kvtier.tiers.base import Chunk, Status, Tier

log = logging.getLogger(__name__)

_STOP = None


class BackgroundWriter:
    def __init__(self, spec: ChunkSpec, max_queued: int, num_threads: int = 1) -> None:
        self.spec = spec
        self._queue: queue.Queue[tuple[Chunk, Sequence[Tier]] | None] = queue.Queue(max_queued)
        self._threads = [threading.Thread(target=self._run, name=f"kvtier-writer-{i}", daemon=True)
                         for i in range(num_threads)]
        self._closed = False
        for t in self._threads:
            t.start()

    def submit(self, chunk: Chunk, tiers: Sequence[Tier]) -> bool:
        """Queue ``chunk`` for ``tiers``; False (and counted) if the queue is full."""
        if not tiers:
            return True
        if self._closed:
            raise RuntimeError("store is closed")
        try:
            self._queue.put_nowait((chunk, tiers))
            return True
        except queue.Full:
            for tier in tiers:
                tier.metrics.add(dropped_writes=1)
            return False

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def flush(self) -> None:
        """Wait until every queued write has been attempted."""
        self._queue.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(_STOP)
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                chunk, tiers = item
                for tier in tiers:
                    try:
                        result = tier.store(chunk, self.spec)
                    except Exception:  # a tier bug must not kill the writer thread
                        log.exception("tier %s raised on store", tier.name)
                        tier.metrics.add(failed_writes=1)
                        continue
                    if result.status is Status.FAILED:
                        log.debug("write to %s failed: %s", tier.name, result.error)
            finally:
                self._queue.task_done()
