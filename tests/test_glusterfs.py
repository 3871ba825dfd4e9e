"""What the shared pool relies on, asserted on a real GlusterFS volume mounted twice.

Mount A and mount B are two FUSE clients of one volume, each with caches of its own, standing
for two machines (``tests/gluster.py``, ``scripts/glusterfs.sh``). Every test writes through
one mount and reads, locks, evicts or verifies through the other. docs/filesystems.md says
what kvtier needs from a filesystem and what was measured here.

Where GlusterFS differs from a local disk it is asserted here: a file another client removed
or replaced opens as ESTALE for about a second (a miss to kvtier, like ENOENT), and two clients
creating one new shard directory at once can see ESTALE from mkdir or ENOENT from the create
after EEXIST (a publish retries).
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from _pool import new_pool
from conftest import Tiny
from kvtier import KVLayout, TieredStore, admin
from kvtier.fileio import TMP_SUFFIX
from kvtier.tiers.base import Status
from kvtier.tiers.files import ChunkFiles
from kvtier.tiers.pagecache import cached_bytes
from kvtier.tiers.pool import PoolTier

pytestmark = pytest.mark.gluster

VISIBLE_S = 5.0  # a rename shows on the other client in milliseconds; this bounds it
ATTR_VISIBLE_S = 2.5  # mtimes and unlinks: about 1 s (the FUSE attribute and entry caches)
# 128 KiB chunks where the client's caches would hide the point: GlusterFS's quick-read serves
# files up to 64 KiB from what it fetched at lookup, so tiny chunks never reach the bricks.
BIG = Tiny(layout=KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, dtype=torch.bfloat16))


def wait_until(what: str, pred: Callable[[], bool], limit_s: float) -> float:
    """Seconds until ``pred()`` held; AssertionError after ``limit_s``."""
    t0 = time.perf_counter()
    while not pred():
        if time.perf_counter() - t0 > limit_s:
            raise AssertionError(f"{what}: not within {limit_s} s")
        time.sleep(0.002)
    return time.perf_counter() - t0


def on_a(b_path: str | Path, a_dir: Path, b_dir: Path) -> Path:
    """The path on mount A of a file given by its path on mount B."""
    return a_dir / Path(b_path).relative_to(b_dir)


def temp_files(root: Path) -> list[Path]:
    return list(root.rglob(f"*{TMP_SUFFIX}"))


# -- publish and read --------------------------------------------------------------------------


@pytest.mark.parametrize("tiny", [Tiny(), BIG], ids=["8KiB", "132KiB"])
def test_a_chunk_published_on_a_is_read_bit_exact_and_validated_on_b(gluster_pool, tiny, bits_equal):
    a_dir, b_dir = gluster_pool
    writer, reader = ChunkFiles(a_dir), ChunkFiles(b_dir)
    chunks = tiny.chunks(8, seed=1)  # eight names: both bricks get some (the volume distributes by name)
    assert reader.leading_present([c.id for c in chunks]) == 0  # B looked first: a negative lookup
    delays = []
    for chunk in chunks:
        assert writer.publish(chunk, tiny.spec()) == tiny.file_bytes
        delays.append(wait_until("published on A, seen on B",
                                 lambda c=chunk: reader.stat_size(c.id.key) == tiny.file_bytes, VISIBLE_S))
    for chunk in chunks:
        got = reader.read(chunk.id, tiny.spec())  # validates header, key and payload checksum
        bits_equal(got.data, chunk.data)
        assert reader.path_for(chunk.id.key).read_bytes() == tiny.image(chunk)
    assert reader.leading_present([c.id for c in chunks]) == len(chunks)
    assert temp_files(a_dir) == [] and temp_files(b_dir) == []
    assert writer.publish(chunks[0], tiny.spec()) == 0 and ChunkFiles(b_dir).publish(chunks[1], tiny.spec()) == 0
    print(f"rename visible on B after {max(delays) * 1e3:.1f} ms at most")


def test_both_clients_publishing_the_same_chunks_at_once_leave_one_sound_copy(gluster_pool, tiny, bits_equal):
    """Two writers of one key (two machines that computed the same prefix) race for the shard
    directories, temp files and renames; names are content addresses, so whichever rename lands
    last, the bytes are the same. A publish that fails must fail cleanly (an OSError, counted by
    the tier as a failed write), never leave a temp file or a wrong chunk."""
    a_dir, b_dir = gluster_pool
    chunks = tiny.chunks(24, seed=2)  # 24 fresh shards: both clients create each one at once
    failures: list[OSError] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def publish_all(root: Path) -> None:
        try:
            files = ChunkFiles(root)
            start.wait()
            for chunk in chunks:
                try:
                    files.publish(chunk, tiny.spec())
                except OSError as exc:
                    failures.append(exc)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=publish_all, args=(d,)) for d in (a_dir, b_dir)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    present = {f.key for f in ChunkFiles(a_dir).scan()}
    for root in (a_dir, b_dir):
        files = ChunkFiles(root)
        wait_until("the same chunks listed on both", lambda f=files: {x.key for x in f.scan()} == present, VISIBLE_S)
        for chunk in chunks:
            if chunk.id.key in present:
                bits_equal(files.read(chunk.id, tiny.spec()).data, chunk.data)
    assert temp_files(a_dir) == [] and temp_files(b_dir) == []
    assert failures == [] and len(present) == len(chunks)


def test_publishing_on_b_while_a_prunes_the_same_shard_directories_never_fails(gluster_pool, tiny, bits_equal):
    """Eviction removes the shard directories it empties (``ChunkFiles.prune_shard``). A writer
    on another client that made (or found) the directory a moment before must not fail: its
    create meets ENOENT or ESTALE and it makes the directory again; a directory holding its
    chunk or temp file is never removed."""
    a_dir, b_dir = gluster_pool
    a, b = ChunkFiles(a_dir), ChunkFiles(b_dir)
    chunks = tiny.chunks(40, seed=9)
    shards = sorted({str(a.path_for(c.id.key).parent.relative_to(a_dir)) for c in chunks})
    done = threading.Event()
    pruned: list[int] = []

    def prune_all() -> None:
        n = 0
        while not done.is_set():
            n += sum(a.prune_shard(shard) for shard in shards)
        pruned.append(n)

    pruner = threading.Thread(target=prune_all)
    pruner.start()
    failures: list[OSError] = []
    try:
        for chunk in chunks:
            for _ in range(3):  # written, pruned after its eviction on A, written again
                try:
                    b.publish(chunk, tiny.spec())
                except OSError as exc:
                    failures.append(exc)
                b.remove(chunk.id.key)
            b.publish(chunk, tiny.spec())
    finally:
        done.set()
        pruner.join(60)
    assert failures == [] and pruned and pruned[0] > 0
    for chunk in chunks:
        wait_until("the chunk shows on A", lambda c=chunk: a.stat_size(c.id.key) is not None, VISIBLE_S)
        bits_equal(a.read(chunk.id, tiny.spec()).data, chunk.data)
    assert temp_files(a_dir) == []


def test_o_excl_creates_are_exclusive_across_the_two_clients(gluster_pool):
    """Temp names are unique (pid + random), and O_EXCL is the backstop if two ever met."""
    a_dir, b_dir = gluster_pool
    names = [f"x{i}{TMP_SUFFIX}" for i in range(40)]
    wins: dict[str, list[str]] = {n: [] for n in names}
    refusals: list[int] = []
    start = threading.Barrier(2)

    def create_all(root: Path, who: str) -> None:
        start.wait()
        for name in names:
            try:
                os.close(os.open(root / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                wins[name].append(who)
            except FileExistsError:
                pass
            except OSError as exc:  # a lost race on FUSE can come back as ENODATA, not EEXIST
                refusals.append(exc.errno)

    threads = [threading.Thread(target=create_all, args=(d, w)) for d, w in ((a_dir, "a"), (b_dir, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(len(w) == 1 for w in wins.values()), {n: w for n, w in wins.items() if len(w) != 1}
    assert set(refusals) <= {errno.ENODATA, errno.EEXIST}, refusals


def test_o_direct_reads_work_on_the_mount_or_fall_back_to_buffered_reads(gluster_pool, bits_equal):
    tiny = BIG
    a_dir, b_dir = gluster_pool
    chunks = tiny.chunks(3, seed=3)
    writer = ChunkFiles(a_dir)
    for chunk in chunks:
        writer.publish(chunk, tiny.spec())
    reader = ChunkFiles(b_dir, direct_io=True)
    for chunk in chunks:
        path = reader.path_for(chunk.id.key)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold on B: the O_DIRECT branch
            cached_bytes(fd)  # cachestat on a FUSE file: an answer or None, never an error
        finally:
            os.close(fd)
        bits_equal(reader.read(chunk.id, tiny.spec()).data, chunk.data)
    # What the mount does with O_DIRECT itself (reported, both outcomes are handled by kvtier).
    try:
        fd = os.open(reader.path_for(chunks[0].id.key), os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        assert exc.errno == errno.EINVAL, exc
        assert reader.direct_io is False  # it fell back, once, and stopped asking
        print("O_DIRECT refused at open: buffered reads")
        return
    try:
        import mmap

        buf = mmap.mmap(-1, tiny.file_bytes)  # page-aligned
        n = os.preadv(fd, [buf], 0)
        assert n == tiny.file_bytes and bytes(buf) == reader.path_for(chunks[0].id.key).read_bytes()
        print(f"O_DIRECT works on the mount; ChunkFiles.direct_io={reader.direct_io}")
    finally:
        os.close(fd)


# -- locks -------------------------------------------------------------------------------------

_LOCKER = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("got at once", flush=True)
except BlockingIOError:
    print("blocked", flush=True)
    t0 = time.monotonic()
    fcntl.flock(fd, fcntl.LOCK_EX)
    print(f"got after {time.monotonic() - t0:.3f}", flush=True)
sys.stdin.readline()  # hold it until told
"""


