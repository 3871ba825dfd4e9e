"""The process-level rows of the fault matrix with the pool on GlusterFS, across two clients.

The same rows as ``test_processes.py`` (writers SIGKILLed mid-write, with fsync off and on;
2 and 4 processes writing, reading and evicting in one pool beside a gc loop), with the pool
on a real GlusterFS volume (``tests/gluster.py``) and the processes split between its two
mounts, which stand for two machines: every read of another process's chunk may cross
clients, every eviction may pull a file from under another client's caches. At a smaller
scale than the local rows (a metadata operation is a network round trip here): each row well
under a minute.

The promise is the local rows': 0 wrong bytes, 0 lost acknowledged chunks, 0 crashes, 0 stuck,
every request served; a chunk another client evicted (ESTALE for about a second here) is a miss,
never a failed read. Two real vLLM engines, one per mount, share a pool too: the second resumes
what the first wrote, then both loop over the prompts while ``kvtier pool gc`` evicts from the
first mount (marker ``engine`` as well).
"""

from __future__ import annotations

import pytest

from _pool import new_pool

from .harness import FaultRow
from .harness.concurrency import share_pool
from .harness.crash import assert_nothing_lost, kill_writers

pytestmark = pytest.mark.gluster

KILLS = 16  # per row (the local rows: 40)
KILL_AFTER_S = (0.02, 0.25)  # a writer's life (locally 2-30 ms): a publish takes milliseconds here, not tenths
SECONDS = 6.0  # per shared-pool row (the local rows: 8)


def _read_errors_allowed(row: FaultRow) -> None:
    """No read is an I/O error: a chunk another client evicted (ESTALE for a while) is a miss."""
    assert not row.extra.get("failed_reads"), f"{row.fault}: {row.extra['failed_reads']} failed reads ({row.notes})"


@pytest.mark.parametrize("fsync", [False, True], ids=["fsync_off", "fsync_on"])
def test_writers_on_both_clients_sigkilled_mid_write_lose_nothing(gluster, fsync):
    a_dir, b_dir = gluster.pair(f"crash-{'on' if fsync else 'off'}")
    row = kill_writers(a_dir / "pool", KILLS, fsync=fsync, seed=3 if fsync else 4,
                       writer_pools=[a_dir / "pool", b_dir / "pool"], kill_after_s=KILL_AFTER_S)
    print(f"\n{row.fault} on GlusterFS: {row.notes}; {row.requests} acknowledged; {row.seconds:.1f} s")
    assert_nothing_lost(row)


def _check_shared(row: FaultRow) -> None:
    print(f"\n{row.fault} on GlusterFS: {row.notes}; failed_reads {row.extra['failed_reads']}, "
          f"failed_writes {row.extra['failed_writes']}; {row.seconds:.1f} s")
    row.check()
    x = row.extra
    assert x["corrupt_chunks"] == 0
    _read_errors_allowed(row)
    assert x["final_verify_bad"] == [] and x["final_wrong"] == 0 and x["final_unknown"] == 0
    assert x["final_identical"] == x["final_chunks"]
    # The run exercised what it claims: hits on other processes' chunks (half of them written
    # through the other mount), chunks evicted under readers (by a worker or gc), gc runs.
    assert int(x["full_hits"]) > 0 and int(x["evictions"]) + int(x["gc_evicted"]) > 0 and int(x["gc_runs"]) > 0


def test_two_processes_one_per_client_share_one_pool_beside_gc_on_the_second(gluster):
    a_dir, b_dir = gluster.pair("share-2")
    row = share_pool(a_dir / "pool", 2, SECONDS, seed=2, worker_pools=[a_dir / "pool", b_dir / "pool"],
                     gc_pool=b_dir / "pool")
    _check_shared(row)


def test_four_processes_two_per_client_share_one_pool_beside_gc_on_the_first(gluster):
    a_dir, b_dir = gluster.pair("share-4")
    row = share_pool(a_dir / "pool", 4, SECONDS, seed=4, worker_pools=[a_dir / "pool", b_dir / "pool"])
    _check_shared(row)


# -- two vLLM engines, one per mount ----------------------------------------------------------------


@pytest.fixture(scope="module")
def bench(engine_bench):  # type: ignore[no-untyped-def]
    return engine_bench  # the local rows' (tests/faults/conftest.py): one reference run for both


@pytest.mark.engine
def test_an_engine_on_the_second_mount_resumes_what_one_on_the_first_wrote(gluster, bench) -> None:
    a_dir, b_dir = gluster.pair("engines-resume")
    n = len(bench.prompts)
    plan = [{"p": i} for i in range(n)]
    writer = bench.run("gluster-a", bench.base("gluster-a", pool_url=new_pool(a_dir / 'pool')), plan)
    reader = bench.run("gluster-b", bench.base("gluster-b", pool_url=new_pool(b_dir / 'pool')), plan)
    assert writer.rc == 0 and reader.rc == 0, (writer.stderr, reader.stderr)
    assert bench.compare(writer.results)[2] == 0 and bench.compare(reader.results)[2] == 0
    # What vLLM's own prefix cache would serve: every full chunk and the tail's block (256-token
    # chunks, 128-token blocks), from A's writes.
    want = [(len(p) - 1) // 128 * 128 for p in bench.prompts]
    assert [r["cached"] for r in reader.results] == want
    pool = reader.metrics["worker"]["tiers"]["pool"]
    assert pool["corrupt_chunks"] == 0 and pool["failed_reads"] == 0 and pool["bytes_read"] > 0


@pytest.mark.engine
def test_two_engines_one_per_mount_share_the_pool_beside_gc_from_the_first(gluster, bench) -> None:
    from .harness.engine import shared_pool_with_gc

    a_dir, b_dir = gluster.pair("engines-gc")
    (row,) = shared_pool_with_gc(bench, 0.5, (a_dir / "pool", b_dir / "pool", a_dir / "pool"),
                                 " on GlusterFS (engines on two mounts)")
    print(f"\n{row.fault}: {row.notes}; {row.seconds:.0f} s")
    row.check()
    assert row.extra["gc_failures"] == 0 and row.extra["verify_bad"] == 0 and row.extra["hits"] > 0
