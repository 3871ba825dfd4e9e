"""kvtier.tiers.host: a slab of chunk slots in this process, exact LRU, pinned leases."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.tiers.base import Status, Tier
from kvtier.tiers.host import HostTier

SLOT = 8192  # a tiny chunk's file image (4096 header + 2048 payload, aligned)


@pytest.fixture
def make_host(tiny):
    def factory(num_chunks: int = 16, capacity_bytes: int | None = None) -> HostTier:
        cap = num_chunks * SLOT if capacity_bytes is None else capacity_bytes
        return HostTier(cap, tiny.layout, tiny.chunk_tokens)

    return factory


def test_speaks_the_tier_protocol(make_host):
    assert isinstance(make_host(), Tier)


def test_store_load_round_trip(make_host, tiny, bits_equal):
    host = make_host()
    a, b = tiny.chunks(2)
    assert host.store(a, tiny.spec()).status is Status.WRITTEN
    assert host.store(a, tiny.spec()).status is Status.EXISTS
    got = host.load(a.id, tiny.spec())
    assert got.status is Status.HIT and got.ok
    bits_equal(got.chunk.data, a.data)
    assert got.chunk.data.data_ptr() != a.data.data_ptr()  # the tier keeps its own copy
    assert host.load(b.id, tiny.spec()).status is Status.MISS
    snap = host.metrics.snapshot()
    assert (snap.written_chunks, snap.bytes_written, snap.bytes_read, snap.chunks) == (1, 2048, 2048, 1)


def test_stored_copy_is_independent_of_the_callers_tensor(make_host, tiny, bits_equal):
    host = make_host()
    (a,) = tiny.chunks(1)
    original = a.data.clone()
    host.store(a, tiny.spec())
    a.data.zero_()
    bits_equal(host.load(a.id, tiny.spec()).chunk.data, original)


def test_lookup_counts_contiguous_prefix(make_host, tiny):
    host = make_host()
    chunks = tiny.chunks(4)
    for i in (0, 1, 3):
        host.store(chunks[i], tiny.spec())
    ids = [c.id for c in chunks]
    assert [host.lookup(ids[i:]) for i in range(4)] == [2, 1, 0, 1]
    assert host.lookup([]) == 0


def test_lookup_requires_the_full_identity(make_host, tiny):
    host = make_host()
    a, b = tiny.chunks(2)
    host.store(a, tiny.spec())
    forged = dataclasses.replace(a.id, tokens_digest=b.id.tokens_digest)  # same key, other tokens
    assert host.lookup([forged]) == 0
    assert host.load(forged, tiny.spec()).status is Status.MISS


def test_exact_lru_eviction_order(make_host, tiny):
    host = make_host(3)  # room for exactly three chunks
    a, b, c, d, e = tiny.chunks(5)
    spec = tiny.spec()
    for ch in (a, b, c):
        host.store(ch, spec)
    assert host.keys() == [a.id.key, b.id.key, c.id.key]
    assert host.load(a.id, spec).ok             # a becomes most recent
    assert host.keys() == [b.id.key, c.id.key, a.id.key]
    host.lookup([b.id])                         # lookups are side-effect free: no reordering
    assert host.keys() == [b.id.key, c.id.key, a.id.key]
    host.store(d, spec)                         # evicts b, the least recently used
    assert host.keys() == [c.id.key, a.id.key, d.id.key]
    host.store(c, spec)                         # re-storing refreshes c
    host.store(e, spec)                         # evicts a
    assert host.keys() == [d.id.key, c.id.key, e.id.key]
    assert host.lookup([b.id]) == 0 and host.lookup([a.id]) == 0
    snap = host.metrics.snapshot()
    assert (snap.evictions, snap.evicted_bytes, snap.chunks, snap.bytes) == (2, 2 * SLOT, 3, 3 * SLOT)


def test_pinned_chunks_are_not_evicted(make_host, tiny, bits_equal):
    host = make_host(2)
    a, b, c, d = tiny.chunks(4)
    host.store(a, tiny.spec())
    host.store(b, tiny.spec())
    lease = host.acquire(a.id)                  # a is pinned (and most recent)
    host.acquire(b.id).release()                # b is most recent, unpinned
    host.store(c, tiny.spec())                  # a is LRU but pinned: b goes instead
    assert host.keys() == [a.id.key, c.id.key]
    bits_equal(lease.chunk.data, a.data)
    pin_c = host.acquire(c.id)
    assert host.store(d, tiny.spec()).status is Status.FAILED  # every slot pinned
    assert host.put(d.id, d.data) is None
    lease.release()
    lease.release()                             # idempotent
    assert host.store(d, tiny.spec()).status is Status.WRITTEN
    assert host.keys() == [c.id.key, d.id.key]
    pin_c.release()


def test_evict_to_target(make_host, tiny):
    host = make_host()
    chunks = tiny.chunks(4)
    for ch in chunks:
        host.store(ch, tiny.spec())
    assert host.evict(SLOT + 1) == 3
    assert host.keys() == [chunks[3].id.key]
    assert host.evict(1 << 20) == 0
    assert host.metrics.snapshot().evictions == 3


def test_budget_smaller_than_one_chunk_keeps_nothing(make_host, tiny):
    host = make_host(capacity_bytes=SLOT - 1)
    (a,) = tiny.chunks(1)
    assert host.store(a, tiny.spec()).status is Status.FAILED
    assert host.lookup([a.id]) == 0 and host.keys() == []


def test_budget_rounds_down_to_whole_chunks(make_host, tiny):
    host = make_host(capacity_bytes=3 * SLOT - 1)
    for ch in tiny.chunks(4):
        host.store(ch, tiny.spec())
    assert len(host.keys()) == 2


def test_close_drops_everything(make_host, tiny):
    host = make_host()
    (a,) = tiny.chunks(1)
    host.store(a, tiny.spec())
    host.close()
    assert host.keys() == [] and host.lookup([a.id]) == 0


def test_chunk_payload_is_its_raw_bytes(tiny):
    (a,) = tiny.chunks(1)
    assert a.nbytes == 2048
    assert bytes(a.payload()) == bytes(a.data.reshape(-1).view(torch.uint8).numpy())



def test_change_journal_mirrors_additions_and_evictions(make_host, tiny):
    """track_changes/drain_changes: a consumer that applies the events holds exactly the keys."""
    host = make_host(num_chunks=2)
    a, b, c = tiny.chunks(3)
    host.store(a, tiny.spec())
    assert host.drain_changes() == []  # not tracking yet
    host.track_changes()
    mirror: set[bytes] = set()

    def apply() -> None:
        for added, key in host.drain_changes():
            (mirror.add if added else mirror.discard)(key)

    apply()
    assert mirror == {a.id.key}  # what it already held is reported once tracking starts
    host.store(b, tiny.spec())
    host.store(c, tiny.spec())  # evicts a, the least recently used
    apply()
    assert mirror == set(host.keys()) == {b.id.key, c.id.key}
    host.evict(0)
    apply()
    assert mirror == set()
    assert host.drain_changes() == []
