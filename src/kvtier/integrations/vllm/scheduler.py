"""The connector's scheduler role: what is cached, what to load, what to save.

Runs in vLLM's engine-core process. It holds no KV and no store, only a lookup view of the
tiers: a mirror of each worker rank's host DRAM keys (``HostView``, fed by the workers'
reports), each rank's disk directory and the shared pool (file existence, or Redis EXISTS).
Every method here is called from vLLM's scheduling loop and never reads chunk data; the
lookups themselves (file metadata of disk and pool) run on lookup threads.

* Keys: the prompt's tokens in chunks of ``chunk_tokens``, chained in one logical namespace;
  ``cache_salt`` enters the namespace, a LoRA adapter and multimodal inputs (their hashes and
  placeholder positions) enter every key. Requests given as prompt embeddings are skipped.
* With tensor parallelism a chunk is hit only when it is present for every rank in a tier that
  rank can read (its own host DRAM or disk, or the pool). The shared pool is asked once per
  chunk for all ranks (its first shard: shards of a chunk are written together and age
  together), in parallel across the request's chunks; the workers then read each chunk from
  the tier found here (``Load.chunk_tiers``), without a second lookup. A shard missing
  after all costs a failed load that vLLM recomputes, never a wrong byte.
* Lookups: once per request (until it is scheduled), for the chunks past vLLM's own prefix
  cache hit, in the background; vLLM is told "not yet" (None) until it is done, for at most
  ``lookup_timeout_s``.
* Loads: with ``load_mode: async`` a hit is answered ``(tokens, True)``; vLLM parks the request
  with its new blocks (``update_state_after_alloc``), the load goes to the workers with the
  next metadata, and vLLM schedules the request once every worker reported it finished. With
  ``sync`` the load goes with the step that schedules the request. ``auto`` (the default)
  chooses per request: in the step while the engine is idle and the load is short
  (``SYNC_IDLE_MAX_S``), where it stalls no one and saves the request two engine steps; else
  in the background.
* Preemption: a preempted request comes back with nothing computed; when it is rescheduled
  its hit is loaded into its new blocks exactly like a new request's.
* Retention: a request's ``kv_transfer_params: {"kvtier": {"retain_s": N}}`` (else the
  ``retain_s`` setting) keeps its session's chunks in the disk tier and the pool ahead of
  unretained ones for N seconds after its last save (``Save.retain_until``).
* KV events (with vLLM's ``--kv-events-config``): see ``events.py``.
* Saves: every prompt chunk that a step completes; chunks vLLM's own prefix cache served are
  not saved again. When a request finishes (``save_decode``), the full chunks of its prompt and
  generated tokens, with its blocks held by vLLM until the workers have copied them.
* Tails (``tail_chunks``): the full blocks after the last full chunk, in steps of
  ``tail_step`` tokens (``keys.tail_id``). Saved when the prompt's prefill completes and when
  the request finishes (its generated tokens too), as a chunk whose payload repeats the tail's
  last block; a lookup that found chunks then asks for the longest tail after them, and the
  load fills only the tail's own blocks. A resume then restores what vLLM's own prefix cache
  would, not up to a chunk less.
* The load decision: a hit is loaded only when reading it is predicted to be faster than
  recomputing it (``load_policy: auto``), from rates measured in the running engine and sent
  back by the workers: the prefill rate of steps that computed many tokens and loaded nothing,
  and each tier's read bandwidth from the workers' own loads. Until measured, ``read_gbps``
  (host DRAM: 10x) stands in; with ``load_mode: auto`` the first hit in a tier also times one
  read there (``rateprobe.py``), so that tier's first load can run in the step.

The per-request state is ``requests.RequestState``; the lookup view of the ranks' tiers is
``lookup.RankTiers``; KV events are ``events.py``; the load decision's rule is ``kvtier.policy``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvtier.config import StoreConfig
from kvtier.identity import AdapterIdentities
from kvtier.integrations.vllm.common import (
    KVTierMetadata,
    KVTierWorkerMeta,
    Load,
    Retain,
    Save,
)
from kvtier.integrations.vllm.config import ConnectorConfig, Deployment
from kvtier.integrations.vllm.counters import count, new_counters
from kvtier.integrations.vllm.events import ChunkEvents
from kvtier.integrations.vllm.lookup import RankTiers, ShardIds
from kvtier.integrations.vllm.profile import Profiler
from kvtier.integrations.vllm.rateprobe import RateProbe, Timed
from kvtier.integrations.vllm.requests import PendingLookup, RequestState, Tail
from kvtier.integrations.vllm.stats import LOOKUP_FIELDS, flatten
from kvtier.integrations.vllm.views import request_extra
from kvtier.keys import ChunkId, Namespace, chunk_ids, tail_id, tail_step
from kvtier.policy import Rates, Read, pays_off, predicted_load_s
from kvtier.threads import executor
from kvtier.tiers.base import Level, Tier
from kvtier.tiers.guard import TierGuard
from kvtier.tiers.kinds import HOST

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

LOOKUP_THREADS = 2
LOOKUP_IDLE_WAIT_S = 0.025
"""While the engine is idle, the longest the scheduler waits for lookups in one scheduling pass
(all its calls together) before answering "not yet". Idle, the wait stalls no running request,
and it keeps a request whose lookup is slow (cold metadata after a restart: 6-9 ms measured on
the first of a pair) from waiting a pass: in that pass the next request arrives, both are
scheduled in one step, and both wait for both prefills (mean TTFT of the first pair at
concurrency 2: about 1.7x the floor's, where the floor runs them one step apart). A slow pool
answers "not yet" after this and keeps its lookup running. Once the pass has scheduled a
request to compute, the wait is over: it would delay that request's step."""
SYNC_IDLE_MAX_S = 0.05
"""With ``load_mode: auto``, the longest predicted load run inside the step of an idle engine
(predicted from measured read rates: until a tier was read from, by a load or by the lookup's
timed first read, ``rateprobe.py``, its loads run in the background).
A background load costs its request two engine steps after the read (one reports it, the
next prefills it: measured 2-3 ms idle on the tiny model, a decode step each when busy); a
load in the step costs nothing when nothing else runs, but holds up a request that arrives
during it by up to its length."""
LOOKUP_BUSY_WAIT_S = 0.001
"""The same while other requests run: a local lookup of a long prompt takes well under this
(32 chunks' stats: 0.16 ms), and an answer in this call saves the request a whole engine step
(at concurrency 2, another request's prefill: hundreds of ms on a CPU), for at most this
much delay to the step, once per request."""


class SchedulerRole:
    """See the module docstring."""

    def __init__(self, connector_config: ConnectorConfig, store_config: StoreConfig, dep: Deployment,
                 counters: dict[str, int], events: ChunkEvents | None = None) -> None:
        self.connector_config, self.store_config, self.dep = connector_config, store_config, dep
        self.counters = new_counters(counters)
        self.chunk_tokens = store_config.chunk_tokens
        self.block_size = dep.block_size
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        self.tail_tokens = tail_step(self.chunk_tokens, self.block_size) if connector_config.tail_chunks else 0
        self.namespace: Namespace = store_config.namespace(rank=0)
        # Per-tier read bandwidth and the prefill rate: priors until the workers measure them.
        self.rates = Rates(connector_config.read_gbps * 1e9, connector_config.prefill_tokens_per_s)
        self.disabled = False
        self._requests: dict[str, RequestState] = {}
        self._idle = True  # the last step scheduled no tokens
        self._idle_wait_left = LOOKUP_IDLE_WAIT_S  # of this scheduling pass (reset by build_connector_meta)
        self._lookups = executor(LOOKUP_THREADS, "kvtier-lookup")
        self._background_loads: list[Load] = []  # allocated this step, sent with the next metadata
        self._finishing: list[Save] = []  # saves of finished requests whose blocks vLLM holds for us
        self.guard = TierGuard(store_config.read_timeout_s, store_config.tier_cooldown_s)
        self.events = events
        self.views = RankTiers(store_config, dep, self.guard, self.counters, connector_config.inject_faults)
        self.probe = RateProbe(self.rates, store_config.chunk_bytes + (1 << 20))  # header and padding: < 1 MiB
        self.adapters = AdapterIdentities()
        self._warned: set[str] = set()
        self.profiler = Profiler(connector_config.profile_file) if connector_config.profile_file is not None else None

    # ---------------------------------------------------------------- the lookup view

    @property
    def rank_tiers(self) -> dict[int, list[Level]]:
        return self.views.by_rank

    @property
    def pool(self) -> Tier | None:
        return self.views.pool

    def _shard_ids(self, state: RequestState, shard: int) -> ShardIds:
        return self.views.shard_ids(state.shard_ids, state.chunk_ids, shard)

    def locate(self, state: RequestState, first: int = 0) -> list[str]:
        """Tier names of chunks ``first..`` of the request's cached prefix (``RankTiers.locate``)."""
        return self.views.locate(state.chunk_ids, state.shard_ids, first)

    def _lookable(self, state: RequestState) -> bool:
        """Whether a lookup could find anything: a full chunk, or a tail of a shorter prompt."""
        if state.chunk_ids:
            return True
        usable = (state.prompt_len - 1) // self.block_size * self.block_size
        return bool(self.tail_tokens) and state.namespace is not None and usable >= self.tail_tokens

    def _lookup(self, state: RequestState, first: int) -> tuple[list[str], Tail | None]:
        """A lookup thread's work for one request: its chunks from ``first`` on, then its tail."""
        located = self.locate(state, first)
        tail = self._find_tail(state, first, first + len(located))
        if self.connector_config.load_mode == "auto":
            self._time_first_reads(state, first, located)
        return located, tail

    def _time_first_reads(self, state: RequestState, first: int, located: Sequence[str]) -> None:
        """Each tier of the hit with no measured read rate: time one read there (``RateProbe``),
        so ``auto`` can load in the step from the first hit on (rank 0's chunk stands for all)."""
        todo: dict[str, int] = {}  # tier name -> its first chunk in the hit
        for i, name in enumerate(located):
            if name != HOST.name and name not in self.rates.measured:
                todo.setdefault(name, i)
        if not todo:
            return
        levels = {level.name: level for level in self.views.by_rank.get(0, [])}
        ids = self._shard_ids(state, self.dep.sharding.shards_of(0)[0])
        for name, i in todo.items():
            level = levels.get(name)
            if isinstance(level, Timed):
                self.probe.measure(level, ids[first + i])

    def _find_tail(self, state: RequestState, first: int, index: int) -> Tail | None:
        """The longest tail after full chunk ``index - 1`` that a load could use, or None.

        Looked for only when it can lengthen a hit: after a full chunk found (by this lookup or
        vLLM's own cache), or when every full chunk of the prompt was found; a new prompt that
        misses its first chunk costs no tail lookups."""
        step, request = self.tail_tokens, state.request
        if not step or state.namespace is None or request is None or request.prompt_token_ids is None:
            return None
        if index == 0 and state.chunk_ids:
            return None
        start = index * self.chunk_tokens
        usable = (state.prompt_len - 1) // self.block_size * self.block_size - start  # vLLM computes >= 1 token
        parent = state.chunk_ids[index - 1].key if index else None
        for n in range(min(self.chunk_tokens - 1, usable) // step * step, 0, -step):
            tid = tail_id(state.namespace, request.prompt_token_ids, start, n, parent, state.extra)
            names = self.views.locate([tid], {}, 0, count_metrics=False)
            if names:
                return Tail(tid, index, n, names[0])
        return None

    # ---------------------------------------------------------------- per request

    def _state(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            trust = self.connector_config.trust_mm_identifiers
            extra = request_extra(request, self.adapters, trust_mm_identifiers=trust, counters=self.counters)
            prompt_len = len(request.prompt_token_ids) if request.prompt_token_ids is not None else 0
            if extra is None:
                count(self.counters, "skipped_requests")
                state = RequestState([], prompt_len)
            else:
                salt = getattr(request, "cache_salt", None)
                namespace = self.namespace if salt is None else self.namespace.with_salt(salt)
                ids = chunk_ids(namespace, request.prompt_token_ids or [], extra)
                state = RequestState(ids, prompt_len, namespace, salt, extra, request=request,
                                     retain_s=self._retain_s(request))
            if self.profiler is not None:
                client_id = str(getattr(request, "external_req_id", None) or request.request_id)
                state.profile = self.profiler.arrived(request.request_id, client_id, prompt_len)
            self._requests[request.request_id] = state
        return state

    def _retain_s(self, request: Request) -> float:
        """The request's ``kv_transfer_params: {"kvtier": {"retain_s": ...}}``, else the server's.

        Any API client can send anything there: a value that is not a finite number >= 0 is
        ignored, one over ``max_retain_s`` is clamped; both counted (``rejected_params``) with one
        warning per kind, never an exception (an unchecked 1e20 once killed the writer threads).
        """
        params = getattr(request, "kv_transfer_params", None) or {}
        mine = params.get("kvtier") if isinstance(params, dict) else None
        if mine is None:
            return self.connector_config.retain_s
        if not isinstance(mine, dict):
            self._rejected(request, "kv_transfer_params kvtier must be a mapping", mine)
            return self.connector_config.retain_s
        if "retain_s" not in mine:
            return self.connector_config.retain_s
        value = mine["retain_s"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            self._rejected(request, "kvtier.retain_s must be a finite number >= 0", value)
            return self.connector_config.retain_s
        most = self.connector_config.max_retain_s
        if value > most:
            self._rejected(request, f"kvtier.retain_s is over max_retain_s={most:g}; clamped", value)
            return most
        return float(value)

    def _rejected(self, request: Request, why: str, value: object) -> None:
        count(self.counters, "rejected_params")
        if why not in self._warned:  # once per kind: a hostile client repeats it a million times
            self._warned.add(why)
            shown = repr(value)
            log.warning("kvtier: request %s: %s, got %s (ignored; later ones are only counted in "
                        "kvtier_rejected_request_params_total)", request.request_id, why,
                        shown if len(shown) <= 80 else shown[:77] + "...")

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens to load past ``num_computed_tokens`` (vLLM's own hit), and whether in the background.

        None ("ask again") while the request's lookup runs on a lookup thread, for at most
        ``lookup_timeout_s``; after that the request is scheduled without a hit.
        """
        state = self._state(request)
        state.load, state.tail = None, None
        if state.loading:
            # Asked again before it ever ran: its background load delivered nothing (vLLM put it
            # back with no tokens). Offering the same hit again could fail the same way forever
            # (a tier the scheduler sees but the workers cannot read): recompute it instead.
            state.loading, state.no_hit = False, True
            count(self.counters, "failed_loads")
        if state.no_hit:
            return 0, False
        first = num_computed_tokens // self.chunk_tokens  # vLLM's own hit covers the chunks before,
        # and they are not saved again: the request that put them in vLLM's prefix cache computed
        # (and saved) or loaded them. Re-gathering them costs other requests' decode steps.
        state.saved_chunks = max(state.saved_chunks, first)
        if self.connector_config.load_policy == "never" or self.disabled or not self._lookable(state):
            return 0, False
        lookup, fresh = state.lookup, False
        if lookup is None or lookup.first > first:
            fresh = True
            future = self._lookups.submit(self._lookup, state, first)
            lookup = state.lookup = PendingLookup(first, time.monotonic(), future)
            if state.profile is not None:
                state.profile.lookup_started, state.profile.lookup_done = lookup.started, None
                future.add_done_callback(lookup.mark_done)
        if not lookup.future.done() and self._idle and self._idle_wait_left > 0:
            # Idle, the wait stalls no one: up to LOOKUP_IDLE_WAIT_S per pass, all calls together,
            # until this pass schedules a request to compute (update_state_after_alloc).
            t0 = time.monotonic()
            cf.wait([lookup.future], timeout=self._idle_wait_left)
            self._idle_wait_left -= time.monotonic() - t0
        elif not lookup.future.done() and fresh:
            # Answering in this call saves the request an engine step; a lookup of local files
            # takes well under a millisecond. Busy, the wait delays this step by at most
            # LOOKUP_BUSY_WAIT_S, and only in the call that started the lookup (a slow pool's
            # lookups, pending over many steps, never add up to a stall).
            cf.wait([lookup.future], timeout=LOOKUP_BUSY_WAIT_S)
        if not lookup.future.done():
            if time.monotonic() - lookup.started < self.connector_config.lookup_timeout_s:
                return None, False
            count(self.counters, "lookup_timeouts")
            self._decided(lookup, "timeout", state)
            log.warning("kvtier: lookup of %s took over %.1f s (lookup_timeout_s); scheduled without a hit",
                        request.request_id, self.connector_config.lookup_timeout_s)
            state.lookup = None
            return 0, False
        tail: Tail | None = None
        try:
            located, tail = lookup.future.result()
        except Exception as exc:  # a lookup bug or an unexpected tier error: no hit, keep serving
            log.error("kvtier: lookup of %s failed: %r", request.request_id, exc)
            located = []
        chunk_tiers = [""] * lookup.first + located  # only chunks from ``first`` on are read
        found = len(chunk_tiers) * self.chunk_tokens
        if tail is not None:
            chunk_tiers.append(tail.tier)
            found += tail.tokens
        if not lookup.decided:
            asked = (len(state.chunk_ids) - lookup.first) * self.chunk_tokens
            count(self.counters, "lookup_tokens", n=asked)
            count(self.counters, "miss_tokens", n=asked - len(located) * self.chunk_tokens)
        # vLLM must compute at least one prompt token itself.
        end = min(found, (state.prompt_len - 1) // self.block_size * self.block_size)
        state.chunk_tiers = chunk_tiers
        ext = end - num_computed_tokens
        if ext <= 0:
            self._decided(lookup, "miss", state)
            return 0, False
        if ext < self.connector_config.min_load_tokens:
            self._decided(lookup, "short", state)
            return 0, False
        if not self._pays_off(chunk_tiers, num_computed_tokens, end):
            self._decided(lookup, "recompute", state)
            return 0, False
        self._decided(lookup, "load", state)
        state.load, state.tail = (num_computed_tokens, end), tail
        state.background = self._in_background(chunk_tiers, num_computed_tokens, end)
        return ext, state.background

    def _in_background(self, chunk_tiers: Sequence[str], start: int, end: int) -> bool:
        """Whether to load in the background (``load_mode``; ``SYNC_IDLE_MAX_S``). ``auto`` trusts
        only measured read rates: on a prior (a tier not read from yet), a slow or stalling tier
        would hold the step, where an abort cannot stop it, for as long as its reads take."""
        mode = self.connector_config.load_mode
        if mode != "auto":
            return mode == "async"
        if not self._idle:
            return True
        used = set(chunk_tiers[start // self.chunk_tokens:-(-end // self.chunk_tokens)]) - {"", HOST.name}
        if not used <= self.rates.measured.keys():
            return True
        return self.predicted_load_s(chunk_tiers, start, end) > SYNC_IDLE_MAX_S

    def _decided(self, lookup: PendingLookup, decision: str, state: RequestState) -> None:
        """Count a lookup's outcome once (``kvtier_load_decisions_total``)."""
        if not lookup.decided:
            lookup.decided = True
            count(self.counters, "decision", decision)
            if state.profile is not None:
                state.profile.decision, state.profile.answered = decision, time.monotonic()
                state.profile.lookup_done = lookup.done_at

    def predicted_load_s(self, chunk_tiers: Sequence[str], start: int, end: int) -> float:
        """Seconds to read tokens [start, end) whose chunks sit in ``chunk_tiers``."""
        # One rank's shards: ranks read theirs in parallel, and the rates they report were measured doing so.
        chunk_bytes = self.store_config.chunk_bytes * self.dep.sharding.rank_shards
        # Whole chunks are read even when only part of one is needed.
        chunks = range(start // self.chunk_tokens, -(-end // self.chunk_tokens))
        return predicted_load_s(Read(chunk_bytes, self.rates.read_rate(chunk_tiers[i])) for i in chunks)

    def _pays_off(self, chunk_tiers: Sequence[str], start: int, end: int) -> bool:
        if self.connector_config.load_policy == "always":
            return True
        return pays_off(self.predicted_load_s(chunk_tiers, start, end), self.rates.recompute_s(end - start))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._state(request)
        state.block_ids = list(blocks.get_block_ids()[0])
        state.lookup = None  # scheduled: a later lookup (after a preemption) starts afresh
        if not (num_external_tokens and state.background):
            self._idle_wait_left = 0.0  # it computes in this step: waiting now would delay it
        if num_external_tokens == 0:
            state.load = None
        elif state.background and state.load is not None:
            # vLLM parks the request (WAITING_FOR_REMOTE_KVS) with these blocks until every
            # worker reports the load finished; it is not among the next step's scheduled ones.
            if getattr(request, "num_preemptions", 0):
                count(self.counters, "resumed_loads")
            count(self.counters, "async_loads")
            self._background_loads.append(self._emit_load(request.request_id, state, background=True))
            state.loading = True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        meta = KVTierMetadata(num_tokens=scheduler_output.total_num_scheduled_tokens)
        self._idle = meta.num_tokens == 0
        self._idle_wait_left = LOOKUP_IDLE_WAIT_S
        if self.profiler is not None:
            self.profiler.step({new.req_id: scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
                                for new in scheduler_output.scheduled_new_reqs} |
                               {r: scheduler_output.num_scheduled_tokens.get(r, 0)
                                for r in scheduler_output.scheduled_cached_reqs.resumed_req_ids})
        meta.loads, self._background_loads = self._background_loads, []
        meta.saves, self._finishing = self._finishing, []
        meta.finished = list(dict.fromkeys(t.req_id for t in meta.saves))  # (a request's chunks and tail)
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            state.loading = False
            if state.load is not None:
                meta.loads.append(self._emit_load(new.req_id, state, background=False))
                state.unverified = True
            self._retain_had(meta, new.req_id, state)
            self._recomputes_from(state, new.num_computed_tokens)
            self._plan_save(meta, new.req_id, state,
                            new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # A preempted request, rescheduled: its blocks are all new, and a hit found for
                # it this step must be loaded into them (else vLLM decodes over stale blocks).
                if new_blocks is not None:
                    state.block_ids = list(new_blocks[0])
                if state.load is not None:
                    count(self.counters, "resumed_loads")
                    meta.loads.append(self._emit_load(req_id, state, background=False))
                    state.unverified = True
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            state.loading = False
            self._retain_had(meta, req_id, state)
            computed = cached.num_computed_tokens[i]
            self._recomputes_from(state, computed)
            self._plan_save(meta, req_id, state, computed + scheduler_output.num_scheduled_tokens.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._requests.pop(req_id, None)
            if self.profiler is not None:
                self.profiler.finished(req_id)
        return meta

    def _retain_had(self, meta: KVTierMetadata, req_id: str, state: RequestState) -> None:
        """A retained session's chunks it did not compute (vLLM's hit, a load, the tail it loaded)
        are kept too."""
        if state.retain_s > 0 and not state.retained and state.saved_chunks:
            state.retained = True
            had = state.chunk_ids[:state.saved_chunks] + ([state.tail.id] if state.tail is not None else [])
            meta.retains.append(Retain(req_id, had, time.time() + state.retain_s))

    def _emit_load(self, req_id: str, state: RequestState, background: bool) -> Load:
        assert state.load is not None
        start, end = state.load
        if self.events is not None and state.request is not None:
            self.events.remember(state.request, state.chunk_ids, start // self.chunk_tokens,
                                 -(-end // self.chunk_tokens))
        # Counted here, not per lookup: vLLM asks again for a request it could not schedule yet.
        count(self.counters, "matched_tokens", n=end - start)
        if not background:
            count(self.counters, "step_loads")
        if state.profile is not None:
            state.profile.dispatched, state.profile.load_tokens = time.monotonic(), end - start
        state.saved_chunks = max(state.saved_chunks, end // self.chunk_tokens)
        state.load = None
        c0, c1 = start // self.chunk_tokens, -(-end // self.chunk_tokens)
        found = tuple(state.chunk_tiers[c0:c1])
        ids: list[ChunkId] = state.chunk_ids[c0:c1]
        tail = state.tail
        if tail is not None and c0 <= tail.index < c1:  # (the last chunk: a load ends where its hit does)
            ids = [*state.chunk_ids[c0:tail.index], tail.id]
            count(self.counters, "tail_loads")
        else:
            state.tail = None  # (retained with the session's chunks only when loaded)
        return Load(req_id, ids, self._blocks(state, start, end), background, state.salt,
                    found if len(found) == c1 - c0 else ())

    def _recomputes_from(self, state: RequestState, computed: int) -> None:
        """vLLM computes from ``computed`` on (a failed load, a preemption): save those chunks again."""
        if computed < state.saved_chunks * self.chunk_tokens:
            state.saved_chunks = computed // self.chunk_tokens

    def _blocks(self, state: RequestState, start: int, end: int) -> list[int | None]:
        """The blocks of the chunks covering tokens [start, end); None outside that range."""
        c0, c1 = start // self.chunk_tokens, -(-end // self.chunk_tokens)
        b_lo, b_hi = start // self.block_size, end // self.block_size
        return [state.block_ids[b] if b_lo <= b < b_hi and b < len(state.block_ids) else None
                for b in range(c0 * self.blocks_per_chunk, c1 * self.blocks_per_chunk)]

    def _save(self, req_id: str, state: RequestState, start: int, end: int) -> Save:
        c0, c1 = start // self.chunk_tokens, -(-end // self.chunk_tokens)
        until = time.time() + state.retain_s if state.retain_s > 0 else None
        return Save(req_id, state.chunk_ids[c0:c1], self._blocks(state, start, end), state.salt, until)

    def _plan_save(self, meta: KVTierMetadata, req_id: str, state: RequestState, computed: int) -> None:
        if state.unverified:
            # Planned again at a later step, from vLLM's computed tokens then (rolled back by a
            # failed load): never from KV computed over blocks a load may not have filled.
            count(self.counters, "unverified_saves")
            return
        full = min(computed, state.prompt_len) // self.chunk_tokens
        full = min(full, len(state.chunk_ids), len(state.block_ids) // self.blocks_per_chunk)
        if full > state.saved_chunks:
            meta.saves.append(self._save(req_id, state, state.saved_chunks * self.chunk_tokens,
                                         full * self.chunk_tokens))
            if self.events is not None and state.request is not None:
                self.events.remember(state.request, state.chunk_ids, state.saved_chunks, full)
            state.saved_chunks = full
        if computed >= state.prompt_len and state.request is not None and state.request.prompt_token_ids is not None:
            tail = self._tail_save(req_id, state, state.request.prompt_token_ids, state.prompt_len, state.block_ids)
            if tail is not None:
                meta.saves.append(tail)

    def _tail_save(self, req_id: str, state: RequestState, tokens: Sequence[int], computed: int,
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
        until = time.time() + state.retain_s if state.retain_s > 0 else None
        return Save(req_id, [tid], blocks, state.salt, until)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        """Queue the save of the finished request's generated tokens (``save_decode``).

        True when a save was queued: vLLM then holds ``block_ids`` until every worker reports
        the request in ``get_finished`` (after copying them), so no other request reuses them
        first. Only tokens whose KV was computed are saved (the last sampled token has none).
        """
        state = self._requests.pop(request.request_id, None)
        if state is None or state.namespace is None or state.loading or state.unverified or self.disabled \
                or not self.connector_config.save_decode:
            return False  # (a request aborted while loading: its blocks are the load's until it ends)
        computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        full = min(computed // self.chunk_tokens, len(block_ids) // self.blocks_per_chunk)
        queued = len(self._finishing)
        tokens = list(request.all_token_ids[:computed])
        if full > len(state.chunk_ids):
            state.chunk_ids = chunk_ids(state.namespace, tokens[:full * self.chunk_tokens], state.extra)
        state.block_ids = list(block_ids)
        if full > state.saved_chunks:
            if self.events is not None:
                self.events.remember(request, state.chunk_ids, state.saved_chunks, full)
            self._finishing.append(self._save(request.request_id, state, state.saved_chunks * self.chunk_tokens,
                                              full * self.chunk_tokens))
            count(self.counters, "decode_saves", n=full - state.saved_chunks)
        if full == computed // self.chunk_tokens:  # (else its blocks end before its tokens do)
            tail = self._tail_save(request.request_id, state, tokens, computed, block_ids)
            if tail is not None:
                self._finishing.append(tail)
        return len(self._finishing) > queued

    # ---------------------------------------------------------------- the workers' reports

    def update_connector_output(self, meta: KVTierWorkerMeta) -> None:
        """Apply the workers' report: host tier changes, measured rates, a disabled worker."""
        if meta.disabled and not self.disabled:
            self.disabled = True
            log.error("kvtier: worker rank(s) %s disabled the connector (see their log); no more hits are "
                      "reported and the engine serves by recomputing", sorted(set(meta.disabled)))
        for sync in meta.sync_loads:
            # A load that fell short is vLLM's to repair (it recomputes from the first block a
            # rank could not fill, rolling back the tokens it computed); saves resume from there.
            state = self._requests.get(sync.req_id)
            if state is not None:
                state.unverified = False
        for rank, names in meta.unavailable.items():
            self.views.drop(rank, names)
        if self.profiler is not None and meta.load_times:
            self.profiler.loads(meta.load_times)
        for rank, changes in meta.host_changes.items():
            view = self.views.host_views.get(rank)
            if view is not None:
                view.apply(changes)
            if rank == 0 and self.events is not None:
                for added, key in changes:
                    self.events.changed("host", added, key)
        if self.events is not None:
            for change in meta.tier_changes:
                self.events.changed(change.tier, change.added, change.key)
        for read in meta.reads:
            self.rates.observe_read(read.tier, read.nbytes, read.seconds)
        for sample in meta.prefill:
            self.rates.observe_prefill(sample.tokens, sample.seconds)

    # ---------------------------------------------------------------- lifecycle

    def lookups_in_flight(self) -> int:
        return sum(1 for s in self._requests.values() if s.lookup is not None and not s.lookup.future.done())

    def take_events(self) -> list[Any]:
        return self.events.take() if self.events is not None else []

    def stats(self) -> tuple[dict[str, float], dict[str, float]]:
        """(counters, gauges) for vLLM's /metrics (``stats.flatten``): the lookups' tier counters."""
        views = {t.name: t.metrics.snapshot() for t in self.rank_tiers.get(0, [])}
        out, _ = flatten(dict(self.counters), views, first_rank=True, tier_fields=LOOKUP_FIELDS.__contains__)
        gauges = {"kvtier_lookups_in_flight": float(self.lookups_in_flight()), "kvtier_disabled": float(self.disabled)}
        return out, gauges

    def snapshot(self) -> dict[str, Any]:
        tiers = {t.name: asdict(t.metrics.snapshot()) for t in self.rank_tiers.get(0, [])}
        return {**self.rates.snapshot(), "tiers": tiers}

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self.probe.close()
        self.guard.close()
        self.views.close()
