"""The SGLang backend's engine-free half (``integrations/sglang/pages.py``): page names as chunk
identities, the namespace each rank gets, and the settings it accepts. SGLang itself is tested
in tests/hicache/ (its own venv)."""

from __future__ import annotations

import pytest
import torch

from kvtier.integrations.sglang.pages import (
    BackendSettings,
    PageGeometry,
    Parallel,
    page_chunk_id,
    page_digest,
    store_config,
)
from kvtier.keys import recompute_key


class FakePool:
    """The few attributes of an SGLang host pool that the geometry reads (layer_first MHA)."""

    def __init__(self, layers: int = 3, heads: int = 2, head_dim: int = 8, page: int = 4) -> None:
        self.layout, self.page_size, self.dtype, self.layer_num = "layer_first", page, torch.float16, layers
        self.head_num, self.head_dim, self.v_head_dim = heads, head_dim, head_dim
        self.kv = torch.zeros(2, layers, 4 * page, heads, head_dim, dtype=torch.float16)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv[:, :, index:index + self.page_size]
        return page.flatten() if flat else page


def test_page_names_become_verifiable_chunk_ids() -> None:
    ns = bytes(range(32))
    key = "ab" * 32
    cid = page_chunk_id(ns, key)
    assert cid is not None and cid.tokens_digest == bytes.fromhex(key) and cid.parent == ns
    assert cid.key == recompute_key(cid.parent, cid.tokens_digest)  # what `pool verify` rechecks
    assert page_chunk_id(bytes(32), key).key != cid.key  # another namespace, another file
    assert page_digest("AB" * 32) == page_digest(key)
    assert page_digest(key + ".mamba") not in (None, page_digest(key))  # sidecar names hashed
    for hostile in (None, 7, b"ab" * 32, "", "x" * 5000):
        assert page_digest(hostile) is None


def test_each_rank_gets_its_namespace_and_mla_shares_one() -> None:
    geometry = PageGeometry.of(FakePool())
    assert geometry.layout.num_kv_heads == 2 and geometry.page_bytes == 4 * 3 * 2 * 2 * 8 * 2
    settings = BackendSettings.from_extra({"backend_name": "kvtier", "interface_v1": 1, "disk_path": "/tmp/x"})

    def namespace(**parallel):
        return store_config(settings, geometry, Parallel(**parallel), "m").namespace()

    r0, r1 = namespace(tp_rank=0, tp_size=2), namespace(tp_rank=1, tp_size=2)
    assert r0.digest != r1.digest and (r1.rank, r1.world_size) == (1, 2)
    assert namespace(tp_rank=0, tp_size=2, replicated=True) == namespace(tp_rank=1, tp_size=2, replicated=True)
    pp = namespace(pp_rank=1, pp_size=2)
    assert pp.kv_format == "sglang-layer_first-pp1of2" and pp.digest != namespace().digest
    config = store_config(settings, geometry, Parallel(), "m")
    assert config.host_bytes == 0 and config.chunk_tokens == 4 and config.disk_path == "/tmp/x"


def test_settings_sglang_decides_are_refused() -> None:
    for key in ("chunk_tokens", "layout", "dtype", "rank", "kv_format", "host_bytes"):
        with pytest.raises(ValueError, match=key):
            BackendSettings.from_extra({key: 1})
    with pytest.raises(ValueError, match="metrics_port"):
        BackendSettings.from_extra({"metrics_port": "9000"})
    with pytest.raises(ValueError, match="model name"):
        store_config(BackendSettings.from_extra({}), PageGeometry.of(FakePool()), Parallel(), None)
    assert BackendSettings.from_extra({"model_id": "override"}).store == {"model_id": "override"}


def test_a_pool_whose_pages_are_not_whole_chunks_is_refused() -> None:
    pool = FakePool()
    pool.head_num = None  # not an MHA pool: a nominal layout of the page's size
    assert PageGeometry.of(pool).page_bytes == FakePool().get_data_page(0).numel() * 2
    pool.get_data_page = lambda index, flat=True: torch.zeros(7, dtype=torch.float16)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="not supported"):
        PageGeometry.of(pool)


@pytest.mark.parametrize("replicated", [False, True])
def test_tensor_parallel_ranks_with_one_disk_path_open_their_own_directories(tmp_path, replicated) -> None:
    """6f37bba gave every rank the same disk_path: the disk tier's exclusive lock failed every
    rank but the first at start."""
    from kvtier import TieredStore

    geometry = PageGeometry.of(FakePool())
    settings = BackendSettings.from_extra({"backend_name": "kvtier", "interface_v1": 1,
                                           "disk_path": str(tmp_path / "disk")})
    configs = [store_config(settings, geometry, Parallel(tp_rank=r, tp_size=2, replicated=replicated), "m")
               for r in range(2)]
    assert [c.disk_path for c in configs] == [str(tmp_path / "disk" / f"tp{r}-of-2") for r in range(2)]
    stores = [TieredStore(c) for c in configs]  # both at once, each holding its directory's lock
    try:
        assert all([t.name for t in s.tiers] == ["disk"] for s in stores)
    finally:
        for s in stores:
            s.close()
    assert store_config(settings, geometry, Parallel(), "m").disk_path == str(tmp_path / "disk")
