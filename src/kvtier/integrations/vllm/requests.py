"""The scheduler's state of one request (``RequestState``) and of its lookup in flight."""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.integrations.vllm.lookup import ShardIds
from kvtier.integrations.vllm.profile import Profile
from kvtier.keys import ChunkId, Namespace


@dataclass(frozen=True)
class Tail:
    """A tail (``keys.tail_id``) a lookup found: ``tokens`` tokens from chunk ``index`` on."""

    id: ChunkId  # logical
    index: int
    tokens: int
    tier: str


@dataclass
class PendingLookup:
    """A background lookup of chunks ``first..`` of a request: ``future`` yields their tiers and
    the tail found after them (None: none, or not looked for)."""

    first: int
    started: float
    future: cf.Future[tuple[list[str], Tail | None]]
    decided: bool = False  # its outcome was counted (vLLM may ask again for the same lookup)
    done_at: float | None = None  # monotonic, set by the lookup thread (the resume profile)

    def mark_done(self, _future: object) -> None:
        self.done_at = time.monotonic()


@dataclass
class RequestState:
    """What the scheduler knows of one request, from its first lookup to its end."""

    chunk_ids: list[ChunkId]  # logical
    prompt_len: int
    namespace: Namespace | None = None  # None: not served from kvtier (prompt embeddings)
    salt: str | None = None  # the request's cache_salt
    extra: bytes = b""
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0
    load: tuple[int, int] | None = None  # token range [start, end) to load when next scheduled
    background: bool = False  # the hit offered last is loaded in the background (vLLM parks the request)
    loading: bool = False  # a background load was sent and the request has not run since
    no_hit: bool = False  # a load of this request failed whole: never offer it a hit again
    lookup: PendingLookup | None = None
    shard_ids: dict[int, ShardIds] = field(default_factory=dict)
    chunk_tiers: list[str] = field(default_factory=list)  # where the decided load's chunks were found
    tail: Tail | None = None  # the tail the decided load ends with (its tier is the last chunk_tiers)
    tail_end: int = 0  # the end (tokens) of the last tail saved for this request: not saved again
    request: Any = None  # vLLM's Request (its block hashes, for KV events)
    retain_s: float = 0.0  # the session asked kvtier to keep its chunks this long
    retained: bool = False  # the chunks it had when first scheduled were sent for retention
    profile: Profile | None = None  # with profile_file: where its time goes (profile.py)
    unverified: bool = False
    """A synchronous load of it went to the workers and not every rank has reported it complete:
    the step that ran it computed over the loaded blocks, so nothing it computed is saved until
    then (a load that fell short means vLLM recomputes from the first missing block)."""
