"""kvtier's HiCache backend against SGLang's own factory, host pool and cache controller.

Runs in the SGLang venv (``scripts/sglang-venv.sh``; ``scripts/test.sh`` runs it there).
SGLang's built-in ``HiCacheFile`` is the reference: the same pages through it and through
kvtier land in the host pool byte for byte alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed here: run in the venv of scripts/sglang-venv.sh")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

sys.path.insert(0, str(Path(__file__).parent))
import _hicache as hc

from kvtier.integrations.sglang import KVTierHiCacheStorage
from kvtier.integrations.sglang.backend import copy_page
from kvtier.integrations.sglang.pages import page_chunk_id
from kvtier.tiers.poolroot import scratch_pool as new_pool

HELPER = str(Path(__file__).parent / "_hicache.py")


@pytest.fixture(autouse=True)
def _parallel() -> None:
    hc.set_parallel()


def storage_config(extra: dict, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                   model: str = "tiny-test") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
                                is_page_first_layout=False, model_name=model,
                                extra_config={**hc.KVTIER, **extra})


def backend(pool: Path, host, **kw) -> KVTierHiCacheStorage:
    b = StorageBackendFactory.create_backend("dynamic", storage_config({"pool_url": new_pool(pool)}, **kw), host)
    b.register_mem_pool_host(host)
    return b


def pool_files(pool: Path) -> list[Path]:
    return sorted(p for p in pool.rglob("*.kvt"))


def pool_bytes(pool: Path) -> int:
    """The bytes of the pool's chunk files now (a file the evictor removes meanwhile counts 0)."""
    total = 0
    for path in pool_files(pool):
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            pass
    return total


def run_helper(*args: str) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, HELPER, *args], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_factory_loads_the_backend_by_module_path(tmp_path: Path) -> None:
    _, host = hc.host_pool()
    b = backend(tmp_path / "pool", host)
    try:
        assert isinstance(b, KVTierHiCacheStorage)
        assert b.store is not None and b.store.host is None  # SGLang's host pool is the DRAM level
        info = b.store.namespace.describe()
        assert info["kv_format"] == "sglang-layer_first" and info["chunk_tokens"] == hc.PAGE
        assert info["layout"] == {"num_layers": hc.LAYERS, "num_kv_heads": hc.HEADS, "head_dim": hc.HEAD_DIM,
                                  "dtype": "bfloat16"}
    finally:
        b.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("v1", [1, 0])
def test_the_controller_writes_and_reads_back_bit_exactly_like_hicachefile(tmp_path: Path, layout: str,
                                                                            v1: int) -> None:
    """SGLang's backup thread writes 12 pages through kvtier and through HiCacheFile; its prefetch
    threads read them back into fresh host pages: the same bytes as written, both ways."""
    digests = {}
    for name, extra in (("kvtier", {"pool_url": new_pool(tmp_path / "pool"), "interface_v1": v1}),
                        ("file", {"file_storage_path": str(tmp_path / "file")})):
        allocator, host = hc.host_pool(layout)
        ctrl = hc.controller(allocator, host, name, extra)
        try:
            tokens = hc.tokens_for(7, 12)
            _, indices, written = hc.backup(ctrl, host, tokens, seed=7)
            assert written == len(tokens)
            want = hc.pages_digest(host, indices, 12)
            got = hc.prefetch(ctrl, host, tokens)
            assert (got.hit_tokens, got.loaded_tokens) == (len(tokens), len(tokens))
            assert got.host_indices is not None and not torch.equal(got.host_indices, indices)
            digests[name] = (want, hc.pages_digest(host, got.host_indices, 12))
        finally:
            ctrl.storage_stop_event.set()
            ctrl.storage_backend.close() if hasattr(ctrl.storage_backend, "close") else None
    assert digests["kvtier"][0] == digests["kvtier"][1] == digests["file"][1]
    assert len(pool_files(tmp_path / "pool")) == 12


