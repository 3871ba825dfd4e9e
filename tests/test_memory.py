"""kvtier.memory: the host slab, its background prefault, and thread priorities."""

from __future__ import annotations

import os
import threading

import numpy as np

from kvtier import memory


def test_the_slab_is_zeroed_page_aligned_and_writable() -> None:
    slab = memory.slab(3 << 20)
    assert slab.nbytes == 3 << 20 and slab.ctypes.data % 4096 == 0
    assert not slab.any()
    slab[-1] = 7
    assert slab[-1] == 7
    assert memory.slab(0).nbytes == 0


def test_prefault_changes_no_byte_even_beside_writers() -> None:
    slab = memory.slab(32 << 20)
    pattern = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)  # 4 MiB of a pattern
    writer = threading.Thread(target=lambda: slab[8 << 20:12 << 20].__setitem__(slice(None), pattern))
    worker = memory.prefault(slab)
    writer.start()
    writer.join()
    if worker is not None:
        worker.join(30)
        assert not worker.is_alive()
    assert np.array_equal(slab[8 << 20:12 << 20], pattern)
    assert not slab[:8 << 20].any() and not slab[12 << 20:].any()


def test_lower_priority_applies_to_the_calling_thread_only() -> None:
    seen: dict[str, int] = {}
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def run() -> None:
        memory.lower_priority(10)
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["thread"] == max(10, mine)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # this thread unchanged
