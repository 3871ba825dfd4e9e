"""The scheduler's save planning: which chunks of a request go to kvtier, and when.

* Every prompt chunk that a step completes is saved; chunks vLLM's own prefix cache served, or
  kvtier loaded, are not saved again (``RequestState.saved_chunks``).
* A step that ran over blocks a synchronous load may not have filled saves nothing of that
  request until every rank reported the load (``RequestState.unverified``).
* Tails (``tail_chunks``): the full blocks after the last full chunk, in steps of ``tail_step``
  tokens (``keys.tail_id``), saved when the prompt's prefill completes and when the request
  finishes, as a chunk whose payload repeats the tail's last block.
* When a request finishes (``save_decode``), the full chunks of its prompt and generated tokens,
  with its blocks held by vLLM until the workers have copied them.
* Retention: a retained session's chunks it did not compute (vLLM's hit, a load, a loaded tail)
  are kept as long as those it saves (``Retain``).

Everything here runs in vLLM's scheduling loop and only builds metadata; the workers copy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.integrations.vllm.common import KVTierMetadata, Retain, Save
from kvtier.integrations.vllm.counters import count
from kvtier.integrations.vllm.events import ChunkEvents
from kvtier.integrations.vllm.requests import RequestState
from kvtier.keys import chunk_ids, tail_id

if TYPE_CHECKING:
    from vllm.v1.request import Request


class SavePlanner:
    """See the module docstring. ``tail_tokens`` 0: tails off."""

    def __init__(self, chunk_tokens: int, block_size: int, tail_tokens: int, counters: dict[str, int],
                 events: ChunkEvents | None) -> None:
        self.chunk_tokens, self.block_size, self.tail_tokens = chunk_tokens, block_size, tail_tokens
        self.blocks_per_chunk = chunk_tokens // block_size
        self.counters, self.events = counters, events

    def blocks(self, state: RequestState, start: int, end: int) -> list[int | None]:
        """The blocks of the chunks covering tokens [start, end); None outside that range."""
        c0, c1 = start // self.chunk_tokens, -(-end // self.chunk_tokens)
        b_lo, b_hi = start // self.block_size, end // self.block_size
        return [state.block_ids[b] if b_lo <= b < b_hi and b < len(state.block_ids) else None
                for b in range(c0 * self.blocks_per_chunk, c1 * self.blocks_per_chunk)]

    def save(self, req_id: str, state: RequestState, start: int, end: int) -> Save:
        c0, c1 = start // self.chunk_tokens, -(-end // self.chunk_tokens)
        return Save(req_id, state.chunk_ids[c0:c1], self.blocks(state, start, end), state.salt, _until(state))

    def recomputes_from(self, state: RequestState, computed: int) -> None:
        """vLLM computes from ``computed`` on (a failed load, a preemption): save those chunks again."""
        if computed < state.saved_chunks * self.chunk_tokens:
            state.saved_chunks = computed // self.chunk_tokens

    def retain_had(self, meta: KVTierMetadata, req_id: str, state: RequestState) -> None:
        """A retained session's chunks it did not compute (vLLM's hit, a load, the tail it loaded)
        are kept too."""
        if state.retain_s > 0 and not state.retained and state.saved_chunks:
            state.retained = True
            had = state.chunk_ids[:state.saved_chunks] + ([state.tail.id] if state.tail is not None else [])
            meta.retains.append(Retain(req_id, had, time.time() + state.retain_s))

    def plan(self, meta: KVTierMetadata, req_id: str, state: RequestState, computed: int) -> None:
        """The saves of a step after which ``computed`` of the request's tokens have KV."""
        if state.unverified:
            # Planned again at a later step, from vLLM's computed tokens then (rolled back by a
            # failed load): never from KV computed over blocks a load may not have filled.
            count(self.counters, "unverified_saves")
            return
        full = min(computed, state.prompt_len) // self.chunk_tokens
        full = min(full, len(state.chunk_ids), len(state.block_ids) // self.blocks_per_chunk)
        if full > state.saved_chunks:
            meta.saves.append(self.save(req_id, state, state.saved_chunks * self.chunk_tokens,
                                        full * self.chunk_tokens))
            if self.events is not None and state.request is not None:
                self.events.remember(state.request, state.chunk_ids, state.saved_chunks, full)
            state.saved_chunks = full
        request = state.request
        if computed >= state.prompt_len and request is not None and request.prompt_token_ids is not None:
            tail = self.tail(req_id, state, request.prompt_token_ids, state.prompt_len, state.block_ids)
            if tail is not None:
                meta.saves.append(tail)

    def tail(self, req_id: str, state: RequestState, tokens: Sequence[int], computed: int,
             block_ids: Sequence[int]) -> Save | None:
        """The save of the tail of ``tokens[:computed]`` (whose KV is in ``block_ids``), or None:
        no tail to save (tails off, shorter than a step, or not past the last one saved).

        A tail's payload is a full chunk's: its blocks, then its last block repeated; a load
        of it fills only the tail's own blocks (``Load.block_ids``)."""
        step = self.tail_tokens
        if not step or state.namespace is None:
            return None
        index = computed // self.chunk_tokens
        start = index * self.chunk_tokens
        n = min(computed - start, (len(block_ids) * self.block_size) - start) // step * step
        if n <= 0 or start + n <= state.tail_end or index > len(state.chunk_ids):
            return None
        parent = state.chunk_ids[index - 1].key if index else None
        tid = tail_id(state.namespace, tokens, start, n, parent, state.extra)
        blocks: list[int | None] = list(block_ids[start // self.block_size:(start + n) // self.block_size])
        blocks += [blocks[-1]] * (self.blocks_per_chunk - len(blocks))
        state.tail_end = start + n
        count(self.counters, "tail_saves")
        return Save(req_id, [tid], blocks, state.salt, _until(state))

    def finished(self, request: Request, state: RequestState, block_ids: Sequence[int]) -> list[Save]:
        """The saves of a finished request's prompt and generated tokens not saved yet
        (``save_decode``): only tokens whose KV was computed (the last sampled one has none)."""
        assert state.namespace is not None  # (a request kvtier cannot key is never saved)
        computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        full = min(computed // self.chunk_tokens, len(block_ids) // self.blocks_per_chunk)
        tokens = list(request.all_token_ids[:computed])
        if full > len(state.chunk_ids):
            state.chunk_ids = chunk_ids(state.namespace, tokens[:full * self.chunk_tokens], state.extra)
        state.block_ids = list(block_ids)
        saves: list[Save] = []
        if full > state.saved_chunks:
            if self.events is not None:
                self.events.remember(request, state.chunk_ids, state.saved_chunks, full)
            saves.append(self.save(request.request_id, state, state.saved_chunks * self.chunk_tokens,
                                   full * self.chunk_tokens))
            count(self.counters, "decode_saves", n=full - state.saved_chunks)
        if full == computed // self.chunk_tokens:  # (else its blocks end before its tokens do)
            tail = self.tail(request.request_id, state, tokens, computed, block_ids)
            if tail is not None:
                saves.append(tail)
        return saves


def _until(state: RequestState) -> float | None:
    """When the request's retention of its saves ends (epoch seconds), or None: not retained."""
    return time.time() + state.retain_s if state.retain_s > 0 else None
