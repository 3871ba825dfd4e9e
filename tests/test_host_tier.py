"""kvtier.tiers.host: the host DRAM slot cache: exact LRU, pinned leases, reads in place."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.tiers.base import Chunk, Tier
from kvtier.tiers.host import HostCache

SLOT = 8192  # a tiny chunk's file image (4096 header + 2048 payload, aligned)


@pytest.fixture
def make_host(tiny):
    def factory(num_chunks: int = 16, capacity_bytes: int | None = None) -> HostCache:
        cap = num_chunks * SLOT if capacity_bytes is None else capacity_bytes
        return HostCache(cap, tiny.layout, tiny.chunk_tokens)

    return factory


def put(host: HostCache, chunk: Chunk) -> bool:
    """Copy a new ``chunk`` in as the store does (reserve, fill, commit) and drop the pin;
    False when every slot is pinned."""
    slot = host.reserve()
    if slot is None:
        return False
    host.slot_view(slot).copy_(chunk.data)
    host.commit(slot, chunk.id).release()
    return True


def test_is_not_a_tier(make_host):
    """It lends its memory (acquire, reserve/commit) instead of copying chunks in and out."""
    host = make_host()
    assert not isinstance(host, Tier)
    assert not hasattr(host, "load") and not hasattr(host, "store")


def test_put_acquire_round_trip(make_host, tiny, bits_equal):
    host = make_host()
    a, b = tiny.chunks(2)
    assert put(host, a)
    assert host.refresh(a.id) and not host.refresh(b.id)  # presence checks are not reads
    lease = host.acquire(a.id)
    assert lease is not None
    bits_equal(lease.chunk.data, a.data)
    assert lease.chunk.data.data_ptr() != a.data.data_ptr()  # the cache keeps its own copy
    lease.release()
    assert host.acquire(b.id) is None
    snap = host.metrics.snapshot()
    assert (snap.written_chunks, snap.bytes_written, snap.bytes_read, snap.chunks) == (1, 2048, 2048, 1)


def test_a_chunk_already_held_is_not_copied_again(make_host, tiny, bits_equal):
    """Two reads of one chunk race: the second commit gets the first's copy, its slot goes back."""
    host = make_host(2)
    a, b = tiny.chunks(2)
    assert put(host, a)
    slot = host.reserve()
    host.slot_view(slot).copy_(b.data)
    lease = host.commit(slot, a.id)  # same identity: the held copy is returned, b's bytes unused
    bits_equal(lease.chunk.data, a.data)
    lease.release()
    assert host.metrics.snapshot().written_chunks == 1 and host.keys() == [a.id.key]
    assert put(host, b) and host.keys() == [a.id.key, b.id.key]  # the slot was freed, not lost


def test_stored_copy_is_independent_of_the_callers_tensor(make_host, tiny, bits_equal):
    host = make_host()
    (a,) = tiny.chunks(1)
    original = a.data.clone()
    put(host, a)
    a.data.zero_()
    with_lease = host.acquire(a.id)
    bits_equal(with_lease.chunk.data, original)
    with_lease.release()


def test_a_reserved_slot_is_visible_only_once_committed(make_host, tiny, bits_equal):
    """The store's read path: a chunk file is read into a slot, validated, then published."""
    host = make_host(2)
    a, b = tiny.chunks(2)
    slot = host.reserve()
    host.slot_view(slot).copy_(a.data)
    assert host.lookup([a.id]) == 0  # filled but not committed: nobody sees it
    lease = host.commit(slot, a.id)
    assert host.lookup([a.id]) == 1
    bits_equal(lease.chunk.data, a.data)
    lease.release()
    slot = host.reserve()
    host.abandon(slot)  # a failed read gives its slot back
    assert host.lookup([b.id]) == 0 and host.keys() == [a.id.key]


def test_lookup_counts_contiguous_prefix(make_host, tiny):
    host = make_host()
    chunks = tiny.chunks(4)
    for i in (0, 1, 3):
        put(host, chunks[i])
    ids = [c.id for c in chunks]
    assert [host.lookup(ids[i:]) for i in range(4)] == [2, 1, 0, 1]
    assert host.lookup([]) == 0