def test_flock_on_the_pool_lock_is_exclusive_across_the_two_clients(gluster_pool):
    a_dir, b_dir = gluster_pool
    pool_a, pool_b = PoolTier(a_dir, 1 << 30, create=True), PoolTier(b_dir, 1 << 30, create=True)
    assert pool_a.lock_works and pool_b.lock_works
    fd = os.open(a_dir / ".lock", os.O_RDWR)
    child = None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held on A
        child = subprocess.Popen([sys.executable, "-c", _LOCKER, str(b_dir / ".lock")], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "blocked"  # B cannot take it
        time.sleep(0.5)
        fcntl.flock(fd, fcntl.LOCK_UN)
        got = child.stdout.readline().split()
        assert got[:2] == ["got", "after"] and float(got[2]) >= 0.4, got  # B waited for A's release
        with pytest.raises(BlockingIOError):  # and now B holds it against A
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(30) == 0

        def lockable() -> bool:  # released when B's process ended (the release travels to A)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False

        wait_until("B's lock released once its process ended", lockable, 5.0)
    finally:
        os.close(fd)
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
    assert pool_a.metrics.snapshot().lock_failures == 0 and pool_b.metrics.snapshot().lock_failures == 0


# -- removal under a reader's feet ---------------------------------------------------------------


def test_a_chunk_unlinked_on_a_after_b_opened_it_is_read_whole_on_b(gluster_pool, bits_equal, monkeypatch):
    """POSIX: unlinking a file does not break a reader that opened it. Needs performance.open-behind
    off (scripts/glusterfs.sh): with it on, B's open is deferred to its first read, which then finds
    the file gone (ENOENT: a miss, though the chunk was readable when B opened it)."""
    tiny = BIG
    a_dir, b_dir = gluster_pool
    writer, reader = ChunkFiles(a_dir), ChunkFiles(b_dir)
    chunks = tiny.chunks(4, seed=4)
    for chunk in chunks:
        writer.publish(chunk, tiny.spec())
    real_open = reader._open_read

    def open_then_unlink_on_a(path: str) -> int:
        fd = real_open(path)
        os.unlink(on_a(path, a_dir, b_dir))  # another machine evicts it right after B opened it
        return fd

    monkeypatch.setattr(reader, "_open_read", open_then_unlink_on_a)
    metrics = PoolTier(b_dir, None, create=True).metrics
    for chunk in chunks:
        got = reader.load(chunk.id, tiny.spec(), None, metrics, 60.0)
        assert got.status is Status.HIT, got
        bits_equal(got.chunk.data, chunk.data)
        assert not writer.path_for(chunk.id.key).exists()
    snap = metrics.snapshot()
    assert (snap.read_races, snap.failed_reads, snap.corrupt_chunks) == (0, 0, 0)


def test_a_chunk_unlinked_on_a_while_b_loads_it_is_read_whole_or_a_counted_miss(gluster_pool, bits_equal):
    """The race at random points: B's load returns the right bytes or a miss, never wrong bytes,
    never an exception, never an I/O error (ESTALE is a miss), never CORRUPT (which would delete
    a good chunk for every instance)."""
    tiny = BIG
    a_dir, b_dir = gluster_pool
    writer, reader = ChunkFiles(a_dir), ChunkFiles(b_dir)
    metrics = PoolTier(b_dir, None, create=True).metrics
    rng = random.Random(5)
    chunks = tiny.chunks(30, seed=5)
    outcomes: dict[str, int] = {}
    for chunk in chunks:
        writer.publish(chunk, tiny.spec())
        wait_until("published", lambda c=chunk: reader.stat_size(c.id.key) is not None, VISIBLE_S)  # B looked it up
        delay = rng.uniform(0, 0.004)
        remover = threading.Timer(delay, os.unlink, args=(writer.path_for(chunk.id.key),))
        remover.start()
        got = reader.load(chunk.id, tiny.spec(), None, metrics, 60.0)
        remover.join()
        outcomes[got.status.value] = outcomes.get(got.status.value, 0) + 1
        if got.status is Status.HIT:
            bits_equal(got.chunk.data, chunk.data)
        else:
            assert got.status is Status.MISS, got
    snap = metrics.snapshot()
    assert snap.corrupt_chunks == 0 and snap.failed_reads == 0
    assert snap.read_races == outcomes.get("miss", 0)
    print(f"outcomes {outcomes}")


def test_estale_between_lookup_on_b_and_read_is_a_counted_miss(gluster_pool, tiny):
    """B looks a chunk up (its caches now hold the file), A evicts it, B loads it within the
    caches' second: GlusterFS answers the open with ESTALE, not ENOENT. That is the same race as
    a file gone before open (a miss, ``read_races``), not an I/O error."""
    a_dir, b_dir = gluster_pool
    writer, reader = PoolTier(a_dir, None, create=True), PoolTier(b_dir, None, create=True)
    chunks = tiny.chunks(5, seed=6)
    for chunk in chunks:
        writer.store(chunk, tiny.spec())
    results = []
    for chunk in chunks:
        assert reader.lookup([chunk.id]) == 1
        os.unlink(writer.files.path_for(chunk.id.key))  # another instance evicts it
        results.append(reader.load(chunk.id, tiny.spec()))
    snap = reader.metrics.snapshot()
    assert [r.status for r in results] == [Status.MISS] * len(chunks), results
    assert (snap.read_races, snap.failed_reads, snap.corrupt_chunks) == (len(chunks), 0, 0)


# -- the LRU clock and retention (mtime) -------------------------------------------------------


def test_mtimes_set_on_one_client_order_the_evictions_of_the_other(gluster_pool, tiny):
    """Retention and the LRU clock are mtimes: set on one client (``os.utime``: a retain, or the
    touch of a hit), they must order the evictions another client makes, after the attribute
    caches' second or so."""
    a_dir, b_dir = gluster_pool
    pool_a, pool_b = PoolTier(a_dir, None, create=True), PoolTier(b_dir, None, create=True)
    old, mid, other, kept = tiny.chunks(4, seed=7)
    for chunk in (old, mid, other, kept):
        pool_a.store(chunk, tiny.spec())
    assert pool_b.lookup([old.id, mid.id, other.id, kept.id]) == 4  # B's caches hold the files now
    now = time.time()
    want = {old.id.key: now - 600, mid.id.key: now - 300, other.id.key: now - 200, kept.id.key: now + 3600}
    for chunk in (old, mid, other):
        os.utime(pool_a.files.path_for(chunk.id.key), (want[chunk.id.key],) * 2)
    assert pool_a.retain(kept.id.key, want[kept.id.key])

    def b_sees_them() -> bool:
        return {f.key: f.mtime for f in pool_b.files.scan()} == pytest.approx(want, abs=1e-3)

    seen = wait_until("mtimes set on A, seen by B's scan", b_sees_them, ATTR_VISIBLE_S)
    assert pool_b.evict(3 * tiny.file_bytes) == 1
    assert {f.key for f in pool_b.files.scan()} == {mid.id.key, other.id.key, kept.id.key}  # the oldest went

    # A hit on B refreshes `mid` (300 s old: over the touch interval); A must then evict `other`
    # first. Had A missed the touch, `mid` would go.
    assert pool_b.load(mid.id, tiny.spec()).status is Status.HIT
    touched = wait_until("B's touch seen on A",
                         lambda: os.stat(pool_a.files.path_for(mid.id.key)).st_mtime > now - 60, ATTR_VISIBLE_S)
    assert pool_a.evict(2 * tiny.file_bytes) == 1
    assert {f.key for f in pool_a.files.scan()} == {mid.id.key, kept.id.key}
    assert pool_a.evict(tiny.file_bytes) == 1  # and the retained chunk is the last one left
    assert {f.key for f in pool_a.files.scan()} == {kept.id.key}
    print(f"utime on A seen by B after {seen:.3f} s, touch on B seen by A after {touched:.3f} s")


# -- the pool tier and the store across the two mounts ---------------------------------------------


def test_pool_tier_store_lookup_load_and_eviction_log_across_the_mounts(gluster_pool, tiny, bits_equal):
    a_dir, b_dir = gluster_pool
    pool_a, pool_b = PoolTier(a_dir, 1 << 30, create=True), PoolTier(b_dir, 1 << 30, create=True)
    assert pool_a.read_evictions() == []  # A reads the shared eviction log from its end
    chunks = tiny.chunks(6, seed=8)
    for chunk in chunks:
        assert pool_a.store(chunk, tiny.spec()).status is Status.WRITTEN
    ids = [c.id for c in chunks]
    wait_until("B looks up all six", lambda: pool_b.lookup(ids) == len(chunks), VISIBLE_S)
    for chunk in chunks:
        got = pool_b.load(chunk.id, tiny.spec())
        assert got.status is Status.HIT, got
        assert not got.from_cache  # a network filesystem: slow reads still call up more threads
        bits_equal(got.chunk.data, chunk.data)
    assert pool_b.store(chunks[0], tiny.spec()).status is Status.EXISTS
    assert pool_b.evict(0) == len(chunks)  # B's eviction...
    gone = wait_until("B's eviction seen by A's lookup", lambda: pool_a.lookup(ids) == 0, ATTR_VISIBLE_S)
    evicted: list[bytes] = []
    wait_until("B's eviction log read on A",
               lambda: evicted.extend(pool_a.read_evictions()) or len(evicted) == len(chunks), ATTR_VISIBLE_S)
    assert sorted(evicted) == sorted(c.id.key for c in chunks)
    snap = pool_b.metrics.snapshot()
    assert (snap.read_races, snap.failed_reads, snap.corrupt_chunks, snap.lock_failures) == (0, 0, 0, 0)
    print(f"eviction visible on A after {gone:.3f} s")


def test_a_store_on_a_puts_and_closes_and_a_store_on_b_gets_the_same_bytes(gluster_pool, tiny, bits_equal):
    a_dir, b_dir = gluster_pool
    tokens, kv = tiny.tokens(4 * tiny.chunk_tokens + 5, seed=9), tiny.kv(4 * tiny.chunk_tokens + 5, seed=9)
    common = {"model_id": tiny.model_id, "layout": tiny.layout, "chunk_tokens": tiny.chunk_tokens,
              "host_bytes": 0, "pool_bytes": 1 << 30}
    with TieredStore.open(pool_url=new_pool(a_dir / 'kv'), **common) as store_a:
        store_a.put(tokens, kv)
    with TieredStore.open(pool_url=new_pool(b_dir / 'kv'), **common) as store_b:
        hit = store_b.lookup(tokens)
        assert hit.num_tokens == 4 * tiny.chunk_tokens and set(hit.chunk_tiers) == {"pool"}
        got = store_b.get(tokens[:hit.num_tokens])
        bits_equal(got, kv[:, :, :hit.num_tokens])
        snap = store_b.metrics_snapshot()["tiers"]["pool"]
        assert (snap["failed_reads"], snap["corrupt_chunks"]) == (0, 0)


# -- pool metadata and maintenance across clients ----------------------------------------------


def test_budget_syncs_alternating_between_the_clients_agree_without_listing_the_pool(gluster_pool, tiny,
                                                                                       monkeypatch):
    """Budget syncs rewrite the pool's small metadata files (temp + rename) on one client and read
    them on the other right after, where its caches still hold the replaced file (GlusterFS
    answers such a read with ESTALE for about a second). A sync must still read the other's
    counts, not take them for missing and list the whole pool (millions of files at scale):
    listing is for a pool never counted."""
    a_dir, b_dir = gluster_pool
    pool_a, pool_b = PoolTier(a_dir, 1 << 30, create=True), PoolTier(b_dir, 1 << 30, create=True)
    chunks = tiny.chunks(9, seed=10)
    pool_a.store(chunks[0], tiny.spec())
    pool_a.sync()
    pool_b.sync()
    time.sleep(1.5)  # any first count of the new pool (by a sync or an evictor thread) is done
    listings: list[str] = []
    caller = threading.get_ident()
    real_scandir = os.scandir
    shard = re.compile(r"[0-9a-f]{2}(/[0-9a-f]{2})?")

    def counted_scandir(path: object = ".") -> object:
        p = os.fspath(path)  # type: ignore[arg-type]
        if threading.get_ident() == caller and p.startswith(os.fspath(b_dir) + "/") and \
                shard.fullmatch(os.path.relpath(p, b_dir)):
            listings.append(p)
        return real_scandir(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", counted_scandir)
    totals = []
    for i, chunk in enumerate(chunks[1:], 1):
        writer, reader = (pool_a, pool_b) if i % 2 else (pool_b, pool_a)
        writer.store(chunk, tiny.spec())
        writer.sync()
        totals.append(reader.sync())  # the other client, at once
    monkeypatch.undo()
    assert listings == []
    assert pool_a.sync() == pool_b.sync() == len(chunks) * tiny.file_bytes, totals


def test_verify_on_b_beside_an_evictor_on_a_does_not_call_evicted_chunks_bad(gluster_pool, tiny, monkeypatch):
    """`kvtier pool verify` runs beside live engines on other machines: a chunk evicted there
    between verify's listing and its check is skipped, not reported."""
    a_dir, b_dir = gluster_pool
    pool_a = PoolTier(a_dir, None, create=True)
    for chunk in tiny.chunks(5, seed=11):
        pool_a.store(chunk, tiny.spec())
    real = admin.check_file
    evicted: list[Path] = []

    def evict_on_a_then_check(path: Path):
        if not evicted:
            evicted.append(path)
            os.unlink(on_a(path, a_dir, b_dir))
        return real(path)

    monkeypatch.setattr(admin, "check_file", evict_on_a_then_check)
    report = admin.verify(b_dir)
    monkeypatch.undo()
    assert len(evicted) == 1
    assert (report.checked, report.ok, report.bad) == (4, 4, [])
