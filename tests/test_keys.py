"""kvtier.keys: deterministic chained chunk keys, namespaces, full chunks only."""

from __future__ import annotations

import array
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from blake3 import blake3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import KVLayout
from kvtier.keys import FORMAT_VERSION, as_token_array, chunk_ids, recompute_key, tail_id

# Keys of tokens 0..47 in the tiny namespace. They name files in every pool on disk: if this
# test fails, stored chunks became unreachable; bump FORMAT_VERSION rather than edit these.
GOLDEN_NAMESPACE = "5a4417b024b0379de07ccf80f35cc3b5de08941a5041d0212a745cb2f3936b21"
GOLDEN_KEYS = [
    "42424165e884afbb375b1ba2c026e50e2e65f46bb26ebba0704cd42cb4be5693",
    "f745ee97adb5c5fa44d62efe3113b3298f53b5057947a248d8e8f7c1834deb2a",
    "7e82817dea0edfbcd0374392cc7d314eecdf6c6b4e35605a0d7e14a1a2757c60",
]

_KEYS_SCRIPT = r"""
import json, sys
import torch
from kvtier import KVLayout
from kvtier.keys import Namespace, chunk_ids
layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
tokens = list(range(1000, 1000 + 40))
out = {}
for salt in ("", "tenant-a"):
    ns = Namespace("tiny-llama", layout, 16, tenant_salt=salt)
    for extra in (b"", b"lora-7"):
        key = f"{salt}|{extra.decode()}"
        out[key] = [c.key.hex() for c in chunk_ids(ns, tokens, extra)]
        # A set of strings iterates in PYTHONHASHSEED order: proves the seed took effect.
out["set_order"] = list({"alpha", "beta", "gamma", "delta", "epsilon", "zeta"})
json.dump(out, sys.stdout)
"""


