"""The shared pool's lock files, and what happens when a filesystem cannot lock.

* ``ROOT/.lock``: the fleet-wide lock (``flock``; Linux NFS clients map it to NFS locks,
  GlusterFS's FUSE client to the volume's lock translator). Only accounting commits take it
  (``tiers/ledger.py``: folding dead instances' ledgers, re-anchoring the total), to read and
  rewrite the base: two small-file operations, never a listing. Blocking.
* ``ROOT/.evict.lock``: the eviction lease. One evictor in the fleet at a time holds it for a
  whole round (``tiers/evict.py``); everyone else tries without blocking and skips the round.
* ``ROOT/.usage.d/<instance>.lock``: each instance holds its own shared for as long as it
  lives, so that another can tell a dead instance (whose lock the kernel or the lock server
  released) from a slow one.

Every lock file is opened without following a symlink or blocking on a FIFO and must be a
regular file. A filesystem that cannot ``flock`` (ENOLCK on an NFS mount without lockd, a FUSE
daemon without locks) or a lock file a neighbour replaced costs only the lock: the caller goes
on unlocked (concurrent evictors are harmless, an accounting commit is then last-writer-wins),
warned about once and counted in ``lock_failures``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path

from kvtier.fileio import open_regular
from kvtier.metrics import TierMetrics
from kvtier.tiers.files import ChunkFiles

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
LEASE_FILE = ".evict.lock"
LEASE_POLL_S = 0.05


class Lease(Enum):
    """The outcome of asking for the eviction lease."""

    HELD = "held"  # ours until the context ends
    BUSY = "busy"  # another evictor holds it: skip this round
    UNLOCKED = "unlocked"  # no working lock here: go on without one (counted, warned once)


class PoolLocks:
    """The lock files of one pool directory, for one process's tier (thread-safe: every call
    opens its own descriptor, and ``flock`` locks of two descriptors exclude each other even
    within one process)."""

    def __init__(self, files: ChunkFiles, metrics: TierMetrics) -> None:
        self.files = files
        self.metrics = metrics
        self._warned = False
        self.longest_hold_s = 0.0
        """The longest ``ROOT/.lock`` hold in this process so far (benchmarks read it)."""
        self.holds = 0

    # -- ROOT/.lock ---------------------------------------------------------------------------

    @contextmanager
    def shared(self) -> Iterator[bool]:
        """Hold the fleet-wide lock for the body; yields False when it could not be taken (a
        failed open or flock: counted and warned once) and the body runs unlocked."""
        try:
            fd = self._open(self.files.root / LOCK_FILE)
        except OSError as exc:
            self.failed(exc, LOCK_FILE)
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                self.failed(exc, LOCK_FILE)
                yield False
                return
            t0 = time.perf_counter()
            try:
                yield True
            finally:
                held = time.perf_counter() - t0
                self.holds += 1
                self.longest_hold_s = max(self.longest_hold_s, held)
        finally:
            os.close(fd)  # closing releases the flock

    def probe(self) -> bool:
        """Whether ``flock`` works on ``ROOT/.lock`` (a held lock counts as working)."""
        try:
            fd = self._open(self.files.root / LOCK_FILE)
        except OSError as exc:
            self.failed(exc, LOCK_FILE)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        except BlockingIOError:
            return True  # another instance holds it right now
        except OSError as exc:
            self.failed(exc, LOCK_FILE)
            return False
        finally:
            os.close(fd)

    # -- ROOT/.evict.lock ---------------------------------------------------------------------

    @contextmanager
    def lease(self, wait_s: float = 0.0) -> Iterator[Lease]:
        """The eviction lease for the body. Never blocks in the kernel: it polls for up to
        ``wait_s`` (0: one try) and yields BUSY when another evictor keeps it that long."""
        try:
            fd = self._open(self.files.root / LEASE_FILE)
        except OSError as exc:
            self.failed(exc, LEASE_FILE)
            yield Lease.UNLOCKED
            return
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    outcome = Lease.HELD
                except BlockingIOError:
                    if time.monotonic() < deadline:
                        time.sleep(LEASE_POLL_S)
                        continue
                    outcome = Lease.BUSY
                except OSError as exc:
                    self.failed(exc, LEASE_FILE)
                    outcome = Lease.UNLOCKED
                break
            yield outcome
        finally:
            os.close(fd)

    # -- per-instance liveness locks ----------------------------------------------------------

    def hold_alive(self, path: Path) -> int | None:
        """Open (creating) ``path`` and hold a shared lock on it; the descriptor, to be closed
        when the instance ends, or None when it cannot be held (then other instances fall back
        to the heartbeat alone)."""
        try:
            fd = self._open(path)
        except OSError:
            return None
        return _locked_or_closed(fd, fcntl.LOCK_SH)

    def owner_gone(self, path: Path) -> int | None:
        """A descriptor holding ``path`` exclusively when no live instance holds it (its owner
        is gone: the caller may fold its ledger, then closes the descriptor); None when an
        owner holds it or it cannot be opened as a regular file. A missing file counts as
        gone (returned as -1: nothing to close)."""
        try:
            fd = open_regular(path, os.O_RDWR)
        except FileNotFoundError:
            return -1
        except OSError:
            return None
        return _locked_or_closed(fd, fcntl.LOCK_EX)

    # -- failures -----------------------------------------------------------------------------

    def failed(self, exc: OSError, name: str) -> None:
        self.metrics.add(lock_failures=1)
        if not self._warned:
            self._warned = True
            log.warning("kvtier: cannot lock %s (%s): the pool's byte budget is kept without its lock, so "
                        "instances evicting at once may overshoot it; use a filesystem with flock (NFS: run "
                        "lockd) or check who replaced the lock file. Counted in kvtier_lock_failures_total.",
                        self.files.root / name, errno.errorcode.get(exc.errno or 0, exc))

    def _open(self, path: Path) -> int:
        """Open (creating, with the directory's file mode) a lock file. A symlink or FIFO swapped
        in for it is refused (OSError), never followed or waited on."""
        fd = self.files.create_file(path, os.O_RDWR | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"not a regular file: {path}")
        except BaseException:
            os.close(fd)
            raise
        return fd


def _locked_or_closed(fd: int, op: int) -> int | None:
    """``fd`` once ``flock(fd, op)`` is granted without waiting; else None, ``fd`` closed (held
    elsewhere, or the filesystem cannot lock)."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None
