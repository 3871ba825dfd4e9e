"""Hostile pool metadata and hostile clients: each costs at most a miss, never a stuck thread.

**Metadata** (a neighbour on a group-shared pool): for each kind, a planted ``.usage``,
``.evicted`` or ``.lock`` (a FIFO, a symlink to ``/dev/zero`` or to a file outside the pool,
nonsense numbers). A store whose pool is small enough to sync and evict all the time then
writes ``scale.corrupt_files`` prompts and reads each back. Every call runs on a watchdog
thread: one that does not return within ``WATCHDOG_S`` is a stuck thread (a FIFO opened for
reading blocks forever, a read of ``/dev/zero`` never ends). Reads must be bit-equal prefixes
(evictions may shorten them); the budget must hold.

**Clients** (any API client of a server): retention times a client can send (``1e20``,
infinities, NaN, negative, the wrong type), each refused with ValueError at the store's API
while writes go on; a tier whose retain raises what ``os.utime`` raised for ``1e20``; a flood of
distinct ``cache_salt`` values (the spec cache and the namespace files stay bounded).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _pool import new_pool
from kvtier import StoreConfig, TieredStore
from kvtier.store import MAX_DESCRIBED, MAX_SPECS
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostCache

from . import FaultRow, Scale, scenario
from .hostile import CHUNK_TOKENS, LAYOUT, MODEL_ID, SPEC, make_prompts, read_prefix

WATCHDOG_S = 10.0


class Stuck(Exception):
    """A call did not return within WATCHDOG_S."""


def watched(fn: Callable[[], Any], seconds: float = WATCHDOG_S) -> Any:
    """``fn()``'s result; Stuck if it has not returned after ``seconds`` (it is left running)."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the caller
            err.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise Stuck(f"{fn} still running after {seconds} s")
    if err:
        raise err[0]
    return out[0] if out else None


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _config(pool: Path, budget: int) -> StoreConfig:
    return StoreConfig(model_id=MODEL_ID, layout=LAYOUT, chunk_tokens=CHUNK_TOKENS, host_bytes=0,
                       pool_url=new_pool(pool), pool_bytes=budget, io_threads=2, read_timeout_s=5.0)


def _fifo(path: Path, outside: Path) -> None:
    os.mkfifo(path, 0o600)


def _dev_zero(path: Path, outside: Path) -> None:
    path.symlink_to("/dev/zero")


def _outside(path: Path, outside: Path) -> None:
    target = outside / f"{path.name}-target"
    target.write_text("a file outside the pool\n")
    path.symlink_to(target)


def _nonsense(path: Path, outside: Path) -> None:
    path.write_text(json.dumps({"bytes": -(10 ** 18), "scanned_at": time.time() + 1e9}))


def _huge(path: Path, outside: Path) -> None:
    with open(path, "wb") as fh:
        fh.truncate(64 << 30)  # sparse: 64 GiB that a reader must not try to hold


METADATA: list[tuple[str, str, Callable[[Path, Path], None]]] = [
    ("FIFO as .usage", ".usage", _fifo),
    (".usage -> /dev/zero", ".usage", _dev_zero),
    ("nonsense in .usage", ".usage", _nonsense),
    ("FIFO as .evicted", ".evicted", _fifo),
    (".evicted -> /dev/zero", ".evicted", _dev_zero),
    ("64 GiB sparse .evicted", ".evicted", _huge),
    ("FIFO as .lock", ".lock", _fifo),
    (".lock -> a file outside", ".lock", _outside),
]


@scenario("hostile metadata")
def hostile_metadata(scale: Scale, work: Path) -> list[FaultRow]:
    return [run_metadata(name, target, plant, scale.corrupt_files, work / f"meta{k}", seed=100 + k)
            for k, (name, target, plant) in enumerate(METADATA)]


