"""``kvtier serve``'s check of a kvtier config file before vLLM starts.

The connector reads its settings inside vLLM's processes, after the model has loaded, and a tier
it cannot open only costs that tier (an engine keeps serving). So a typo, a negative size or an
unmounted pool would otherwise surface minutes later as a log line, or not at all. Here every
setting is validated as the connector will read it (its own settings, and the store's with a
stand-in model and layout), and an fs pool's root must exist and be a pool. Importable without
vLLM.
"""

from __future__ import annotations

import os

import torch

from kvtier.config import load_settings
from kvtier.errors import TierUnavailableError
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.layout import KVLayout
from kvtier.tiers.poolroot import check_pool_root
from kvtier.urls import is_redis_url, parse_pool_url

_STAND_IN = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16)


def check_config(path: str | os.PathLike[str] | None) -> None:
    """Raise ValueError, naming the setting, for anything the connector would refuse or that
    would leave the pool unused; the file is read as the connector reads it (``${VAR}``
    expanded, ``KVTIER_*`` variables applied)."""
    connector, rest = ConnectorConfig.split({"config": os.fspath(path)} if path is not None else {})
    settings = dict(connector.file_settings)
    settings.setdefault("model_id", "preflight")
    config = load_settings(settings, **rest, layout=_STAND_IN)
    if config.pool_url is not None and not is_redis_url(config.pool_url):
        try:
            check_pool_root(parse_pool_url(config.pool_url))
        except TierUnavailableError as exc:
            raise ValueError(f"pool_url: {exc}") from None