def _keys_in_subprocess(hash_seed: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    return subprocess.Popen([sys.executable, "-c", _KEYS_SCRIPT], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_keys_identical_across_processes_with_different_hash_seeds(tiny):
    procs = [_keys_in_subprocess(seed) for seed in ("1", "2")]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    # Different hash seeds really were in effect (else this test could not fail).
    assert results[0]["set_order"] != results[1]["set_order"]
    keys = [{k: v for k, v in r.items() if k != "set_order"} for r in results]
    assert keys[0] == keys[1]
    # ... and equal to what this process computes.
    tokens = list(range(1000, 1040))
    ns = tiny.namespace()
    assert keys[0]["|"] == [c.key.hex() for c in chunk_ids(ns, tokens)]
    salted = chunk_ids(ns.with_salt("tenant-a"), tokens, b"lora-7")
    assert keys[0]["tenant-a|lora-7"] == [c.key.hex() for c in salted]
    assert len(keys[0]["|"]) == 2  # 40 tokens = 2 full chunks of 16
    assert len({k[0] for k in keys[0].values()}) == 4  # salt and extra each change the keys


def test_golden_keys(tiny):
    ns = tiny.namespace()
    assert ns.digest.hex() == GOLDEN_NAMESPACE
    assert [c.key.hex() for c in chunk_ids(ns, list(range(48)))] == GOLDEN_KEYS


def test_key_chain_follows_documented_formula(tiny):
    ns = tiny.namespace()
    tokens = tiny.tokens(3 * 16, seed=5)
    extra = b"image-sha"
    ids = chunk_ids(ns, tokens, extra)
    parent = ns.digest
    for i, cid in enumerate(ids):
        tokens_digest = blake3(struct.pack("<16I", *tokens[i * 16:(i + 1) * 16])).digest()
        extra_digest = blake3(extra).digest()
        assert cid.parent == parent
        assert cid.tokens_digest == tokens_digest
        assert cid.extra_digest == extra_digest
        assert cid.key == blake3(parent + tokens_digest + extra_digest).digest()
        assert recompute_key(cid.parent, cid.tokens_digest, cid.extra_digest) == cid.key
        parent = cid.key


@pytest.mark.parametrize("change", [
    {"model_id": "other-model"},
    {"layout": KVLayout(2, 2, 8, torch.float16)},           # dtype
    {"layout": KVLayout(3, 2, 8, torch.bfloat16)},          # num_layers
    {"layout": KVLayout(2, 4, 4, torch.bfloat16)},          # same bytes per token, other shape
    {"chunk_tokens": 8},
    {"rank": 1, "world_size": 2},
    {"world_size": 2},
    {"tenant_salt": "tenant-b"},
    {"format_version": FORMAT_VERSION + 1},
    {"kv_format": "vllm-cpu-vec-bs128"},
], ids=["model_id", "dtype", "num_layers", "shape", "chunk_tokens", "rank", "world_size",
        "tenant_salt", "format_version", "kv_format"])
def test_namespace_change_changes_every_key(tiny, change):
    base = tiny.namespace()
    other = tiny.namespace(**change)
    assert other.digest != base.digest
    tokens = tiny.tokens(64, seed=1)
    base_keys = {c.key for c in chunk_ids(base, tokens)}
    other_keys = {c.key for c in chunk_ids(other, tokens)}
    assert len(base_keys) == 4
    assert not base_keys & other_keys


def test_all_namespace_digests_distinct(tiny):
    variants = [tiny.namespace(), tiny.namespace(model_id="m2"), tiny.namespace(chunk_tokens=32),
                tiny.namespace(rank=1, world_size=2), tiny.namespace(world_size=2),
                tiny.namespace(tenant_salt="a"), tiny.namespace(tenant_salt="b")]
    assert len({ns.digest for ns in variants}) == len(variants)


def test_tenant_salt_is_not_described_in_clear(tiny):
    described = tiny.namespace(tenant_salt="s3cret-salt").describe()
    assert "s3cret-salt" not in json.dumps(described)
    assert described["tenant"] == blake3(b"s3cret-salt").hexdigest()[:16]
    assert tiny.namespace().describe()["tenant"] == ""


@pytest.mark.parametrize(("n_tokens", "n_chunks"), [(0, 0), (15, 0), (16, 1), (47, 2), (48, 3), (49, 3)])
def test_only_full_chunks_get_keys(tiny, n_tokens, n_chunks):
    ids = chunk_ids(tiny.namespace(), tiny.tokens(n_tokens))
    assert len(ids) == n_chunks


def test_max_chunks_limits_and_partial_chunk_does_not_change_keys(tiny):
    ns = tiny.namespace()
    tokens = tiny.tokens(64, seed=2)
    full = chunk_ids(ns, tokens)
    assert chunk_ids(ns, tokens, max_chunks=2) == full[:2]
    assert chunk_ids(ns, tokens, max_chunks=0) == []
    assert chunk_ids(ns, tokens[:40]) == full[:2]


def test_changing_one_token_changes_its_chunk_and_all_later_keys(tiny):
    ns = tiny.namespace()
    tokens = tiny.tokens(64, seed=3)
    changed = list(tokens)
    changed[20] += 1  # inside chunk 1
    a, b = chunk_ids(ns, tokens), chunk_ids(ns, changed)
    assert a[0] == b[0]
    assert [x.key != y.key for x, y in zip(a, b, strict=False)] == [False, True, True, True]
    # Chunk 2's tokens are unchanged: its token digest matches, only the chain differs.
    assert a[2].tokens_digest == b[2].tokens_digest


def test_extra_changes_keys(tiny):
    ns = tiny.namespace()
    tokens = tiny.tokens(32)
    plain, lora = chunk_ids(ns, tokens), chunk_ids(ns, tokens, b"lora-1")
    assert plain[0].extra_digest == b""
    assert lora[0].extra_digest == blake3(b"lora-1").digest()
    assert {c.key for c in plain}.isdisjoint({c.key for c in lora})
    assert chunk_ids(ns, tokens, b"lora-1") == lora


def test_token_containers_give_the_same_keys(tiny):
    ns = tiny.namespace()
    tokens = tiny.tokens(48, seed=4)
    expected = chunk_ids(ns, tokens)
    for form in (tuple(tokens), np.array(tokens, dtype=np.int64), np.array(tokens, dtype=np.uint32),
                 np.array(tokens, dtype=">u4"), torch.tensor(tokens, dtype=torch.int64),
                 torch.tensor(tokens, dtype=torch.int32), array.array("i", tokens), array.array("I", tokens)):
        assert chunk_ids(ns, form) == expected  # array("i"): vLLM 0.34's TokenBuffer


def test_a_token_buffer_is_read_in_place_not_copied_token_by_token():
    buffer = array.array("i", range(100_000))
    ids = as_token_array(buffer)
    assert ids.dtype == np.uint32 and ids[-1] == 99_999
    assert np.shares_memory(ids, np.frombuffer(buffer, dtype=np.int32))


@pytest.mark.parametrize("bad", [[1, -1], [2**32], np.array([-5]), np.array([[1, 2]]), array.array("i", [3, -2]),
                                 torch.tensor([1, 2**33]), ["a"]])
def test_bad_token_ids_raise_value_error(bad):
    with pytest.raises(ValueError, match="token"):
        as_token_array(bad)


_token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=_token_lists, cut=st.integers(0, 80))
def test_prefix_of_tokens_gives_prefix_of_ids(tiny, tokens, cut):
    ns = tiny.namespace(chunk_tokens=8)
    full = chunk_ids(ns, tokens)
    assert len(full) == len(tokens) // 8
    assert chunk_ids(ns, tokens[:cut]) == full[: min(cut, len(tokens)) // 8]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=_token_lists, b=_token_lists)
def test_key_i_equal_iff_chunks_0_to_i_equal(tiny, a, b):
    ns = tiny.namespace(chunk_tokens=4)
    ids_a, ids_b = chunk_ids(ns, a), chunk_ids(ns, b)
    for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)):
        assert (x.key == y.key) == (a[: (i + 1) * 4] == b[: (i + 1) * 4])