def test_lookup_requires_the_full_identity(make_host, tiny):
    host = make_host()
    a, b = tiny.chunks(2)
    put(host, a)
    forged = dataclasses.replace(a.id, tokens_digest=b.id.tokens_digest)  # same key, other tokens
    assert host.lookup([forged]) == 0
    assert host.acquire(forged) is None and not host.refresh(forged)


def test_exact_lru_eviction_order(make_host, tiny):
    host = make_host(3)  # room for exactly three chunks
    a, b, c, d, e = tiny.chunks(5)
    for ch in (a, b, c):
        put(host, ch)
    assert host.keys() == [a.id.key, b.id.key, c.id.key]
    host.acquire(a.id).release()                # a becomes most recent
    assert host.keys() == [b.id.key, c.id.key, a.id.key]
    host.lookup([b.id])                         # lookups are side-effect free: no reordering
    assert host.keys() == [b.id.key, c.id.key, a.id.key]
    put(host, d)                                # evicts b, the least recently used
    assert host.keys() == [c.id.key, a.id.key, d.id.key]
    assert host.refresh(c.id)                   # a save's presence check refreshes c
    put(host, e)                                # evicts a
    assert host.keys() == [d.id.key, c.id.key, e.id.key]
    assert host.lookup([b.id]) == 0 and host.lookup([a.id]) == 0
    snap = host.metrics.snapshot()
    assert (snap.evictions, snap.evicted_bytes, snap.chunks, snap.bytes) == (2, 2 * SLOT, 3, 3 * SLOT)


def test_pinned_chunks_are_not_evicted(make_host, tiny, bits_equal):
    host = make_host(2)
    a, b, c, d = tiny.chunks(4)
    put(host, a)
    put(host, b)
    lease = host.acquire(a.id)                  # a is pinned (and most recent)
    host.acquire(b.id).release()                # b is most recent, unpinned
    put(host, c)                                # a is LRU but pinned: b goes instead
    assert host.keys() == [a.id.key, c.id.key]
    bits_equal(lease.chunk.data, a.data)
    pin_c = host.acquire(c.id)
    assert not put(host, d)                     # every slot pinned
    assert host.reserve() is None
    lease.release()
    lease.release()                             # idempotent
    assert put(host, d)
    assert host.keys() == [c.id.key, d.id.key]
    pin_c.release()


def test_evict_to_target(make_host, tiny):
    host = make_host()
    chunks = tiny.chunks(4)
    for ch in chunks:
        put(host, ch)
    assert host.evict(SLOT + 1) == 3
    assert host.keys() == [chunks[3].id.key]
    assert host.evict(1 << 20) == 0
    assert host.metrics.snapshot().evictions == 3


def test_budget_smaller_than_one_chunk_keeps_nothing(make_host, tiny):
    host = make_host(capacity_bytes=SLOT - 1)
    (a,) = tiny.chunks(1)
    assert not put(host, a)
    assert host.lookup([a.id]) == 0 and host.keys() == []


def test_budget_rounds_down_to_whole_chunks(make_host, tiny):
    host = make_host(capacity_bytes=3 * SLOT - 1)
    for ch in tiny.chunks(4):
        put(host, ch)
    assert len(host.keys()) == 2


def test_close_drops_everything(make_host, tiny):
    host = make_host()
    (a,) = tiny.chunks(1)
    put(host, a)
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
    put(host, a)
    assert host.drain_changes() == []  # not tracking yet
    host.track_changes()
    mirror: set[bytes] = set()

    def apply() -> None:
        for added, key in host.drain_changes():
            (mirror.add if added else mirror.discard)(key)

    apply()
    assert mirror == {a.id.key}  # what it already held is reported once tracking starts
    put(host, b)
    put(host, c)  # evicts a, the least recently used
    apply()
    assert mirror == set(host.keys()) == {b.id.key, c.id.key}
    host.evict(0)
    apply()
    assert mirror == set()
    assert host.drain_changes() == []
