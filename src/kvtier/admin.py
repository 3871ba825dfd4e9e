"""Operator commands on a chunk directory (a pool or a disk tier): stats, verify, gc.

These run beside live engines: verify only removes files it proved bad; gc lists the pool with
no lock held, evicts by the LRU rule the pool tier approximates (oldest mtime first, retained
chunks last), exactly, under the pool's eviction lease, and re-anchors the pool's byte count;
temp files are removed only when older than ``tmp_age_s`` (a live writer finishes in well
under that).
"""

from __future__ import annotations

import errno
import math
import os
import stat
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvtier.fileio import TMP_SUFFIX
from kvtier.format import (
    HEADER_BYTES,
    PAYLOAD_OFFSET,
    ChunkError,
    ChunkFault,
    ChunkHeader,
    file_bytes_for,
    unpack_header,
)
from kvtier.keys import DIGEST_BYTES, ChunkKey, recompute_key
from kvtier.layout import DTYPES_BY_CODE
from kvtier.metrics import TierMetrics
from kvtier.threads import executor
from kvtier.tiers.evict import LOG_BATCH
from kvtier.tiers.evictlog import EvictionLog
from kvtier.tiers.files import MARKER, NAMESPACE_MAX_BYTES, ChunkFiles
from kvtier.tiers.folds import anchor, fold_dead, remove_orphans
from kvtier.tiers.ledger import read_usage
from kvtier.tiers.listing import SCAN_THREADS, described_namespaces, listed
from kvtier.tiers.poollock import PoolLocks
from kvtier.tiers.poolroot import init_pool, read_budget, set_budget

__all__ = ["GcReport", "PoolStats", "VerifyReport", "check_file", "gc", "init_pool", "open_existing", "read_budget",
           "set_budget", "stats", "verify"]


def open_existing(path: str | os.PathLike[str]) -> ChunkFiles:
    """A ChunkFiles on an existing kvtier directory; ValueError if it is not one."""
    root = Path(path)
    if not (root / MARKER).is_file():
        raise ValueError(f"{root} is not a kvtier pool or disk directory (no {MARKER} marker); "
                         "check the path (give the directory of pool_url fs://PATH)")
    # A setgid root is a group pool (group_access): what gc and verify rewrite keeps group modes.
    group = bool(os.stat(root).st_mode & stat.S_ISGID)
    return ChunkFiles(root, create=False, group_access=group)


# Payload is hashed in pieces of this size: verify's memory stays bounded whatever a file holds.
HASH_PIECE_BYTES = 1 << 20
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK


