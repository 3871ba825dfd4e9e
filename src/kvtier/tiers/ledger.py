"""The shared pool's byte count, without a counter that every instance rewrites.

    ROOT/.usage               the base: the pool's bytes at the last exact count (an anchor),
                              plus what the ledgers of instances since gone added and removed
    ROOT/.usage.d/<id>.json   one ledger per instance: the bytes it published and unlinked since
                              it began, and a heartbeat; written by that instance only
    ROOT/.usage.d/<id>.lock   held (shared) by that instance for as long as it lives

The pool's total is ``base + sum(added - removed)`` over the ledgers. An instance accounts for
its writes and evictions by rewriting its own ledger (``fileio.write_atomic``) without any
lock, so no writer ever waits on another. ``ROOT/.lock`` guards the base alone, and is held
only to read it and write it back (one small read, one atomic rewrite), by two kinds of commit
(both in ``tiers/folds.py``):

* **fold** (``fold_dead``): the ledger of an instance that is gone (its liveness lock is free
  and it closed, or its heartbeat is older than ``STALE_S``) moves into the base, at most
  ``FOLD_BATCH`` per commit (their ledgers read and liveness locks taken before the lock). The
  base remembers the ledgers it folded lately (id and counts), so a reader that meets one of
  them still on disk leaves it out, a folder that dies before unlinking them never folds one
  twice, and an instance folded while alive (stalled past ``STALE_S``, and its lock file
  replaced by someone) goes on under a new id with only what the fold did not take.
* **anchor** (``anchor``): a pass that visited every shard directory (an eviction round, the
  first count of a pool, ``kvtier pool gc``) makes what it counted the total: the ledgers read
  before the lock (again under it only if a fold came in between), one base written. Ledgers
  are never rewritten by anyone but their owner.

Errors lean toward counting too much, which only makes eviction start a little early:

* An anchor may count bytes published during its pass twice, and removals made during its
  pass are never subtracted again (they may or may not be in the count): both over-count.
* Bytes an instance published but had not yet written to its ledger when it crashed are
  missing until the next anchor: at most ``sync_bytes`` per crashed instance. This is the one
  under-count by design; an evictor writes its ledger before every anchor and every
  ``sync_bytes`` it frees, and holds the eviction lease meanwhile, so removals are never
  subtracted twice.
* A chunk removed outside any ledger (a corrupt chunk a reader dropped, an operator's ``rm``)
  stays counted until the next anchor: an over-count.

Every file here may have been planted by a neighbour: each is read with ``fileio.read_small``
(no symlink followed, no FIFO waited on, a bounded size), and anything malformed (not JSON, a
negative or huge number, NaN, a time in the far future) is ignored: a ledger as if absent, a
base as missing. A total that adds up to less than zero is unknown too; the evictor then
counts the pool (``kvtier.tiers.evict``) and anchors a fresh base.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.fileio import read_small
from kvtier.tiers.files import ChunkFiles
from kvtier.tiers.poollock import PoolLocks

BASE_FILE = ".usage"
LEDGER_DIR = ".usage.d"
BASE_MAX_BYTES = 64 << 10
LEDGER_MAX_BYTES = 4096
MAX_LEDGERS = 8192  # read per total: a fleet of 100 TP=8 engines is 900 processes; beyond, the freshest
MAX_FOLDS_KEPT = 256  # folded ids the base remembers (idempotence of a fold a folder died in)
FOLD_BATCH = 8  # ledgers folded per hold of ROOT/.lock
FOLD_LOOK = 4 * FOLD_BATCH  # fold candidates examined per round (from a rotating start)
STALE_S = 600.0  # a ledger whose heartbeat is older (and whose lock is free) is a dead instance's
ORPHAN_AGE_S = 3600.0  # temp and lock files of .usage.d left this long by a crash are removed
LIMIT = 1 << 62  # bytes beyond this are nonsense
FUTURE_S = 86400.0  # a time further ahead than this is nonsense (clock skew is far less)
BASE_FUTURE_S = 30 * 86400.0  # a count's time: only its age is judged, and by each reader's clock (evict.py)
_ID = re.compile(r"[A-Za-z0-9_-]{1,80}")
_LEDGER_ID = re.compile(r"[A-Za-z0-9_-]{1,40}-[0-9]{1,10}-[0-9a-f]{8}")
"""What ``new_id`` makes: any other name in ``.usage.d`` was planted, and is never read."""


@dataclass(frozen=True)
class Base:
    """``ROOT/.usage``. ``bytes`` may be below zero: a dead evictor's removals folded in."""

    bytes: int
    anchored_at: float
    folded_added: int = 0
    folded_removed: int = 0
    folds: tuple[tuple[str, int, int], ...] = ()  # (id, added, removed) of ledgers folded lately

    def folded(self, ident: str) -> tuple[int, int] | None:
        """What a fold of ledger ``ident`` took (added, removed), if the base remembers one."""
        for i, added, removed in self.folds:
            if i == ident:
                return added, removed
        return None


