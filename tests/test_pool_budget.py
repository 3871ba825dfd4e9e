"""The shared pool's budget: ledgers, the eviction round and its lease, the overshoot cap, gc.

``tiers/ledger.py``, ``tiers/evict.py``, ``tiers/poollock.py`` and ``PoolTier``'s admission; the
plainer budget behaviour (exact LRU on a small pool, retention, the eviction log, hostile
``.usage`` and lock files) is in test_pool_tier.py.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import secrets
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from _pool import new_pool
from conftest import bytes_on_disk, within
from kvtier import TieredStore, admin
from kvtier.tiers import evict as evict_mod
from kvtier.tiers import ledger as ledger_mod
from kvtier.tiers import poollock as poollock_mod
from kvtier.tiers.base import Status
from kvtier.tiers.evict import Evictor
from kvtier.tiers.files import ChunkFiles
from kvtier.tiers.folds import fold_dead
from kvtier.tiers.ledger import LEDGER_DIR, STALE_S, read_usage
from kvtier.tiers.pool import PoolTier
from kvtier.tiers.poollock import PoolLocks

FILE = 8192
TESTS = Path(__file__).parent


def _sparse_pool(root: Path, n: int, size: int = FILE, mtime: float | None = None,
                 seed: int | None = None) -> list[Path]:
    """``n`` chunk files under valid names (random, or from ``seed``), sparse (metadata is what
    eviction costs), ``mtime`` or oldest first."""
    ChunkFiles(root)
    rng = random.Random(seed)
    paths = []
    for i in range(n):
        h = secrets.token_hex(32) if seed is None else rng.randbytes(32).hex()
        path = root / h[:2] / h[2:4] / f"{h}.kvt"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(size)
        t = (time.time() - 10_000 + i) if mtime is None else mtime
        os.utime(path, (t, t))
        paths.append(path)
    return paths


@contextmanager
def _watch_lock(monkeypatch):
    """Record what happens while ROOT/.lock is held: listings and small-file reads, by thread."""
    inside = threading.local()
    seen: dict[str, list] = {"scandir": [], "reads": [], "holders": []}  # reads: one list per hold
    real_shared, real_scandir, real_read_small = PoolLocks.shared, os.scandir, ledger_mod.read_small

    @contextmanager
    def shared(self):  # type: ignore[no-untyped-def]
        with real_shared(self) as locked:
            inside.on = True
            seen["holders"].append(threading.get_ident())
            seen["reads"].append([])
            try:
                yield locked
            finally:
                inside.on = False

    def scandir(path="."):  # type: ignore[no-untyped-def]
        if getattr(inside, "on", False):
            seen["scandir"].append(os.fspath(path))
        return real_scandir(path)

    def read_small(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if getattr(inside, "on", False):
            seen["reads"][-1].append(os.fspath(path))
        return real_read_small(path, *args, **kwargs)

    monkeypatch.setattr(PoolLocks, "shared", shared)
    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(ledger_mod, "read_small", read_small)
    yield seen
    monkeypatch.undo()


# -- the fleet-wide lock: bounded, never on the writer's path ---------------------------------------


def test_the_lock_is_held_only_to_read_and_rewrite_the_base(open_pool, pool_dir, monkeypatch):
    _sparse_pool(pool_dir, 3000)
    others = [open_pool() for _ in range(3)]  # three more instances with ledgers of their own
    for other in others:
        other.ledger.add(FILE)
        other.sync()
    pool = open_pool()
    others[0].close()  # one of them ends: its ledger is to be folded
    with _watch_lock(monkeypatch) as seen:
        assert pool.evict(2000 * FILE) > 0  # a round that counts the whole pool, then anchors
        assert fold_dead(pool.files, pool.locks, [o.ledger.id for o in others]) == [others[0].ledger.id]
    assert len(seen["holders"]) >= 2  # the anchor and the fold took it
    assert seen["scandir"] == []  # no listing at all under the lock (ledgers are read before it)
    assert [Path(p).name for reads in seen["reads"] for p in reads] == [".usage"] * len(seen["holders"])
    assert pool.locks.longest_hold_s < 0.1


def test_writers_never_take_the_lock_nor_run_a_round(open_pool, pool_dir, tiny, monkeypatch):
    pool = open_pool(capacity_bytes=4 * FILE, sync_bytes=FILE)
    assert pool.evictor.settle()
    calls: list[tuple[str, int]] = []
    real_shared, real_round = PoolLocks.shared, Evictor._round

    def shared(self):  # type: ignore[no-untyped-def]
        calls.append(("lock", threading.get_ident()))
        return real_shared(self)

    def round_(self, *args):  # type: ignore[no-untyped-def]
        calls.append(("round", threading.get_ident()))
        return real_round(self, *args)

    monkeypatch.setattr(PoolLocks, "shared", shared)
    monkeypatch.setattr(Evictor, "_round", round_)
    for chunk in tiny.chunks(12):
        pool.store(chunk, tiny.spec())  # syncs at every chunk, over budget from the fifth
        pool.sync()
    assert pool.evictor.settle()
    assert ("round", pool.evictor.thread_id) in calls
    assert all(ident != threading.get_ident() for _, ident in calls)


def test_eviction_does_not_run_on_the_writers_thread(tiny, pool_dir, monkeypatch):
    unlinks: list[int] = []
    stores: list[int] = []
    real_unlink, real_store = Evictor._unlink, PoolTier.store

    def unlink(self, f):  # type: ignore[no-untyped-def]
        unlinks.append(threading.get_ident())
        return real_unlink(self, f)

    def store(self, chunk, spec):  # type: ignore[no-untyped-def]
        stores.append(threading.get_ident())
        return real_store(self, chunk, spec)

    monkeypatch.setattr(Evictor, "_unlink", unlink)
    monkeypatch.setattr(PoolTier, "store", store)
    with TieredStore(tiny.config(host_bytes=0, pool_url=new_pool(pool_dir), pool_bytes=6 * tiny.file_bytes)) as s:
        n = tiny.chunk_tokens
        for seed in range(30):
            s.put(tiny.tokens(n, seed), tiny.kv(n, seed))
            s.flush()
        s.tiers[0].sync()
        assert s.tiers[0].evictor.settle()
        assert bytes_on_disk(pool_dir) <= 6 * tiny.file_bytes
    assert unlinks and stores
    assert not set(unlinks) & set(stores)


# -- ledgers --------------------------------------------------------------------------------------


_DIE_WITHOUT_CLOSING = """
import os, sys
sys.path.insert(0, {tests!r})
from conftest import Tiny
from kvtier.tiers.pool import PoolTier
tiny = Tiny()
pool = PoolTier({pool!r}, None, sync_bytes={sync}, create=True)
for chunk in tiny.chunks({n}, seed={seed}):
    assert pool.store(chunk, tiny.spec()).status.value == "written"
