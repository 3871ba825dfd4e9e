"""kvtier as SGLang HiCache's L3 storage backend (sglang 0.5.23's dynamic backend loader).

Launch SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KVTierHiCacheStorage",
        "interface_v1": 1, "pool_url": "fs:///mnt/pool", "pool_bytes": "10TiB"}'

The extra config takes ``TieredStore.open``'s settings below host DRAM (``disk_path``,
``pool_url``, ``pool_bytes``, ``io_threads``, ``read_timeout_s``, ``tenant_salt``, ...) and/or
``"config": "kvtier.yaml"``; SGLang's host pool is the DRAM level. The package: ``pages``
(page names as chunk identities, the namespace, settings; no SGLang import) and ``backend``
(the ``HiCacheStorage`` subclass). ``KVTierHiCacheStorage`` is imported on first use, so
``kvtier.integrations.sglang.pages`` works without SGLang installed. See docs/sglang.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVTierHiCacheStorage":
        from kvtier.integrations.sglang.backend import KVTierHiCacheStorage

        return KVTierHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
