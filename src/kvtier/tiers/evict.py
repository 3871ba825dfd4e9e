"""Evicting the shared pool: an approximate LRU whose cost per evicted chunk does not grow with
the pool, run by one background thread per pool tier and by one instance of the fleet at a time.

A **round** holds the eviction lease (``ROOT/.evict.lock``, taken without blocking: an instance
that finds it held skips the round) and no other lock while it works:

1. it lists the shard directories (``ChunkFiles.shard_dirs``: at most 257 listings, a small
   constant beside a sweep's) and shuffles them;
2. **sample**: it lists and ``lstat``s directories in that order until it has seen
   ``SAMPLE_FILES`` chunk files, and picks a global mtime cutoff (``tiers/evictplan.py``): the
   mtime below which the share of the pool's bytes it must free lies in the sample (oldest
   first, plus twice the share's sampling error, so that one pass rarely falls short);
3. **sweep**: it visits the directories in the same order (the sampled ones from memory) and
   unlinks every chunk older than the cutoff, until it freed what it must, and removes the
   directories it empties (``ChunkFiles.prune_shard``: rounds then list only directories that
   hold chunks).

On a network filesystem every listing, ``lstat`` and unlink is a round trip: when the first
``PROBE_DIRS`` directories take over ``PARALLEL_ABOVE_S`` each, the round lists and unlinks on
``SCAN_THREADS`` threads, a few directories ahead, and accounts the outcomes in order in its
own thread (on a local disk threads only add overhead: it stays serial).

mtime is the LRU clock (a hit refreshes it at most once a minute). A global cutoff keeps the
files of one logical chunk (head shards written together, with near-equal mtimes) together:
whichever directories they are in, they are on the same side of it. A sweep visits about
``total / freed`` chunk files per chunk it frees (ten from the budget down to the low
watermark, 0.9 of it) plus a constant (the sample, the listing of directories): the cost per
evicted chunk does not grow with the pool; one round's cost does.

**Retained chunks** (an mtime in the future, ``PoolTier.retain``) lie beyond any cutoff of a
first pass, which is clipped at the round's start. Only after a pass that visited every
directory with that clipped cutoff (so every unretained chunk it met is gone) may the next one
reach into them, oldest retention first.

A pass that visits **every** directory is a count of the pool: the round then anchors the
total (``tiers/ledger.py``). A round visits everything when the sample covers the whole pool
(small pools: exact LRU), when there is no sound total (a new pool, ``.usage`` lost or
hostile, a sum below zero), when the total disagrees with the sample's estimate by more than
sampling explains (drift: crashed writers, manual deletes), and every ``RECOUNT_S``.

Concurrent evictors (no working lock, or an explicit ``evict`` beside a background round) are
harmless: an unlink that meets ENOENT is not counted as freed, and each removal is accounted
once, in the ledger of whoever removed the file.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import os
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.metrics import TierMetrics
from kvtier.threads import executor, thread
from kvtier.tiers.base import ChangeJournal
from kvtier.tiers.evictlog import EvictionLog
from kvtier.tiers.evictpace import Pace
from kvtier.tiers.evictplan import SLACK, Plan, plan
from kvtier.tiers.files import ChunkFile, ChunkFiles
from kvtier.tiers.folds import anchor, fold_dead, remove_orphans
from kvtier.tiers.ledger import Ledger, Usage, read_usage
from kvtier.tiers.listing import SCAN_THREADS, listed
from kvtier.tiers.poollock import Lease, PoolLocks

log = logging.getLogger(__name__)
__all__ = ["HEARTBEAT_S", "LOG_BATCH", "LOW_WATERMARK", "SCAN_THREADS", "SLACK", "Evictor", "Plan", "RoundStats",
           "listed", "plan"]

LOW_WATERMARK = 0.9  # a round frees down to this share of the budget (less its lead: evictpace.py)
SAMPLE_FILES = 2048  # chunk files a round's sample sees (about 2% error on the cutoff's share)
RESERVOIR = 4096  # kept chunks remembered by a pass, to place the next pass's cutoff
MAX_PASSES = 4
PARALLEL_ABOVE_S = 5e-4  # a round lists on the scan threads when a directory takes longer than this
PROBE_DIRS = 16  # listed one by one at a round's start, to tell a local disk from a network filesystem
TICK_S = 10.0  # the evictor looks at the total this often (and whenever a writer sees it over)
BUSY_RETRY_S = 1.0  # over budget, lease held elsewhere: look again this soon
MIN_LOOK_S = 0.2  # looks (a sync each) at most this often, however often writers wake the thread
HEARTBEAT_S = 60.0  # an idle instance rewrites its ledger this often (ledger.STALE_S is 600)
FOLD_INTERVAL_S = 60.0
RECOUNT_S = 3600.0  # a total older than this is recounted by the next round (drift, crashes)
COUNT_RETRY_S = 600.0  # a count that left no sound total (a neighbour's nonsense) is retried this late
LOG_BATCH = 256  # evicted keys appended to the eviction log at once


class Owner(Protocol):
    """What the evictor needs from its pool tier."""

    capacity_bytes: int | None

    def sync(self, wake: bool = True) -> int:
        """Write this instance's ledger if due, read the total (``known_total``)."""
        ...

    def known_total(self) -> int | None:
        """The pool's total as last read plus this instance's unwritten counts; None: unknown."""
        ...

    def last_usage(self) -> Usage | None:
        ...

    def note_estimate(self, total_bytes: int) -> None:
        """A sample's estimate of the pool's bytes (used while the total is unknown)."""
        ...


