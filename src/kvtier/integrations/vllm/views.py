"""The scheduler's lookup views and request keys: what the scheduler sees without any KV.

``HostView`` mirrors the keys one worker rank's host DRAM holds (fed by the workers' reports);
``FileLookup`` checks a rank's disk directory by file existence; ``request_extra`` is what,
beyond its token ids, changes a request's KV (and so enters its chunk keys): a LoRA adapter's
and each multimodal item's content.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from blake3 import blake3

from kvtier.identity import AdapterIdentities
from kvtier.integrations.vllm.counters import count
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

    def time_read(self, chunk: ChunkId, max_bytes: int) -> tuple[int, float] | None:
        return self.files.time_read(chunk.key, max_bytes)  # ``TierBase.time_read``

    def close(self) -> None:
        return  # holds no handles


def request_extra(request: Request, adapters: AdapterIdentities | None = None, *,
                  trust_mm_identifiers: bool = False, counters: dict[str, int] | None = None) -> bytes | None:
    """Bytes that change a request's KV beyond its token ids; None: do not serve it from kvtier.

    A LoRA adapter and multimodal inputs change the KV of the same prompt ids, so they enter
    every key, by *content*, never by a name a client or an operator can reuse for other
    content: the adapter by the digest of its files (``adapters``; None: its name and path
    only, for tests), each multimodal item by a digest of its processed data and its
    placeholder position. An item that reaches the engine without its data (vLLM's processor
    cache) has only its identifier, which may be a client's ``multi_modal_uuids`` string: such
    a request is not served from kvtier unless ``trust_mm_identifiers`` (then the identifier
    is the key, counted in ``mm_trusted_ids``). Requests given as prompt embeddings have no
    token ids to key them by.
    """
    if getattr(request, "prompt_embeds", None) is not None or request.prompt_token_ids is None:
        return None
    parts: list[bytes] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        path = str(getattr(lora, "lora_path", "") or "")
        content = adapters.digest(path) if adapters is not None and path else ""
        parts.append(f"lora\0{lora.lora_name}\0{path}\0{content}".encode())
    for feature in getattr(request, "mm_features", None) or ():
        pos = feature.mm_position
        data = getattr(feature, "data", None)
        if data is not None:
            ident = "data:" + mm_data_digest(data)
        else:
            if not trust_mm_identifiers:
                return None
            if counters is not None:
                count(counters, "mm_trusted_ids")
            ident = "id:" + str(getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None) or "")
        parts.append(f"mm\0{getattr(feature, 'modality', '')}\0{ident}\0{pos.offset}\0{pos.length}".encode())
    return blake3(b"\0\0".join(parts)).digest() if parts else b""


def mm_data_digest(data: Any) -> str:
    """Hex digest of one multimodal item's processed data (vLLM's ``MultiModalKwargsItem``: field
    name -> element whose ``data`` is a tensor or nested lists of tensors): names, dtypes,
    shapes and bytes. The same pixels give the same digest in every process."""
    h = blake3(b"kvtier-mm\0")

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"t{t.dtype}{tuple(t.shape)}\0".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
        elif isinstance(value, (list, tuple)):
            h.update(f"l{len(value)}\0".encode())
            for item in value:
                feed(item)
        elif isinstance(value, Mapping):
            h.update(f"d{len(value)}\0".encode())
            for key in sorted(value, key=str):
                h.update(f"k{key}\0".encode())
                feed(value[key])
        else:
            h.update(f"v{value!r}\0".encode())

    items = data.items() if isinstance(data, Mapping) else [("", data)]
    for key, elem in sorted(items, key=lambda kv: str(kv[0])):
        h.update(f"f{key}\0".encode())
        feed(getattr(elem, "data", elem))
    return h.hexdigest()