def run_metadata(name: str, target: str, plant: Callable[[Path, Path], None], n: int, work: Path,
                 seed: int) -> FaultRow:
    t0 = time.perf_counter()
    pool, outside = work / "pool", work / "outside"
    outside.mkdir(parents=True)
    TieredStore(_config(pool, 1 << 30)).close()  # the pool exists, with its own files
    path = pool / target
    if path.exists() or path.is_symlink():
        path.unlink()
    plant(path, outside)
    budget = 6 * SPEC.file_bytes  # far less than the prompts: every few writes sync and evict
    prompts = make_prompts(n, seed)
    row = FaultRow(name, injected=1)
    store: TieredStore | None = None
    try:
        store = watched(lambda: TieredStore(_config(pool, budget)))
        for prompt in prompts:
            watched(lambda p=prompt: store.put(p.tokens, p.kv))
        watched(store.flush)
        for prompt in prompts:
            row.requests += 1
            got = watched(lambda p=prompt: read_prefix(store, p))
            row.served += 1
            if all(_bits_equal(kv, prompt.chunk_kv(c)) for c, kv in enumerate(got)):
                row.identical += 1
            else:
                row.wrong += 1
        watched(store.tiers[0].sync)  # type: ignore[attr-defined]
        watched(store.tiers[0].read_evictions)
        on_disk = sum(p.stat().st_size for p in pool.glob("??/??/*.kvt"))
        lock_failures = int(store.tiers[0].metrics.snapshot().lock_failures)
    except Stuck as exc:
        row.stuck += 1
        row.notes = str(exc)
        row.seconds = time.perf_counter() - t0
        return row
    finally:
        if store is not None:
            try:
                watched(store.close)
            except Stuck:
                row.stuck += 1
    # The budget is kept (within the sync overshoot: one sync's worth of bytes).
    over = on_disk > budget + store.tiers[0].sync_bytes  # type: ignore[attr-defined]
    row.wrong += int(over)
    row.seconds = time.perf_counter() - t0
    row.extra = {"pool_bytes": on_disk, "budget": budget, "lock_failures": lock_failures}
    row.notes = (f"pool {on_disk} B of a {budget} B budget; lock failures counted {lock_failures}; "
                 f"every call returned within {WATCHDOG_S:.0f} s")
    return row


class _RaisingRetain(DiskTier):
    def retain(self, key: Any, until: float) -> bool:
        raise OverflowError("timestamp out of range for platform time_t")


@scenario("hostile clients")
def hostile_clients(scale: Scale, work: Path) -> list[FaultRow]:
    return [_bad_retention(scale, work / "retain"), _raising_retain(scale, work / "hook"),
            _salt_flood(scale, work / "salts")]


def _bad_retention(scale: Scale, work: Path) -> FaultRow:
    t0 = time.perf_counter()
    values: list[Any] = [1e20, float("inf"), float("-inf"), float("nan"), -1.0, "forever", None, [1], True]
    prompts = make_prompts(scale.corrupt_files, seed=7)
    row = FaultRow("retain until 1e20, inf, NaN, -1, a string...", injected=0)
    config = StoreConfig(model_id=MODEL_ID, layout=LAYOUT, chunk_tokens=CHUNK_TOKENS, host_bytes=1 << 20,
                         disk_path=str(work / "disk"), pool_url=new_pool(work / 'pool'), io_threads=2)
    with TieredStore(config) as store:
        for i, prompt in enumerate(prompts):
            row.injected += 1
            try:
                store.retain(prompt.ids, values[i % len(values)])
            except ValueError:
                pass
            else:
                row.wrong += 1  # accepted: it would reach os.utime
            store.retain(prompt.ids, time.time() + 60)  # and a sound retention of the same chunks
            store.put(prompt.tokens, prompt.kv)
        try:
            watched(store.flush)
        except Stuck:
            row.stuck += 1
        _read_back(row, store, prompts, evict_host=True)
    row.seconds = time.perf_counter() - t0
    row.notes = "each refused with ValueError at the API; the chunks were written and retained all the same"
    return row


