"""``KVTierConnector``: vLLM's KV connector API, forwarded to the scheduler or the worker role.

vLLM builds one instance in the engine-core process (role SCHEDULER) and one per worker rank
(role WORKER, beside the KV tensors; a separate process even at world size 1). They share
nothing but the picklable metadata of ``common.py``. This class only validates the
configuration (``config.py``: an unsupported deployment is refused here, at start) and
forwards each call to ``SchedulerRole`` (``scheduler.py``) or ``WorkerRole`` (``worker.py``).
A vLLM release it was not tested with is refused here too (``releases.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvtier.integrations.vllm.common import KVTierMetadata, KVTierWorkerMeta, MetricsFile
from kvtier.integrations.vllm.config import REQUIRED_LAYOUT, ConnectorConfig, deployment, store_config
from kvtier.integrations.vllm.counters import new_counters
from kvtier.integrations.vllm.events import ChunkEvents
from kvtier.integrations.vllm.releases import check as check_release
from kvtier.integrations.vllm.scheduler import SchedulerRole
from kvtier.integrations.vllm.stats import KVTierPromMetrics, KVTierStats, StatsSource
from kvtier.integrations.vllm.worker import WorkerRole
from kvtier.logs import show_in_engine

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)



def _tp_rank(vllm_config: VllmConfig) -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError, AttributeError):  # no TP group: a single rank
        return int(vllm_config.parallel_config.rank)


class KVTierConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvtier as a vLLM v1 KV connector; see ``kvtier.integrations.vllm``'s docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        # vLLM 0.32's engine always passes kv_cache_config; older callers (and tests) may not.
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        show_in_engine(os.environ)  # vLLM configures only its own logger: kvtier's lines need this
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None, "vLLM builds a KV connector only from --kv-transfer-config"
        extra = transfer.kv_connector_extra_config
        self.connector_config, settings = ConnectorConfig.split(extra)
        import vllm

        warning = check_release(vllm.__version__, self.connector_config.allow_untested_vllm)
        if warning is not None:
            log.warning(warning)
        self.deployment = deployment(vllm_config, kv_cache_config)
        rank = _tp_rank(vllm_config) if role == KVConnectorRole.WORKER else 0
        self.store_config = store_config(self.connector_config, settings, vllm_config, self.deployment,
                                   rank if role == KVConnectorRole.WORKER else None)
        self.counters: dict[str, int] = new_counters()
        self.scheduler: SchedulerRole | None = None
        self.worker: WorkerRole | None = None
        events_config = getattr(vllm_config, "kv_events_config", None)
        events = bool(events_config is not None and getattr(events_config, "enable_kv_cache_events", False))
        if role == KVConnectorRole.SCHEDULER:
            chunk_events = ChunkEvents(self.store_config.chunk_tokens, self.deployment.block_size,
                                       self.deployment.sharding.num_shards,
                                       self.connector_config.events_max_chunks) if events else None
            self.scheduler = SchedulerRole(self.connector_config, self.store_config, self.deployment, self.counters,
                                           events=chunk_events)
        else:
            self.worker = WorkerRole(self.connector_config, self.store_config, self.deployment, rank, self.counters,
                                     events=events)
        # One file per process: "scheduler", "worker" (rank 0), "worker1", ... (other ranks).
        label = role.name.lower() + (str(rank) if rank else "")
        self.metrics_file = MetricsFile(self.connector_config.metrics_file, label, self._snapshot)
        self.stats = StatsSource(label, self._read_stats)
        # %s of the configs: their reprs redact secrets (a Redis password, credentials in a URL).
        log.info("kvtier connector (%s, rank %d of %d): %s; %s; %s", role.name, rank,
                 self.deployment.sharding.world_size, self.connector_config, self.store_config, self.deployment)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return REQUIRED_LAYOUT

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """Sleep mode (vLLM 0.33+) is supported: the workers hold views of the KV tensors, and
        ``unregister_kv_caches`` / ``restore_kv_caches`` stop and resume every byte kvtier moves
        in or out of them around the sleep (``WorkerRole.sleep``). kvtier's tiers keep their
        chunks meanwhile: sessions resume after the wake-up."""
        return True

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """No (vLLM 0.34): kvtier keys chunks by the prompt's own tokens, never by hashes of
        tokens the engine has not committed."""
        return False

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def may_load_async(self, request: Request) -> bool:
        """vLLM 0.34 (``--max-num-inflight-kv-loads``): see ``SchedulerRole.may_load_async``."""
        return self.scheduler.may_load_async(request) if self.scheduler is not None else False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        self.metrics_file.maybe_write()
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self.scheduler is not None and isinstance(meta, KVTierWorkerMeta):
            known = self.scheduler.rates.known()
            self.scheduler.update_connector_output(meta)
            if known != self.scheduler.rates.known():
                # A rate measured for the first time: in the metrics file now, not at the next 5 s
                # tick or at shutdown, which vLLM may never give the scheduler's connector.
                self.metrics_file.write()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True (vLLM holds the blocks until ``get_finished`` says so) while generated tokens are saved."""
        if self.scheduler is None:
            return False, None
        held = self.scheduler.request_finished(request, block_ids)
        if not self.scheduler.requests_left():
            # Drained: the engine may idle or be stopped from here, and vLLM does not always give
            # the scheduler's connector its shutdown; the file is current whenever no request is left.
            self.metrics_file.write()
        return held, None

    def reset_cache(self) -> bool | None:
        """vLLM resets the connector's cache (new weights): see ``SchedulerRole.reset_cache``."""
        return self.scheduler.reset_cache() if self.scheduler is not None else None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """``BlockStored`` / ``BlockRemoved`` of kvtier's tiers since the last call (KV events on)."""
        events = self.scheduler.events if self.scheduler is not None else None
        return events.take() if events is not None else ()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: nothing is owed to anyone if a request goes away

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        self.worker.register_kv_caches(kv_caches, num_blocks)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33+ is going to sleep and releases the KV cache's memory (``WorkerRole.sleep``)."""
        if self.worker is not None:
            self.worker.sleep()

    def restore_kv_caches(self) -> None:
        """vLLM woke up: the KV cache is back where it was (``WorkerRole.wake``)."""
        if self.worker is not None:
            self.worker.wake()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KVTierMetadata):
            self.worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM's runner calls this first in a step, before it zeroes or reuses any block."""
        if self.worker is not None:
            self.worker.handle_preemptions()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and isinstance(meta, KVTierMetadata):
            self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a sync load completes in start_load_kv; a background one's request is not in this pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole chunks are saved after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and isinstance(meta, KVTierMetadata):
            self.worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        return self.worker.get_finished(finished_req_ids)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        self.metrics_file.maybe_write()
        return self.worker.report() if self.worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks() if self.worker is not None else set()

    # ---------------------------------------------------------------- metrics on vLLM's /metrics

    def get_kv_connector_stats(self) -> KVTierStats | None:
        """This process's counter increments and gauges since the last step (None: no change)."""
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats:
        return KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _read_stats(self) -> tuple[dict[str, float], dict[str, float]]:
        """(counters, gauges) of this process for ``stats.StatsSource``: its role's own."""
        role = self.scheduler or self.worker
        assert role is not None
        return role.stats()

    # ---------------------------------------------------------------- lifecycle

    def shutdown(self) -> None:
        """Flush pending writes; with ``metrics_file`` set, write the final counters there."""
        for role in (self.scheduler, self.worker):
            if role is not None:
                role.close()
        self.metrics_file.write()

    def _snapshot(self) -> dict[str, Any]:
        snapshot: dict[str, Any] = {"pid": os.getpid(), "connector": dict(self.counters)}
        for role in (self.scheduler, self.worker):
            if role is not None:
                snapshot.update(role.snapshot())
        return snapshot
