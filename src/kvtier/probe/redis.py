"""``kvtier probe redis://...``: how fast can a Redis / Valkey server feed KV back?

Stores chunk values in kvtier's own format under a scratch key prefix (``kvtier-probe:<rand>:``,
deleted afterwards) through kvtier's write path, then measures, interleaved per repeat:

* raw reads: ``GET`` of every value received straight into a reused buffer (the tier's
  zero-copy path, no validation), serial (one connection) and parallel (``threads``
  connections); and, for reference, serial ``GET`` through redis-py's own reply parser;
* kvtier's own path: ``TieredStore.get`` of whole sessions with the Redis tier as the pool
  (host and disk tiers off), ``io_threads=threads`` and ``io_threads=1``.

Bandwidth counts value bytes (header page included) in every mode; figures are medians over
``repeats``. The server must have room for ``total_bytes`` (it is written once).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import queue
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.layout import KVLayout
from kvtier.probe.result import DEFAULT_LAYOUT, ProbeResult, Row, get_bandwidth
from kvtier.store import TieredStore
from kvtier.tiers.base import aligned_buffer
from kvtier.tiers.redis import RedisTier

log = logging.getLogger(__name__)


@dataclass
class RedisProbeResult(ProbeResult):
    """A Redis / Valkey server's figures (``path``: its URL, password redacted)."""

    server: str
    keys: int
    kvtier_serial_gbps: float
    redis_py_serial_gbps: float
    """Serial ``client.get`` through redis-py's own reply parser (copies each value), for reference."""
    samples_gbps: dict[str, list[float]] = field(default_factory=dict)

    def title(self) -> str:
        return (f"kvtier probe {self.path} ({self.server}): {self.keys} values x {self.file_bytes / 1024:.0f} KiB, "
                f"{self.threads} threads, median of {self.repeats}")

    def rows(self) -> list[Row]:
        return [("GET, raw", self.serial_gbps, self.parallel_gbps),
                ("kvtier get", self.kvtier_serial_gbps, self.kvtier_read_gbps),
                ("GET, redis-py parser", self.redis_py_serial_gbps, None)]