Doom = Callable[[ChunkFile], bool]  # which chunks of a directory a sweep unlinks
# a directory's chunk files, unlink outcomes by index, and whether the directory was pruned (emptied)
Visit = tuple[list[ChunkFile], dict[int, bool | None], bool]


@dataclass
class Sweep:
    """One pass over shard directories."""

    complete: bool = False  # every directory visited: kept_* are a count of the pool
    evicted: int = 0
    freed: int = 0
    kept_bytes: int = 0
    kept_chunks: int = 0
    visited: int = 0
    seen: int = 0
    pruned: int = 0
    reservoir: list[ChunkFile] = field(default_factory=list)


@dataclass(frozen=True)
class RoundStats:
    """What the last round did (benchmarks and tests read it)."""

    evicted: int
    freed: int
    passes: int
    anchored: bool
    dirs: int
    visited: int
    seen: int
    seconds: float
    pruned: int = 0  # empty shard directories removed


class Evictor:
    """The eviction rounds of one pool tier: ``evict`` in the caller's thread, and (``start``)
    a background thread that runs them when the total nears the budget (``tiers/evictpace.py``).
    The thread never runs writers' work and writers never run rounds: they only ``wake`` it."""

    def __init__(self, owner: Owner, files: ChunkFiles, locks: PoolLocks, ledger: Ledger,
                 journal: ChangeJournal, metrics: TierMetrics, sync_bytes: int, log: EvictionLog) -> None:
        self._owner = weakref.ref(owner)  # the thread must not keep an unclosed tier alive
        self.files, self.locks, self.ledger = files, locks, ledger
        self.journal, self.metrics, self.sync_bytes = journal, metrics, sync_bytes
        self.log = log
        self.last_round: RoundStats | None = None
        self.pace = Pace()  # when a round starts: ahead of the budget by a round's worth of writes
        self._rng = random.Random()
        self._scan_pool: cf.ThreadPoolExecutor | None = None
        self._parallel = True
        self._round_mutex = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._asked = self._done = 0
        self._thread: threading.Thread | None = None
        self._last_fold = -math.inf
        self._counted_at = -math.inf  # time.monotonic() of this evictor's last full pass
        self._seen_count = (math.nan, 0.0)  # (a count's anchored_at, when this evictor first saw it)
        self._quiet_until = -math.inf
        self.thread_id: int | None = None
        self._unlink_warned = False

    # -- the background thread -------------------------------------------------------------

    def start(self) -> None:
        # No thread_init: the thread touches files only, never a device.
        self._thread = thread(self._loop, "kvtier-pool-evict")
        self._thread.start()
        self.wake()

    def wake(self) -> None:
        """Ask for a look at the total soon (cheap; any thread)."""
        self._wake.set()

    def settle(self, timeout_s: float = 60.0) -> bool:
        """Wait until a look (and any round it starts) begun after this call has ended; False on
        timeout or without a thread (for tests and benchmarks)."""
        if self._thread is None:
            return False
        with self._cond:
            self._asked += 1
            want = self._asked
            self._wake.set()
            return self._cond.wait_for(lambda: self._done >= want or self._stop.is_set(), timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        if self._scan_pool is not None:
            self._scan_pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        self.thread_id = threading.get_ident()
        wait, ended = 0.0, -math.inf
        while not self._stop.is_set():
            self._wake.wait(wait)
            if wait > 0:  # writers' wakes come per chunk: look at most every MIN_LOOK_S, unless behind
                self._stop.wait(MIN_LOOK_S - (time.monotonic() - ended))
            self._wake.clear()
            with self._cond:
                asked, forced = self._asked, self._asked > self._done
            if self._stop.is_set():
                break
            try:
                wait = self._look(forced)
            except Exception:  # a bug or a surprise from the filesystem must not end the thread
                log.exception("kvtier: the pool's evictor failed; it goes on")
                self.metrics.add(thread_errors=1)
                wait = TICK_S
            ended = time.monotonic()
            with self._cond:
                self._done = max(self._done, asked)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _look(self, forced: bool) -> float:
        """Heartbeat, folds, and a round when over budget; returns the seconds to the next look."""
        owner = self._owner()
        if owner is None:
            self._stop.set()
            return 0.0
        try:
            total = owner.sync(wake=False)  # our ledger (if due) and the total
        except OSError:
            total = owner.known_total() or 0
        usage, now = owner.last_usage(), time.time()
        if usage is not None and now - self._last_fold > FOLD_INTERVAL_S:
            self._last_fold = now
            candidates = usage.foldable(now)
            if candidates:
                fold_dead(self.files, self.locks, candidates, now)
            remove_orphans(self.files, now)
        capacity = owner.capacity_bytes
        if capacity is None:
            return TICK_S
        base = usage.base if usage is not None else None
        count = (base is None or usage is None or usage.total is None or self._age(base.anchored_at) > RECOUNT_S) \
            and self._may_count()
        self.pace.look(time.monotonic(), total)
        if total <= self.pace.start_at(capacity) and not count:
            return max(MIN_LOOK_S, self.pace.next_look_s(total, capacity, TICK_S))
        quiet = self._quiet_until - time.monotonic()
        if quiet > 0 and not forced:
            return quiet  # the last round found nothing to do: writers' wakes change nothing yet
        del owner  # a round may be long: do not keep the tier alive through it
        # Started ahead of the budget, a round frees as much further: a tenth of it at least.
        evicted = self.evict(int(capacity * LOW_WATERMARK) - self.pace.lead(capacity), count=count)
        if evicted is None:
            return BUSY_RETRY_S  # another instance is evicting: look again soon
        if not evicted and not (self.last_round is not None and self.last_round.anchored):
            # Over budget by the total, not by what the round saw (drift it may not recount yet).
            self._quiet_until = time.monotonic() + TICK_S
            return TICK_S
        return 0.0 if evicted else TICK_S  # writers outpacing it: the next round at once, if still over

    def _age(self, anchored_at: float) -> float:
        """The age of the count anchored at ``anchored_at`` (another instance's clock): by this
        clock, or, when that puts it in the future, since this evictor first saw it. So a
        clock ahead on the instance that anchored does not make every other one recount, and
        one ahead here recounts at most once per count it sees."""
        if self._seen_count[0] != anchored_at:
            self._seen_count = (anchored_at, time.monotonic())
        return max(time.time() - anchored_at, time.monotonic() - self._seen_count[1])

    def _may_count(self) -> bool:
        return time.monotonic() - self._counted_at > COUNT_RETRY_S

    # -- a round ---------------------------------------------------------------------------

    def evict(self, target_bytes: int, *, wait_s: float = 0.0, count: bool = False) -> int | None:
        """One round down to ``target_bytes``, in the caller's thread, under the eviction lease
        (polled for up to ``wait_s``). ``count``: visit every directory and anchor the total even
        once enough is freed. Returns the chunks evicted, or None when another evictor kept the
        lease."""
        with self._round_mutex, self.locks.lease(wait_s) as lease:
            if lease is Lease.BUSY:
                return None
            if self._scan_pool is None and SCAN_THREADS > 1:
                self._scan_pool = executor(SCAN_THREADS, "kvtier-evict-scan")  # no device work: no init
            return self._round(target_bytes, count)

    def _round(self, target: int, count: bool) -> int:
        t0, now = time.perf_counter(), time.time()
        own = (self.ledger.id, self.ledger.added)  # first: a write in between counts as "since"
        before = read_usage(self.files.root)
        order = self.files.shard_dirs(self._scan_pool if self._parallel else None)
        self._rng.shuffle(order)
        first: dict[str, list[ChunkFile]] = {}  # the sampled directories, not listed again
        sample: list[ChunkFile] = []
        t_probe = time.perf_counter()
        for shard in order[:PROBE_DIRS]:
            found = first[shard] = self.files.scan_shard(shard)
            sample += found
        # A local disk answers in tens of microseconds: threads would only add their overhead.
        self._parallel = (time.perf_counter() - t_probe) / max(1, len(first)) > PARALLEL_ABOVE_S
        listing = listed(self.files, order[len(first):], self._scan_pool if self._parallel else None)
        for shard, found in listing if len(sample) < SAMPLE_FILES else ():
            first[shard] = found
            sample += found
            if len(sample) >= SAMPLE_FILES:
                break
        listing.close()
        exact = len(first) == len(order)
        total, count = self._total(sample, len(first), len(order), exact, before, count)
        evicted = freed = seen = visited = passes = pruned = 0
        anchored, retained = False, exact
        while passes < MAX_PASSES and (total > target or count):
            passes += 1
            chosen = plan(sample, total - target, total, now, exact=exact, retained=retained)
            sweep = self._sweep(order, first, chosen, total - target, visit_all=exact or count)
            evicted, freed = evicted + sweep.evicted, freed + sweep.freed
            seen, visited, pruned = seen + sweep.seen, visited + sweep.visited, pruned + sweep.pruned
            if not sweep.complete:
                break  # freed what it must (or the tier is closing)
            self._write_ledger()  # our removals, before the anchor reads the ledgers
            anchored_total = anchor(self.files, self.locks, sweep.kept_bytes, before, own)
            if anchored_total is not None:
                anchored = True
                self.metrics.set(bytes=anchored_total)
            # Go on from what the pass saw (the anchored total may count a pass's new writes twice).
            total, count, self._counted_at = sweep.kept_bytes, False, time.monotonic()
            self.metrics.set(chunks=sweep.kept_chunks)
            own = (self.ledger.id, self.ledger.added)
            before = read_usage(self.files.root)
            retained = retained or chosen.all_unretained  # every unretained chunk it met is gone
            sample, exact, first = sweep.reservoir, len(sweep.reservoir) == sweep.kept_chunks, {}
            self._rng.shuffle(order)
        self._write_ledger()
        owner = self._owner()
        if anchored and owner is not None:
            try:
                owner.sync(wake=False)  # its view of the total: the anchored one, not an estimate
            except OSError:
                pass
        del owner
        self.last_round = RoundStats(evicted, freed, passes, anchored, len(order), visited, seen,
                                     time.perf_counter() - t0, pruned)
        self.pace.round_ended(self.last_round.seconds)
        return evicted

    def _total(self, sample: list[ChunkFile], sampled_dirs: int, dirs: int, exact: bool, before: Usage,
               count: bool) -> tuple[int, bool]:
        """The total a round works from, and whether it must count the pool: the sample itself
        when it is the whole pool; else the accounted total, unless there is none or it differs
        from the sample's estimate by more than the sample's error (then the estimate, and a
        count when one is allowed)."""
        sampled = sum(f.size for f in sample)
        estimate = sampled if exact else sampled * dirs // max(1, sampled_dirs)
        self.metrics.set(chunks=len(sample) if exact else len(sample) * dirs // max(1, sampled_dirs))
        owner = self._owner()
        known = owner.known_total() if owner is not None else before.total
        if owner is not None:
            owner.note_estimate(estimate)
        if exact:
            return estimate, count
        if known is None or abs(known - estimate) > max(0.25, 3 / math.sqrt(max(1, len(sample)))) * estimate:
            return estimate, count or self._may_count()
        return known, count

    def _sweep(self, order: list[str], first: dict[str, list[ChunkFile]], chosen: Plan, need: int, *,
               visit_all: bool) -> Sweep:
        """Visit ``order`` (the directories in ``first`` already listed) unlinking the plan's
        victims (all of them), or else chunks older than its cutoff until ``need`` bytes are
        freed (then stop, or only count on when ``visit_all``). Listings and unlinks run on the
        scan threads, a few directories ahead (so a sweep may free a few directories' worth
        more than ``need``); what they did is accounted here, in order."""
        out = Sweep()
        victims, cutoff = chosen.victims, chosen.cutoff
        doom: Doom = (lambda f: os.fspath(f.path) in victims) if victims is not None else (lambda f: f.mtime < cutoff)
        keys: list[bytes] = []
        unwritten = 0

        def next_task(shard: str) -> tuple[bool, Doom | None]:
            if self._stop.is_set():
                return False, None
            if victims is None and out.freed >= need:
                return visit_all, None  # freed enough: stop, or only count on
            return True, doom

        for found, outcomes, pruned in self._visits(order, first, next_task):
            out.visited += 1
            out.pruned += pruned
            for i, f in enumerate(found):
                out.seen += 1
                gone = outcomes.get(i)
                if gone:
                    out.evicted, out.freed, unwritten = out.evicted + 1, out.freed + f.size, unwritten + f.size
                    keys.append(f.key)
                    self.ledger.remove(f.size)
                    self.journal.record(False, f.key)
                    self.metrics.add(evictions=1, evicted_bytes=f.size)
                    continue
                if gone is False:
                    continue  # someone else removed it: neither freed by us nor kept
                out.kept_bytes += f.size
                out.kept_chunks += 1
                if len(out.reservoir) < RESERVOIR:
                    out.reservoir.append(f)
                else:
                    j = self._rng.randrange(out.kept_chunks)
                    if j < RESERVOIR:
                        out.reservoir[j] = f
            if len(keys) >= LOG_BATCH:
                self.log.append(keys)
                keys = []
            if unwritten >= self.sync_bytes:
                self._write_ledger()  # a crash mid-round leaves at most sync_bytes of removals unwritten
                unwritten = 0
        out.complete = out.visited == len(order) and not self._stop.is_set()
        self.log.append(keys)
        return out

    def _visits(self, order: list[str], first: dict[str, list[ChunkFile]],
                next_task: Callable[[str], tuple[bool, Doom | None]]) -> Iterator[Visit]:
        """``_visit`` of each of ``order`` in turn, up to ``2 x SCAN_THREADS`` directories ahead
        on the scan threads; ``next_task(shard)`` gives (go on?, what to unlink there). When it
        says stop, what is in flight is still yielded: every unlink made is accounted for."""
        window: deque[cf.Future[Visit]] = deque()
        todo = iter(order)
        submitting = True
        while True:
            while submitting and len(window) < 2 * SCAN_THREADS:
                shard = next(todo, None)
                go, doom = next_task(shard) if shard is not None else (False, None)
                if shard is None or not go:
                    submitting = False
                    break
                if self._scan_pool is not None and self._parallel:
                    window.append(self._scan_pool.submit(self._visit, shard, first.get(shard), doom))
                else:
                    done: cf.Future[Visit] = cf.Future()
                    done.set_result(self._visit(shard, first.get(shard), doom))
                    window.append(done)
            if not window:
                return
            yield window.popleft().result()

    def _visit(self, shard: str, found: list[ChunkFile] | None, doom: Doom | None) -> Visit:
        """List ``shard`` (unless ``found``) and unlink what ``doom`` picks: its chunk files, and
        the outcome of each unlink by index (see ``_unlink``). Runs on a scan thread."""
        earlier = found is not None  # the round's sample: listed a while ago
        if found is None:
            found = self.files.scan_shard(shard)
        outcomes = {i: self._unlink(f) for i, f in enumerate(found)
                    if doom is not None and doom(f) and (not earlier or self._unchanged(f))}
        emptied = all(outcomes.get(i) is not None for i in range(len(found)))
        return found, outcomes, emptied and self.files.prune_shard(shard)

    @staticmethod
    def _unchanged(f: ChunkFile) -> bool:
        """A file listed earlier was neither hit nor retained since (its mtime, looked at again):
        one that was is kept. (A file gone meanwhile counts as unchanged: its unlink says so.)"""
        try:
            return os.lstat(f.path).st_mtime <= f.mtime
        except OSError:
            return True

    def _unlink(self, f: ChunkFile) -> bool | None:
        """True: removed; False: already gone (someone else's eviction); None: cannot be removed
        (kept). Counted by the caller."""
        try:
            os.unlink(f.path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if not self._unlink_warned:
                self._unlink_warned = True
                log.warning("kvtier: cannot evict %s (%s); such chunks stay in the pool", f.path, exc)
            return None
        return True

    def _write_ledger(self) -> None:
        try:
            self.ledger.write()
        except OSError as exc:
            log.debug("pool ledger write failed (kept for the next): %s", exc)
