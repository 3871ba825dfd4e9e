"""The C library, loaded once for the few calls Python does not wrap (``madvise``, ``prctl``).

A leaf module (it imports nothing of kvtier's), so that ``memory`` (prefaulting host DRAM)
and ``threads`` (naming OS threads) can both use it without importing each other.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL | None:
    """The C library (loaded once; None where ctypes cannot find it)."""
    global _libc
    if _libc is None:
        path = ctypes.util.find_library("c")
        if path is None:
            return None
        _libc = ctypes.CDLL(path, use_errno=True)  # foreign calls release the GIL
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    return _libc
