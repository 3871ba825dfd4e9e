"""What every storage probe measures, and the one table that shows it.

A probe writes chunks in kvtier's own format to a storage target, then reads them back raw
(the device's best) and through kvtier's read path (``TieredStore.get``), interleaved per
repeat; figures are medians. ``ProbeResult`` holds the figures every target has; each probe's
result adds its own (``FsProbeResult``: O_DIRECT and page-cache reads; ``RedisProbeResult``:
redis-py's parser) and lists its table rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from rich.table import Table

from kvtier.layout import KVLayout
from kvtier.store import TieredStore

DEFAULT_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
"""An 8B-class model (Llama-3.1-8B's KV shape): 32 MiB per 256-token chunk."""

Row = tuple[str, float | None, float | None]  # (read mode, serial GB/s, parallel GB/s)


@dataclass
class ProbeResult:
    """The figures of every probe (GB/s count chunk bytes moved, header page included)."""

    path: str
    file_bytes: int
    total_bytes: int
    threads: int
    repeats: int
    write_gbps: float
    serial_gbps: float
    parallel_gbps: float
    best_raw_gbps: float
    """The best raw read of the target (the device's, with no kvtier in the way)."""
    kvtier_read_gbps: float
    """kvtier's parallel read path (``TieredStore.get``, ``io_threads=threads``), cold."""
    kvtier_vs_best_raw: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def title(self) -> str:
        return f"kvtier probe {self.path}"

    def rows(self) -> list[Row]:
        raise NotImplementedError

    def caption(self) -> str:
        return (f"kvtier read = {self.kvtier_vs_best_raw:.0%} of the best raw read ({self.best_raw_gbps:.2f} GB/s); "
                f"write {self.write_gbps:.2f} GB/s")


def probe_table(r: ProbeResult) -> Table:
    """Serial and parallel GB/s of each read mode of the probe's target."""
    table = Table(title=r.title())
    table.add_column("read", style="bold")
    table.add_column("serial GB/s", justify="right")
    table.add_column("parallel GB/s", justify="right")
    table.add_column("parallel / serial", justify="right")
    for name, serial, parallel in r.rows():
        ratio = f"{parallel / serial:.2f}x" if serial and parallel else "-"
        table.add_row(name, f"{serial:.2f}" if serial else "-", f"{parallel:.2f}" if parallel else "-", ratio)
    table.caption = r.caption()
    return table


def get_bandwidth(store: TieredStore, sessions: Sequence[np.ndarray], out: torch.Tensor,
                  total_bytes: int) -> Callable[[], float]:
    """A timer of kvtier's read path: ``get`` every session into ``out``; returns GB/s."""
    def run() -> float:
        t = time.perf_counter()
        for tokens in sessions:
            store.get(tokens, out=out)
        return total_bytes / (time.perf_counter() - t) / 1e9
    return run
