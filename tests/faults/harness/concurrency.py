"""Processes sharing one pool: writers, readers and evictors at once, beside a gc loop.

N forked workers each run a TieredStore over one pool directory (no host tier, so every read
goes to the pool) whose byte budget holds a few dozen chunks, so the cooperative LRU eviction
runs all the time; each worker mixes writes of its own prompts (and of a few prompts every
worker writes, so one key is published by several processes at once), reads of prompts other
workers published, and explicit evictions. Beside them a process runs ``kvtier.admin.gc``
with an even smaller budget in a loop.

Every chunk is a function of (prompt id, chunk index), so any process can recompute the
exact bytes of whatever it reads: a shorter prefix or a miss is fine (evicted), a wrong byte
is ``wrong``. At the end, with everyone stopped, every chunk left in the pool must verify and
be bit-equal to its expected bytes. Meanwhile the parent samples the pool's size on disk every
few milliseconds: a sample over the stated overshoot bound (``tiers/pool.py``:
``overshoot_bound``) counts as ``wrong`` too.

``lost`` stays 0 here: eviction legitimately removes published chunks, and no process can
tell a chunk an evictor removed from one that vanished otherwise. The crash scenario
(``crash.py``) is where "no published chunk is lost" is measured.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier import StoreConfig, TieredStore, admin
from kvtier.format import ChunkSpec
from kvtier.keys import ChunkKey, Namespace, chunk_ids
from kvtier.layout import DTYPE_CODES, KVLayout
from kvtier.tiers.pool import PoolTier, default_sync_bytes, overshoot_bound

from . import FaultRow, Scale, scenario
from .crash import fork_child

# 2 KiB of KV per token, 32 tokens: 64 KiB chunks (68 KiB files), cheap to make and check.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
CHUNK_TOKENS = 32
MODEL_ID = "fault-shared-pool"
NAMESPACE = Namespace(MODEL_ID, LAYOUT, CHUNK_TOKENS)
SPEC = ChunkSpec(NAMESPACE.digest, DTYPE_CODES[LAYOUT.dtype], LAYOUT.shape(CHUNK_TOKENS),
                 CHUNK_TOKENS * LAYOUT.bytes_per_token)
POOL_CHUNKS = 48  # the pool's budget, in chunks
GC_CHUNKS = 24  # the gc loop's budget: below the pool's, so gc evicts too
GC_TMP_AGE_S = 0.5  # gc removes temp files older than this: a slow live write may lose its file
MAX_PROMPT_CHUNKS = 4
SHARED_PROMPTS = 8  # prompts every worker writes: several processes publish one key at once
RECENT = 4  # readers pick among each writer's last RECENT prompts (older ones are likely evicted)
SHARED_OWNER = 1_000  # prompt ids: owner * 1_000_000 + n; the shared ones have this owner
HANG_S = 120.0  # a worker not done this long after its deadline is hung: killed, counted as a crash


# -- deterministic prompts -----------------------------------------------------------------------


def prompt_id(owner: int, n: int) -> int:
    return owner * 1_000_000 + n


def prompt_chunks(pid: int) -> int:
    return 1 + pid * 7919 % MAX_PROMPT_CHUNKS


def prompt_tokens(pid: int) -> np.ndarray:
    """Tokens of every chunk of prompt ``pid``; chunk i's come from the seed (pid, i)."""
    return np.concatenate([np.random.default_rng([pid, i]).integers(0, 50_000, CHUNK_TOKENS, dtype=np.uint32)
                           for i in range(prompt_chunks(pid))])