def test_a_tail_is_named_by_its_tokens_its_length_and_its_parent_never_as_a_chunk(tiny):
    ns = tiny.namespace(chunk_tokens=8)
    tokens = tiny.tokens(24, seed=5)
    full = chunk_ids(ns, tokens)
    tail = tail_id(ns, tokens, 8, 4, full[0].key)
    assert tail.parent == full[0].key and tail.key == recompute_key(tail.parent, tail.tokens_digest, tail.extra_digest)
    assert tail == tail_id(ns, np.array(tokens[:12]), 8, 4, full[0].key)  # only its own tokens count
    others = {full[1].key, tail_id(ns, tokens, 8, 6, full[0].key).key, tail_id(ns, tokens, 8, 4, b"x" * 32).key,
              tail_id(ns, tokens, 8, 4, full[0].key, b"lora").key, tail_id(ns, tokens, 0, 4).key}
    assert tail.key not in others and len(others) == 5
    # Never the key of a chunk of the same tokens, even in a namespace whose chunks are that long.
    short = tiny.namespace(chunk_tokens=4)
    assert tail_id(ns, tokens, 0, 4).key != chunk_ids(short, tokens)[0].key
    for bad in ((8, 0), (8, 8), (4, 2), (16, 9)):
        with pytest.raises(ValueError):
            tail_id(ns, tokens, bad[0], bad[1], full[0].key)
    with pytest.raises(ValueError, match="parent"):
        tail_id(ns, tokens, 8, 4)
    with pytest.raises(ValueError, match="parent"):
        tail_id(ns, tokens, 0, 4, full[0].key)
