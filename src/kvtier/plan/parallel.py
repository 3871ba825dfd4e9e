"""Independent simulations of one large workload, run side by side on the machine's cores.

Each simulation is single-threaded Python; a plan simulates several (one per configuration,
one per point of the capacity curve) over the same workload, so a workload of thousands of
sessions runs them in forked worker processes, and a small one in this process (a fork costs
more than its simulations).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtier.plan.workload import Workload

PARALLEL_TURNS = 2000  # workloads with at least this many requests simulate in parallel
J = TypeVar("J")
R = TypeVar("R")


def turns_of(workload: Workload) -> int:
    return sum(len(s) for phase in workload for s in phase.sessions)


def run_all(fn: Callable[[J], R], jobs: Sequence[J], turns: int) -> list[R]:
    """``[fn(job) for job in jobs]``, in forked processes when ``turns`` is large and the
    machine has more than one core. ``fn`` must be a module-level function."""
    workers = min(len(jobs), os.cpu_count() or 1)
    if turns < PARALLEL_TURNS or workers < 2:
        return [fn(job) for job in jobs]
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
        return list(pool.map(fn, jobs))