@dataclass(frozen=True)
class Entry:
    """One instance's ledger as read."""

    added: int
    removed: int
    heartbeat: float
    closed: bool = False


@dataclass(frozen=True)
class Usage:
    """A read of the ledgers and the base (``read_usage``)."""

    base: Base | None
    ledgers: dict[str, Entry] = field(default_factory=dict)
    read_at: float = 0.0

    @property
    def total(self) -> int | None:
        """The pool's bytes; None when unknown (no sound base, or a sum below zero)."""
        if self.base is None:
            return None
        total = self.base.bytes + sum(e.added - e.removed for e in self.ledgers.values())
        return total if total >= 0 else None

    @property
    def floor(self) -> int:
        """What the ledgers alone account for (a lower guess while the total is unknown)."""
        return max(0, sum(e.added - e.removed for e in self.ledgers.values()))

    def foldable(self, now: float) -> list[str]:
        """Ledgers that look like a gone instance's (``fold_dead`` checks its lock too)."""
        return sorted(i for i, e in self.ledgers.items() if e.closed or now - e.heartbeat > STALE_S)


# -- reading (anyone, no lock) -----------------------------------------------------------------


def _int(value: object, low: int = 0) -> int:
    if type(value) is not int or not low <= value <= LIMIT:
        raise ValueError(f"not a byte count: {value!r}")
    return value


