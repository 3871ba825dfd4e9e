"""How a chunk file's bytes reach memory: whole-file reads (O_DIRECT or buffered) and reads in
place, straight into a caller's pages (``tiers.base.Pages``), validated there.

``fill`` reads a file whole into one buffer; an O_DIRECT read that the filesystem accepted at
open but refuses at read (some FUSE and NFS setups) ends buffered. ``read_in_place`` reads the
header into scratch memory and the payload into the caller's pages with ``preadv``, then checks
header and checksum over the pieces, all between ``Pages.enter`` and ``leave``; a load that was
over before the read raises ``LoadEnded`` and nothing is read. Inside that gate no read waits
for a device: each ``preadv`` there asks ``RWF_NOWAIT``, and a page the cache dropped since the
caller checked raises ``NotCached`` (the caller then reads the file outside the gate), so the
load's ``read_timeout_s`` bounds the wait as for any read.
"""

from __future__ import annotations

import errno
import os

from kvtier.fileio import set_direct
from kvtier.format import PAYLOAD_OFFSET, ChunkError, ChunkFault, ChunkSpec
from kvtier.keys import ChunkId
from kvtier.tiers.base import Pages

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class LoadEnded(Exception):
    """``Pages.enter`` refused: the load the pages belong to is over."""


class NotCached(Exception):
    """The page cache no longer holds the whole file (or cannot say so without waiting): read it
    outside the gate. What the read put in the pages is garbage the caller never uses."""


_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def read_in_place(fd: int, size: int, spec: ChunkSpec, cid: ChunkId, pages: Pages) -> None:
    """Read a chunk file of ``size`` bytes: its header region into scratch memory, its payload
    into ``pages.views``, its padding into scratch; validate header and payload checksum there.
    All inside ``pages.enter``/``leave``. Raises ChunkError, OSError, or ``LoadEnded``."""
    if sum(v.nbytes for v in pages.views) != spec.payload_bytes:
        raise ValueError(f"pages of {sum(v.nbytes for v in pages.views)} B for a payload of {spec.payload_bytes} B")
    head = memoryview(bytearray(PAYLOAD_OFFSET))
    pad = size - PAYLOAD_OFFSET - spec.payload_bytes
    buffers: list[memoryview] = [head, *pages.views]
    if pad:
        buffers.append(memoryview(bytearray(pad)))
    if not _NOWAIT:
        raise NotCached  # no way to read only what the cache holds: never risk a device read in the gate
    if not pages.enter():
        raise LoadEnded
    try:
        _readv_all(fd, buffers, _NOWAIT)
        spec.decode_parts(head, pages.views, cid)
    finally:
        pages.leave()


def _readv_all(fd: int, buffers: list[memoryview], flags: int = 0) -> None:
    """Fill ``buffers`` in order from the start of ``fd`` (``preadv``, ``_IOV_MAX`` at a time).
    With ``RWF_NOWAIT`` in ``flags``, data not in the page cache raises ``NotCached``."""
    buffers = list(buffers)  # a partly filled one is replaced by its rest: not in the caller's list
    offset, total = 0, sum(b.nbytes for b in buffers)
    first = 0  # buffers[:first] are filled
    while offset < total:
        try:
            n = os.preadv(fd, buffers[first:first + _IOV_MAX], offset, flags)
        except OSError as exc:
            if flags and exc.errno in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL):
                raise NotCached from None
            raise
        if n == 0:
            raise ChunkError(ChunkFault.TRUNCATED, f"short read: {offset} of {total} B")
        offset += n
        while first < len(buffers) and n >= buffers[first].nbytes:  # skip what is filled
            n -= buffers[first].nbytes
            first += 1
        if n:  # resume inside a partly filled one
            buffers[first] = buffers[first][n:]


def fill(fd: int, view: memoryview, direct: bool) -> None:
    """Fill ``view`` from the start of ``fd``. A read with O_DIRECT (``direct``) that the
    filesystem accepted at open but refuses at read (some FUSE and NFS setups) ends buffered."""
    done = _read_all(fd, view, 0, stop_on_einval=direct)
    if done < len(view):
        set_direct(fd, False)
        _read_all(fd, view, done)


def _read_all(fd: int, view: memoryview, done: int = 0, stop_on_einval: bool = False) -> int:
    """Fill ``view[done:]`` from ``fd`` at the same offsets; returns the bytes filled.

    With ``stop_on_einval`` an EINVAL (O_DIRECT accepted at open, refused at read, as on
    some FUSE mounts) returns early so the caller can finish with a buffered read.
    """
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], done)
        except OSError as exc:
            if stop_on_einval and exc.errno == errno.EINVAL:
                return done
            raise
        if n == 0:
            raise ChunkError(ChunkFault.TRUNCATED, f"short read: {done} of {len(view)} B")
        done += n
    return done
