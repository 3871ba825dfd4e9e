"""SGLang's HiCache pages as kvtier chunks: identities, geometry and settings (no SGLang import).

HiCache names a page of ``page_size`` tokens by a chained SHA-256 (64 hex characters) of its
tokens and every page before it; the name carries no model, rank, dtype or layout. kvtier
stores each page as one chunk file of the pool's usual format, so ``kvtier pool verify / gc /
stats`` work on it unchanged, and scopes it by the namespace: the model (and the content of its
weights when its directory is known), the host pool's dtype and page geometry, its layout
(``kv_format`` ``sglang-<layout>``: the payload is the page exactly as the host pool's
``get_data_page`` lays it out), the TP rank and size (one namespace for all ranks of an MLA
model, whose KV every rank holds whole), the PP and attention-CP stage, and the tenant salt.

A page's identity (``page_chunk_id``): parent = the namespace digest, token digest = the 32
bytes of SGLang's hash, so its key is ``BLAKE3(namespace || hash)`` and ``pool verify``
rechecks it from the header alone. A name that is not 64 hex characters (a sidecar pool's
``<hash>.<pool>``) is hashed with BLAKE3 first; anything that is not a short string is refused.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from blake3 import blake3

from kvtier.codec import FLOAT_DTYPES, KVGeometry
from kvtier.config import StoreConfig, load_settings, read_settings_file
from kvtier.identity import content_digest, local_dir
from kvtier.keys import ChunkId, recompute_key
from kvtier.layout import KVLayout

MAX_KEY_CHARS = 1024
_HEX = frozenset("0123456789abcdefABCDEF")

SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size")
"""Keys of the extra config that SGLang itself reads (its dynamic-backend loader)."""
log = logging.getLogger(__name__)
_warned_unidentified: set[str] = set()

BACKEND_KEYS = ("config", "model_path", "metrics_port")
"""The backend's own settings; every other key is a ``StoreConfig`` setting."""
SET_BY_SGLANG = ("model_id", "layout", "num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_tokens",
                 "chunk_size", "rank", "world_size", "kv_format", "host_bytes", "model_digest")
"""Store settings the backend derives from SGLang's host pool and parallel state."""


def page_digest(key: object) -> bytes | None:
    """The 32 bytes naming a HiCache page, or None for a key that is not a reasonable string."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        return None
    if len(key) == 64 and _HEX.issuperset(key):
        return bytes.fromhex(key)
    return blake3(b"kvtier-sglang-key\0" + key.encode("utf-8", "surrogatepass")).digest()


def page_chunk_id(namespace_digest: bytes, key: object) -> ChunkId | None:
    """The chunk identity of the page ``key`` in a namespace (module docstring), or None."""
    digest = page_digest(key)
    if digest is None:
        return None
    return ChunkId(recompute_key(namespace_digest, digest), namespace_digest, digest)


@dataclass(frozen=True)
class PageGeometry:
    """What one page of a host pool is: its layout name, tokens, dtype and byte size."""

    layout_name: str
    page_size: int
    layout: KVLayout
    """A ``KVLayout`` whose ``page_size`` tokens have exactly the page's bytes (for an MHA pool
    its real layers, KV heads and head size; otherwise a nominal one of the same size)."""
    page_shape: tuple[int, ...]

    @classmethod
    def of(cls, host_pool: Any) -> PageGeometry:
        """Read an SGLang host pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``, ...).

        Raises ValueError for a pool whose pages cannot be stored as whole chunks.
        """
        layout_name = str(host_pool.layout)
        page_size = int(host_pool.page_size)
        dtype = host_pool.dtype
        layers = int(host_pool.layer_num)
        page = host_pool.get_data_page(0, flat=False)
        numel = int(page.numel())
        if page.dtype != dtype:
            raise ValueError(f"the host pool's pages are {page.dtype}, its dtype {dtype}")
        heads, head_dim = getattr(host_pool, "head_num", None), getattr(host_pool, "head_dim", None)
        v_head_dim = getattr(host_pool, "v_head_dim", head_dim)
        if isinstance(heads, int) and isinstance(head_dim, int) and v_head_dim == head_dim \
                and numel == layers * 2 * page_size * heads * head_dim:
            layout = KVLayout(layers, heads, head_dim, dtype)
        else:
            # MLA (one latent per token), K and V of different widths: a nominal layout of the
            # page's size; the kv_format names the real one.
            per = 2 * layers * page_size
            if numel % per:
                raise ValueError(f"a page of {numel} elements is not {layers} layers x {page_size} tokens x 2 halves; "
                                 f"the {type(host_pool).__name__} pool is not supported")
            layout = KVLayout(layers, 1, numel // per, dtype)
        return cls(layout_name, page_size, layout, tuple(page.shape))

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.layout.bytes_per_token

    def kv_geometry(self) -> KVGeometry | None:
        """Where K and V sit in a page, for a KV codec: an MHA host pool's page is ``[2, ...]``,
        all its K rows (``head_dim`` elements each, over layers, tokens and heads in the layout's
        order) before all its V rows. None for a page that is not so (MLA, K and V of different
        widths) or not floating point: its chunks are then stored as they are."""
        layout, shape = self.layout, self.page_shape
        if layout.dtype not in FLOAT_DTYPES or not shape or shape[0] != 2 or shape[-1] != layout.head_dim:
            return None
        if layout.num_kv_heads * layout.head_dim * layout.num_layers * self.page_size * 2 != math.prod(shape):
            return None
        rows = math.prod(shape) // (2 * layout.head_dim)
        return KVGeometry(1, 1, rows, layout.head_dim, layout.dtype, interleaved=False)


@dataclass(frozen=True)
class BackendSettings:
    """The backend's own settings and the store settings, split from SGLang's extra config."""

    store: dict[str, Any]
    model_path: str | None = None
    metrics_port: int | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> BackendSettings:
        """Split ``--hicache-storage-backend-extra-config``: SGLang's keys dropped, ``config``
        (a kvtier YAML file, ``${VAR}`` expanded here so a secret stays off argv) read, the
        extra config winning over the file. Raises ValueError on a setting SGLang decides."""
        rest = {k: v for k, v in dict(extra or {}).items() if k not in SGLANG_KEYS}
        path = rest.pop("config", None)
        store: dict[str, Any] = {}
        if path is not None:
            if not isinstance(path, (str, os.PathLike)) or not str(path):
                raise ValueError(f"kvtier setting config: expected a file path, got {path!r}")
            store.update(read_settings_file(path))
        mine = {k: rest.pop(k) for k in BACKEND_KEYS if k in rest}
        mine.update({k: store.pop(k) for k in BACKEND_KEYS if k in store and k not in mine})
        store.update(rest)
        clash = sorted(k for k in store if k in SET_BY_SGLANG and k != "model_id")
        if clash:
            raise ValueError(f"kvtier setting(s) {', '.join(clash)}: SGLang decides these (its host pool's "
                             "page size, dtype and layout, its parallel ranks); leave them out")
        port = mine.get("metrics_port")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError(f"kvtier setting metrics_port: expected a TCP port, got {port!r}")
        model_path = mine.get("model_path")
        if model_path is not None and (not isinstance(model_path, str) or not model_path):
            raise ValueError(f"kvtier setting model_path: expected a directory, got {model_path!r}")
        return cls(store, model_path, port)


@dataclass(frozen=True)
class Parallel:
    """The parts of SGLang's ``HiCacheStorageConfig`` that scope a namespace."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    replicated: bool = False
    """MLA: every TP rank holds the whole KV, so all ranks share one namespace."""

    @classmethod
    def of(cls, storage_config: Any) -> Parallel:
        return cls(int(storage_config.tp_rank), int(storage_config.tp_size), int(storage_config.pp_rank),
                   int(storage_config.pp_size), int(getattr(storage_config, "attn_cp_rank", 0)),
                   int(getattr(storage_config, "attn_cp_size", 1)), bool(storage_config.is_mla_model))


