"""How a chunk file's bytes reach memory: whole-file reads (O_DIRECT or buffered) and reads in
place, straight into a caller's pages (``tiers.base.Pages``), validated there.

``fill`` reads a file whole into one buffer; an O_DIRECT read that the filesystem accepted at
open but refuses at read (some FUSE and NFS setups) ends buffered. ``read_in_place`` reads the
header into scratch memory and checks it, then the payload into the caller's pages with
``preadv``, a piece at a time, each checksummed right after its read, all between
``Pages.enter`` and ``leave``; a load that was
over before the read raises ``LoadEnded`` and nothing is read. Inside that gate no read waits
for a device: each ``preadv`` there asks ``RWF_NOWAIT``, and a page the cache dropped since the
caller checked raises ``NotCached`` (the caller then reads the file outside the gate), so the
load's ``read_timeout_s`` bounds the wait as for any read.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

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


HASH_PIECE_BYTES = 1 << 20
"""``read_in_place`` reads the payload in pieces of about this size and checksums each right
after its read, while it is still in the CPU's cache: over a 32 MiB chunk that halves the
checksum's cost (2.2 ms from memory, 1.1 ms from cache, on a 2-core AMD EPYC), for one more
``preadv`` per MiB (a few microseconds)."""


def read_in_place(fd: int, size: int, spec: ChunkSpec, cid: ChunkId, pages: Pages) -> None:
    """Read a chunk file of ``size`` bytes: its header region into scratch memory and check it
    against ``cid`` and ``spec`` (a file that is not this chunk writes nothing to the pages),
    then its payload into ``pages.views`` piece by piece, checksummed as it lands (the padding
    after it is not read). All inside ``pages.enter``/``leave``. Raises ChunkError, OSError,
    ``NotCached`` or ``LoadEnded``."""
    _check_sizes(pages, spec, size)
    if not _NOWAIT:
        raise NotCached  # no way to read only what the cache holds: never risk a device read in the gate
    head = memoryview(bytearray(PAYLOAD_OFFSET))
    if not pages.enter():
        raise LoadEnded
    try:
        _readv_all(fd, [head], _NOWAIT)
        digest = spec.payload_digest(head, cid)
        offset = PAYLOAD_OFFSET
        for piece in _pieces(pages.views, HASH_PIECE_BYTES):
            _readv_all(fd, piece, _NOWAIT, offset)
            for view in piece:
                digest.update(view)
                offset += view.nbytes
        digest.verify()
    finally:
        pages.leave()


def copy_in_place(image: memoryview, spec: ChunkSpec, cid: ChunkId, pages: Pages) -> None:
    """Validate a chunk file read whole into ``image`` (its header against ``cid`` and ``spec``:
    a file that is not this chunk writes nothing to the pages) and copy its payload into
    ``pages.views``, piece by piece, each checksummed right after its copy, while it is still in
    the CPU's cache: one pass over memory fewer than checking the image and then copying it.
    The copy runs inside ``pages.enter``/``leave``. Raises ChunkError or ``LoadEnded``."""
    _check_sizes(pages, spec, len(image))
    digest = spec.payload_digest(image[:PAYLOAD_OFFSET], cid)
    src = np.frombuffer(image, dtype=np.uint8)
    if not pages.enter():
        raise LoadEnded
    try:
        offset = PAYLOAD_OFFSET
        for piece in _pieces(pages.views, HASH_PIECE_BYTES):
            for view in piece:
                # numpy's copy runs without the GIL (a memoryview's slice assignment holds it).
                np.copyto(np.frombuffer(view, dtype=np.uint8), src[offset:offset + view.nbytes])
                digest.update(view)
                offset += view.nbytes
        digest.verify()
    finally:
        pages.leave()


def _check_sizes(pages: Pages, spec: ChunkSpec, file_bytes: int) -> None:
    """Before anything lands in ``pages``: their sizes add up to the payload (else ValueError: the
    caller's bug), and a file of ``file_bytes`` holds a whole one (else ChunkError TRUNCATED)."""
    placed = sum(v.nbytes for v in pages.views)
    if placed != spec.payload_bytes:
        raise ValueError(f"pages of {placed} B for a payload of {spec.payload_bytes} B")
    if file_bytes < PAYLOAD_OFFSET + spec.payload_bytes:
        raise ChunkError(ChunkFault.TRUNCATED, f"{file_bytes} of {PAYLOAD_OFFSET + spec.payload_bytes} bytes")


def _pieces(views: Sequence[memoryview], nbytes: int) -> Iterator[list[memoryview]]:
    """``views`` in order, in runs of about ``nbytes`` (a larger view is cut; none is empty)."""
    if sum(v.nbytes for v in views) <= nbytes:  # a small chunk (most of a TP shard's): one run, as is
        yield [v for v in views if v.nbytes]
        return
    run: list[memoryview] = []
    size = 0
    for view in views:
        for at in range(0, view.nbytes, nbytes):
            part = view[at:at + nbytes]
            run.append(part)
            size += part.nbytes
            if size >= nbytes:
                yield run
                run, size = [], 0
    if run:
        yield run


def _readv_all(fd: int, buffers: list[memoryview], flags: int = 0, offset: int = 0) -> None:
    """Fill ``buffers`` in order from ``offset`` in ``fd`` (``preadv``, ``_IOV_MAX`` at a time).
    With ``RWF_NOWAIT`` in ``flags``, data not in the page cache raises ``NotCached``."""
    buffers = list(buffers)  # a partly filled one is replaced by its rest: not in the caller's list
    total = offset + sum(b.nbytes for b in buffers)
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


DEVICE_WINDOW_BYTES = 32 << 20
"""Bytes of device reads a chunk directory on a local filesystem lets run at once
(``DeviceWindow``): one 32 MiB chunk of an 8B-class model, seven 4 MiB shards of one at TP=8,
sixty-three chunks of the 512 KiB test model. One large read already keeps a local disk busy
(the kernel splits it into many requests). Eight at once shared the disk and finished together,
so every chunk's checks and copy waited for the last read and the disk idled through them:
on a 2-core machine with a 5.2 GB/s disk, kvtier's cold reads of 32 MiB chunks took 3.5 GB/s
with eight in flight, 3.3 GB/s with two and 4.1 GB/s with one (medians of three interleaved
runs). On a network filesystem, where a read waits for round trips, reads are not held back."""


class DeviceWindow:
    """At most ``limit`` bytes of device reads at once, admitted in the order they asked (the
    prefix's order: a load needs its first chunks first). A read larger than ``limit`` runs
    alone; a ``limit`` of 0 holds nothing back. Thread-safe."""

    def __init__(self, limit: int = DEVICE_WINDOW_BYTES) -> None:
        self.limit = limit
        self._cond = threading.Condition()
        self._used = 0
        self._next = 0  # the ticket admitted next
        self._issued = 0

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Wait for ``nbytes`` of the window (0: no wait), then hold them until the block ends."""
        if nbytes <= 0 or self.limit <= 0:
            yield
            return
        n = min(nbytes, self.limit)
        with self._cond:
            ticket = self._issued
            self._issued += 1
            self._cond.wait_for(lambda: self._next == ticket and self._used + n <= self.limit)
            self._next += 1
            self._used += n
            self._cond.notify_all()  # the next ticket may fit too
        try:
            yield
        finally:
            with self._cond:
                self._used -= n
                self._cond.notify_all()