def chunk_bits(pid: int, index: int) -> np.ndarray:
    """KV bits of chunk ``index`` of prompt ``pid`` (uint16, the chunk's shape): random bf16
    with exponent bit 14 cleared, so no value is an inf or NaN (whose bits a conversion
    might canonicalise)."""
    bits = np.random.default_rng([pid, index, 1]).integers(0, 1 << 16, SPEC.payload_bytes // 2, dtype=np.uint16)
    bits &= 0xBFFF
    return bits.reshape(SPEC.shape)


def chunk_kv(pid: int, index: int) -> torch.Tensor:
    return torch.from_numpy(chunk_bits(pid, index)).view(LAYOUT.dtype)


def prompt_kv(pid: int) -> torch.Tensor:
    bits = np.concatenate([chunk_bits(pid, i) for i in range(prompt_chunks(pid))], axis=2)
    return torch.from_numpy(bits).view(LAYOUT.dtype)


def expected_by_key(prompts: Sequence[int]) -> dict[ChunkKey, tuple[int, int]]:
    """Chunk key -> (prompt id, chunk index) for every chunk of ``prompts``."""
    out: dict[ChunkKey, tuple[int, int]] = {}
    for pid in prompts:
        for i, cid in enumerate(chunk_ids(NAMESPACE, prompt_tokens(pid))):
            out[cid.key] = (pid, i)
    return out


def _same(data: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-equal, compared with numpy: the forked workers run no torch kernels of their own
    (an OpenMP pool does not survive a fork in every build)."""
    return np.array_equal(data.view(torch.uint8).numpy(), want.view(torch.uint8).numpy())


# -- workers -------------------------------------------------------------------------------------


@dataclass
class Counts:
    requests: int = 0
    served: int = 0
    identical: int = 0
    wrong: int = 0
    full_hits: int = 0
    partial_hits: int = 0
    misses: int = 0
    hit_chunks: int = 0
    prompts_written: int = 0
    shared_writes: int = 0
    explicit_evictions: int = 0
    request_errors: list[str] = field(default_factory=list)


def _report(fd: int, payload: dict[str, Any]) -> None:
    """One JSON line to the parent: small enough (errors are capped) to fit the pipe buffer,
    so the write never blocks even if the parent reads only after the child is gone."""
    os.write(fd, (json.dumps(payload) + "\n").encode())


def _worker(pool: Path, worker: int, peers: int, published: Any, deadline: float, seed: int, fd: int) -> None:
    """Write, read and evict until ``deadline``; report counts (or the exception) on ``fd``."""
    try:
        rng = random.Random(seed)
        counts = Counts()
        budget = POOL_CHUNKS * SPEC.file_bytes
        tier = PoolTier(pool, budget, create=True)
        config = StoreConfig(model_id=MODEL_ID, layout=LAYOUT, chunk_tokens=CHUNK_TOKENS, host_bytes=0,
                             io_threads=2, write_threads=1, write_queue_chunks=16, read_timeout_s=30.0)
        with TieredStore(config, tiers=[tier]) as store:
            while time.monotonic() < deadline:
                roll = rng.random()
                if roll < 0.40:
                    _write(store, worker, published, rng, counts)
                elif roll < 0.95:
                    _read(store, worker, peers, published, rng, counts)
                else:
                    tier.evict(int(budget * rng.uniform(0.25, 0.75)))
                    counts.explicit_evictions += 1
            snap = store.metrics_snapshot()
        _report(fd, {"worker": worker, "counts": counts.__dict__, "pool": snap["tiers"]["pool"]})
    except BaseException:
        _report(fd, {"worker": worker, "error": traceback.format_exc()[-4000:]})
        raise


def _write(store: TieredStore, worker: int, published: Any, rng: random.Random, counts: Counts) -> None:
    if rng.random() < 0.2:
        pid = prompt_id(SHARED_OWNER, rng.randrange(SHARED_PROMPTS))
        counts.shared_writes += 1
    else:
        pid = prompt_id(worker, published[worker])
    store.put(prompt_tokens(pid), prompt_kv(pid))
    store.flush()  # published (or failed, or dropped: a miss later) before readers look
    if pid // 1_000_000 == worker:
        published[worker] += 1
        counts.prompts_written += 1


def _read(store: TieredStore, worker: int, peers: int, published: Any, rng: random.Random, counts: Counts) -> None:
    others = [w for w in range(peers) if w != worker and published[w]]
    if rng.random() < 0.2 or not others:
        pid = prompt_id(SHARED_OWNER, rng.randrange(SHARED_PROMPTS))
    else:
        owner = rng.choice(others)
        n = published[owner]
        pid = prompt_id(owner, rng.randrange(max(0, n - RECENT), n))
    tokens = prompt_tokens(pid)
    n_chunks = prompt_chunks(pid)
    counts.requests += 1
    try:
        if rng.random() < 0.5:
            delivered = _read_get(store, tokens, n_chunks)
        else:
            delivered = _read_load_into(store, tokens)
    except Exception:
        if len(counts.request_errors) < 3:
            counts.request_errors.append(traceback.format_exc()[-1500:])
        return
    counts.served += 1
    good = all(_same(data, chunk_kv(pid, i)) for i, data in delivered.items())
    counts.identical += good
    counts.wrong += not good
    counts.hit_chunks += len(delivered)
    if len(delivered) == n_chunks:
        counts.full_hits += 1
    elif delivered:
        counts.partial_hits += 1
    else:
        counts.misses += 1


def _read_get(store: TieredStore, tokens: np.ndarray, n_chunks: int) -> dict[int, torch.Tensor]:
    """``get``: all chunks or KeyError (a miss)."""
    try:
        got = store.get(tokens)
    except KeyError:
        return {}
    c = CHUNK_TOKENS
    return {i: got[:, :, i * c:(i + 1) * c] for i in range(n_chunks)}


def _read_load_into(store: TieredStore, tokens: np.ndarray) -> dict[int, torch.Tensor]:
    """``load_into``: the delivered prefix (chunks handed over past it are ignored)."""
    copies: dict[int, torch.Tensor] = {}

    def sink(index: int, data: torch.Tensor) -> None:
        copies[index] = torch.from_numpy(data.view(torch.uint8).numpy().copy())  # valid only during the call

    loaded = store.load_into(store.chunk_ids(tokens), sink)
    return {i: copies[i] for i in range(loaded.num_chunks)}


def _gc_loop(pool: Path, deadline: float, fd: int) -> None:
    try:
        runs = evicted = removed = 0
        while time.monotonic() < deadline:
            report = admin.gc(pool, max_bytes=GC_CHUNKS * SPEC.file_bytes, tmp_age_s=GC_TMP_AGE_S)
            runs += 1
            evicted += report.evicted_chunks
            removed += report.removed_temp_files
            time.sleep(0.05)
        _report(fd, {"gc": {"runs": runs, "evicted": evicted, "removed_temp_files": removed}})
    except BaseException:
        _report(fd, {"gc": None, "error": traceback.format_exc()[-4000:]})
        raise


def _sample_sizes(pool: Path, deadline: float, sizes: list[int]) -> None:
    """The pool's chunk bytes on disk, every few milliseconds until ``deadline``."""
    while time.monotonic() < deadline:
        total = 0
        try:
            paths = list(pool.glob("??/??/*.kvt"))
        except FileNotFoundError:  # a directory emptied and removed by the gc while listed: again
            time.sleep(0.005)
            continue
        for path in paths:
            try:
                total += path.lstat().st_size
            except OSError:
                continue  # evicted since the listing
        sizes.append(total)
        time.sleep(0.005)


def _spawn(body: Callable[[int], None]) -> tuple[int, int]:
    """Fork a child running ``body(write_fd)``: (pid, the parent's read end)."""
    read_fd, write_fd = os.pipe()

    def child() -> None:
        os.close(read_fd)
        body(write_fd)

    pid = fork_child(child)
    os.close(write_fd)
    return pid, read_fd


def _collect(pid: int, read_fd: int, deadline: float) -> tuple[dict[str, Any] | None, int]:
    """A child's report (None if it sent none) and wait status. A child still running at
    ``deadline`` (hung: a deadlock would look like this) is SIGKILLed and sends none."""
    data = b""
    with os.fdopen(read_fd, "rb", buffering=0) as f:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([f], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                break
            chunk = f.read(1 << 16)
            if not chunk:
                break
            data += chunk
    _, status = os.waitpid(pid, 0)
    lines = data.decode(errors="replace").strip().splitlines()
    try:
        return (json.loads(lines[-1]) if lines else None), status
    except ValueError:
        return None, status


# -- the scenario --------------------------------------------------------------------------------


def share_pool(pool: Path, processes: int, seconds: float, seed: int = 0, *,
               worker_pools: Sequence[Path] | None = None, gc_pool: Path | None = None) -> FaultRow:
    """``processes`` workers and one gc loop on ``pool`` for ``seconds``; then check the pool.

    ``worker_pools`` / ``gc_pool``: the same pool as the workers (worker w uses entry w modulo
    their number) and the gc loop reach it, e.g. through two mounts of a shared filesystem;
    the final checks read ``pool``."""
    t0 = time.perf_counter()
    PoolTier(pool, None, create=True).close()  # the directory and its marker, before anyone races for them
    # Each writer's count of published prompts, in shared memory (one writer per slot).
    published = multiprocessing.get_context("fork").RawArray("q", processes)
    deadline = time.monotonic() + seconds
    where = list(worker_pools) if worker_pools else [pool]
    children = [_spawn(lambda fd, w=w: _worker(where[w % len(where)], w, processes, published, deadline,
                                               seed * 100 + w, fd))
                for w in range(processes)]
    gc_child = _spawn(lambda fd: _gc_loop(gc_pool or pool, deadline, fd))
    budget = POOL_CHUNKS * SPEC.file_bytes
    bound = overshoot_bound(budget, default_sync_bytes(budget), processes)
    sizes: list[int] = []
    sampler = threading.Thread(target=_sample_sizes, args=(pool, deadline, sizes), daemon=True)
    sampler.start()  # after the forks: a forked child never inherits this thread

    totals = Counts()
    pool_metrics: dict[str, float] = {}
    crashes = 0
    errors: list[str] = []
    give_up = deadline + HANG_S
    for pid, fd in children:
        report, status = _collect(pid, fd, give_up)
        if report is None or "error" in report or not os.WIFEXITED(status) or os.WEXITSTATUS(status):
            crashes += 1
            errors.append(str(report.get("error") if report else f"no report, wait status {status}"))
            continue
        for name, value in report["counts"].items():
            if name == "request_errors":
                totals.request_errors += value
            else:
                setattr(totals, name, getattr(totals, name) + value)
        for name, value in report["pool"].items():
            pool_metrics[name] = pool_metrics.get(name, 0) + value
    gc_report, gc_status = _collect(*gc_child, give_up)
    gc_stats = (gc_report or {}).get("gc")
    if gc_stats is None or not os.WIFEXITED(gc_status) or os.WEXITSTATUS(gc_status):
        crashes += 1
        errors.append(str((gc_report or {}).get("error", f"gc: no report, wait status {gc_status}")))
        gc_stats = {"runs": 0, "evicted": 0, "removed_temp_files": 0}

    sampler.join()
    over_bound = sum(size > bound for size in sizes)
    # Everyone has stopped: what is left must verify and be exactly what its prompt implies.
    verify = admin.verify(pool)
    prompts = [prompt_id(w, n) for w in range(processes) for n in range(published[w])]
    prompts += [prompt_id(SHARED_OWNER, n) for n in range(SHARED_PROMPTS)]
    known = expected_by_key(prompts)
    reader = PoolTier(pool, None, create=True)
    final_identical = final_wrong = final_unknown = 0
    for f in reader.files.scan():
        where = known.get(f.key)
        if where is None:
            final_unknown += 1
            continue
        pid, index = where
        cid = chunk_ids(NAMESPACE, prompt_tokens(pid))[index]
        got = reader.load(cid, SPEC)
        if got.ok and got.chunk is not None and _same(got.chunk.data, chunk_kv(pid, index)):
            final_identical += 1
        else:
            final_wrong += 1

    wrong = totals.wrong + final_wrong + final_unknown + len(verify.bad) + over_bound
    extra: dict[str, object] = {
        "processes": processes, "seconds_per_run": seconds, "pool_budget_chunks": POOL_CHUNKS,
        "gc_budget_chunks": GC_CHUNKS, "full_hits": totals.full_hits, "partial_hits": totals.partial_hits,
        "misses": totals.misses, "hit_chunks": totals.hit_chunks, "prompts_written": totals.prompts_written,
        "shared_writes": totals.shared_writes, "chunks_written": int(pool_metrics.get("written_chunks", 0)),
        "evictions": int(pool_metrics.get("evictions", 0)), "explicit_evict_calls": totals.explicit_evictions,
        "failed_writes": int(pool_metrics.get("failed_writes", 0)),
        "dropped_writes": int(pool_metrics.get("dropped_writes", 0)),
        "read_races": int(pool_metrics.get("read_races", 0)),
        "corrupt_chunks": int(pool_metrics.get("corrupt_chunks", 0)),
        "failed_reads": int(pool_metrics.get("failed_reads", 0)), "timeouts": int(pool_metrics.get("timeouts", 0)),
        "gc_runs": gc_stats["runs"], "gc_evicted": gc_stats["evicted"],
        "gc_removed_temp_files": gc_stats["removed_temp_files"],
        "final_chunks": verify.checked, "final_verify_bad": verify.bad, "final_identical": final_identical,
        "final_wrong": final_wrong, "final_unknown": final_unknown,
        "request_errors": totals.request_errors[:3], "crash_errors": [e[-1500:] for e in errors[:3]],
        "size_samples": len(sizes), "max_pool_bytes": max(sizes, default=0), "pool_bound_bytes": bound,
        "samples_over_bound": over_bound,
    }
    notes = (f"{processes} processes + gc; hits {totals.full_hits} full / {totals.partial_hits} partial, "
             f"misses {totals.misses}; written {extra['chunks_written']} chunks, evictions {extra['evictions']} "
             f"+ gc {gc_stats['evicted']} in {gc_stats['runs']} runs; read_races {extra['read_races']}, "
             f"corrupt_chunks {extra['corrupt_chunks']}; end: {verify.checked} chunks verify and read back "
             f"identical {final_identical}; pool at most {max(sizes, default=0)} B of a {bound} B bound "
             f"({over_bound} of {len(sizes)} samples over); lost not measurable (eviction removes chunks)")
    # The fault: chunks removed (worker evictions and gc) under the feet of readers and writers.
    injected = int(pool_metrics.get("evictions", 0)) + int(gc_stats["evicted"])
    return FaultRow(fault=f"{processes} processes share one pool", injected=injected,
                    requests=totals.requests, served=totals.served, identical=totals.identical, wrong=wrong,
                    lost=0, crashes=crashes, seconds=time.perf_counter() - t0, notes=notes, extra=extra)


@scenario("processes share one pool")
def processes_share_pool(scale: Scale, path: Path) -> list[FaultRow]:
    """One row per process count (2, 4), ``scale.stress_seconds`` each, each in a fresh pool."""
    return [share_pool(path / f"pool-{n}", n, scale.stress_seconds, seed=n) for n in (2, 4)]
