"""The background threads kvtier starts, and what they do with a work item that raises.

Every thread kvtier starts (I/O, writer, retention, lookup, loader threads) is made here, so
that each one

* runs the process's ``thread_init`` first: on a GPU, the engine's device (``torch.cuda.
  set_device``), or a new thread would create a CUDA context on GPU 0 whatever rank it serves;
* survives any exception in its work item: ``Failures.record`` logs the first one of each
  place with its traceback (later ones at debug level, so a hostile input repeated a million
  times cannot flood the log) and counts every one in the store's ``thread_errors``;
* carries its name to the OS (Linux: the thread's ``comm``, first 15 bytes), so ``top -H``,
  ``py-spy`` and ``/proc/PID/task/*/comm`` tell kvtier's threads from the engine's;
* runs torch's CPU ops on itself alone (``one_cpu_thread``): a torch op on a new thread
  otherwise starts an OpenMP team of its own, as many threads as the engine's, which compete
  with the engine's threads for its cores (measured on a 2-core machine: 64 copies of 256 KiB
  took 1.5 ms on the main thread, 7-9 ms on a second thread, 1.6-2 ms there with one thread).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from kvtier.libc import libc, openmp
from kvtier.metrics import TierMetrics

log = logging.getLogger(__name__)

ThreadInit = Callable[[], None]


class Failures:
    """Exceptions raised by background work items: counted, the first of each place logged."""

    def __init__(self, metrics: TierMetrics | None = None) -> None:
        self.metrics = metrics
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def record(self, where: str) -> None:
        """Call from an ``except`` block: count the exception, log it if ``where`` is new."""
        if self.metrics is not None:
            self.metrics.add(thread_errors=1)
        with self._lock:
            first = where not in self._logged
            self._logged.add(where)
        if first:
            log.exception("kvtier: %s raised (the thread goes on; later errors here are logged at debug "
                          "level and counted in kvtier_thread_errors_total)", where)
        else:
            log.debug("kvtier: %s raised again", where, exc_info=True)

    def call(self, where: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None after recording what it raised."""
        try:
            return fn(*args)
        except Exception:
            self.record(where)
            return None


_PR_SET_NAME = 15


def name_os_thread() -> None:
    """Give the calling thread's Python name to the OS (Linux ``prctl(PR_SET_NAME)``; a no-op
    elsewhere or when libc cannot be loaded)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        lib = libc()
        if lib is not None:
            lib.prctl(_PR_SET_NAME, threading.current_thread().name.encode()[:15] + b"\0", 0, 0, 0)
    except (OSError, AttributeError):
        pass


def one_cpu_thread() -> None:
    """Make torch's CPU ops on the calling thread run on it alone (no OpenMP team of its own).

    Only this thread's OpenMP setting changes: ``torch.set_num_threads`` would also set the
    count every thread started later inherits, the engine's included. A no-op without torch
    or an OpenMP runtime.
    """
    torch = sys.modules.get("torch")
    lib = openmp()
    if torch is None or lib is None:
        return
    torch.get_num_threads()  # torch sets a new thread's OpenMP count on its first op: let it, then override
    lib.omp_set_num_threads(1)


def _initializer(init: ThreadInit | None) -> Callable[[], None]:
    def run() -> None:
        name_os_thread()
        one_cpu_thread()
        if init is None:
            return
        try:
            init()
        except Exception:  # a thread that cannot set its device still serves (on the default one)
            log.exception("kvtier: thread initializer failed in %s", threading.current_thread().name)

    return run


def executor(workers: int, prefix: str, init: ThreadInit | None = None) -> cf.ThreadPoolExecutor:
    """A thread pool whose threads are named ``<prefix>_N`` and run ``init`` first."""
    return cf.ThreadPoolExecutor(workers, thread_name_prefix=prefix, initializer=_initializer(init))


def thread(target: Callable[[], None], name: str, init: ThreadInit | None = None) -> threading.Thread:
    """A daemon thread (not started) that runs ``init`` and then ``target``."""
    first = _initializer(init)

    def run() -> None:
        first()
        target()

    return threading.Thread(target=run, name=name, daemon=True)