def _raising_retain(scale: Scale, work: Path) -> FaultRow:
    t0 = time.perf_counter()
    prompts = make_prompts(scale.corrupt_files, seed=8)
    row = FaultRow("a tier's retain raises (os.utime overflow)", injected=0)
    disk = _RaisingRetain(work / "disk", 1 << 30)
    config = StoreConfig(model_id=MODEL_ID, layout=LAYOUT, chunk_tokens=CHUNK_TOKENS, host_bytes=1 << 20,
                         io_threads=2)
    store = TieredStore(config, tiers=[disk], host=HostCache(1 << 20, LAYOUT, CHUNK_TOKENS))
    try:
        for prompt in prompts:
            store.retain(prompt.ids, time.time() + 3600)
            store.put(prompt.tokens, prompt.kv)
            row.injected += len(prompt.ids)  # each chunk that lands calls the raising retain
        try:
            watched(store.flush)
        except Stuck:
            row.stuck += 1
        _read_back(row, store, prompts, evict_host=True)
        errors = int(store.store_metrics.snapshot().thread_errors)
    finally:
        store.close()
    row.seconds = time.perf_counter() - t0
    row.notes = f"{errors} exceptions recorded (thread_errors); the writer thread went on"
    return row


def _salt_flood(scale: Scale, work: Path) -> FaultRow:
    t0 = time.perf_counter()
    n = max(MAX_SPECS, MAX_DESCRIBED) + 50 * scale.corrupt_files
    prompts = make_prompts(1, seed=9)
    rng = random.Random(9)
    row = FaultRow(f"{n} distinct cache_salts", injected=n)
    config = StoreConfig(model_id=MODEL_ID, layout=LAYOUT, chunk_tokens=CHUNK_TOKENS, host_bytes=1 << 20,
                         pool_url=new_pool(work / 'pool'), io_threads=2)
    first = prompts[0].tokens[:CHUNK_TOKENS], prompts[0].chunk_kv(0)
    with TieredStore(config) as store:
        for i in range(n):
            # What a request under a new salt costs: a lookup (a miss) and the save of what it
            # computed. The save is what makes a spec and a namespace file (a lookup makes none).
            salt = f"salt-{rng.getrandbits(64)}-{i}"
            store.lookup(first[0], tenant_salt=salt)
            store.put(first[0], first[1], tenant_salt=salt)
        salted = [f"kept-{i}" for i in range(scale.corrupt_files)]
        for salt in salted:
            store.put(prompts[0].tokens, prompts[0].kv, tenant_salt=salt)
        store.flush()
        store.host.evict(0)  # type: ignore[union-attr]
        for salt in salted:
            row.requests += 1
            got = [c.data.clone() for c in store.iter_chunks(store.chunk_ids(prompts[0].tokens, tenant_salt=salt),
                                                             tenant_salt=salt)]
            row.served += 1
            ok = len(got) == len(prompts[0].ids) and all(
                _bits_equal(kv, prompts[0].chunk_kv(c)) for c, kv in enumerate(got))
            row.identical += ok
            row.wrong += not ok
        specs = len(store._specs)
    files = len(list((work / "pool" / "namespaces").glob("*.json")))
    row.wrong += int(specs > MAX_SPECS or files > MAX_DESCRIBED)
    row.seconds = time.perf_counter() - t0
    row.extra = {"spec_cache": specs, "namespace_files": files}
    row.notes = f"spec cache {specs} (bound {MAX_SPECS}), namespace files {files} (bound {MAX_DESCRIBED})"
    return row


def _read_back(row: FaultRow, store: TieredStore, prompts: list[Any], evict_host: bool) -> None:
    if evict_host and store.host is not None:
        store.host.evict(0)
    for prompt in prompts:
        row.requests += 1
        try:
            got = watched(lambda p=prompt: read_prefix(store, p))
        except Stuck:
            row.stuck += 1
            continue
        row.served += 1
        ok = len(got) == len(prompt.ids) and all(_bits_equal(kv, prompt.chunk_kv(c)) for c, kv in enumerate(got))
        row.identical += ok
        row.wrong += not ok
