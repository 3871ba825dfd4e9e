"""kvtier as a vLLM v1 KV connector: resumed sessions read their KV back instead of prefilling.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"pool_url": "fs:///mnt/pool", ...}}'

The extra config takes ``TieredStore.open``'s settings (``host_bytes``, ``disk_path``,
``pool_url``, ...) and/or ``"config": "kvtier.yaml"``, plus the connector's own settings
(``ConnectorConfig``: ``load_policy``, ``read_gbps``, ...). The KV layout comes from vLLM.
``kv_load_failure_policy`` must be ``recompute`` (vLLM's default is ``fail``): the connector
refuses to start otherwise, because a chunk that vanishes or fails validation between lookup
and load would fail the request.

The package: ``connector`` (the facade vLLM loads), ``config`` (settings, the deployment
checks, sharding and ``kv_format``), ``scheduler`` (lookups, load decisions, per-request
state), ``worker`` (byte movement and the store), ``common`` (the metadata between the roles).
Supported and refused deployments: docs/vllm.md.
"""

from kvtier.integrations.vllm.config import ConnectorConfig, UnsupportedDeployment
from kvtier.integrations.vllm.connector import KVTierConnector

__all__ = ["ConnectorConfig", "KVTierConnector", "UnsupportedDeployment"]
