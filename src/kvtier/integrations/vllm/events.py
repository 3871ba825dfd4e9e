"""KV events for cache-aware routers: ``BlockStored`` / ``BlockRemoved`` when kvtier's tiers change.

With vLLM's ``--kv-events-config`` (``enable_kv_cache_events``), vLLM publishes its own block
pool's events on ZMQ; the scheduler adds the connector's (``take_events``), in the same stream.
kvtier's events use vLLM's types and vLLM's own block hashes (``request.block_hashes``, one per
KV block of ``block_size`` tokens), so a router indexes a chunk exactly as it indexes vLLM's
blocks: one event per chunk carries the hashes of its ``chunk_tokens / block_size`` blocks, the
hash of the block before it, its token ids and its LoRA name.

Where a chunk is, is told by ``medium`` and ``ownership`` (the kvtier tier):

====================  =========  ==========
tier                  medium     ownership
====================  =========  ==========
host DRAM             CPU        host
local disk            STORAGE    disk
shared pool (fs)      STORAGE    pool
shared pool (Redis)   STORAGE    redis
====================  =========  ==========

(one row per kind in ``kvtier.tiers.kinds``, Redis's too). The scheduler remembers the hashes
of chunks this instance saved or loaded (``remember``, at most ``max_chunks``, least recently
used dropped first); the first tensor-parallel rank reports what its tiers added and removed
(``changed``), including chunks any instance or ``kvtier pool gc`` evicted from the pool
(``ROOT/.evicted``). A chunk is announced once per
tier it reaches and withdrawn once per tier it leaves; a change of a chunk this process does
not remember (written by another instance, or forgotten) publishes nothing.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from kvtier.keys import ChunkId, shard_id
from kvtier.tiers.kinds import KINDS

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class _Chunk:
    block_hashes: list[Any]  # vLLM's ExternalBlockHash (bytes, or int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    parent: Any
    token_ids: array[int]  # compact: a chunk is remembered until it leaves every tier
    lora_name: str | None
    lora_id: int | None
    extra_keys: list[Any] | None
    tiers: set[str] = field(default_factory=set)


def _external(block_hash: Any) -> Any:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(block_hash)


def _extra_keys(request: Request, start: int, end: int, block_size: int) -> list[Any] | None:
    """vLLM's per-block extra keys (LoRA, multimodal, cache_salt) as its own events publish them."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

        keys, mm_idx = [], 0
        for s in range(start, end, block_size):
            extra, mm_idx = generate_block_hash_extra_keys(request, s, s + block_size, mm_idx)
            keys.append(extra)
        return to_event_extra_keys(keys)
    except Exception:  # an older or newer vLLM: the hashes alone identify the blocks
        return None


class ChunkEvents:
    """See the module docstring."""

    def __init__(self, chunk_tokens: int, block_size: int, num_shards: int, max_chunks: int) -> None:
        self.chunk_tokens, self.block_size, self.num_shards = chunk_tokens, block_size, num_shards
        self.blocks_per_chunk = chunk_tokens // block_size
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[bytes, _Chunk] = OrderedDict()  # first rank's shard key -> chunk
        self._events: list[KVCacheEvent] = []

    def remember(self, request: Request, ids: Sequence[ChunkId], first: int, end: int) -> None:
        """Chunks ``first..end`` of ``request`` (``ids`` are its logical chunk ids) are being
        saved or loaded: keep their hashes for the events their tiers will cause."""
        hashes = getattr(request, "block_hashes", None) or []
        tokens = request.all_token_ids
        bpc = self.blocks_per_chunk
        lora = getattr(request, "lora_request", None)
        for i in range(first, min(end, len(ids))):
            if (i + 1) * bpc > len(hashes):
                break  # vLLM has not hashed these blocks (cannot happen for full chunks)
            key = shard_id(ids[i], 0, self.num_shards).key
            known = self._chunks.get(key)
            if known is not None:
                self._chunks.move_to_end(key)
                continue
            start = i * self.chunk_tokens
            self._chunks[key] = _Chunk(
                [_external(h) for h in hashes[i * bpc:(i + 1) * bpc]],
                _external(hashes[i * bpc - 1]) if i else None,
                array("q", tokens[start:start + self.chunk_tokens]),
                lora.name if lora is not None else None,
                getattr(lora, "adapter_id", None) if lora is not None else None,
                _extra_keys(request, start, start + self.chunk_tokens, self.block_size))
        while len(self._chunks) > self.max_chunks:
            self._chunks.popitem(last=False)

    def changed(self, tier: str, added: bool, key: bytes) -> None:
        """The first rank's ``tier`` added or removed the chunk with shard key ``key``."""
        chunk = self._chunks.get(key)
        if chunk is None or tier not in KINDS:
            return
        medium = KINDS[tier].medium
        if added and tier not in chunk.tiers:
            chunk.tiers.add(tier)
            self._events.append(BlockStored(
                block_hashes=chunk.block_hashes, parent_block_hash=chunk.parent, token_ids=chunk.token_ids.tolist(),
                block_size=self.block_size, lora_id=chunk.lora_id, medium=medium, lora_name=chunk.lora_name,
                extra_keys=chunk.extra_keys, group_idx=0, ownership=tier))
        elif not added and tier in chunk.tiers:
            chunk.tiers.discard(tier)
            self._events.append(BlockRemoved(block_hashes=chunk.block_hashes, medium=medium, group_idx=0,
                                             ownership=tier))

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
