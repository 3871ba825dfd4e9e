"""Listing a chunk directory: its shard directories, the chunk files in each, its temp files;
removing a shard directory eviction emptied.

Names are untrusted (a group-shared pool): only a name a chunk can have, in the shard directory
its key names, is listed as a chunk; sizes and mtimes are the entry's own (``lstat``). Used by
``ChunkFiles`` (``scan``, ``shard_dirs``, ``scan_shard``, ``temp_files``, ``prune_shard``), which
callers use; ``listed`` lists many shard directories on a thread pool, a few ahead (eviction, ``pool gc``).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvtier.fileio import TMP_SUFFIX, read_small
from kvtier.keys import DIGEST_BYTES, ChunkKey

SUFFIX = ".kvt"
_NAME_CHARS = 2 * DIGEST_BYTES + len(SUFFIX)
_HEX2 = re.compile(r"[0-9a-f]{2}")
SCAN_THREADS = 8  # shard directories listed at once: on a network filesystem each listing and lstat is a round trip


@dataclass(frozen=True)
class ChunkFile:
    path: Path
    key: ChunkKey
    size: int
    mtime: float


def shard_dirs(root: str, pool: cf.Executor | None = None) -> list[str]:
    """The shard directories ``"ab/cd"`` of ``root`` that exist now, in name order: one listing
    of ``root`` and one of each ``ab`` (on ``pool``'s threads when given: round trips on a
    network filesystem), however many chunks they hold (at most 257 listings). Only lowercase
    hex names that are real directories (not symlinks) count."""
    tops = _subdir_names(root)
    paths = [f"{root}/{ab}" for ab in tops]
    subs = pool.map(_subdir_names, paths) if pool is not None else map(_subdir_names, paths)
    return [f"{ab}/{cd}" for ab, cds in zip(tops, subs, strict=True) for cd in cds]

def scan_shard(root: str, shard: str) -> list[ChunkFile]:
    """The published chunk files of one shard directory ``"ab/cd"`` (see ``ChunkFiles.scan``): one
    listing and one ``lstat`` per chunk name; [] when the directory is gone or unreadable."""
    ab, _, cd = shard.partition("/")
    folder = f"{root}/{shard}"
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    out: list[ChunkFile] = []
    for entry in entries:
        name = entry.name
        if len(name) != _NAME_CHARS or not name.endswith(SUFFIX) or name[:2] != ab or name[2:4] != cd:
            continue  # not a chunk name, or a real name in another chunk's shard
        h = name[: -len(SUFFIX)]
        try:
            key = ChunkKey(bytes.fromhex(h))
            if key.hex() != h:
                continue  # upper case, or spaces (fromhex skips them)
            st = entry.stat(follow_symlinks=False)
        except (ValueError, OSError):
            continue  # a stray name, or removed since the listing
        out.append(ChunkFile(Path(entry.path), key, st.st_size, st.st_mtime))
    return out


class Shards(Protocol):
    """A chunk directory that lists a shard directory's chunk files (``ChunkFiles``)."""

    def scan_shard(self, shard: str) -> list[ChunkFile]:
        ...


def listed(files: Shards, order: Sequence[str], pool: cf.ThreadPoolExecutor | None,
           ahead: int = 2 * SCAN_THREADS) -> Generator[tuple[str, list[ChunkFile]], None, None]:
    """``(shard, its chunk files)`` for each of ``order``, in that order, listed on ``pool`` up
    to ``ahead`` directories ahead (inline without a pool). Closing it early cancels what is
    queued."""
    if pool is None:
        for shard in order:
            yield shard, files.scan_shard(shard)
        return
    window: deque[tuple[str, cf.Future[list[ChunkFile]]]] = deque()
    todo = iter(order)
    try:
        while True:
            while len(window) < ahead:
                nxt = next(todo, None)
                if nxt is None:
                    break
                window.append((nxt, pool.submit(files.scan_shard, nxt)))
            if not window:
                return
            shard, listing = window.popleft()
            yield shard, listing.result()
    finally:
        for _, listing in window:
            listing.cancel()


def temp_files(root: str, shards: Sequence[str]) -> Iterator[tuple[Path, float]]:
    """Temp files (writes in progress or left by crashed writers) in ``shards`` of ``root``, and
    their mtimes; vanished directories and files are skipped."""
    for shard in shards:
        try:
            entries = list(os.scandir(f"{root}/{shard}"))
        except OSError:
            continue
        for entry in entries:
            if entry.name.endswith(TMP_SUFFIX):
                try:
                    yield Path(entry.path), entry.stat().st_mtime
                except OSError:
                    continue


def prune_shard(root: str, shard: str) -> bool:
    """Remove the shard directory ``"ab/cd"`` of ``root`` if it is empty; True when removed.

    Eviction prunes the directories it empties, so that its rounds list only directories that
    hold chunks (a small pool of random keys would otherwise come to list all 65,536, each a
    round trip on a network filesystem). A writer racing with it finds its directory gone and
    makes it again (``ChunkFiles.publish``); a file created in it first makes the ``rmdir``
    fail (ENOTEMPTY), and the directory stays."""
    ab, _, cd = shard.partition("/")
    if not (_HEX2.fullmatch(ab) and _HEX2.fullmatch(cd)):
        return False
    try:
        os.rmdir(f"{root}/{shard}")
    except OSError:
        return False
    return True


def _subdir_names(path: str) -> list[str]:
    """Sorted names of the two-hex-digit subdirectories of ``path`` ([] when it is gone)."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return []
    names = []
    for entry in entries:
        try:
            if _HEX2.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                names.append(entry.name)
        except OSError:
            continue
    return sorted(names)


def described_namespaces(root: str | os.PathLike[str], max_bytes: int) -> dict[str, dict[str, object]]:
    """The namespaces described under ``ROOT/namespaces`` (``ChunkFiles.describe_namespace``), by
    digest; files that are unreadable, too large or not a JSON object are skipped."""
    out: dict[str, dict[str, object]] = {}
    try:
        entries = list(os.scandir(os.path.join(root, "namespaces")))
    except OSError:
        return out
    for entry in entries:
        if entry.name.endswith(".json"):
            try:
                info = json.loads(read_small(entry.path, max_bytes)[0])
            except (OSError, ValueError):
                continue
            if isinstance(info, dict):
                out[entry.name[:-5]] = info
    return out