def test_pages_go_through_each_kv_codec_smaller_and_back(tmp_path: Path) -> None:
    """With ``kv_codec``, the pool's files are that many times smaller, ``lossless`` reads back
    the same bytes and ``fp8`` / ``k8v4`` values close to them: K and V found where SGLang's
    page keeps them (all K rows, then all V rows)."""
    from kvtier.format import unpack_header

    for layout, codec, least, tol in (("layer_first", "lossless", 1.05, 0.0), ("layer_first", "fp8", 1.9, 1 / 8),
                                      ("layer_first", "k8v4", 2.4, 1 / 4), ("page_first", "fp8", 1.9, 1 / 8)):
        pool = tmp_path / f"{layout}-{codec}"
        allocator, host = hc.host_pool(layout)
        ctrl = hc.controller(allocator, host, "kvtier", {"pool_url": new_pool(pool), "kv_codec": codec})
        try:
            tokens = hc.tokens_for(3, 6)
            _, indices, written = hc.backup(ctrl, host, tokens, seed=3)
            assert written == len(tokens)
            want = [host.get_data_page(i, flat=True).float().clone() for i in indices[::hc.PAGE].tolist()]
            got = hc.prefetch(ctrl, host, tokens)
            assert got.loaded_tokens == len(tokens) and got.host_indices is not None
            for page, i in zip(want, got.host_indices[::hc.PAGE].tolist(), strict=True):
                back = host.get_data_page(i, flat=True).float()
                # randn pages: within a fraction of each value's own scale (|x| <= ~5)
                assert (back - page).abs().max().item() <= tol * 5, codec
        finally:
            ctrl.storage_stop_event.set()
            ctrl.storage_backend.close()
        files = pool_files(pool)
        assert len(files) == 6
        for path in files:
            header = unpack_header(path.read_bytes()[:4096])
            assert header.codec is not None and header.codec.raw_bytes / header.payload_bytes >= least, (codec, path)
            assert header.codec.layers == 1 and header.codec.row_elems == hc.HEAD_DIM


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_copy_page_copies_strided_pages_bit_exactly(dtype: torch.dtype) -> None:
    """The page copy of every path (NumPy's, not torch's threaded ``copy_``): a strided page of a
    layer_first pool to a flat buffer and back, every bit pattern kept (NaNs included)."""
    bits = torch.randint(0, 256, (2, 3, 64, 2, 8 * dtype.itemsize), dtype=torch.uint8)
    page = bits.view(dtype)[:, :, 16:32]
    flat = torch.empty(page.shape, dtype=dtype)
    copy_page(flat, page)
    assert torch.equal(flat.view(torch.uint8), bits[:, :, 16:32])
    back = torch.zeros_like(bits).view(dtype)
    copy_page(back[:, :, 16:32], flat)
    assert torch.equal(back.view(torch.uint8)[:, :, 16:32], bits[:, :, 16:32])
    assert not back.view(torch.uint8)[:, :, :16].any() and not back.view(torch.uint8)[:, :, 32:].any()
    converted = torch.zeros(4, dtype=torch.float32)
    copy_page(converted, torch.arange(4, dtype=torch.float64))  # widths differ: torch's copy_
    assert converted.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_second_process_reads_what_the_first_wrote(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    wrote = run_helper("write", "--dir", pool, "--seed", "11", "--pages", "10")
    read = run_helper("read", "--dir", pool, "--seed", "11", "--pages", "10")
    assert wrote["written_tokens"] == read["hit_tokens"] == read["loaded_tokens"] == 10 * hc.PAGE
    assert read["digest"] == wrote["digest"]
    # The pool is an ordinary kvtier pool: verify checks every page's header and payload.
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "pool", "verify", pool, "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["checked"] == report["ok"] == 10 and report["bad"] == [], report


def _damage(path: Path, how: str, foreign: Path | None = None) -> None:
    data = bytearray(path.read_bytes())
    if how == "corrupt":
        data[4096 + 100] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path.write_bytes(bytes(data[: 4096 + 512]))
    elif how == "foreign":
        assert foreign is not None
        path.write_bytes(foreign.read_bytes())


@pytest.mark.parametrize("how", ["corrupt", "truncated", "foreign"])
def test_a_hostile_pool_file_costs_a_miss_never_wrong_bytes(tmp_path: Path, how: str) -> None:
    """Page 5 of 8 damaged in the pool (a flipped payload byte, a cut file, or another model's
    page of the same size under its name): the prefetch loads pages 0-4 exactly and stops."""
    pool = tmp_path / "pool"
    allocator, host = hc.host_pool()
    foreign = None
    if how == "foreign":
        other = backend(pool, host, model="another-model")
        try:
            page = host.get_data_page(0, flat=True).clone()
            assert other.batch_set(["ab" * 32], [page])
            foreign = next(p for p in pool_files(pool))
        finally:
            other.close()
    ctrl = hc.controller(allocator, host, "kvtier", {"pool_url": new_pool(pool), "interface_v1": 1})
    try:
        tokens = hc.tokens_for(5, 8)
        hashes, indices, _ = hc.backup(ctrl, host, tokens, seed=5)
        want5 = hc.pages_digest(host, indices, 5)
        cid = page_chunk_id(ctrl.storage_backend.store.namespace.digest, hashes[5])
        victim = next(p for p in pool_files(pool) if p.name.startswith(cid.key.hex()))
        _damage(victim, how, foreign)
        got = hc.prefetch(ctrl, host, tokens)
        assert got.loaded_tokens == 5 * hc.PAGE
        assert hc.pages_digest(host, got.host_indices, 5) == want5
        corrupt = ctrl.storage_backend.metrics_snapshot()["tiers"]["pool"]
        assert corrupt["corrupt_chunks"] + corrupt.get("errors", 0) >= 1, corrupt
    finally:
        ctrl.storage_stop_event.set()
        ctrl.storage_backend.close()


def test_hostile_keys_and_indices_are_misses_not_exceptions(tmp_path: Path) -> None:
    _, host = hc.host_pool()
    b = backend(tmp_path / "pool", host)
    try:
        idx = host.alloc(2 * hc.PAGE)
        good = "cd" * 32
        assert b.batch_set_v1([good, "ef" * 32], idx) == [True, True]
        assert b.batch_exists([good, None, "ef" * 32]) == 1  # type: ignore[list-item]
        assert b.batch_exists([good, "x" * 10**6]) == 1
        assert b.batch_exists([12345]) == 0  # type: ignore[list-item]
        assert b.batch_get_v1([good], idx[:3]) == [False]  # indices for the wrong number of pages
        assert b.batch_get_v1([good], idx.view(2, -1)) == [False]
        assert b.batch_get([good], [torch.zeros(7)]) == [None]
        assert b.batch_set([good], [torch.zeros(7)]) is False
        assert b.exists(good) and not b.exists("00" * 32)
        assert b.batch_get_v1([good, "ef" * 32], idx) == [True, True]
    finally:
        b.close()
    assert b.batch_exists([good]) == 0 and b.batch_get_v1([good], idx[: hc.PAGE]) == [False]  # closed
    assert b.batch_set_v1([good], idx[: hc.PAGE]) == [False]


def test_tp2_ranks_write_their_own_shards_and_agree_on_hits(tmp_path: Path) -> None:
    """Two TP ranks (one KV head each) on one pool: each writes and reads its own shard; both
    answer a hit query alike, and a shard lost on one rank shortens that rank's answer, which
    is what the controller's minimum across ranks needs."""
    pool = tmp_path / "pool"
    ranks = []
    for r in (0, 1):
        hc.set_parallel(tp_rank=r, tp_size=2)
        _, host = hc.host_pool(heads=1)
        ranks.append((backend(pool, host, tp_rank=r, tp_size=2), host))
    try:
        keys = [f"{i:064x}" for i in range(6)]
        written = {}
        for r, (b, host) in enumerate(ranks):
            idx = host.alloc(6 * hc.PAGE)
            hc.fill_pages(host, idx, seed=100 + r)
            assert b.batch_set_v1(keys, idx) == [True] * 6
            written[r] = hc.pages_digest(host, idx, 6)
        assert len(pool_files(pool)) == 12  # a shard per rank per page
        assert [b.batch_exists(keys) for b, _ in ranks] == [6, 6]
        for r, (b, host) in enumerate(ranks):
            idx = host.alloc(6 * hc.PAGE)
            assert b.batch_get_v1(keys, idx) == [True] * 6
            assert hc.pages_digest(host, idx, 6) == written[r]
        b1 = ranks[1][0]
        cid = page_chunk_id(b1.store.namespace.digest, keys[3])
        next(p for p in pool_files(pool) if p.name.startswith(cid.key.hex())).unlink()
        assert [b.batch_exists(keys) for b, _ in ranks] == [6, 3]
    finally:
        for b, _ in ranks:
            b.close()


def test_mla_pages_are_written_once_by_the_storage_writer(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    _, host = hc.host_pool()
    writer, other = (backend(pool, host, tp_rank=r, tp_size=2, mla=True) for r in (0, 1))
    try:
        assert writer.is_writer and not other.is_writer
        idx = host.alloc(2 * hc.PAGE)
        keys = ["aa" * 32, "bb" * 32]
        assert other.batch_set_v1(keys, idx) == [True, True] and not pool_files(pool)
        assert writer.batch_set_v1(keys, idx) == [True, True] and len(pool_files(pool)) == 2
        assert other.batch_exists(keys) == 2  # one namespace for every rank of an MLA model
    finally:
        writer.close()
        other.close()


def test_settings_sglang_decides_are_refused_and_secrets_come_from_the_file(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _, host = hc.host_pool()
    with pytest.raises(ValueError, match="chunk_tokens"):
        StorageBackendFactory.create_backend("dynamic", storage_config({"chunk_tokens": 256}), host)
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(f"pool_url: {new_pool(tmp_path / 'pool')}\ntenant_salt: ${{TEST_SALT}}\n")
    monkeypatch.setenv("TEST_SALT", "s3cret-salt")
    b = StorageBackendFactory.create_backend("dynamic", storage_config({"config": str(cfg)}), host)
    b.register_mem_pool_host(host)
    plain = backend(tmp_path / "pool", host)
    try:
        assert b.store.config.tenant_salt == "s3cret-salt" and "s3cret" not in repr(b.store.config)
        idx = host.alloc(hc.PAGE)
        assert b.batch_set_v1(["ee" * 32], idx) == [True]
        assert b.batch_exists(["ee" * 32]) == 1 and plain.batch_exists(["ee" * 32]) == 0  # tenants apart
    finally:
        b.close()
        plain.close()


def test_the_pool_budget_holds_and_stats_reach_sglang(tmp_path: Path) -> None:
    """128 pages into a pool of 40: the budget holds, a page the pool refuses (eviction behind the
    writer) is False, never an exception, and SGLang's storage stats count the pages that landed."""
    _, host = hc.host_pool()
    page_file = 4096 + hc.PAGE * hc.LAYERS * 2 * hc.HEADS * hc.HEAD_DIM * 2
    cfg = storage_config({"pool_url": new_pool(tmp_path / "pool"), "pool_bytes": 40 * page_file})
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    b.register_mem_pool_host(host)
    try:
        landed: list[bool] = []
        for batch in range(4):
            idx = host.alloc(32 * hc.PAGE)
            keys = [f"{batch:02x}{i:062x}" for i in range(32)]
            landed += b.batch_set_v1(keys, idx)
            host.free(idx)
        assert landed[:32] == [True] * 32  # within the budget, every page lands
        # The pool refuses a page past its cap (budget + a margin) and evicts on a thread of its
        # own, down to the budget: the files never pass the cap and come back within the budget.
        budget, cap = 40 * page_file, b.store.tiers[0].cap_bytes
        assert budget < cap < 2 * budget
        deadline = time.monotonic() + 30
        while (size := pool_bytes(tmp_path / "pool")) > budget:
            assert size <= cap and time.monotonic() < deadline, size
            time.sleep(0.05)
        stats = b.get_stats()
        assert sum(stats.backup_pgs) == sum(landed) and all(bw > 0 for bw in stats.backup_bandwidth)
        assert b.get_stats().backup_pgs == []  # since the last call
    finally:
        b.close()
