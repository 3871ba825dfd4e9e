"""Shared pool tier (``fs://PATH``): one chunk directory used by many processes and machines.

Correctness across instances comes from the file format and naming, not from locks:
chunks are published atomically under content-addressed names, every read is validated, a
chunk deleted between lookup and read is a counted miss, and unlinking a file never breaks a
reader that already opened it (POSIX; NFS keeps it alive by silly-rename).

**The byte budget** is the pool's own: recorded in ``ROOT/.budget`` by ``kvtier pool init
--max-bytes`` or ``kvtier pool budget`` and read by every instance (``tiers/poolroot.py``); an
instance's ``pool_bytes`` is the budget only where the pool records none, and otherwise only
lowers that instance's own admissions. Here an *instance* is each process that opens the pool:
a vLLM engine at tensor parallel N is N + 1 of them (its scheduler, which looks chunks up, and
each worker, which writes its heads). The budget holds across all of them, with no counter that
they all rewrite and no scan under a lock:

* Accounting (``tiers/ledger.py``): each instance counts the bytes it publishes and unlinks
  in a ledger file of its own, ``ROOT/.usage.d/<instance>.json``, which it rewrites (no lock)
  before its unwritten bytes would pass ``sync_bytes`` (1/32 of the budget, 1-256 MiB) and
  reads the others' at the same time (a *sync*: one listing, one small read per instance).
  The pool's total is a base (``ROOT/.usage``, the last exact count) plus every ledger.
* Eviction (``tiers/evict.py``) runs on a thread of this tier's own, never on the writer's,
  woken when the total nears the budget (a round's worth of writes below it, at most 10%:
  ``tiers/evictpace.py``), and by one instance of the fleet at a time (a
  non-blocking lease, ``ROOT/.evict.lock``): an approximate LRU (oldest mtime first; a hit
  refreshes mtime at most once a minute) sampled per shard directory, down to 0.9 of the
  budget (less the lead it started with), whose cost per evicted chunk does not grow with the pool.
* ``ROOT/.lock`` is held only to read and rewrite the base (one small read, one atomic
  replace): when folding up to 8 dead instances' ledgers, or re-anchoring the total after a
  pass that counted the whole pool (the ledgers are read before it). Never over a listing.

**Overshoot bound.** A writer publishes a chunk only while the total it last read plus what it
added since stays within the cap, ``budget + max(budget // 16, sync_bytes)``; past it the
chunk is refused and counted (``budget_refusals``), never waited for. As every instance syncs
before its unwritten bytes pass ``sync_bytes``, the pool holds at most

    cap + (instances - 1) x sync_bytes      (+ sync_bytes per instance crashed since the last anchor)

however far eviction lags: the last instance to read the total saw each other's ledger as it
is now, less at most ``sync_bytes`` each. (When one instance's writer threads keep more than
``sync_bytes`` in flight, e.g. chunks larger than it, that instance counts with its in-flight
bytes instead.) Only processes that publish count in ``instances`` (a vLLM scheduler process
never does: its ledger is always current), so a fleet of E engines at TP=N counts E x N. With
the defaults (``sync_bytes`` = budget / 32, at most 256 MiB) that is budget x (17/16 + (instances
- 1)/32) up to an 8 GiB budget (1.16 x for four writers), and budget x 17/16 + (instances - 1) x
256 MiB above it: for 32 writers (four TP=8 engines) on a 100 TB pool, 106.25 TB + 7.75 GiB.
The pool's filesystem needs that headroom over its budget (docs/operations.md, "Sizing").
Until a new pool (or one whose ``.usage`` was lost) has been counted once, the total is a
sample's estimate. The ``chunks`` gauge is an estimate too (exact after a full pass).

Retention (``retain``): a chunk kept for a session until a time gets that time as its mtime.
LRU order then evicts every unretained chunk before it, across instances and by ``kvtier pool
gc`` alike, and once the time has passed it ages like any chunk used then. (Setting a file's
times needs its owner: in a group-shared pool a chunk another user wrote keeps its mtime.)

Every eviction (by any instance, or gc) appends the chunk's key to ``ROOT/.evicted``, so that
each instance can tell routers that a chunk it announced is gone (``read_evictions``).

The pool's own files (``.lock``, ``.evict.lock``, ``.usage``, ``.usage.d/*``, ``.evicted``) are
as untrusted as its chunks in a group-shared pool: each is opened without following a symlink
or blocking on a FIFO, must be a regular file, and is read only up to a fixed size
(``fileio.read_small``); nonsense in one is ignored. A filesystem that cannot ``flock``
(ENOLCK on an NFS mount without lockd, a FUSE daemon without locks), or a lock file a
neighbour replaced, does not stop the budget: eviction goes on without the lease (concurrent
evictors are harmless), warned about once and counted in ``lock_failures``; dead instances'
ledgers are then not folded (each costs a read per sync until a lock works again); and bytes
a failed sync was adding are kept for the next.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from kvtier.errors import TierUnavailableError
from kvtier.format import ChunkSpec
from kvtier.keys import ChunkId, ChunkKey
from kvtier.metrics import TierMetrics
from kvtier.tiers.base import ChangeJournal, Chunk, LoadResult, Pages, Status, StoreResult, TierBase
from kvtier.tiers.evict import HEARTBEAT_S, LOW_WATERMARK, Evictor
from kvtier.tiers.evictlog import EVICTION_READ_MAX_BYTES, EvictionLog
from kvtier.tiers.files import ChunkFiles
from kvtier.tiers.ledger import Ledger, Usage, read_usage
from kvtier.tiers.poollock import PoolLocks
from kvtier.tiers.poolroot import BUDGET_REFRESH_S, check_pool_root, describe_at_open, read_budget, warn_once
from kvtier.urls import parse_pool_url

log = logging.getLogger(__name__)

TOUCH_INTERVAL_S = 60.0
CAP_MARGIN = 16  # the cap is budget + max(budget // CAP_MARGIN, sync_bytes)
REFRESH_S = 1.0  # over the cap, a writer reads the total again at most this often before refusing
LEASE_WAIT_S = 10.0  # an explicit evict() waits this long for another evictor's round
SYNC_FAILED = "budget sync failed"
__all__ = ["EVICTION_READ_MAX_BYTES", "LOW_WATERMARK", "PoolTier", "cap_bytes", "default_sync_bytes",
           "overshoot_bound", "parse_pool_url"]


def default_sync_bytes(capacity_bytes: int | None) -> int:
    """``sync_bytes`` when none is given: 1/32 of the budget, 1-256 MiB (64 MiB without one)."""
    return 64 << 20 if capacity_bytes is None else max(1 << 20, min(256 << 20, capacity_bytes // 32))


def cap_bytes(capacity_bytes: int, sync_bytes: int) -> int:
    """Past this total, writers refuse to publish: ``budget + max(budget // 16, sync_bytes)``."""
    return capacity_bytes + max(capacity_bytes // CAP_MARGIN, sync_bytes)


def overshoot_bound(capacity_bytes: int, sync_bytes: int, instances: int, crashed: int = 0) -> int:
    """The most the pool can hold (the module docstring's bound): ``cap + (instances - 1 +
    crashed) x sync_bytes``, ``crashed`` counting instances that died since the last anchor."""
    return cap_bytes(capacity_bytes, sync_bytes) + (instances - 1 + crashed) * sync_bytes


class PoolTier(TierBase):
    name = "pool"
    may_hang = True  # a network filesystem: lookups are timed (tiers/guard.py)
    reads_in_place = True

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int | None, *,
                 fsync: bool = False, direct_io: bool = True, sync_bytes: int | None = None,
                 group_access: bool = False, create: bool = False) -> None:
        """Open the pool at ``path``: an existing, marked pool directory (``tiers/poolroot.py``)
        unless ``create``, which makes and marks it first (``kvtier pool init`` does that for
        users). ``capacity_bytes`` is this instance's ``pool_bytes``: the budget when the pool
        records none, and otherwise a limit on this instance's own admissions only."""
        if not create:
            check_pool_root(path)
        self.own_bytes = capacity_bytes
        self.metrics = TierMetrics(self.name)
        self.files = ChunkFiles(path, fsync=fsync, direct_io=direct_io, group_access=group_access)
        try:
            # Created here with the directory's file mode (group members must open it too);
            # a symlink planted in its place is refused, never followed, and (like a FIFO
            # there) costs only the lock: the probe below warns and counts it.
            os.close(self.files.create_file(self.files.root / ".lock", os.O_RDWR | os.O_NONBLOCK))
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise TierUnavailableError(f"cannot use {self.files.root / '.lock'} as the pool's lock file: "
                                           f"{exc.strerror or exc}") from exc
        self.locks = PoolLocks(self.files, self.metrics)
        self.lock_works = self.locks.probe()
        describe_at_open(self.files.root)
        self.pool_budget = read_budget(self.files.root)
        self._budget_read_at = time.monotonic()
        self.capacity_bytes = self.pool_budget if self.pool_budget is not None else capacity_bytes
        """The pool's budget, which eviction holds: the one recorded in the pool, else ``pool_bytes``."""
        self.sync_bytes = default_sync_bytes(self.capacity_bytes) if sync_bytes is None else sync_bytes
        self.cap_bytes: int | None = None
        """Above this, this instance refuses to publish (the overshoot bound's cap, lowered by
        its own ``pool_bytes``; None: no budget)."""
        self._set_cap()
        if self.capacity_bytes is None:
            log.warning("kvtier pool %s has no budget (none recorded in the pool, no pool_bytes): it grows until "
                        "its filesystem is full; set one with `kvtier pool budget %s SIZE`", path, path)
        self.journal: ChangeJournal = ChangeJournal()
        self.ledger = Ledger(self.files, self.locks)
        self._mutex = threading.Lock()  # the fields below
        self._admission = threading.Lock()  # serialises admissions and syncs (both quick)
        self._usage: Usage | None = None  # the last read of the ledgers and the base
        self._view: int | None = None  # its total (None: unknown)
        self._own_read = 0  # our ledger's part of that total (added - removed, as read)
        self._estimate: int | None = None  # a sample's estimate, while the total is unknown
        self._read_at = -float("inf")  # time.monotonic() of the last read
        self._inflight = 0  # bytes admitted and not yet published (or given up)
        self.eviction_log = EvictionLog(self.files)
        self.evictor = Evictor(self, self.files, self.locks, self.ledger, self.journal, self.metrics, self.sync_bytes,
                               self.eviction_log)
        self._evicting = False
        self._start_evictor()

    # -- the budget (tiers/poolroot.py) -------------------------------------------------------

    def _set_cap(self) -> None:
        caps = [cap_bytes(b, self.sync_bytes) for b in (self.pool_budget, self.own_bytes) if b is not None]
        self.cap_bytes = min(caps) if caps else None
        if self.pool_budget is not None and self.own_bytes is not None and self.own_bytes != self.pool_budget:
            lowers = self.own_bytes < self.pool_budget
            warn_once(str(self.files.root), f"budget-disagrees-{self.own_bytes}",
                      "kvtier pool %s: pool_bytes %d differs from the budget recorded in the pool (%d); the pool's "
                      "budget is the one eviction holds, and %s", self.files.root, self.own_bytes, self.pool_budget,
                      "this instance admits chunks only while the pool is within its own pool_bytes" if lowers
                      else "this instance's larger pool_bytes is ignored")

    def _start_evictor(self) -> None:
        if self.capacity_bytes is not None and not self._evicting:
            self._evicting = True
            self.evictor.start()

    def _refresh_budget(self) -> None:
        """Read the pool's budget again when ``BUDGET_REFRESH_S`` have passed (in a sync)."""
        now = time.monotonic()
        if now - self._budget_read_at < BUDGET_REFRESH_S:
            return
        self._budget_read_at = now
        budget = read_budget(self.files.root)
        if budget is None or budget == self.pool_budget:
            return
        log.info("kvtier pool %s: budget now %d bytes (was %s)", self.files.root, budget, self.pool_budget)
        self.pool_budget = self.capacity_bytes = budget
        self._set_cap()
        self._start_evictor()

    # -- protocol ---------------------------------------------------------------------------

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        return self.files.leading_present(ids)

    def load(self, chunk: ChunkId, spec: ChunkSpec, into: np.ndarray | None = None, *,
             pages: Pages | None = None) -> LoadResult:
        # A corrupt chunk is useless to every instance: load removes it for all of them.
        return self.files.load(chunk, spec, into, self.metrics, TOUCH_INTERVAL_S, pages)

    def time_read(self, chunk: ChunkId, max_bytes: int) -> tuple[int, float] | None:
        return self.files.time_read(chunk.key, max_bytes)

    def store(self, chunk: Chunk, spec: ChunkSpec) -> StoreResult:
        """Publish ``chunk`` unless the pool is over its cap (then FAILED, counted in
        ``budget_refusals``: eviction is behind). Never evicts and never waits on another
        instance: at most a sync (its own ledger written, the others' read) every ``sync_bytes``."""
        size = spec.file_bytes
        refusal = self._admit(size)
        if refusal is not None:
            if self.files.stat_size(chunk.id.key) is not None:
                return StoreResult(Status.EXISTS)
            self.metrics.add(**{"failed_writes" if refusal.startswith(SYNC_FAILED) else "budget_refusals": 1})
            return StoreResult(Status.FAILED, refusal)
        try:
            written = self.files.publish(chunk, spec)
            if written:
                self.ledger.add(written)  # before the reservation goes: never counted zero times
        except OSError as exc:
            self.metrics.add(failed_writes=1)
            return StoreResult(Status.FAILED, str(exc))
        finally:
            with self._mutex:
                self._inflight -= size
        if not written:
            return StoreResult(Status.EXISTS)
        self.journal.record(True, chunk.id.key)
        self.metrics.add(bytes_written=written, written_chunks=1)
        return StoreResult(Status.WRITTEN)

    def evict(self, target_bytes: int) -> int:
        """One eviction round down to ``target_bytes`` now, in the caller's thread (after up to
        ``LEASE_WAIT_S`` for another evictor's round; 0 if it is still going then)."""
        return self.evictor.evict(target_bytes, wait_s=LEASE_WAIT_S) or 0

    def retain(self, key: ChunkKey, until: float) -> bool:
        """Keep the chunk ahead of unretained ones until ``until`` (epoch seconds): its mtime.
        False when it is not there, or its mtime could not be set (another user's file)."""
        return self.files.retain(key, until)

    def describe_namespace(self, digest: bytes, info: dict[str, object]) -> None:
        self.files.describe_namespace(digest, info)

    def read_evictions(self) -> list[bytes]:
        """Keys evicted from the pool (by anyone) since the last call; the first call starts
        at the log's end."""
        return self.eviction_log.read_new()

    def close(self) -> None:
        """Stop the evictor (a round in progress stops at its next directory) and write the
        final ledger, marked closed so that another instance folds it. Never raises."""
        self.evictor.close()
        self.ledger.close()

    # -- accounting (tiers/ledger.py) -------------------------------------------------------

    def sync(self, wake: bool = True) -> int:
        """Write this instance's ledger (when it has counts to write or its heartbeat is due)
        and read the pool's total, without ``ROOT/.lock``; wake the evictor when over budget
        (unless not ``wake``: the evictor's own look). Returns the total as this instance knows
        it. Raises OSError when the ledger cannot be written; its counts are kept for the next."""
        with self._admission:
            return self._sync(wake)

    def _sync(self, wake: bool = True) -> int:
        self._refresh_budget()
        if self.ledger.due(HEARTBEAT_S):
            self.ledger.write()
        usage = read_usage(self.files.root, self._usage)
        folded = usage.base.folded(self.ledger.id) if usage.base is not None else None
        if folded is not None:
            self.ledger.rotate(*folded)  # we looked dead and were folded: go on under a new id
            self.ledger.write()
            usage = read_usage(self.files.root, usage)
        own = usage.ledgers.get(self.ledger.id)
        with self._mutex:
            self._usage, self._view, self._read_at = usage, usage.total, time.monotonic()
            self._own_read = own.added - own.removed if own is not None else 0
            known = self._known()
        self.metrics.set(bytes=known)
        if wake and self.capacity_bytes is not None and (
                usage.total is None or known > self.evictor.pace.start_at(self.capacity_bytes)):
            self.evictor.wake()
        return known

    def _admit(self, size: int) -> str | None:
        """Reserve ``size`` bytes for a publish, or say why not: sync first when the bytes not
        yet in our ledger would pass ``sync_bytes`` (or, over budget, when the total we read is
        over a second old), then check the cap."""
        with self._admission:
            with self._mutex:
                unwritten = self.ledger.unsynced()[0] + self._inflight + size
                projected = self._known() + self._inflight + size
                stale = time.monotonic() - self._read_at > REFRESH_S
            over = self.capacity_bytes is not None and projected > self.capacity_bytes
            if unwritten > self.sync_bytes or (over and stale):
                try:
                    self._sync()
                except OSError as exc:
                    if self.capacity_bytes is not None:  # unwritten bytes must stay within sync_bytes
                        return f"{SYNC_FAILED}: {exc}"
            with self._mutex:
                projected = self._known() + self._inflight + size
                refused = self.cap_bytes is not None and projected > self.cap_bytes
                if not refused:
                    self._inflight += size
        if self.capacity_bytes is not None and projected > self.evictor.pace.start_at(self.capacity_bytes):
            self.evictor.wake()  # a round starts a little ahead of the budget (tiers/evictpace.py)
        if refused:
            return f"the pool is over its budget cap ({self.cap_bytes} B): eviction is behind; not published"
        return None

    def _known(self) -> int:
        """The total as last read, with our own ledger's part as it is now rather than as read
        (our writes and our evictor's removals since count at once; caller holds _mutex)."""
        if self._view is not None:
            return max(0, self._view - self._own_read + self.ledger.added - self.ledger.removed)
        # Unknown until the evictor's first count: a sample's estimate, or the ledgers.
        added, removed = self.ledger.unsynced()
        read = max(self._estimate or 0, self._usage.floor if self._usage is not None else 0)
        return max(0, read + added - removed)

    def known_total(self) -> int | None:
        """``_known``, or None while the total is unknown and no sample has estimated it."""
        with self._mutex:
            return None if self._view is None and self._estimate is None else self._known()

    def last_usage(self) -> Usage | None:
        with self._mutex:
            return self._usage

    def note_estimate(self, total_bytes: int) -> None:
        with self._mutex:
            self._estimate = total_bytes