def _time(value: object, now: float, ahead_s: float = FUTURE_S) -> float:
    """A finite time at most ``ahead_s`` after ``now``, else ValueError."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or value > now + ahead_s:
        raise ValueError(f"not a time: {value!r}")
    return float(value)


_HOSTILE = {errno.ELOOP, errno.EINVAL, errno.ENXIO, errno.EISDIR}  # a symlink, FIFO, device, directory


def _load(path: Path, max_bytes: int) -> object:
    """The JSON of a small file. FileNotFoundError: gone; ValueError: malformed or not a regular
    file (a neighbour's); another OSError: unreadable right now (an I/O error)."""
    for attempt in range(3):
        try:
            return json.loads(read_small(path, max_bytes)[0])
        except OSError as exc:
            if exc.errno in _HOSTILE:
                raise ValueError(str(exc)) from exc
            if exc.errno != errno.ESTALE or attempt == 2:
                raise
            # Another client replaced it since this one looked it up (GlusterFS, NFS): look again.
    raise AssertionError("unreachable")


_MALFORMED = (ValueError, KeyError, TypeError, AttributeError, RecursionError)


def read_base(root: Path) -> Base | None:
    """The base; None when it is missing or anything about it is malformed. Raises OSError
    when it cannot be read right now."""
    try:
        data = _load(root / BASE_FILE, BASE_MAX_BYTES)
        folds = data.get("folds", [])  # type: ignore[attr-defined]
        if not isinstance(folds, list):
            return None
        kept = []
        for fold in folds[-MAX_FOLDS_KEPT:]:
            ident, added, removed = fold
            if not isinstance(ident, str) or not _ID.fullmatch(ident):
                return None
            kept.append((ident, _int(added), _int(removed)))
        return Base(_int(data["bytes"], -LIMIT), _time(data["anchored_at"], time.time(), BASE_FUTURE_S),  # type: ignore[index]
                    _int(data.get("folded_added", 0)), _int(data.get("folded_removed", 0)),  # type: ignore[attr-defined]
                    tuple(kept))
    except FileNotFoundError:
        return None
    except _MALFORMED:
        return None


def read_entry(path: Path) -> Entry | None:
    """One ledger; None when it is gone or malformed. Raises OSError when it cannot be read
    right now."""
    try:
        data = _load(path, LEDGER_MAX_BYTES)
        closed = data.get("closed", False)  # type: ignore[attr-defined]
        if type(closed) is not bool:
            return None
        return Entry(_int(data["added"]), _int(data["removed"]),  # type: ignore[index]
                     _time(data["heartbeat"], time.time()), closed)  # type: ignore[index]
    except FileNotFoundError:
        return None
    except _MALFORMED:
        return None


def ledger_ids(root: Path) -> list[str]:
    """Ids of the ledger files present, sorted (none when ``.usage.d`` is not a real directory: a
    symlink planted there is not followed). Only names ``new_id`` can make count, so planted
    names cost a listing entry, never a read; past ``MAX_LEDGERS`` such names, the most recently
    written are kept (a live instance rewrites its ledger every heartbeat, a planted file never)."""
    folder = root / LEDGER_DIR
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return []
        entries = [e for e in os.scandir(folder) if e.name.endswith(".json") and _LEDGER_ID.fullmatch(e.name[:-5])]
    except OSError:
        return []
    if len(entries) > MAX_LEDGERS:
        entries = sorted(entries, key=_mtime, reverse=True)[:MAX_LEDGERS]
    return sorted(e.name[:-5] for e in entries)


def _mtime(entry: os.DirEntry[str]) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return -math.inf


def read_ledgers(root: Path, previous: Usage | None = None) -> dict[str, Entry]:
    """Every readable ledger: one listing and one small read each. One that cannot be read right
    now counts as in ``previous`` (when there is none, that raises the OSError)."""
    ledgers = {}
    for i in ledger_ids(root):
        try:
            entry = read_entry(root / LEDGER_DIR / f"{i}.json")
        except OSError:
            if previous is None:
                raise
            entry = previous.ledgers.get(i)
        if entry is not None:
            ledgers[i] = entry
    return ledgers


def read_usage(root: Path, previous: Usage | None = None) -> Usage:
    """The ledgers, then the base, less the ledgers the base says it folded: a fold between the
    two reads is counted once, in the base. A file that cannot be read right now counts as in
    ``previous`` (an empty one when None), never raises."""
    now = time.time()
    ledgers = read_ledgers(root, previous or Usage(None))
    try:
        base = read_base(root)
    except OSError:
        base = previous.base if previous is not None else None
    if base is not None and base.folds:
        folded = {f[0] for f in base.folds}
        ledgers = {i: e for i, e in ledgers.items() if i not in folded}
    return Usage(base, ledgers, now)


def write_base(files: ChunkFiles, base: Base) -> None:
    files.write_small(files.root / BASE_FILE, json.dumps({
        "bytes": base.bytes, "anchored_at": base.anchored_at, "folded_added": base.folded_added,
        "folded_removed": base.folded_removed, "folds": [list(f) for f in base.folds[-MAX_FOLDS_KEPT:]]}).encode())


# -- this instance's ledger ----------------------------------------------------------------------


def new_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


class Ledger:
    """This instance's ledger file. ``add``/``remove`` only count in memory (any thread);
    ``write`` publishes the counts (any thread, serialised here; never under ``ROOT/.lock``).
    Nothing is written before there is something to count."""

    def __init__(self, files: ChunkFiles, locks: PoolLocks) -> None:
        self.files, self.locks = files, locks
        self.id = new_id()
        self._count = threading.Lock()
        self._write = threading.Lock()
        self.added = self.removed = 0
        self.written_added = self.written_removed = 0
        self.written_at = 0.0  # time.monotonic() of the last write; 0: never written
        self._alive_fd: int | None = None

    def add(self, n: int) -> None:
        with self._count:
            self.added += n

    def remove(self, n: int) -> None:
        with self._count:
            self.removed += n

    def unsynced(self) -> tuple[int, int]:
        """Bytes added and removed since the last write."""
        with self._count:
            return self.added - self.written_added, self.removed - self.written_removed

    def due(self, heartbeat_s: float) -> bool:
        """Something to write, or a heartbeat older than ``heartbeat_s`` once written."""
        added, removed = self.unsynced()
        return bool(added or removed) or (self.written_at > 0 and time.monotonic() - self.written_at > heartbeat_s)

    def write(self, closed: bool = False) -> None:
        """Replace the ledger file with the counts; OSError (ENOSPC, ...) leaves them unwritten
        in memory, to be written next time."""
        with self._write:
            with self._count:
                added, removed, ident = self.added, self.removed, self.id
            folder = self.files.root / LEDGER_DIR
            if _ensure_dir(self.files, folder):
                self._release()  # our lock file went with whatever stood there
            if self._alive_fd is None:
                self._alive_fd = self.locks.hold_alive(folder / f"{ident}.lock")  # None: heartbeat only
            self.files.write_small(folder / f"{ident}.json", json.dumps({
                "added": added, "removed": removed, "heartbeat": time.time(), "closed": closed}).encode())
            with self._count:
                if ident == self.id:
                    self.written_added, self.written_removed = added, removed
            self.written_at = time.monotonic()

    def rotate(self, folded_added: int, folded_removed: int) -> None:
        """Our ledger was folded with these counts (we looked dead to another instance: a stall
        longer than ``STALE_S``, and a lock file someone replaced): go on under a new id with only
        the counts the fold did not take."""
        with self._write, self._count:
            self.added -= min(folded_added, self.added)
            self.removed -= min(folded_removed, self.removed)
            self.written_added = self.written_removed = 0
            self.id = new_id()
            self._release()

    def close(self) -> None:
        """Write the final counts marked closed (so a neighbour folds them at once) and release
        the liveness lock. Never raises."""
        try:
            if self.written_at or any(self.unsynced()):
                self.write(closed=True)
        except OSError:
            pass
        with self._write:
            self._release()

    def _release(self) -> None:
        if self._alive_fd is not None:
            os.close(self._alive_fd)  # releases the lock: the ledger is foldable
            self._alive_fd = None


def _ensure_dir(files: ChunkFiles, folder: Path) -> bool:
    """Make ``.usage.d`` unless it is a real directory (True: made); a symlink or file a neighbour
    put in its place is removed first (never followed: ledgers written through a link would land
    outside the pool). One ``lstat`` when all is well."""
    try:
        if stat.S_ISDIR(os.lstat(folder).st_mode):
            return False
        os.unlink(folder)
    except FileNotFoundError:
        pass
    try:
        files.make_dir(folder)
    except FileExistsError:
        return False
    return True
