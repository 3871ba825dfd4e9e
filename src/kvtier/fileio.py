"""Whole files replaced atomically: the one helper for chunk files, pool metadata, reports and
metrics snapshots; and the bounded, symlink- and FIFO-proof reads of small files that others
may have planted (``read_small``).

A write goes to a new temp file beside the target, named ``<target>.<pid>.<random>.tmp``
(unique, so concurrent writers never share one; the pid and suffix let ``kvtier pool gc``
recognise a crashed writer's leftover), which is then renamed over the target: a reader sees
the old file or the whole new one, never a part.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Sequence

TMP_SUFFIX = ".tmp"


def write_atomic(path: str | os.PathLike[str], data: bytes | memoryview | Sequence[bytes | memoryview], *,
                 mode: int = 0o600, exact_mode: bool = False, fsync: bool = False) -> None:
    """Replace ``path`` with ``data`` (bytes, or buffers written in order with ``writev``).

    The file is created with ``mode`` (less the umask, unless ``exact_mode``: then exactly
    ``mode``), never through a symlink. ``fsync``: the data reaches the disk before the rename
    (the directory entry is the caller's to sync). On any error the temp file is removed and
    the error raised (FileNotFoundError: ``path``'s directory is missing).
    """
    final = os.fspath(path)
    tmp = f"{final}.{os.getpid()}.{secrets.token_hex(6)}{TMP_SUFFIX}"
    buffers = [data] if isinstance(data, (bytes, memoryview)) else list(data)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        try:
            if exact_mode:
                os.fchmod(fd, mode)  # the umask may have stripped bits
            write_all(fd, buffers)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_all(fd: int, buffers: Sequence[bytes | memoryview]) -> None:
    """Write every byte of ``buffers`` to ``fd`` in order (``writev``, resumed after short writes)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        n = os.writev(fd, views)
        while n and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


# Never follow a symlink planted under a metadata file's name, never block opening a FIFO:
# a group-shared pool's neighbours can plant anything there.
_SAFE_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK


def open_regular(path: str | os.PathLike[str], flags: int = _SAFE_READ_FLAGS, mode: int = 0o600) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_NONBLOCK)``, refusing anything but a regular file.

    Raises OSError: ELOOP for a symlink, EINVAL (closing the descriptor first) for a FIFO,
    socket, device or directory under the name, and whatever ``open`` raises.
    """
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"not a regular file (mode {oct(st.st_mode)})", os.fspath(path))
        if flags & os.O_NONBLOCK == 0:
            # O_NONBLOCK was only for the open; reads of a regular file ignore it anyway.
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: str | os.PathLike[str], max_bytes: int, offset: int = 0) -> tuple[bytes, os.stat_result]:
    """At most ``max_bytes`` of the regular file ``path`` from ``offset``, and its ``fstat``.

    For metadata a neighbour may have replaced: a symlink, FIFO or device is refused (OSError,
    see ``open_regular``), and however large the file is, no more than ``max_bytes`` are read.
    """
    fd = open_regular(path)
    try:
        st = os.fstat(fd)
        chunks: list[bytes] = []
        got = 0
        while got < max_bytes:
            data = os.pread(fd, max_bytes - got, offset + got)
            if not data:
                break
            chunks.append(data)
            got += len(data)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so that a create or rename in it is on the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def set_direct(fd: int, on: bool) -> None:
    """Turn ``O_DIRECT`` on or off for an open descriptor."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
