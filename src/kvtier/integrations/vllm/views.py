"""The scheduler's lookup views and request keys: what the scheduler sees without any KV.

``HostView`` mirrors the keys one worker rank's host DRAM holds (fed by the workers' reports);
``FileLookup`` checks a rank's disk directory by file existence; ``request_extra`` is what,
beyond its token ids, changes a request's KV (and so enters its chunk keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from blake3 import blake3

from kvtier.keys import ChunkId
from kvtier.metrics import TierMetrics
from kvtier.tiers.base import leading_held
from kvtier.tiers.files import ChunkFiles

if TYPE_CHECKING:
    from vllm.v1.request import Request


class HostView:
    """The scheduler's mirror of the keys one worker rank's host DRAM holds: a lookup-only
    ``Level`` (``tiers.base``).

    It lags the worker by at most one step; a chunk evicted in between is read from disk or
    the pool if it is there, and otherwise reported as a failed load that vLLM recomputes: a
    stale view costs a recompute, never a wrong answer.
    """

    name = "host"
    may_hang = False

    def __init__(self) -> None:
        self.metrics = TierMetrics(self.name)
        self.keys: set[bytes] = set()

    def apply(self, changes: Sequence[tuple[bool, bytes]]) -> None:
        for added, key in changes:
            if added:
                self.keys.add(key)
            else:
                self.keys.discard(key)
        self.metrics.set(chunks=len(self.keys))

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        return leading_held(ids, self.keys)

    def close(self) -> None:
        self.keys.clear()


class FileLookup:
    """Lookup-only view of a chunk directory (a rank's disk tier), a ``Level``: no lock, no index."""

    may_hang = False  # a local disk

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.metrics = TierMetrics(name)
        self.files = ChunkFiles(path, create=False)

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        return self.files.leading_present(ids)

    def close(self) -> None:
        return  # holds no handles


def request_extra(request: Request) -> bytes | None:
    """Bytes that change a request's KV beyond its token ids; None: do not serve it from kvtier.

    A LoRA adapter (name and path) and multimodal inputs (each item's content hash and
    placeholder position) change the KV of the same prompt ids. Requests given as prompt
    embeddings have no token ids to key them by.
    """
    if getattr(request, "prompt_embeds", None) is not None or request.prompt_token_ids is None:
        return None
    parts: list[bytes] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora\0{lora.lora_name}\0{getattr(lora, 'lora_path', '')}".encode())
    for feature in getattr(request, "mm_features", None) or ():
        pos = feature.mm_position
        ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None) or ""
        parts.append(f"mm\0{ident}\0{pos.offset}\0{pos.length}".encode())
    return blake3(b"\0\0".join(parts)).digest() if parts else b""
