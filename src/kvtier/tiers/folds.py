"""Commits to a pool's base (``ROOT/.usage``), under ``ROOT/.lock``: folding the ledgers of gone
instances into it (``fold_dead``), removing files crashes left in ``.usage.d``
(``remove_orphans``), and anchoring the total to a full count (``anchor``). What the base and the
ledgers are, and why these are the only commits, is ``tiers/ledger.py``'s docstring.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence

from kvtier.fileio import TMP_SUFFIX
from kvtier.tiers.files import ChunkFiles
from kvtier.tiers.ledger import (
    FOLD_BATCH,
    FOLD_LOOK,
    LEDGER_DIR,
    MAX_FOLDS_KEPT,
    ORPHAN_AGE_S,
    STALE_S,
    Base,
    Entry,
    Usage,
    read_base,
    read_entry,
    read_ledgers,
    write_base,
)
from kvtier.tiers.poollock import PoolLocks

__all__ = ["anchor", "fold_dead", "remove_orphans"]


def fold_dead(files: ChunkFiles, locks: PoolLocks, candidates: Sequence[str], now: float | None = None) -> list[str]:
    """Fold up to ``FOLD_BATCH`` of ``candidates`` whose instance is gone into the base; returns
    the ids folded. Their ledgers are read and their liveness locks taken first; ``ROOT/.lock``
    is held only to read and rewrite the base. Nothing is folded without that lock (two unlocked
    folders could each drop the other's fold), nor while there is no base (the next anchor
    accounts for every ledger). Ledgers the base already holds (a folder died before unlinking
    them) are removed, not added again."""
    now = time.time() if now is None else now
    folder = files.root / LEDGER_DIR
    ready: list[tuple[str, Entry, int]] = []  # a dead instance's ledger, and its liveness lock (held)
    order = list(candidates)
    if order:  # a rotating start: candidates that cannot be folded (alive, locked) never starve the rest
        start = random.randrange(len(order))
        order = order[start:] + order[:start]
    try:
        for ident in order[:FOLD_LOOK]:
            if len(ready) == FOLD_BATCH:
                break
            try:
                entry = read_entry(folder / f"{ident}.json")
            except OSError:
                continue
            if entry is None or not (entry.closed or now - entry.heartbeat > STALE_S):
                continue
            fd = locks.owner_gone(folder / f"{ident}.lock")
            if fd is not None:  # else alive (or a lock file we cannot use: left alone)
                ready.append((ident, entry, fd))
        if not ready:
            return []
        fresh = []
        with locks.shared() as locked:
            if not locked:
                return []
            try:
                base = read_base(files.root)
            except OSError:
                return []
            if base is None:
                return []
            total, added, removed, folds = base.bytes, base.folded_added, base.folded_removed, list(base.folds)
            folded_ids = {f[0] for f in folds}
            for ident, entry, _ in ready:
                if ident not in folded_ids:
                    total += entry.added - entry.removed
                    added, removed = added + entry.added, removed + entry.removed
                    folds.append((ident, entry.added, entry.removed))
                    fresh.append(ident)
            if fresh:
                try:
                    write_base(files, Base(total, base.anchored_at, added, removed, tuple(folds[-MAX_FOLDS_KEPT:])))
                except OSError:
                    return []
        # Unlocked: a reader that still sees one of these ledgers leaves it out (the base lists it).
        for ident, _, _ in ready:
            for suffix in (".json", ".lock"):
                try:
                    os.unlink(folder / f"{ident}{suffix}")
                except OSError:
                    pass
        return fresh
    finally:
        for _, _, fd in ready:
            if fd >= 0:
                os.close(fd)


def remove_orphans(files: ChunkFiles, now: float | None = None) -> int:
    """Remove what crashes leave in ``.usage.d`` and no fold takes: temp files of ledger writes
    and liveness locks without a ledger, once older than ``ORPHAN_AGE_S``. No lock needed."""
    now = time.time() if now is None else now
    folder = files.root / LEDGER_DIR
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    names = {e.name for e in entries}
    removed = 0
    for e in entries:
        lonely_lock = e.name.endswith(".lock") and f"{e.name[:-5]}.json" not in names
        if not (e.name.endswith(TMP_SUFFIX) or lonely_lock):
            continue
        try:
            if e.is_file(follow_symlinks=False) and now - e.stat(follow_symlinks=False).st_mtime > ORPHAN_AGE_S:
                os.unlink(e.path)
                removed += 1
        except OSError:
            continue
    return removed


def anchor(files: ChunkFiles, locks: PoolLocks, counted_bytes: int, before: Usage,
           own: tuple[str, int] | None = None) -> int | None:
    """Make ``counted_bytes`` the pool's total: what a pass over every shard directory, begun
    after ``before`` was read, found there (less what it unlinked itself). The ledgers are read
    first; ``ROOT/.lock`` is held to read and rewrite the base (and, only if a fold came in
    between, to read the ledgers again). Returns the new total, or None when a ledger or the
    base could not be read right now (no anchor then).

    Bytes added since ``before`` (by live ledgers, and by ledgers folded meanwhile) are added
    on top, as the pass may have missed them; removals since ``before`` are not subtracted
    again. ``own``: the caller's ledger id and its exact count of bytes added when ``before``
    was read (its writes not yet in its ledger then are not "since"). The caller has written
    its own ledger and holds the eviction lease, so no removal it or another evictor made
    before the pass ended is still unwritten."""
    try:
        early, ledgers = read_base(files.root), read_ledgers(files.root)
    except OSError:
        return None  # no anchor on a partial read: the next one will do
    with locks.shared():  # unlocked: the last anchor wins, which is as good as any
        try:
            base = read_base(files.root)
            if (base.folds if base else None) != (early.folds if early else None):
                ledgers = read_ledgers(files.root)  # a fold came in between
        except OSError:
            return None
        folded = {f[0] for f in base.folds} if base is not None else set()
        ledgers = {i: e for i, e in ledgers.items() if i not in folded}
        start = {i: e.added for i, e in before.ledgers.items()}
        if own is not None:
            start[own[0]] = own[1]
        adds = sum(max(0, e.added - start.get(i, 0)) for i, e in ledgers.items())
        if base is not None and before.base is not None and base.folded_added >= before.base.folded_added:
            gone = sum(e.added for i, e in before.ledgers.items() if i not in ledgers)
            adds += max(0, base.folded_added - before.base.folded_added - gone)
        total = counted_bytes + adds
        net = sum(e.added - e.removed for e in ledgers.values())
        kept = base or Base(0, 0.0)
        try:
            write_base(files, Base(total - net, time.time(), kept.folded_added, kept.folded_removed, kept.folds))
        except OSError:
            return None
    return total
