"""Operator commands on a chunk directory (a pool or a disk tier): stats, verify, gc.

These run beside live engines: verify only removes files it proved bad, gc evicts under the
same lock and by the same LRU rule (oldest mtime first) the pool tier uses, and temp files are
removed only when older than ``tmp_age_s`` (a live writer finishes in well under that).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtier.format import PAYLOAD_OFFSET, ChunkError, ChunkFault, file_bytes_for, payload_checksum, unpack_header
from kvtier.keys import recompute_key
from kvtier.layout import DTYPES_BY_CODE
from kvtier.tiers.files import MARKER, ChunkFiles
from kvtier.tiers.pool import PoolTier


def open_existing(path: str | os.PathLike[str]) -> ChunkFiles:
    """A ChunkFiles on an existing kvtier directory; ValueError if it is not one."""
    root = Path(path)
    if not (root / MARKER).is_file():
        raise ValueError(f"{root} is not a kvtier pool or disk directory (no {MARKER} marker); "
                         "check the path (give the directory of pool_url fs://PATH)")
    return ChunkFiles(root, create=False)


def check_file(path: Path) -> ChunkFault | None:
    """Fully validate one chunk file on its own; None when it is sound."""
    try:
        data = path.read_bytes()
    except OSError:
        return ChunkFault.TRUNCATED
    try:
        header = unpack_header(data)
    except ChunkError as exc:
        return exc.fault
    if len(data) != file_bytes_for(header.payload_bytes):
        return ChunkFault.TRUNCATED
    dtype = DTYPES_BY_CODE.get(header.dtype_code)
    if dtype is None or math.prod(header.shape) * torch.empty((), dtype=dtype).element_size() != header.payload_bytes:
        return ChunkFault.LAYOUT
    if payload_checksum(memoryview(data)[PAYLOAD_OFFSET:PAYLOAD_OFFSET + header.payload_bytes]) != header.payload_xxh3:
        return ChunkFault.PAYLOAD_CHECKSUM
    key = header.chunk.key
    if path.name != f"{key.hex()}.kvt" or recompute_key(
            header.chunk.parent, header.chunk.tokens_digest, header.chunk.extra_digest) != key:
        return ChunkFault.IDENTITY
    return None


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


def stats(path: str | os.PathLike[str]) -> PoolStats:
    """Count chunks and bytes, per namespace (read from each chunk's header)."""
    files = open_existing(path)
    out = PoolStats(str(files.root))
    now = time.time()
    described = files.namespaces()
    for f in files.scan():
        out.chunks += 1
        out.bytes += f.size
        age = now - f.mtime
        out.oldest_age_s = age if out.oldest_age_s is None else max(out.oldest_age_s, age)
        out.newest_age_s = age if out.newest_age_s is None else min(out.newest_age_s, age)
        try:
            with open(f.path, "rb") as fh:
                ns = unpack_header(fh.read(PAYLOAD_OFFSET)).namespace.hex()
        except (OSError, ChunkError):
            out.unreadable_headers += 1
            continue
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
        fault = check_file(f.path)
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


def gc(path: str | os.PathLike[str], max_bytes: int, tmp_age_s: float = 3600.0) -> GcReport:
    """Evict least recently used chunks down to ``max_bytes``; remove stale temp files."""
    files = open_existing(path)
    removed_tmp = 0
    cutoff = time.time() - tmp_age_s
    for tmp, mtime in list(files.temp_files()):
        if mtime < cutoff:
            try:
                os.unlink(tmp)
                removed_tmp += 1
            except FileNotFoundError:
                pass
    pool = PoolTier(files.root, max_bytes)
    evicted = pool.evict(max_bytes)
    return GcReport(str(files.root), evicted, pool.metrics.snapshot().bytes, removed_tmp)
