"""How much of a file the page cache holds, without causing any I/O (Linux ``cachestat``).

The read path uses it to choose per file: a warm file is copied from the page cache, a cold
one is read with O_DIRECT. (A ``RWF_NOWAIT`` probe read was tried and rejected: on a miss it
still starts readahead, so the device would be read twice.)
"""

from __future__ import annotations

import ctypes
import errno
import platform

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
    """Bytes of ``fd``'s file in the page cache, or None where the kernel cannot tell (< 6.5)."""
    global _available
    if not _available or _libc is None:
        return None
    whole = _Range(0, 0)
    stat = _Stat()
    if _libc.syscall(_SYSCALL_NR, fd, ctypes.byref(whole), ctypes.byref(stat), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            _available = False
        return None
    return int(stat.nr_cache) * _PAGE