os._exit(0)  # killed: no close, no final ledger write; the kernel releases its liveness lock
"""


def _die_without_closing(pool: Path, n: int, sync_bytes: int, seed: int = 1) -> None:
    code = _DIE_WITHOUT_CLOSING.format(tests=str(TESTS), pool=str(pool), sync=sync_bytes, n=n, seed=seed)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_crashed_instance_is_missing_at_most_its_unwritten_bytes_until_gc(pool_dir):
    admin.gc(ChunkFiles(pool_dir).root, 1 << 40)  # an empty pool, counted: total 0
    _die_without_closing(pool_dir, n=7, sync_bytes=3 * FILE)
    # It wrote its ledger before the 4th and the 7th chunk: 6 of 7 chunks are counted.
    assert (read_usage(pool_dir).total, bytes_on_disk(pool_dir)) == (6 * FILE, 7 * FILE)
    assert admin.gc(pool_dir, 1 << 40).bytes_after == 7 * FILE
    assert read_usage(pool_dir).total == 7 * FILE  # re-anchored


def test_a_dead_instances_ledger_is_folded_into_the_base_once(open_pool, pool_dir):
    admin.gc(ChunkFiles(pool_dir).root, 1 << 40)
    _die_without_closing(pool_dir, n=4, sync_bytes=FILE)
    files, locks = ChunkFiles(pool_dir), PoolLocks(ChunkFiles(pool_dir), open_pool().metrics)
    (dead,) = read_usage(pool_dir).ledgers
    saved = (pool_dir / LEDGER_DIR / f"{dead}.json").read_bytes()
    live = open_pool()
    live.ledger.add(FILE)
    live.sync()
    total = read_usage(pool_dir).total
    later = time.time() + STALE_S + 1  # both heartbeats are stale by then
    assert fold_dead(files, locks, sorted(read_usage(pool_dir).ledgers), later) == [dead]
    assert sorted(read_usage(pool_dir).ledgers) == [live.ledger.id]  # the live one holds its lock
    assert not (pool_dir / LEDGER_DIR / f"{dead}.json").exists()
    assert read_usage(pool_dir).total == total  # moved into the base, not lost
    assert fold_dead(files, locks, [dead], later) == []
    # A folder that died after writing the base and before unlinking leaves the ledger behind:
    # it is recognised (the base lists it), never added twice, and then removed.
    (pool_dir / LEDGER_DIR / f"{dead}.json").write_bytes(saved)
    assert read_usage(pool_dir).total == total
    assert fold_dead(files, locks, [dead], later) == []
    assert not (pool_dir / LEDGER_DIR / f"{dead}.json").exists()
    assert read_usage(pool_dir).total == total


def test_planted_ledger_names_never_hide_the_real_ones(open_pool, pool_dir, tiny, monkeypatch):
    """6f37bba read the first 1024 names in sorted order: 1024 planted names hid every real
    ledger (a pool at 60 MiB in a 16 MiB budget, accounted 0)."""
    admin.gc(ChunkFiles(pool_dir).root, 1 << 40)
    writer = open_pool()
    for chunk in tiny.chunks(5):
        writer.store(chunk, tiny.spec())
    writer.sync()
    folder = pool_dir / LEDGER_DIR
    for i in range(1100):  # names that sort before any real id, and that new_id() cannot make
        (folder / f"0-{i:05d}.json").write_text('{"added": 1073741824, "removed": 0, "heartbeat": 0}')
    assert read_usage(pool_dir).total == 5 * FILE and writer.ledger.id in read_usage(pool_dir).ledgers
    # Past MAX_LEDGERS names new_id() could make, the freshest are read: a live ledger is rewritten.
    monkeypatch.setattr(ledger_mod, "MAX_LEDGERS", 64)
    old = time.time() - 3600
    for i in range(200):
        forged = folder / f"0host-{i}-{i:08x}.json"
        forged.write_text(json.dumps({"added": 0, "removed": 0, "heartbeat": old}))
        os.utime(forged, (old, old))
    writer.store(tiny.chunks(6)[5], tiny.spec())
    writer.sync()
    usage = read_usage(pool_dir)
    assert writer.ledger.id in usage.ledgers and len(usage.ledgers) == 64 and usage.total == 6 * FILE


def test_fold_candidates_that_cannot_be_folded_never_starve_the_dead_ones(open_pool, pool_dir):
    """6f37bba looked at the first 8 candidates only: 8 that could not be folded kept every
    other dead ledger unfolded forever."""
    admin.gc(ChunkFiles(pool_dir).root, 1 << 40)
    pool = open_pool()
    folder = pool_dir / LEDGER_DIR
    folder.mkdir(exist_ok=True)
    stale = time.time() - STALE_S - 60
    held = []
    for i in range(10):  # alive by their lock (an instance stalled past STALE_S), sorted first
        ident = f"a-{i}-{i:08x}"
        (folder / f"{ident}.json").write_text(json.dumps({"added": FILE, "removed": 0, "heartbeat": stale}))
        fd = os.open(folder / f"{ident}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.append(fd)
    dead = [f"z-{i}-{i:08x}" for i in range(3)]
    for ident in dead:
        (folder / f"{ident}.json").write_text(json.dumps({"added": FILE, "removed": 0, "heartbeat": stale}))
    try:
        folded: list[str] = []
        for _ in range(40):
            folded += fold_dead(pool.files, pool.locks, read_usage(pool_dir).foldable(time.time()))
            if len(folded) == 3:
                break
        assert sorted(folded) == dead
        assert read_usage(pool_dir).total == 13 * FILE  # folded into the base, none lost
    finally:
        for fd in held:
            os.close(fd)


def test_a_closed_ledger_is_folded_at_once(open_pool, pool_dir, tiny):
    admin.gc(ChunkFiles(pool_dir).root, 1 << 40)
    a = open_pool()
    for chunk in tiny.chunks(3):
        a.store(chunk, tiny.spec())
    a.close()
    folder = open_pool()
    assert fold_dead(folder.files, folder.locks, read_usage(pool_dir).foldable(time.time())) == [a.ledger.id]
    assert read_usage(pool_dir).ledgers == {} and read_usage(pool_dir).total == 3 * FILE


def test_an_instance_that_finds_itself_folded_goes_on_under_a_new_id(open_pool, pool_dir, tiny):
    admin.gc(ChunkFiles(pool_dir).root, 1 << 40)
    pool = open_pool()
    a, b = tiny.chunks(2)
    pool.store(a, tiny.spec())
    pool.sync()
    old = pool.ledger.id
    # Another instance took it for dead (a stall, and a lock file someone replaced) and folded it.
    base = json.loads((pool_dir / ".usage").read_text())
    base.update(bytes=base["bytes"] + FILE, folded_added=FILE, folds=[[old, FILE, 0]])
    (pool_dir / ".usage").write_text(json.dumps(base))
    (pool_dir / LEDGER_DIR / f"{old}.json").unlink()
    pool.store(b, tiny.spec())
    assert pool.sync() == 2 * FILE  # its first chunk counted once (in the base), its second once
    assert pool.ledger.id != old and read_usage(pool_dir).total == 2 * FILE


def _sparse_file(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


HOSTILE = {
    "symlink to /dev/zero": lambda p: p.symlink_to("/dev/zero"),
    "fifo": lambda p: os.mkfifo(p),
    "64 GiB sparse": lambda p: _sparse_file(p, 64 << 30),
    "not json": lambda p: p.write_bytes(b"\xff" * 100),
    "a list": lambda p: p.write_text("[1, 2]"),
    "deep nesting": lambda p: p.write_text("[" * 3000 + "]" * 3000),
    "negative": lambda p: p.write_text(json.dumps({"added": -5, "removed": 0, "heartbeat": time.time()})),
    "huge": lambda p: p.write_text(json.dumps({"added": 2 ** 70, "removed": 0, "heartbeat": time.time()})),
    "nan heartbeat": lambda p: p.write_text('{"added": 5, "removed": 0, "heartbeat": NaN}'),
    "bool bytes": lambda p: p.write_text(json.dumps({"added": True, "removed": 0, "heartbeat": time.time()})),
    "far future": lambda p: p.write_text(json.dumps({"added": 5, "removed": 0, "heartbeat": 1e30})),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_ledger_costs_nothing(open_pool, pool_dir, tiny, kind):
    pool = open_pool(capacity_bytes=1 << 30)
    assert pool.evictor.settle()
    for chunk in tiny.chunks(3):
        pool.store(chunk, tiny.spec())
    (pool_dir / LEDGER_DIR).mkdir(exist_ok=True)
    HOSTILE[kind](pool_dir / LEDGER_DIR / "evil-1-ab.json")
    assert within(pool.sync, 5.0) == 3 * FILE  # ignored, as if absent
    assert within(lambda: fold_dead(pool.files, pool.locks, ["evil-1-ab"], time.time() + 2 * STALE_S), 5.0) == []
    assert within(pool.evictor.settle, 10.0)


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_base_means_a_count(open_pool, pool_dir, tiny, kind):
    pool = open_pool(capacity_bytes=2 * FILE)
    assert pool.evictor.settle()
    (pool_dir / ".usage").unlink()
    HOSTILE[kind](pool_dir / ".usage")
    for chunk in tiny.chunks(4):
        pool.store(chunk, tiny.spec())
    within(pool.sync, 5.0)
    pool.evictor._counted_at = -1e9  # as if its last count were long ago (a count is retried every 600 s)
    assert within(pool.evictor.settle, 10.0)
    assert bytes_on_disk(pool_dir) <= 2 * FILE and read_usage(pool_dir).total == bytes_on_disk(pool_dir)
    assert (pool_dir / ".usage").is_file() and not (pool_dir / ".usage").is_symlink()


def test_a_symlink_in_place_of_the_ledger_directory_is_never_followed(open_pool, pool_dir, tmp_path, tiny):
    outside = tmp_path / "outside"
    outside.mkdir()
    pool = open_pool()
    (pool_dir / LEDGER_DIR).symlink_to(outside)
    pool.store(tiny.chunks(1)[0], tiny.spec())
    pool.sync()
    assert list(outside.iterdir()) == []
    assert (pool_dir / LEDGER_DIR).is_dir() and not (pool_dir / LEDGER_DIR).is_symlink()
    assert read_usage(pool_dir).floor == FILE


# -- the eviction round -----------------------------------------------------------------------------


def test_two_evictors_without_a_lock_are_harmless(open_pool, pool_dir, monkeypatch):
    """No working lock: both run at once. Whatever one removes is counted by it alone; a file the
    other got first (ENOENT) is neither counted nor logged twice. The total is what
    docs/filesystems.md promises without the lock: a round's anchor can miss what the other
    removed while it listed, so it may read low by at most what was removed (the budget's
    overshoot bound may be exceeded), and `kvtier pool gc`'s count makes it exact again."""
    def no_locks(fd, op):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(poollock_mod.fcntl, "flock", no_locks)
    paths = _sparse_pool(pool_dir, 400)
    a, b = open_pool(), open_pool()
    start = threading.Barrier(2)
    counts: list[int] = []

    def run(tier: PoolTier) -> None:
        start.wait()
        counts.append(tier.evict(100 * FILE))

    threads = [threading.Thread(target=run, args=(t,)) for t in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    removed = [p for p in paths if not p.exists()]
    assert sum(counts) == len(removed) >= 300
    assert a.ledger.removed + b.ledger.removed == len(removed) * FILE
    snaps = [t.metrics.snapshot() for t in (a, b)]
    assert sum(s.evictions for s in snaps) == len(removed)
    logged = (pool_dir / ".evicted").read_text().split()
    assert len(logged) == len(set(logged)) == len(removed)
    total = read_usage(pool_dir).total
    # Low by at most what was removed; read so low that it adds up below zero, it is unknown (None:
    # the evictor then counts the pool). Under CPU load the race reaches that about 1 run in 14.
    assert total is None or bytes_on_disk(pool_dir) - len(removed) * FILE <= total
    admin.gc(pool_dir, 1 << 40)
    assert read_usage(pool_dir).total == bytes_on_disk(pool_dir)


def test_an_unlink_another_evictor_got_to_first_is_not_counted(open_pool, pool_dir, monkeypatch):
    paths = _sparse_pool(pool_dir, 40)
    pool = open_pool()
    real_unlink = os.unlink

    def raced(path: Path) -> bool:  # the other evictor gets to these first
        return int(Path(path).name[0], 16) % 2 == 0

    def unlink(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if Path(path).suffix == ".kvt" and raced(path):
            real_unlink(path)  # the other evictor, a moment earlier
            raise FileNotFoundError(errno.ENOENT, "gone", path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(evict_mod.os, "unlink", unlink)
    n = pool.evict(0)
    monkeypatch.undo()
    mine = sum(not raced(p) for p in paths)
    assert not any(p.exists() for p in paths) and 0 < mine < 40
    assert n == pool.metrics.snapshot().evictions == mine
    assert pool.ledger.removed == mine * FILE
    assert len((pool_dir / ".evicted").read_text().split()) == mine


def test_retained_chunks_go_last_when_the_round_samples(open_pool, pool_dir, monkeypatch):
    monkeypatch.setattr(evict_mod, "SAMPLE_FILES", 4)  # a sample of a few directories, not the pool
    now = time.time()
    plain = _sparse_pool(pool_dir, 30, seed=1)
    retained = []
    for i in range(10):
        (path,) = _sparse_pool(pool_dir, 1, mtime=now + 3600 + i, seed=100 + i)  # oldest retention first
        retained.append(path)
    admin.gc(pool_dir, 1 << 40)
    pool = open_pool()
    pool.sync()
    pool.evict(35 * FILE)
    assert all(p.exists() for p in retained)  # only unretained chunks went
    assert sum(not p.exists() for p in plain) >= 5
    pool.evict(5 * FILE)  # more than every unretained chunk: then the oldest retentions
    assert not any(p.exists() for p in plain)
    assert [p.exists() for p in retained] == [False] * 5 + [True] * 5


def test_a_sampled_round_costs_a_bounded_number_of_visits_per_evicted_chunk(open_pool, pool_dir, monkeypatch):
    monkeypatch.setattr(evict_mod, "SAMPLE_FILES", 200)
    paths = _sparse_pool(pool_dir, 2000, seed=7)  # oldest first; names and the order fixed: no flakes
    admin.gc(pool_dir, 1 << 40)  # counted: the round trusts the total and needs no full pass
    pool = open_pool()
    pool.evictor._rng.seed(7)
    pool.sync()
    n = pool.evict(1800 * FILE)  # 10%: a sweep visits about ten chunks per chunk evicted
    stats = pool.evictor.last_round
    assert 200 <= n <= 260 and stats.passes == 1
    assert stats.seen <= 12 * n + 200
    # One global cutoff, aimed a little past the oldest 10% (by twice the sample's error): what
    # went is among the oldest, and most of the oldest went (the sweep stops once it freed
    # enough, leaving some old ones in directories it did not reach).
    gone = [i for i, p in enumerate(paths) if not p.exists()]
    assert len(gone) == n and max(gone) < 400 and sum(i < 200 for i in gone) >= 100


def test_the_first_sync_of_a_pool_without_accounting_counts_nothing_on_the_callers_thread(pool_dir, open_pool,
                                                                                          monkeypatch):
    _sparse_pool(pool_dir, 500)
    scans: list[int] = []
    real = ChunkFiles.scan_shard

    def scan_shard(self, shard):  # type: ignore[no-untyped-def]
        scans.append(threading.get_ident())
        return real(self, shard)

    monkeypatch.setattr(ChunkFiles, "scan_shard", scan_shard)
    pool = open_pool(capacity_bytes=1 << 40)
    within(pool.sync, 5.0)
    assert pool.evictor.settle()
    assert scans and threading.get_ident() not in scans
    assert read_usage(pool_dir).total == 500 * FILE == bytes_on_disk(pool_dir)


def test_an_old_total_is_recounted(open_pool, pool_dir):
    _sparse_pool(pool_dir, 20)
    (pool_dir / ".usage").write_text(json.dumps({"bytes": 999 * FILE, "anchored_at": time.time() - 2 * 3600}))
    pool = open_pool(capacity_bytes=1 << 40)
    assert pool.evictor.settle()
    assert read_usage(pool_dir).total == 20 * FILE


# -- the overshoot cap --------------------------------------------------------------------------------


def test_the_cap_refuses_and_counts_and_holds_the_stated_bound_while_eviction_is_stuck(open_pool, pool_dir, tiny):
    capacity, sync_bytes = 20 * FILE, 2 * FILE
    a, b = open_pool(capacity, sync_bytes=sync_bytes), open_pool(capacity, sync_bytes=sync_bytes)
    for tier in (a, b):
        assert tier.evictor.settle()
    assert a.cap_bytes == capacity + sync_bytes
    bound = a.cap_bytes + (2 - 1) * sync_bytes
    lease = os.open(pool_dir / ".evict.lock", os.O_RDWR)
    fcntl.flock(lease, fcntl.LOCK_EX)  # an evictor elsewhere that never finishes its round
    try:
        results = []
        for i, chunk in enumerate(tiny.chunks(60, seed=3)):
            t0 = time.monotonic()
            results.append((a, b)[i % 2].store(chunk, tiny.spec()))
            assert time.monotonic() - t0 < 2.0  # refused, never waited for
            assert bytes_on_disk(pool_dir) <= bound
        refused = [r for r in results if r.status is Status.FAILED]
        assert refused and all("budget cap" in r.error for r in refused)
        assert a.metrics.snapshot().budget_refusals + b.metrics.snapshot().budget_refusals == len(refused)
        assert capacity < bytes_on_disk(pool_dir) <= bound
    finally:
        os.close(lease)
    for tier in (a, b):
        tier.sync()
        assert tier.evictor.settle()
    assert bytes_on_disk(pool_dir) <= capacity
    a.sync()  # (a writer over the cap reads the total again at most every second by itself)
    assert a.store(tiny.chunks(1, seed=99)[0], tiny.spec()).status is Status.WRITTEN


# -- gc ---------------------------------------------------------------------------------------------------


def test_gc_is_exact_and_re_anchors_the_count(pool_dir, tiny, monkeypatch):
    pool = PoolTier(pool_dir, None, create=True)
    chunks = tiny.chunks(10, seed=4)
    now = time.time()
    for i, chunk in enumerate(chunks):
        pool.store(chunk, tiny.spec())
        os.utime(pool.files.path_for(chunk.id.key), (now - 1000 + i,) * 2)
    pool.retain(chunks[0].id.key, now + 3600)
    pool.retain(chunks[1].id.key, now + 7200)
    pool.close()
    # Drift: a base with a wrong count, and a chunk deleted by hand.
    (pool_dir / ".usage").write_text(json.dumps({"bytes": 10**12, "anchored_at": now}))
    os.unlink(pool.files.path_for(chunks[2].id.key))
    with _watch_lock(monkeypatch) as seen:
        report = admin.gc(pool_dir, 5 * FILE)
    assert (report.evicted_chunks, report.bytes_after) == (4, 5 * FILE)
    left = {f.key for f in ChunkFiles(pool_dir, create=False).scan()}
    assert left == {c.id.key for c in (chunks[0], chunks[1], *chunks[7:])}  # oldest first, retained last
    assert read_usage(pool_dir).total == 5 * FILE == bytes_on_disk(pool_dir)
    assert all(Path(p).name == LEDGER_DIR for p in seen["scandir"])  # the listing ran unlocked
    assert admin.gc(pool_dir, FILE).evicted_chunks == 4
    assert {f.key for f in ChunkFiles(pool_dir, create=False).scan()} == {chunks[1].id.key}



def test_a_sampled_chunk_hit_or_retained_since_the_sample_is_kept(open_pool, pool_dir):
    """6f37bba unlinked the round's sampled victims without looking again: a chunk hit (its mtime
    refreshed) or retained (mtime in the future) after the sample was listed was evicted."""
    paths = _sparse_pool(pool_dir, 6, seed=3)
    pool = open_pool()
    shards = sorted({str(p.parent.relative_to(pool_dir)) for p in paths})
    for shard in shards:
        found = pool.files.scan_shard(shard)  # the sample, listed before the sweep
        kept = found[0].path
        later = time.time() + 3600
        os.utime(kept, (later, later))  # retained since the listing
        _, outcomes, pruned = pool.evictor._visit(shard, found, lambda f: True)
        assert not pruned  # the retained chunk is still there
        assert kept.exists() and 0 not in outcomes
        assert all(outcomes[i] is True for i in range(1, len(found)))
        assert not any(f.path.exists() for f in found[1:])


def test_a_round_removes_the_shard_directories_it_empties(open_pool, pool_dir, tiny):
    """6f37bba never removed a shard directory: a small pool of random keys came to hold
    thousands of empty ones, and every round listed them all (one round trip each on a network
    filesystem: 19 s rounds on GlusterFS). Now a round removes what it empties; a directory
    holding anything else (a writer's temp file) stays, and a writer whose directory went makes
    it again."""
    paths = _sparse_pool(pool_dir, 300, seed=11)  # oldest first
    busy = paths[0].parent / "x.kvt.tmp"
    busy.write_bytes(b"a write in progress")
    pool = open_pool()
    pool.evict(30 * FILE)  # the newest 10% stay
    stats = pool.evictor.last_round
    holding = {p.parent for p in paths if p.exists()} | {busy.parent}
    left = {pool_dir / s for s in pool.files.shard_dirs()}
    assert stats.pruned > 0 and left == holding
    assert all(os.listdir(d) for d in left)
    chunk = tiny.chunks(1, seed=5)[0]
    shard = pool.files.path_for(chunk.id.key).parent
    if shard.exists() and not os.listdir(shard):
        shard.rmdir()
    assert pool.store(chunk, tiny.spec()).status is Status.WRITTEN
    assert pool.files.prune_shard(str(shard.relative_to(pool_dir))) is False  # not empty: kept
    assert pool.load(chunk.id, tiny.spec()).status is Status.HIT
    assert pool.files.prune_shard("../..") is False and pool.files.prune_shard("zz/00") is False


def test_a_round_starts_ahead_of_the_budget_by_a_rounds_worth_of_writes():
    """6f37bba started a round only past the budget: with the cap a sixteenth above it, a pool
    written faster than budget / 16 per round refused chunks during every round (13% of 20 MB/s
    on GlusterFS, rounds of 2 s, a 512 MiB budget)."""
    from kvtier.tiers.evictpace import MAX_LEAD, Pace

    budget = 512 << 20
    pace = Pace()
    assert pace.start_at(budget) == budget  # nothing learnt yet
    pace.look(0.0, 100 << 20)
    pace.look(0.1, 200 << 20)  # too close to the last look to say anything
    assert pace.rate == 0
    pace.look(1.0, 110 << 20)  # 10 MiB/s
    assert pace.start_at(budget) == budget - int(MAX_LEAD * budget)  # writes seen, no round timed yet
    pace.round_ended(1.0)
    pace.look(2.0, 90 << 20)  # after the round: measured afresh, a fall is not a rate
    assert pace.rate == 5 << 20  # smoothed from 0
    assert pace.start_at(budget) == budget - int(1.5 * (5 << 20))
    for t in range(3, 30):
        pace.look(float(t), (90 << 20) + (t - 2) * (40 << 20))  # 40 MiB/s: the lead is capped
    pace.round_ended(3.0)
    assert pace.start_at(budget) == budget - int(MAX_LEAD * budget)
    # 40 MiB/s from empty to the start (90% of the budget): half of 11.5 s
    assert 5.5 < pace.next_look_s(0, budget, 10.0) < 6.0
    assert pace.next_look_s(budget, budget, 10.0) == 1.0  # at least a second apart
    fresh = Pace()
    fresh.look(0.0, 0)
    fresh.look(1.0, 100 << 20)
    assert fresh.rate > 0 and fresh.next_look_s(0, budget, 10.0) == 10.0  # never evicted: the usual tick
    assert fresh.start_at(budget) == budget - int(MAX_LEAD * budget)  # but starts early: no round timed yet


def test_the_evictor_starts_a_round_before_the_pool_passes_its_budget(open_pool, pool_dir, tiny):
    """With a write rate learnt, the background evictor runs a round while the total is still
    under the budget, so the writers never meet the cap."""
    budget = 40 * tiny.spec().file_bytes
    pool = open_pool(capacity_bytes=budget)
    pool.evictor.pace.rate, pool.evictor.pace.round_s = budget, 1.0  # a budget per second: the lead is 5%
    start = pool.evictor.pace.start_at(budget)
    assert start < budget
    for ch in tiny.chunks(39, seed=21):  # 97.5% of the budget: past the start, not the budget
        assert pool.store(ch, tiny.spec()).status is Status.WRITTEN
    assert pool.sync() > start
    assert within(pool.evictor.settle, 10.0)
    assert pool.evictor.last_round is not None and pool.evictor.last_round.evicted > 0
    assert pool.sync() <= budget * evict_mod.LOW_WATERMARK


def test_a_count_anchored_by_a_clock_a_day_ahead_makes_no_one_recount(open_pool, pool_dir, tiny):
    """Before: a count anchored by an instance whose clock ran a day ahead read as nonsense
    (a time in the future), so every other instance recounted the pool every 10 minutes."""
    size = tiny.spec().file_bytes
    first = open_pool(capacity_bytes=100 * size)
    for ch in tiny.chunks(3, seed=8):
        first.store(ch, tiny.spec())
    assert first.evictor.settle()
    counted = read_usage(pool_dir).total  # the first count
    assert counted is not None
    usage = json.loads((pool_dir / ".usage").read_text())
    usage["anchored_at"] = time.time() + 25 * 3600
    (pool_dir / ".usage").write_text(json.dumps(usage))
    rounds = first.evictor.last_round
    other = open_pool(capacity_bytes=100 * size)
    assert read_usage(pool_dir).total == counted  # a count, not nonsense
    assert other.evictor.settle() and first.evictor.settle()
    assert other.evictor.last_round is None and first.evictor.last_round is rounds  # nobody counted
    assert other.evictor._age(usage["anchored_at"]) < 60
