"""Tenant isolation at the store level (the engine-level test is in test_engine.py).

Two stores share one pool, as two engine instances would. Identical prompts of different
tenants (a per-call ``tenant_salt``, or each instance's default) never reach each other's
chunks: not through lookup, not through get, not through the host tier, and not by files
placed under the other tenant's names.
"""

from __future__ import annotations

import pytest

from _pool import new_pool
from kvtier import TieredStore


@pytest.fixture
def pool_url(tmp_path) -> str:
    return new_pool(tmp_path / "pool")


def test_identical_prompts_of_two_tenants_never_share_chunks(tiny, pool_url, bits_equal):
    tokens, kv = tiny.tokens(64), tiny.kv(64)
    with TieredStore(tiny.config(pool_url=pool_url)) as a:
        assert a.put(tokens, kv, tenant_salt="tenant-a").stored_chunks == 4
        a.flush()
        # Same store, same host DRAM: another tenant sees nothing.
        assert a.lookup(tokens, tenant_salt="tenant-b").num_tokens == 0
        assert a.lookup(tokens).num_tokens == 0  # the instance default ("") is a tenant too
        with pytest.raises(KeyError):
            a.get(tokens, tenant_salt="tenant-b")
    with TieredStore(tiny.config(pool_url=pool_url)) as b:
        assert b.lookup(tokens, tenant_salt="tenant-b").num_tokens == 0
        assert b.lookup(tokens, tenant_salt="tenant-a").num_tokens == 64  # the owner still hits
        bits_equal(b.get(tokens, tenant_salt="tenant-a"), kv)


def test_instance_default_salt_isolates_instances_and_a_request_salt_replaces_it(tiny, pool_url, bits_equal):
    tokens, kv = tiny.tokens(48), tiny.kv(48)
    with TieredStore(tiny.config(pool_url=pool_url, tenant_salt="instance-a")) as a:
        a.put(tokens, kv)
        a.flush()
    with TieredStore(tiny.config(pool_url=pool_url, tenant_salt="instance-b")) as b:
        assert b.lookup(tokens).num_tokens == 0
        assert b.lookup(tokens, tenant_salt="instance-a").num_tokens == 48
        bits_equal(b.get(tokens, tenant_salt="instance-a"), kv)


def test_another_tenants_file_under_my_key_is_rejected_not_served(tiny, tmp_path, pool_url):
    """A tenant with write access to the pool copies its own chunk file over a name of mine:
    the header's namespace differs, so it is a corrupt chunk (removed), never my KV."""
    tokens = tiny.tokens(32)
    with TieredStore(tiny.config(pool_url=pool_url, host_bytes=0)) as s:
        s.put(tokens, tiny.kv(32, seed=1), tenant_salt="mallory")
        s.put(tokens, tiny.kv(32, seed=2), tenant_salt="alice")
        s.flush()
        mine = s.chunk_ids(tokens, tenant_salt="alice")
        theirs = s.chunk_ids(tokens, tenant_salt="mallory")
        pool = s.tiers[-1]
        pool.files.path_for(mine[0].key).write_bytes(pool.files.path_for(theirs[0].key).read_bytes())
        assert s.lookup(tokens, tenant_salt="alice").num_tokens == 32  # the name is there...
        with pytest.raises(KeyError):
            s.get(tokens, tenant_salt="alice")  # ...but it is not alice's chunk
        assert pool.metrics.snapshot().corrupt_chunks == 1
        assert s.lookup(tokens, tenant_salt="alice").num_tokens == 0  # removed
