"""The C libraries kvtier calls directly, each loaded once: the C library for the few calls
Python does not wrap (``madvise``, ``prctl``), and the OpenMP runtime torch runs its CPU ops on
(``omp_set_num_threads``, which torch only offers with a process-wide side effect).

A leaf module (it imports nothing of kvtier's), so that ``memory`` (prefaulting host DRAM)
and ``threads`` (naming OS threads) can both use it without importing each other.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from pathlib import Path

_libc: ctypes.CDLL | None = None
_openmp: ctypes.CDLL | bool | None = False  # False: not looked for yet


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


def openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch's CPU ops use, or None (torch not imported, or built without one).

    The copy torch ships beside its libraries when it has one (the handle of the library
    already loaded: ``omp_set_num_threads`` must reach the runtime torch calls), else whatever
    runtime the process has loaded globally.
    """
    global _openmp
    if _openmp is False:
        _openmp = None
        torch = sys.modules.get("torch")
        if torch is not None and torch.__file__ is not None:
            shipped = sorted((Path(torch.__file__).parent / "lib").glob("lib*omp*.so*"))
            candidates = [str(p) for p in shipped if p.name.startswith(("libgomp", "libiomp", "libomp"))]
            for path in [*candidates, None]:
                try:
                    lib = ctypes.CDLL(path)
                    lib.omp_set_num_threads.argtypes = (ctypes.c_int,)
                except (OSError, AttributeError):
                    continue
                _openmp = lib
                break
    return _openmp if isinstance(_openmp, ctypes.CDLL) else None
