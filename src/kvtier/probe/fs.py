"""Storage probe: how fast can this path feed KV back, raw and through kvtier's read path?

Writes chunk files in kvtier's own format under a scratch directory, then measures, in the
same run and interleaved per repeat so that a noisy device affects all modes alike:

* cold reads (page cache dropped per file with ``posix_fadvise(DONTNEED)``): buffered and
  O_DIRECT, serial (one thread) and parallel (``threads`` threads), over the same files;
* page-cache reads (files warm): serial and parallel buffered;
* kvtier's own path: ``TieredStore.get`` of whole sessions from the pool tier (host and disk
  tiers off), cold and warm, with ``io_threads=threads`` (parallel) and ``io_threads=1``
  (serial: one reader thread; the caller's copy into the output still overlaps it).

Bandwidth counts file bytes moved (header page included) for every mode, so ratios compare
like with like. Figures are medians over ``repeats``.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import secrets
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.layout import KVLayout
from kvtier.probe.result import DEFAULT_LAYOUT, ProbeResult, Row, get_bandwidth
from kvtier.store import TieredStore
from kvtier.tiers.base import aligned_buffer
from kvtier.tiers.poolroot import expect_local, init_pool


@dataclass
class FsProbeResult(ProbeResult):
    """A directory's figures: cold buffered and O_DIRECT reads, page-cache reads, kvtier's both."""

    files: int
    direct_serial_gbps: float | None
    direct_parallel_gbps: float | None
    cache_serial_gbps: float
    cache_parallel_gbps: float
    cache_parallel_speedup: float
    kvtier_cache_gbps: float
    kvtier_cold_serial_gbps: float
    kvtier_cache_serial_gbps: float
    kvtier_cache_parallel_speedup: float
    direct_io: bool
    samples_gbps: dict[str, list[float]] = field(default_factory=dict)

    def title(self) -> str:
        return (f"kvtier probe {self.path}: {self.files} files x {self.file_bytes / 1024:.0f} KiB, "
                f"{self.threads} threads, median of {self.repeats}")

    def rows(self) -> list[Row]:
        return [("cold, buffered", self.serial_gbps, self.parallel_gbps),
                ("cold, O_DIRECT", self.direct_serial_gbps, self.direct_parallel_gbps),
                ("cold, kvtier get", self.kvtier_cold_serial_gbps, self.kvtier_read_gbps),
                ("page cache, raw", self.cache_serial_gbps, self.cache_parallel_gbps),
                ("page cache, kvtier get", self.kvtier_cache_serial_gbps, self.kvtier_cache_gbps)]

    def caption(self) -> str:
        return (f"kvtier cold read = {self.kvtier_vs_best_raw:.0%} of the best raw cold read "
                f"({self.best_raw_gbps:.2f} GB/s); write {self.write_gbps:.2f} GB/s")


def drop_cache(paths: list[Path]) -> None:
    """Evict these files' pages from the page cache (they must be clean: written and synced)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _Reader:
    """Reads whole files into a per-thread reusable aligned buffer (the raw baseline)."""

    def __init__(self, file_bytes: int, direct: bool) -> None:
        self.file_bytes = file_bytes
        self.flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        self._local = threading.local()

    def __call__(self, path: Path) -> int:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = aligned_buffer(self.file_bytes).data
        fd = os.open(path, self.flags)
        try:
            done = 0
            while done < self.file_bytes:
                n = os.preadv(fd, [buf[done:]], done)
                if n == 0:
                    break
                done += n
            return done
        finally:
            os.close(fd)


def _direct_supported(path: Path) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        _Reader(os.path.getsize(path), direct=True)(path)
        return True
    except OSError:
        return False