def _open_regular(path: Path, gone: bool = False) -> int | ChunkFault:
    """An fd on ``path`` when it is a regular file, else the fault; never follows a symlink
    or blocks on a FIFO (the lstat and the fstat both look, in case it was swapped between).
    With ``gone``, a file that is no longer there raises FileNotFoundError: ENOENT, or ESTALE,
    which a network filesystem's client returns for a while for a file another client removed
    (a cached ``lexists`` still says it is there)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return ChunkFault.NOT_A_FILE
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if gone and exc.errno in (errno.ENOENT, errno.ESTALE):
            raise FileNotFoundError(errno.ENOENT, "evicted since it was listed", str(path)) from None
        return ChunkFault.NOT_A_FILE if exc.errno == errno.ELOOP else ChunkFault.TRUNCATED
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return ChunkFault.NOT_A_FILE


def _read_header(fd: int) -> ChunkHeader | ChunkFault:
    try:
        head = os.pread(fd, HEADER_BYTES, 0)
        return unpack_header(head)
    except ChunkError as exc:
        return exc.fault
    except OSError:
        return ChunkFault.TRUNCATED


def check_file(path: Path) -> ChunkFault | None:
    """Fully validate one chunk file on its own; None when it is sound.

    Bounded whatever the file: a symlink, FIFO or other non-regular file is NOT_A_FILE
    (never followed, never waited on), only the 4096-byte header is read before the file's
    size is checked against the header's payload length, and the payload is hashed in
    ``HASH_PIECE_BYTES`` pieces. Never raises on the file's contents; an I/O error or a file
    that vanishes or shrinks midway is TRUNCATED. A file that is gone before it is opened
    raises FileNotFoundError (evicted since it was listed: not a fault of the pool).
    """
    opened = _open_regular(path, gone=True)
    if isinstance(opened, ChunkFault):
        return opened
    fd = opened
    try:
        header = _read_header(fd)
        if isinstance(header, ChunkFault):
            return header
        if os.fstat(fd).st_size != file_bytes_for(header.payload_bytes):
            return ChunkFault.TRUNCATED
        dtype = DTYPES_BY_CODE.get(header.dtype_code)
        # Python ints: an absurd shape (5 dims of up to 2**32 - 1) is a big product, not an overflow.
        raw_bytes = header.payload_bytes if header.codec is None else header.codec.raw_bytes
        if dtype is None or math.prod(header.shape) * dtype.itemsize != raw_bytes:
            return ChunkFault.LAYOUT
        if _hash_payload(fd, header.payload_bytes) != header.payload_xxh3:
            return ChunkFault.PAYLOAD_CHECKSUM
    except (OSError, _Shrunk):
        return ChunkFault.TRUNCATED
    finally:
        os.close(fd)
    key = header.chunk.key
    if path.name != f"{key.hex()}.kvt" or recompute_key(
            header.chunk.parent, header.chunk.tokens_digest, header.chunk.extra_digest) != key:
        return ChunkFault.IDENTITY
    return None


class _Shrunk(Exception):
    """The file ended before its payload did (truncated while being checked)."""


def _hash_payload(fd: int, payload_bytes: int) -> int:
    """xxh3-64 of ``payload_bytes`` from PAYLOAD_OFFSET, read in fixed pieces into one buffer."""
    digest = xxhash.xxh3_64()
    piece = memoryview(bytearray(min(HASH_PIECE_BYTES, payload_bytes)))
    offset, end = PAYLOAD_OFFSET, PAYLOAD_OFFSET + payload_bytes
    while offset < end:
        n = os.preadv(fd, [piece[:min(len(piece), end - offset)]], offset)
        if n == 0:
            raise _Shrunk
        digest.update(piece[:n])
        offset += n
    return digest.intdigest()


def _read_header_and_close(fd: int) -> ChunkHeader | ChunkFault:
    try:
        return _read_header(fd)
    finally:
        os.close(fd)


@dataclass
class PoolStats:
    path: str
    chunks: int = 0
    bytes: int = 0
    temp_files: int = 0
    oldest_age_s: float | None = None
    newest_age_s: float | None = None
    namespaces: dict[str, dict[str, object]] = field(default_factory=dict)
    unreadable_headers: int = 0
    budget_bytes: int | None = None
    """The budget recorded in the pool (``kvtier pool budget``), None when it records none."""


def stats(path: str | os.PathLike[str]) -> PoolStats:
    """Count chunks and bytes, per namespace (read from each chunk's header)."""
    files = open_existing(path)
    out = PoolStats(str(files.root), budget_bytes=read_budget(files.root))
    now = time.time()
    described = described_namespaces(files.root, NAMESPACE_MAX_BYTES)
    for f in files.scan():
        out.chunks += 1
        out.bytes += f.size
        age = now - f.mtime
        out.oldest_age_s = age if out.oldest_age_s is None else max(out.oldest_age_s, age)
        out.newest_age_s = age if out.newest_age_s is None else min(out.newest_age_s, age)
        opened = _open_regular(f.path)
        header = opened if isinstance(opened, ChunkFault) else _read_header_and_close(opened)
        if isinstance(header, ChunkFault):
            out.unreadable_headers += 1
            continue
        ns = header.namespace.hex()
        entry = out.namespaces.setdefault(ns[:16], {"chunks": 0, "bytes": 0, **described.get(ns, {})})
        entry["chunks"] = int(entry["chunks"]) + 1  # type: ignore[call-overload]
        entry["bytes"] = int(entry["bytes"]) + f.size  # type: ignore[call-overload]
    out.temp_files = sum(1 for _ in files.temp_files())
    return out


@dataclass
class VerifyReport:
    path: str
    checked: int = 0
    ok: int = 0
    bad: list[dict[str, str]] = field(default_factory=list)
    removed: int = 0


def verify(path: str | os.PathLike[str], fix: bool = False,
           progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check every chunk's header, size, checksum and key; with ``fix`` remove the bad ones."""
    files = open_existing(path)
    report = VerifyReport(str(files.root))
    for f in files.scan():
        try:
            fault = check_file(f.path)
        except FileNotFoundError:
            continue  # evicted between the listing and the check (verify runs beside live engines)
        if fault is not None and not os.path.lexists(f.path):
            continue  # evicted while it was being checked
        report.checked += 1
        if fault is None:
            report.ok += 1
        else:
            report.bad.append({"path": str(f.path), "fault": fault.value})
            if fix:
                try:
                    os.unlink(f.path)
                    report.removed += 1
                except FileNotFoundError:
                    pass
        if progress is not None:
            progress(report.checked)
    return report


@dataclass
class GcReport:
    path: str
    evicted_chunks: int
    bytes_after: int
    removed_temp_files: int


GC_LEASE_WAIT_S = 60.0  # gc waits this long for an eviction round in progress, then goes on beside it
GC_FOLD_BATCHES = 16


def gc(path: str | os.PathLike[str], max_bytes: int, tmp_age_s: float = 3600.0) -> GcReport:
    """Evict least recently used chunks down to ``max_bytes`` exactly; remove stale temp files;
    make the pool's byte count exact again (an anchor, ``tiers/ledger.py``).

    Every chunk is listed and ``lstat``-ed with no lock held (live engines go on writing and
    evicting; ``SCAN_THREADS`` directories at once); then, under the eviction lease (so that no
    instance's round runs meanwhile; after ``GC_LEASE_WAIT_S`` it goes on beside one,
    harmlessly), chunks are unlinked oldest mtime first (retained chunks, whose mtime is in the
    future, last) until what the listing found, less what is gone, is within ``max_bytes``;
    then dead instances' ledgers are folded and the total is anchored to that count, which
    corrects any drift (crashed writers, manual deletes). ``bytes_after`` is that count.
    Memory: 48 bytes per chunk in the pool.
    """
    files = open_existing(path)
    removed_tmp = 0
    cutoff = time.time() - tmp_age_s
    for tmp, mtime in _temp_files(files):
        if mtime < cutoff:
            try:
                os.unlink(tmp)
                removed_tmp += 1
            except FileNotFoundError:
                pass
    locks = PoolLocks(files, TierMetrics("pool"))
    before = read_usage(files.root)
    mtimes, sizes, keys = array("d"), array("q"), bytearray()
    scanners = executor(SCAN_THREADS, "kvtier-gc-scan")  # listings are round trips on a network filesystem
    try:
        for _, found in listed(files, files.shard_dirs(), scanners):
            for f in found:
                mtimes.append(f.mtime)
                sizes.append(f.size)
                keys += f.key
    finally:
        scanners.shutdown(cancel_futures=True)
    total = sum(sizes)
    evicted = 0
    log = EvictionLog(files)
    with locks.lease(GC_LEASE_WAIT_S):
        batch: list[bytes] = []
        for i in sorted(range(len(mtimes)), key=mtimes.__getitem__):
            if total <= max_bytes:
                break
            key = ChunkKey(bytes(keys[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]))
            try:
                os.unlink(files.path_for(key))
            except FileNotFoundError:
                total -= sizes[i]  # another evictor took it: gone all the same, not counted here
                continue
            except OSError:
                continue  # cannot be removed (another user's file in a read-only shard): it stays
            total -= sizes[i]
            evicted += 1
            batch.append(key)
            if len(batch) >= LOG_BATCH:
                log.append(batch)
                batch = []
        log.append(batch)
        for _ in range(GC_FOLD_BATCHES):
            candidates = read_usage(files.root).foldable(time.time())
            if not candidates or not fold_dead(files, locks, candidates):
                break
        remove_orphans(files)
        anchor(files, locks, total, before)
    return GcReport(str(files.root), evicted, total, removed_tmp)


def _temp_files(files: ChunkFiles) -> list[tuple[Path, float]]:
    """Every temp file a writer may leave when it dies between create and rename, and its mtime.

    Chunk writes leave theirs in the shard directories; the small files written the same way
    (``ROOT/.usage`` at every anchor, the marker, ``ROOT/namespaces/*.json``) leave theirs
    beside them, where ``ChunkFiles.temp_files`` does not look. (Ledger writes leave theirs in
    ``ROOT/.usage.d``, which folding cleans: ``ledger.remove_orphans``.)
    """
    found = list(files.temp_files())
    for folder in (files.root, files.root / "namespaces"):
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.name.endswith(TMP_SUFFIX) and entry.is_file(follow_symlinks=False):
                    found.append((Path(entry.path), entry.stat(follow_symlinks=False).st_mtime))
            except OSError:
                continue  # removed since the listing
    return found
