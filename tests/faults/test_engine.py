"""The engine-level fault matrix at the CI scale (a real vLLM engine, CPU build).

Faults: the pool's filesystem full / read-only / removed while serving (root only), every
pool read hanging, tenants with other salts, a pool that is not mounted, two engines sharing a
small pool with gc.
Each row must show every request served with the recompute's tokens; the asserts below add
what each fault must (and must not) do to hits.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("KVTIER_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from faults.harness import SCALES, is_root
from faults.harness.engine import (
    Bench,
    hanging_pool,
    shared_pool_with_gc,
    storage_faults,
    tenant_isolation,
    unmounted_pool,
)

pytestmark = pytest.mark.engine  # starts vLLM engines: left out of the fast loop (-m "not engine")

SCALE = SCALES["ci"]


@pytest.fixture(scope="module")
def bench(engine_bench: Bench) -> Bench:
    return engine_bench


@pytest.mark.root
def test_pool_filesystem_full_read_only_and_removed_while_serving(bench: Bench) -> None:
    if not is_root():
        pytest.skip("mounting a size-limited tmpfs needs root")
    rows = storage_faults(bench, bench.workdir)
    for row in rows:
        row.check()
    healthy = next(r for r in rows if r.control)
    full = next(r for r in rows if "ENOSPC" in r.fault)
    read_only = next(r for r in rows if "EROFS" in r.fault)
    removed = next(r for r in rows if "removed" in r.fault)
    assert healthy.extra["hits_again"] == healthy.extra["requests_again"]
    # A pool that cannot take writes still serves what it holds.
    assert full.extra["hits_again"] == full.extra["requests_again"]
    assert read_only.extra["hits_again"] == read_only.extra["requests_again"]
    # A removed pool serves nothing, and is not silently recreated on the disk below it.
    assert removed.extra["hits_again"] == 0
    assert removed.extra["not_recreated"] is True
    assert int(removed.extra["pool"]["failed_writes"]) > 0  # type: ignore[index]


def test_a_hanging_pool_read_costs_a_recompute_within_the_read_timeout(bench: Bench) -> None:
    (row,) = hanging_pool(bench, ("load",))
    row.check()  # includes: no request slower than the bound
    # One read timed out, then the pool was skipped for the cooldown: one timeout, not six.
    assert row.extra["worker_timeouts"] == 1


def test_a_hanging_pool_lookup_does_not_stall_the_scheduler(bench: Bench) -> None:
    (row,) = hanging_pool(bench, ("lookup", "load"))
    row.check()
    assert row.extra["scheduler_timeouts"] == 1  # then skipped: the scheduler never waited again


def test_tenants_never_hit_each_others_chunks(bench: Bench) -> None:
    rows = tenant_isolation(bench)
    for row in rows:
        row.check()  # a cross-tenant hit counts as wrong
    control = next(r for r in rows if r.control)
    assert control.extra["owner_hits"] == control.requests  # the chunks were there to be hit


def test_two_engines_and_gc_share_one_small_pool(bench: Bench) -> None:
    (row,) = shared_pool_with_gc(bench, SCALE.engine_minutes)
    row.check()
    assert row.extra["verify_bad"] == 0
    assert row.extra["hits"] > 0


def test_a_pool_that_is_not_mounted_is_refused_said_and_never_created(bench: Bench) -> None:
    (row,) = unmounted_pool(bench)
    row.check()
    assert row.extra["hits"] == 0 and row.extra["said"] >= 1 and row.extra["created"] is False
