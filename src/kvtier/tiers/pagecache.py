"""How much of a file the page cache holds, without causing any I/O (Linux ``cachestat``), and
whether a hit there is a memory read (a local filesystem) or still a round trip (a network one).

The read path uses it to choose per file: a warm file is copied from the page cache, a cold
one is read with O_DIRECT; and the reader calls up more threads only for reads that waited for
the device, never for page-cache hits of a local filesystem. (A ``RWF_NOWAIT`` probe read was
tried and rejected: on a miss it still starts readahead, so the device would be read twice.)
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import re

_SYSCALL_NR = {"x86_64": 451, "aarch64": 451}.get(platform.machine())
_PAGE = 4096


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64),
                ("nr_writeback", ctypes.c_uint64), ("nr_evicted", ctypes.c_uint64),
                ("nr_recently_evicted", ctypes.c_uint64)]


try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - non-glibc platforms
    _libc = None
_available = _SYSCALL_NR is not None and _libc is not None


def cached_bytes(fd: int) -> int | None:
    """Bytes of ``fd``'s file in the page cache, or None where the kernel cannot tell (< 6.5).
    The kernel walks every page of the file: about 150 us for a 32 MiB file (``holds_whole``
    asks less)."""
    pages = _cached_pages(fd, 0, 0)
    return None if pages is None else pages * _PAGE


WHOLE_CHECK_BYTES = 4 << 20
"""``holds_whole`` asks about every page of a file up to this size, and about samples of a larger one."""
SAMPLES = 4
SAMPLE_BYTES = 64 << 10


def holds_whole(fd: int, size: int) -> bool | None:
    """Whether the page cache holds ``fd``'s file (``size`` bytes) whole; None where the kernel
    cannot tell. A file over ``WHOLE_CHECK_BYTES`` is judged by ``SAMPLES`` windows of
    ``SAMPLE_BYTES`` spread from its first byte to its last: 12 us instead of 150 us for a
    32 MiB chunk file, on a path whose page-cache reads take 2-5 ms. A file with a hole
    between the windows is taken for whole; the read path stays right (a read in place asks
    ``RWF_NOWAIT`` and reads the file outside the caller's memory when a page is missing; a
    buffered read only reads the hole from the device), so a sample costs at most that."""
    if size <= WHOLE_CHECK_BYTES:
        cached = cached_bytes(fd)
        return None if cached is None else cached >= size
    last = size - SAMPLE_BYTES
    for i in range(SAMPLES):
        off = last * i // (SAMPLES - 1) // _PAGE * _PAGE
        pages = _cached_pages(fd, off, SAMPLE_BYTES)
        if pages is None:
            return None
        if pages < SAMPLE_BYTES // _PAGE:
            return False
    return True


def _cached_pages(fd: int, off: int, length: int) -> int | None:
    """Pages of ``fd``'s bytes ``off:off + length`` (to the end for 0) in the page cache, or None."""
    global _available
    if not _available or _libc is None:
        return None
    span = _Range(off, length)
    stat = _Stat()
    if _libc.syscall(_SYSCALL_NR, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            _available = False
        return None
    return int(stat.nr_cache)


# Filesystems whose page-cache hits are memory reads. On any other (FUSE, NFS, CIFS, Ceph,
# Lustre, 9p, ...) opening a file is a round trip to a server even when the client's cache
# holds its bytes, so such reads still gain from running in parallel.
_OCTAL = re.compile(r"\\([0-7]{3})")  # mountinfo's escapes: space, tab, newline, backslash
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "tmpfs", "ramfs",
                               "overlay", "bcachefs", "jfs", "reiserfs"})


def filesystem_type(path: str, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem ``path`` is on (``/proc/self/mountinfo``: the longest mount
    point above it), or None where that cannot be read."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                mountinfo = f.read()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, best_type = -1, None
    for line in mountinfo.splitlines():
        fields = line.split()
        sep = fields.index("-") if "-" in fields else -1
        if sep < 5 or sep + 1 >= len(fields):  # mount point is field 4; the type follows " - "
            continue
        point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])  # a space is written \040
        fstype = fields[sep + 1]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, best_type = len(point), fstype
    return best_type


def cache_hits_are_local(path: str, mountinfo: str | None = None) -> bool:
    """Whether a page-cache hit under ``path`` is a memory read (``LOCAL_FILESYSTEMS``)."""
    return filesystem_type(path, mountinfo) in LOCAL_FILESYSTEMS
