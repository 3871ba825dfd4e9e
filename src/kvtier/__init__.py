"""kvtier: KV-cache tiering for LLM engines (host DRAM -> local disk -> shared pool)."""

from kvtier.config import StoreConfig
from kvtier.errors import KVTierError, TierUnavailableError
from kvtier.keys import ChunkId, ChunkKey, Namespace
from kvtier.layout import KVLayout
from kvtier.store import LoadedChunk, LookupResult, PrefixLoad, PutResult, TieredStore

__all__ = [
    "ChunkId",
    "ChunkKey",
    "KVLayout",
    "KVTierError",
    "LoadedChunk",
    "LookupResult",
    "Namespace",
    "PrefixLoad",
    "PutResult",
    "StoreConfig",
    "TierUnavailableError",
    "TieredStore",
]
__version__ = "0.1.0"
