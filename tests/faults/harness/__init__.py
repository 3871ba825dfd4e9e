"""The fault-injection harness: scenarios, their result rows, and the report they make.

Each scenario injects one kind of fault a given number of times (or for a given time) into a
real component (files, processes, a vLLM engine) and returns ``FaultRow``s: how often the
fault was injected and what came of it. The scenarios are this package's modules (``hostile``,
``adversary``, ``crash``, ``concurrency``, ``engine``); the pytest files beside the package (``tests/faults/
test_*.py``) run every scenario at the ``ci`` scale and assert the outcome; ``stress.py`` runs
them at the ``full`` scale and writes the table in docs/reliability-record.md.

The promise each row checks: a fault costs at most a recompute (a miss, a shorter prefix),
never a wrong answer (``wrong``), never a published chunk (``lost``), never a crash
(``crashes``) of a process that was not the fault's target, never a call or thread that does
not return (``stuck``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class FaultRow:
    fault: str
    """What was injected, in a few words (the table's first column)."""
    injected: int
    """How many times the fault was injected (kills, corrupted files, removals, delays...)."""
    requests: int = 0
    """Reads, lookups or engine requests made while (or after) the fault was present."""
    served: int = 0
    """Requests that completed: a hit, a clean miss or a recompute; not an exception."""
    identical: int = 0
    """Served requests whose answer equals the reference (bit-equal KV, or the recompute's tokens)."""
    wrong: int = 0
    """Served requests whose answer differs from the reference. Must be 0."""
    lost: int = 0
    """Chunks whose publish returned but that were gone later without being evicted. Must be 0."""
    crashes: int = 0
    """Processes that died though they were not the fault's target. Must be 0."""
    stuck: int = 0
    """Calls (or threads) that never returned: a FIFO read, a hung tier, a dead writer's flush. Must be 0."""
    seconds: float = 0.0
    notes: str = ""
    control: bool = False
    """A control row (no fault injected) shown beside the faults it is compared with."""
    extra: dict[str, object] = field(default_factory=dict)

    def check(self) -> None:
        """Assert the promise: nothing wrong, nothing lost, no crash, every request served."""
        assert self.control or self.injected > 0, f"{self.fault}: nothing was injected ({self.notes})"
        assert self.wrong == 0, f"{self.fault}: {self.wrong} wrong answers ({self.notes})"
        assert self.lost == 0, f"{self.fault}: {self.lost} published chunks lost ({self.notes})"
        assert self.crashes == 0, f"{self.fault}: {self.crashes} crashes ({self.notes})"
        assert self.stuck == 0, f"{self.fault}: {self.stuck} stuck calls ({self.notes})"
        assert self.served == self.requests, f"{self.fault}: {self.requests - self.served} requests not served"
        assert self.identical == self.served, f"{self.fault}: {self.served - self.identical} not compared equal"


@dataclass(frozen=True)
class Scale:
    """How hard each scenario pushes; ``ci`` keeps the whole matrix to a few minutes."""

    name: str
    kills: int  # SIGKILLs of a writer mid-write
    corrupt_files: int  # hostile files planted per kind
    stress_seconds: float  # multi-process writers/readers/evictors + gc, per process count
    engine_prompts: int  # prompts per engine-level scenario
    engine_minutes: float  # two vLLM instances + gc sharing one pool
    soak_seconds: float


SCALES = {
    "ci": Scale("ci", kills=40, corrupt_files=5, stress_seconds=8, engine_prompts=12, engine_minutes=0.5,
                soak_seconds=0),
    "full": Scale("full", kills=400, corrupt_files=50, stress_seconds=180, engine_prompts=40, engine_minutes=4.0,
                  soak_seconds=600),
}


Scenario = Callable[[Scale, Path], list[FaultRow]]


@dataclass(frozen=True)
class Registered:
    name: str
    run: Scenario
    needs_vllm: bool
    needs_root: bool


SCENARIOS: dict[str, Registered] = {}


def scenario(name: str, *, needs_vllm: bool = False, needs_root: bool = False) -> Callable[[Scenario], Scenario]:
    """Register a scenario for stress.py (tests call the function directly)."""

    def register(fn: Scenario) -> Scenario:
        SCENARIOS[name] = Registered(name, fn, needs_vllm, needs_root)
        return fn

    return register


def timed(fn: Callable[[], list[FaultRow]]) -> list[FaultRow]:
    """Run ``fn``; rows that did not time themselves get its wall time."""
    t0 = time.perf_counter()
    rows = fn()
    for row in rows:
        if not row.seconds:
            row.seconds = time.perf_counter() - t0
    return rows


def is_root() -> bool:
    return os.geteuid() == 0


def markdown_table(rows: list[FaultRow]) -> str:
    head = "| fault | injected | requests | served | identical | wrong | lost | crashes | stuck | seconds | notes |"
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r.fault} | {r.injected} | {r.requests} | {r.served} | {r.identical} | {r.wrong} | "
                     f"{r.lost} | {r.crashes} | {r.stuck} | {r.seconds:.1f} | {r.notes} |")
    return "\n".join(lines)


def write_results(rows: list[FaultRow], out: Path, meta: dict[str, object]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    (out / "table.md").write_text(markdown_table(rows) + "\n")