def run_probe(path: str | os.PathLike[str], *, total_bytes: int = 1 << 30, threads: int = 8,
              repeats: int = 3, layout: KVLayout | None = None, chunk_tokens: int = 256,
              session_chunks: int = 8, keep: bool = False,
              progress: Callable[[str, float], None] | None = None) -> FsProbeResult:
    """Measure raw and kvtier read bandwidth under ``path``; see the module docstring.

    ``progress(stage, fraction_done)`` is called as the probe goes.
    """
    layout = layout or DEFAULT_LAYOUT
    root = Path(path) / f"kvtier-probe-{secrets.token_hex(4)}"
    root.mkdir(parents=True)
    report = progress or (lambda stage, frac: None)
    try:
        return _probe(root, total_bytes, threads, repeats, layout, chunk_tokens, session_chunks, report)
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def _probe(root: Path, total_bytes: int, threads: int, repeats: int, layout: KVLayout,
           chunk_tokens: int, session_chunks: int, report: Callable[[str, float], None]) -> FsProbeResult:
    chunk_bytes = chunk_tokens * layout.bytes_per_token
    n_chunks = max(session_chunks, total_bytes // chunk_bytes)
    n_sessions = max(1, n_chunks // session_chunks)
    rng = np.random.default_rng(0)
    store_kwargs = {"model_id": "kvtier-probe", "layout": layout, "chunk_tokens": chunk_tokens, "host_bytes": 0,
                        "pool_url": f"fs://{root / 'pool'}", "io_threads": threads,
                        "write_queue_chunks": n_sessions * session_chunks + 1}
    sessions = [rng.integers(0, 32000, session_chunks * chunk_tokens).astype(np.uint32)
                for _ in range(n_sessions)]
    init_pool(root / "pool", 4 * total_bytes + (1 << 30))  # a scratch pool of the probe's own
    expect_local(root / "pool")
    store = TieredStore.open(**store_kwargs)  # type: ignore[arg-type]
    serial_store = TieredStore.open(**{**store_kwargs, "io_threads": 1})  # type: ignore[arg-type]
    try:
        shape = layout.shape(session_chunks * chunk_tokens)
        nbytes = math.prod(shape) * layout.element_bytes
        kv = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).view(layout.dtype).view(shape)
        t0 = time.perf_counter()
        for i, tokens in enumerate(sessions):
            kv.view(torch.uint8).view(-1)[:8] = torch.frombuffer(bytearray(i.to_bytes(8, "little")), dtype=torch.uint8)
            store.put(tokens, kv)
            store.flush()  # bounds memory: the queue would otherwise hold every chunk
            report("write", (i + 1) / n_sessions / 2)
        write_s = time.perf_counter() - t0
        os.sync()  # clean pages: DONTNEED can only drop clean pages
        files = sorted(f.path for f in store.tiers[0].files.scan())  # type: ignore[attr-defined]
        file_bytes = os.path.getsize(files[0])
        total = file_bytes * len(files)
        direct = _direct_supported(files[0])

        def raw(direct_io: bool, parallel: bool) -> Callable[[], float]:
            reader = _Reader(file_bytes, direct_io)

            def run() -> float:
                t = time.perf_counter()
                if parallel:
                    with cf.ThreadPoolExecutor(threads) as pool:
                        moved = sum(pool.map(reader, files))
                else:
                    moved = sum(reader(f) for f in files)
                return moved / (time.perf_counter() - t) / 1e9
            return run

        out = torch.empty(layout.shape(session_chunks * chunk_tokens), dtype=layout.dtype)
        out.zero_()  # fault its pages in now: an engine reads into memory it already has

        def kvtier(reader: TieredStore) -> Callable[[], float]:
            return get_bandwidth(reader, sessions, out, total)

        cold: dict[str, Callable[[], float]] = {
            "buffered_serial": raw(False, False), "buffered_parallel": raw(False, True),
            "kvtier_cold": kvtier(store), "kvtier_cold_serial": kvtier(serial_store)}
        if direct:
            cold["direct_serial"] = raw(True, False)
            cold["direct_parallel"] = raw(True, True)
        warm = {"cache_serial": raw(False, False), "cache_parallel": raw(False, True),
                "kvtier_cache": kvtier(store), "kvtier_cache_serial": kvtier(serial_store)}
        samples = _measure(cold, warm, repeats, files, raw(False, True), report)
    finally:
        store.close()
        serial_store.close()

    return _result(str(root.parent), samples, files=len(files), file_bytes=file_bytes, total_bytes=total,
                   threads=threads, repeats=repeats, write_gbps=total / write_s / 1e9, direct_io=direct)


def _result(path: str, samples: dict[str, list[float]], **figures: Any) -> FsProbeResult:
    """The medians of ``samples`` as an ``FsProbeResult`` (``figures``: the run's own)."""
    med = {name: statistics.median(v) for name, v in samples.items()}
    raw_cold = [med[m] for m in ("buffered_serial", "buffered_parallel", "direct_serial", "direct_parallel")
                if m in med]
    best = max(raw_cold)
    return FsProbeResult(
        path=path, **figures,
        serial_gbps=med["buffered_serial"], parallel_gbps=med["buffered_parallel"],
        direct_serial_gbps=med.get("direct_serial"), direct_parallel_gbps=med.get("direct_parallel"),
        best_raw_gbps=best, kvtier_read_gbps=med["kvtier_cold"], kvtier_vs_best_raw=med["kvtier_cold"] / best,
        cache_serial_gbps=med["cache_serial"], cache_parallel_gbps=med["cache_parallel"],
        cache_parallel_speedup=med["cache_parallel"] / med["cache_serial"],
        kvtier_cache_gbps=med["kvtier_cache"], kvtier_cold_serial_gbps=med["kvtier_cold_serial"],
        kvtier_cache_serial_gbps=med["kvtier_cache_serial"],
        kvtier_cache_parallel_speedup=med["kvtier_cache"] / med["kvtier_cache_serial"],
        samples_gbps={k: [round(x, 4) for x in v] for k, v in samples.items()},
    )


def _measure(cold: dict[str, Callable[[], float]], warm: dict[str, Callable[[], float]], repeats: int,
             files: list[Path], warm_up: Callable[[], float],
             report: Callable[[str, float], None]) -> dict[str, list[float]]:
    """Every mode ``repeats`` times: the cold ones in a rotated order with the page cache dropped
    before each, then the page-cache ones after ``warm_up``. GB/s samples per mode."""
    samples: dict[str, list[float]] = {m: [] for m in (*cold, *warm)}
    steps = repeats * (len(cold) + len(warm))
    done = 0
    for r in range(repeats):
        # Rotate the order each repeat so no mode always runs right after another.
        order = list(cold.items())
        order = order[r % len(order):] + order[:r % len(order)]
        for name, fn in order:
            drop_cache(files)
            samples[name].append(fn())
            done += 1
            report(f"cold {name}", 0.5 + done / steps / 2)
        warm_up()  # warm the page cache
        for name, fn in warm.items():
            samples[name].append(fn())
            done += 1
            report(f"page cache {name}", 0.5 + done / steps / 2)
    return samples
