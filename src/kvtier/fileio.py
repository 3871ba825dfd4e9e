"""Whole files replaced atomically: the one helper for chunk files, pool metadata, reports and
metrics snapshots.

A write goes to a new temp file beside the target, named ``<target>.<pid>.<random>.tmp``
(unique, so concurrent writers never share one; the pid and suffix let ``kvtier pool gc``
recognise a crashed writer's leftover), which is then renamed over the target: a reader sees
the old file or the whole new one, never a part.
"""

from __future__ import annotations

import os
import secrets
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