def store_config(settings: BackendSettings, geometry: PageGeometry, parallel: Parallel,
                 model_name: str | None) -> StoreConfig:
    """The ``StoreConfig`` of one rank's backend: no host DRAM (SGLang's host pool is that
    level), one chunk per page, the namespace of the module docstring."""
    store = dict(settings.store)
    model_id = store.pop("model_id", None) or model_name
    if not model_id:
        raise ValueError("kvtier: SGLang gave no model name; set model_id in the extra config")
    digest, weights = model_digests(settings.model_path or model_name)
    stage = ""
    if parallel.pp_size > 1:
        stage += f"-pp{parallel.pp_rank}of{parallel.pp_size}"
    if parallel.cp_size > 1:
        stage += f"-cp{parallel.cp_rank}of{parallel.cp_size}"
    rank, world = (0, 1) if parallel.replicated else (parallel.tp_rank, parallel.tp_size)
    config = load_settings(store, model_id=str(model_id), layout=geometry.layout, chunk_tokens=geometry.page_size,
                           host_bytes=0, rank=rank, world_size=world,
                           kv_format=f"sglang-{geometry.layout_name}{stage}",
                           model_digest=digest, weights_digest=weights)
    if config.disk_path is not None:
        config = replace(config, disk_path=disk_path_of(config.disk_path, parallel))
    if not weights and config.pool_url is not None and model_id not in _warned_unidentified:
        _warned_unidentified.add(model_id)
        log.warning("kvtier: found no weight files of %s (neither a directory nor a snapshot with weights in the "
                    "Hugging Face cache): its pages are keyed by its name only, so another checkpoint served under "
                    "this name would read them; set model_path in the extra config", model_id)
    return config


def disk_path_of(disk_path: str, parallel: Parallel) -> str:
    """Each rank's own disk tier directory (a disk tier holds an exclusive lock on its directory, so
    ranks sharing one failed at start on all but the first): ``tpR-of-N`` (``-ppS``, ``-cpC``
    where those split the KV), as the vLLM connector names them."""
    parts = []
    if parallel.tp_size > 1:
        parts.append(f"tp{parallel.tp_rank}-of-{parallel.tp_size}")
    if parallel.pp_size > 1:
        parts.append(f"pp{parallel.pp_rank}-of-{parallel.pp_size}")
    if parallel.cp_size > 1:
        parts.append(f"cp{parallel.cp_rank}-of-{parallel.cp_size}")
    return os.path.join(disk_path, "-".join(parts)) if parts else disk_path


def model_digests(model: str | None) -> tuple[str, str]:
    """(the namespace's ``model_digest``, the weights' content digest) of a model directory or an HF
    id (its snapshot in the local cache; the snapshot's name, the resolved revision, is folded in);
    ("", "") when no weights are found."""
    root = local_dir(model, None) if model else None
    if root is None:
        return "", ""
    weights = content_digest(root)
    if model is not None and os.path.isdir(model):
        return weights, weights  # a directory: as before, so its pools stay warm
    return blake3(f"kvtier-sglang-hf\0{root.name}\0{weights}".encode()).hexdigest(), weights
