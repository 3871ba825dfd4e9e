"""Tiny factories shared by the tests: a 2-layer, 2-head, 8-dim layout with 16-token chunks.

One chunk is 2048 payload bytes (8192 on disk with its 4096-byte header and padding), so a
test can store dozens of chunks in milliseconds. Also the fixtures and helpers of the chunk
directory tests: ``pool_dir``, ``open_pool``, ``kvt_files``, ``bytes_on_disk``, ``within``.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from gluster import gluster, gluster_pool  # noqa: F401  (fixtures: a GlusterFS volume mounted twice)
from kvtier import KVLayout, StoreConfig, TieredStore
from kvtier.format import PAYLOAD_OFFSET, ChunkSpec, file_bytes_for
from kvtier.keys import ChunkId, Namespace, chunk_ids
from kvtier.layout import DTYPE_CODES
from kvtier.tiers.base import Chunk
from kvtier.tiers.pagecache import cached_bytes
from kvtier.tiers.pool import PoolTier

CHUNK_TOKENS = 16
MODEL_ID = "tiny-llama"


@dataclass(frozen=True)
class Tiny:
    """Factories for one tiny model; every method is deterministic in its ``seed``."""

    layout: KVLayout = field(default_factory=lambda: KVLayout(num_layers=2, num_kv_heads=2, head_dim=8,
                                                              dtype=torch.bfloat16))
    chunk_tokens: int = CHUNK_TOKENS
    model_id: str = MODEL_ID

    @property
    def payload_bytes(self) -> int:
        return self.chunk_tokens * self.layout.bytes_per_token

    @property
    def file_bytes(self) -> int:
        return file_bytes_for(self.payload_bytes)

    def config(self, **overrides: Any) -> StoreConfig:
        settings: dict[str, Any] = {"model_id": self.model_id, "layout": self.layout,
                                    "chunk_tokens": self.chunk_tokens, "host_bytes": 1 << 20,
                                    "io_threads": 2, "read_timeout_s": 5.0}
        settings.update(overrides)
        return StoreConfig(**settings)

    def namespace(self, **overrides: Any) -> Namespace:
        fields_: dict[str, Any] = {"model_id": self.model_id, "layout": self.layout,
                                   "chunk_tokens": self.chunk_tokens}
        fields_.update(overrides)
        return Namespace(**fields_)

    def spec(self, namespace: Namespace | None = None) -> ChunkSpec:
        """What a store of this model expects of its chunk files."""
        ns = namespace or self.namespace()
        return ChunkSpec(ns.digest, DTYPE_CODES[ns.layout.dtype], ns.layout.shape(ns.chunk_tokens),
                         ns.chunk_tokens * ns.layout.bytes_per_token)

    def tokens(self, n: int, seed: int = 0) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(0, 50_000) for _ in range(n)]

    def kv(self, n: int, seed: int = 0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(self.layout.shape(n), generator=gen).to(self.layout.dtype)

    def ids(self, n_chunks: int, seed: int = 0, namespace: Namespace | None = None) -> list[ChunkId]:
        return chunk_ids(namespace or self.namespace(), self.tokens(n_chunks * self.chunk_tokens, seed))

    def chunks(self, n_chunks: int, seed: int = 0) -> list[Chunk]:
        """``n_chunks`` chained chunks with real ids and random KV."""
        kv = self.kv(n_chunks * self.chunk_tokens, seed)
        c = self.chunk_tokens
        return [Chunk(cid, kv[:, :, i * c:(i + 1) * c].contiguous())
                for i, cid in enumerate(self.ids(n_chunks, seed))]

    def image(self, chunk: Chunk, spec: ChunkSpec | None = None) -> bytearray:
        """The exact bytes ChunkFiles writes for ``chunk`` (header, payload, padding)."""
        spec = spec or self.spec()
        payload = chunk.payload()
        header = spec.header_for(chunk.id, payload).pack()
        return bytearray(header + bytes(payload) + bytes(spec.file_bytes - PAYLOAD_OFFSET - len(payload)))


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same shape, dtype and bytes (torch.equal on the raw bits: -0.0 != 0.0 here)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(autouse=True)
def _kvtier_logger_as_it_was() -> Iterator[None]:
    """A connector built in the test's process sets the ``kvtier`` logger's level
    (``kvtier.logs.show_in_engine``): put it back, so no test sees records another let through."""
    logger = logging.getLogger("kvtier")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers = handlers


@pytest.fixture
def tiny() -> Tiny:
    return Tiny()


@pytest.fixture
def make_store(tiny: Tiny) -> Iterator[Any]:
    """``make_store(**config_overrides, tiers=None, host=None)`` -> an open TieredStore, closed after
    the test (``tiers``/``host``: TieredStore's)."""
    stores: list[TieredStore] = []

    def factory(*, tiers: Any = None, host: Any = None, **overrides: Any) -> TieredStore:
        store = TieredStore(tiny.config(**overrides), tiers=tiers, host=host)
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


@pytest.fixture
def bits_equal() -> Any:
    return assert_bits_equal


def within(fn: Callable[[], Any], seconds: float) -> Any:
    """``fn()``'s result if it returns within ``seconds``; AssertionError if it blocks (it is left
    running on a daemon thread)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} blocked for over {seconds} s"
    return out[0] if out else None


def require_cachestat(path: Path) -> None:
    """Skip the test unless the kernel can tell how much of ``path`` the page cache holds
    (``cachestat``, Linux 6.5): without it no read counts as a page-cache hit."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if cached_bytes(fd) is None:
            pytest.skip("the kernel has no cachestat (Linux < 6.5): reads never claim the page cache")
    finally:
        os.close(fd)


def kvt_files(root: Path) -> list[Path]:
    """The chunk files (``*.kvt``) under ``root``, sorted; temp files are not among them."""
    return sorted(root.rglob("*.kvt"))


def bytes_on_disk(root: Path) -> int:
    """The sizes of the chunk files under ``root``, summed (what a pool's budget counts). A
    file an evictor thread removes between the listing and its stat is not on disk: 0 bytes."""
    total = 0
    for p in kvt_files(root):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            continue
    return total


@pytest.fixture
def pool_dir(tmp_path: Path) -> Path:
    return tmp_path / "pool"


@pytest.fixture
def open_pool(pool_dir: Path) -> Iterator[Callable[..., PoolTier]]:
    """``open_pool(capacity_bytes=None, **PoolTier options)`` -> a PoolTier on ``pool_dir``, closed
    after the test; call it again for another instance sharing the directory."""
    tiers: list[PoolTier] = []

    def factory(capacity_bytes: int | None = None, **kw: Any) -> PoolTier:
        tier = PoolTier(pool_dir, capacity_bytes, **kw, create=True)
        tiers.append(tier)
        return tier

    yield factory
    for tier in tiers:
        tier.close()


# tests/hicache/ runs in the SGLang venv (scripts/sglang-venv.sh; scripts/test.sh runs it there):
# elsewhere it is not collected at all, rather than skipped file by file.
import importlib.util as _importlib_util  # noqa: E402


def _has_sglang() -> bool:
    try:
        return _importlib_util.find_spec("sglang.srt") is not None
    except ImportError:
        return False


collect_ignore = [] if _has_sglang() else ["hicache"]


@pytest.hookimpl(tryfirst=True)  # the order the workers take modules in
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from _schedule import distributing, order_for_workers

    if distributing(config):
        order_for_workers(items)
