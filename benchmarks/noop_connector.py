"""A vLLM v1 KV connector that does nothing: what a connector's mere presence costs in vLLM.

``benchmarks/save_cost.py --variants plain,noop,connector`` compares plain vLLM, vLLM with this
connector (vLLM's own per-step and per-layer calls into a connector, and nothing else) and
kvtier's connector with nothing to store (kvtier's own per-step work on top). Loaded by module
path: ``--kv-transfer-config '{"kv_connector": "NoopConnector", "kv_connector_module_path":
"noop_connector", "kv_role": "kv_both"}'`` with this folder on ``PYTHONPATH``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NoopConnector(KVConnectorBase_V1):
    """Never matches, never loads, never saves."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
