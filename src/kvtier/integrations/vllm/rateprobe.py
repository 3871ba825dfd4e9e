"""A tier's first read rate, timed by the scheduler when a lookup first finds a hit there.

``load_mode: auto`` loads in the step only from tiers whose read rate was measured: on the
prior, a slow or stalling tier would hold the step, where an abort cannot stop the load. The
workers measure a tier with their loads, so before this, a restarted engine's first hit from
each tier loaded in the background and cost its request two engine steps (at concurrency 2,
the first pair's mean TTFT went from 1.08x to 1.42x the floor).

``RateProbe.measure`` runs on a lookup thread. The first time a tier holds a hit it reads one
chunk file there whole (``TierBase.time_read``: raw bytes, nothing validated, kept, removed or
touched) on a probe thread, waits for it up to ``PROBE_WAIT_S`` after it started, and records
the rate in ``Rates`` as the tier's first measurement. A read that takes longer leaves the
tier unmeasured for the requests that waited (they load in the background, as before) and is
recorded when it ends; a failed read (the file gone, a tier that cannot time reads, Redis) is
tried again by a later hit, at most once every ``RETRY_S``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from typing import Protocol, runtime_checkable

from kvtier.keys import ChunkId
from kvtier.policy import Rates
from kvtier.threads import executor

log = logging.getLogger(__name__)

PROBE_WAIT_S = 0.015
"""The longest a lookup waits for a probe: with the lookup's own metadata calls (6-9 ms cold)
it stays inside the idle scheduler's wait (``LOOKUP_IDLE_WAIT_S``), so the request is answered
in the pass it arrived in. One chunk of the tiny model cold from this disk: about 1 ms."""
RETRY_S = 1.0


@runtime_checkable
class Timed(Protocol):
    """A level that can time a raw read (``TierBase.time_read``)."""

    name: str

    def time_read(self, chunk: ChunkId, max_bytes: int) -> tuple[int, float] | None: ...


class RateProbe:
    """One probe per tier at a time, on probe threads; results go to ``rates``."""

    def __init__(self, rates: Rates, max_bytes: int) -> None:
        self.rates, self.max_bytes = rates, max_bytes
        self._threads = executor(2, "kvtier-probe")  # disk and pool: a hung pool never holds up the disk's
        self._lock = threading.Lock()
        self._running: dict[str, tuple[float, cf.Future[None]]] = {}  # tier name -> (started, probe)
        self._failed_at: dict[str, float] = {}

    def measure(self, tier: Timed, chunk: ChunkId) -> None:
        """Time a read of ``chunk`` (present in ``tier``) unless the tier was measured; wait for
        it, or for the probe already running there, up to ``PROBE_WAIT_S`` after it started."""
        name = tier.name
        if name in self.rates.measured:
            return
        now = time.monotonic()
        with self._lock:
            running = self._running.get(name)
            if running is None:
                if now - self._failed_at.get(name, -RETRY_S) < RETRY_S:
                    return
                running = self._running[name] = (now, self._threads.submit(self._probe, tier, chunk))
        started, future = running
        left = started + PROBE_WAIT_S - now
        if left > 0:
            cf.wait([future], timeout=left)

    def _probe(self, tier: Timed, chunk: ChunkId) -> None:
        timed = None
        try:
            timed = tier.time_read(chunk, self.max_bytes)
        except Exception as exc:  # a tier bug must not end the probe thread's usefulness
            log.warning("kvtier: timing a read of the %s tier failed: %r", tier.name, exc)
        with self._lock:  # recorded before the next lookup can find neither a probe nor a rate
            del self._running[tier.name]
            if timed is None:
                self._failed_at[tier.name] = time.monotonic()
                return
            nbytes, seconds = timed
            self.rates.observe_read(tier.name, nbytes, seconds)
        log.info("kvtier: first read from the %s tier: %d B in %.2f ms (%.2f GB/s)", tier.name, nbytes,
                 seconds * 1e3, nbytes / max(seconds, 1e-9) / 1e9)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
