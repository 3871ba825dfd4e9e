"""Host memory that does not cost the engine page faults, and background threads that yield to it.

First touches of fresh anonymous memory are expensive on virtual machines (nested paging): here
copying 256 MiB into fresh pages took 1.44 s, into the same pages again 0.05 s, and into fresh
pages advised as transparent huge pages 0.32 s. Host DRAM's slab is filled by the engine's own
thread when it saves (``PageMover.save``'s gather), so every first touch there is on the time to
first token of a new prompt. ``slab`` therefore maps it with ``MADV_HUGEPAGE`` and
``prefault`` faults it in from a thread of the lowest priority (``MADV_POPULATE_WRITE``, which
never changes a byte, so it is safe beside saves into the same slab), using cores the engine
leaves idle.

``lower_priority`` lowers the scheduling priority of the calling thread (Linux: a thread's id
is a process id to ``setpriority``); kvtier's background writers use it, so their copies and
checksums run behind the engine's threads instead of preempting one of its OpenMP team
(on a 2-core machine every preemption stalls the team's next barrier).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading

import numpy as np

from kvtier.libc import libc
from kvtier.threads import thread

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux 5.14
PREFAULT_STEP = 2 << 20  # one huge page per call: the call holds no lock of ours and releases the GIL


def slab(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeroed, page-aligned host memory (advised as huge pages where the kernel has
    them); the array keeps its mapping alive."""
    if nbytes <= 0:
        return np.empty(0, np.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # no transparent huge pages: 4 KiB pages, prefault all the more useful
    return np.frombuffer(mapping, dtype=np.uint8)


def lower_priority(nice: int) -> None:
    """Run the calling thread at ``nice`` (0-19, higher: yields more); errors are ignored."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError):
        pass


def prefault(array: np.ndarray, name: str = "kvtier-prefault") -> threading.Thread | None:
    """Fault ``array``'s pages in on a daemon thread at the lowest priority (contents unchanged);
    None where the kernel cannot (no ``MADV_POPULATE_WRITE``: pages then fault on first use)."""
    lib = libc()
    if lib is None or not array.nbytes:
        return None

    def run() -> None:
        lower_priority(19)
        base, size = array.ctypes.data, array.nbytes
        for offset in range(0, size, PREFAULT_STEP):
            n = min(PREFAULT_STEP, size - offset)
            if lib.madvise(ctypes.c_void_p(base + offset), ctypes.c_size_t(n), MADV_POPULATE_WRITE) != 0:
                log.debug("kvtier: MADV_POPULATE_WRITE failed (errno %d): host DRAM faults in on first use",
                          ctypes.get_errno())
                return

    worker = thread(run, name)
    worker.start()
    return worker