def run_redis_probe(path: str, *, total_bytes: int = 1 << 30, threads: int = 8, repeats: int = 3,
                    layout: KVLayout | None = None, chunk_tokens: int = 256, session_chunks: int = 8,
                    progress: Callable[[str, float], None] | None = None,
                    **settings: Any) -> RedisProbeResult:
    """Measure raw and kvtier read bandwidth against the server at ``path`` (a redis URL).

    ``settings``: extra StoreConfig fields (``redis_password``, ``redis_options``, ...).
    Raises OSError when the server is unreachable or refuses to keep the data.
    """
    layout = layout or DEFAULT_LAYOUT
    report = progress or (lambda stage, frac: None)
    chunk_bytes = chunk_tokens * layout.bytes_per_token
    n_sessions = max(1, max(session_chunks, total_bytes // chunk_bytes) // session_chunks)
    kwargs: dict[str, Any] = {
        "model_id": "kvtier-probe", "layout": layout, "chunk_tokens": chunk_tokens, "host_bytes": 0,
        "pool_url": path, "io_threads": threads, "write_queue_chunks": session_chunks + 1,
        "read_timeout_s": 60.0, "redis_prefix": f"kvtier-probe:{secrets.token_hex(4)}:",
        "redis_timeout_s": 10.0}
    kwargs.update(settings)
    rng = np.random.default_rng(0)
    sessions = [rng.integers(0, 32000, session_chunks * chunk_tokens).astype(np.uint32)
                for _ in range(n_sessions)]
    store = TieredStore.open(**kwargs)
    try:
        serial_store = TieredStore.open(**{**kwargs, "io_threads": 1})
    except BaseException:
        store.close()
        raise
    tier = store.tiers[0]
    assert isinstance(tier, RedisTier)
    keys: list[str] = []
    try:
        client = tier.client
        server = _server_name(client)
        shape = layout.shape(session_chunks * chunk_tokens)
        write_s = _fill(store, tier, sessions, layout, shape, report, keys)
        file_bytes = tier.metrics.snapshot().bytes_written // len(keys)
        total = file_bytes * len(keys)
        raw = _raw_reader(tier, keys, threads, file_bytes, total)

        def redis_py_get(key: str) -> int:
            value = client.get(key)
            return 0 if value is None else len(value)

        out = torch.empty(shape, dtype=layout.dtype)
        out.zero_()  # fault its pages in now: an engine reads into memory it already has

        def kvtier(reader: TieredStore) -> Callable[[], float]:
            return get_bandwidth(reader, sessions, out, total)

        modes = {"serial": raw(False), "parallel": raw(True), "kvtier": kvtier(store),
                 "kvtier_serial": kvtier(serial_store), "redis_py_serial": raw(False, redis_py_get)}
        samples: dict[str, list[float]] = {m: [] for m in modes}
        done = 0
        for r in range(repeats):
            order = list(modes.items())
            for name, fn in order[r % len(order):] + order[:r % len(order)]:
                samples[name].append(fn())
                done += 1
                report(f"read {name}", 1 / 3 + done / (repeats * len(modes)) * 2 / 3)
    finally:
        try:
            _delete(tier, keys)
        finally:
            store.close()
            serial_store.close()
    med = {name: statistics.median(v) for name, v in samples.items()}
    best = max(med["serial"], med["parallel"])
    return RedisProbeResult(
        path=tier.url.redacted(), server=server, keys=len(keys), file_bytes=file_bytes, total_bytes=total,
        threads=threads, repeats=repeats, write_gbps=total / write_s / 1e9, serial_gbps=med["serial"],
        parallel_gbps=med["parallel"], best_raw_gbps=best, kvtier_read_gbps=med["kvtier"],
        kvtier_serial_gbps=med["kvtier_serial"], kvtier_vs_best_raw=med["kvtier"] / best,
        redis_py_serial_gbps=med["redis_py_serial"],
        samples_gbps={k: [round(x, 4) for x in v] for k, v in samples.items()})


def _fill(store: TieredStore, tier: RedisTier, sessions: list[np.ndarray], layout: KVLayout,
          shape: tuple[int, ...], report: Callable[[str, float], None], keys: list[str]) -> float:
    """Write every session through kvtier, appending the keys to ``keys`` as it goes (the caller
    deletes them, even after a failure); seconds taken. OSError if some chunks were lost."""
    kv = torch.randint(0, 256, (math.prod(shape) * layout.element_bytes,), dtype=torch.uint8)
    kv = kv.view(layout.dtype).view(shape)
    t0 = time.perf_counter()
    for i, tokens in enumerate(sessions):
        keys += [tier.key(cid) for cid in store.chunk_ids(tokens)]
        kv.view(torch.uint8).view(-1)[:8] = i  # distinct payloads, cheap
        store.put(tokens, kv)
        store.flush()  # bounds memory: the queue would otherwise hold every chunk
        report("write", (i + 1) / len(sessions) / 3)
    write_s = time.perf_counter() - t0
    failed = tier.metrics.snapshot().failed_writes
    held = sum(store.lookup(tokens).num_chunks for tokens in sessions)
    if failed or held < len(keys):
        raise OSError(f"redis {tier.url.redacted()} kept {held} of {len(keys)} chunks ({failed} writes "
                      "failed: server down, maxmemory or OOM?); probe with a smaller --total")
    return write_s


def _raw_reader(tier: RedisTier, keys: list[str], threads: int, file_bytes: int,
                total: int) -> Callable[..., Callable[[], float]]:
    """``raw(parallel, fn=GET into a reused buffer)``: a timer of reading every key; GB/s."""
    buffers: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
    for _ in range(threads):
        buf = aligned_buffer(file_bytes)
        buf.fill(0)  # fault its pages in now, as for kvtier's own (reused) buffers
        buffers.put(buf)

    def get(key: str) -> int:
        """The transport alone: a GET received into a reused buffer, not validated."""
        buf = buffers.get()
        try:
            return max(0, tier.get_into(key, buf))
        finally:
            buffers.put(buf)

    def raw(parallel: bool, fn: Callable[[str], int] = get) -> Callable[[], float]:
        def run() -> float:
            t = time.perf_counter()
            if parallel:
                with cf.ThreadPoolExecutor(threads) as pool:
                    moved = sum(pool.map(fn, keys))
            else:
                moved = sum(fn(k) for k in keys)
            if moved != total:
                raise OSError(f"redis {tier.url.redacted()} lost chunks during the probe")
            return moved / (time.perf_counter() - t) / 1e9
        return run
    return raw


def _server_name(client: Any) -> str:
    try:
        info = client.info("server")
    except Exception:  # INFO may be renamed or disabled on managed servers
        return "unknown"
    if isinstance(info, dict) and "redis_version" not in info and info:
        info = next(iter(info.values()))  # cluster: one reply per node
    if not isinstance(info, dict):
        return "unknown"
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"{info.get('server_name', 'redis')} {info.get('redis_version', '?')}"


def _delete(tier: RedisTier, keys: list[str]) -> None:
    """Remove the probe's keys (a pipeline of single-key UNLINKs: works across cluster slots)."""
    try:
        for start in range(0, len(keys), 256):
            pipe = tier.client.pipeline(transaction=False)
            for key in keys[start:start + 256]:
                pipe.unlink(key)
            pipe.execute()
    except Exception as exc:  # do not hide the probe's own error
        log.warning("could not delete the probe's keys (prefix %s): %s", tier.prefix, exc)
