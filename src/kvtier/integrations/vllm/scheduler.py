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
  (``decide.SYNC_IDLE_MAX_S``), where it stalls no one and saves the request two engine steps;
  else in the background.
* Preemption: a preempted request comes back with nothing computed; when it is rescheduled
  its hit is loaded into its new blocks exactly like a new request's (among the cached
  requests in vLLM 0.32 / 0.33, among the new ones in 0.34: ``releases.py``).
* vLLM may cap the hit after it was offered (0.33+): loads are planned from
  ``update_state_after_alloc``'s ``num_external_tokens``, not from the offer.
* Retention: a request's ``kv_transfer_params: {"kvtier": {"retain_s": N}}`` (else the
  ``retain_s`` setting) keeps its session's chunks in the disk tier and the pool ahead of
  unretained ones for N seconds after its last save (``Save.retain_until``).
* KV events (with vLLM's ``--kv-events-config``): see ``events.py``.
* Saves (``saves.py``): every prompt chunk that a step completes, and, when a request finishes
  (``save_decode``), the full chunks of its prompt and generated tokens. Tails
  (``tail_chunks``): the full blocks after the last full chunk; a lookup that found chunks
  then asks for the longest tail after them (``prefix.py``), and the load fills only the
  tail's own blocks. A resume then restores what vLLM's own prefix cache would, not up to a
  chunk less.
* The load decision: a hit is loaded only when reading it is predicted to be faster than
  recomputing it (``load_policy: auto``), from rates measured in the running engine and sent
  back by the workers: the prefill rate of steps that computed many tokens and loaded nothing,
  and each tier's read bandwidth from the workers' own loads. Until measured, ``read_gbps``
  (host DRAM: 10x) stands in; with ``load_mode: auto`` the first hit in a tier also times one
  read there (``rateprobe.py``), so that tier's first load can run in the step.

The per-request state is ``requests.RequestState``; the lookup view of the ranks' tiers is
``lookup.RankTiers``, a lookup thread's work ``prefix.PrefixFinder``; save planning is
``saves.SavePlanner``; ``kv_transfer_params`` are read by ``params.RequestParams``; KV events
are ``events.py``; the load decision's rule is ``kvtier.policy``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvtier.config import StoreConfig
from kvtier.identity import AdapterIdentities
from kvtier.integrations.vllm.common import KVTierMetadata, KVTierWorkerMeta, Load, Save
from kvtier.integrations.vllm.config import ConnectorConfig, Deployment
from kvtier.integrations.vllm.counters import count, new_counters
from kvtier.integrations.vllm.decide import LoadDecision
from kvtier.integrations.vllm.events import ChunkEvents
from kvtier.integrations.vllm.lookup import RankTiers
from kvtier.integrations.vllm.lookups import LookupQueue
from kvtier.integrations.vllm.params import RequestParams
from kvtier.integrations.vllm.prefix import PrefixFinder
from kvtier.integrations.vllm.profile import Profiler
from kvtier.integrations.vllm.rateprobe import RateProbe
from kvtier.integrations.vllm.releases import resumed_ids
from kvtier.integrations.vllm.requests import PendingLookup, RequestState, Tail
from kvtier.integrations.vllm.saves import SavePlanner
from kvtier.integrations.vllm.stats import LOOKUP_FIELDS, flatten
from kvtier.integrations.vllm.views import request_extra
from kvtier.keys import ChunkId, Namespace, chunk_ids, tail_step
from kvtier.policy import Rates
from kvtier.tiers.base import Level, Tier
from kvtier.tiers.guard import TierGuard

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

LOOKUP_IDLE_WAIT_S = 0.025
"""While the engine is idle, the longest the scheduler waits for lookups in one scheduling pass
(all its calls together) before answering "not yet". Idle, the wait stalls no running request,
and it keeps a request whose lookup is slow (cold metadata after a restart: 6-9 ms measured on
the first of a pair) from waiting a pass: in that pass the next request arrives, both are
scheduled in one step, and both wait for both prefills (mean TTFT of the first pair at
concurrency 2: about 1.7x the floor's, where the floor runs them one step apart). A slow pool
answers "not yet" after this and keeps its lookup running. Once the pass has scheduled a
request to compute, the wait is over: it would delay that request's step."""
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
        tail_tokens = tail_step(self.chunk_tokens, self.block_size) if connector_config.tail_chunks else 0
        self.namespace: Namespace = store_config.namespace(rank=0)
        # Per-tier read bandwidth and the prefill rate: priors until the workers measure them.
        self.rates = Rates(connector_config.read_gbps * 1e9, connector_config.prefill_tokens_per_s)
        self.disabled = False
        self._requests: dict[str, RequestState] = {}
        self._idle = True  # the last step scheduled no tokens
        self._idle_wait_left = LOOKUP_IDLE_WAIT_S  # of this scheduling pass (reset by build_connector_meta)
        self._background_loads: list[Load] = []  # allocated this step, sent with the next metadata
        self._finishing: list[Save] = []  # saves of finished requests whose blocks vLLM holds for us
        self.guard = TierGuard(store_config.read_timeout_s, store_config.tier_cooldown_s)
        self.events = events
        self.views = RankTiers(store_config, dep, self.guard, self.counters, connector_config.inject_faults)
        self.probe = RateProbe(self.rates, store_config.chunk_bytes + (1 << 20))  # header and padding: < 1 MiB
        self.prefix = PrefixFinder(self.views, dep, self.chunk_tokens, tail_tokens, self.rates, self.probe,
                                   timed_reads=connector_config.load_mode == "auto")
        self.lookups = LookupQueue(self.prefix.find, self.guard, lambda: self.views.pool, self.counters)
        self.decide = LoadDecision(connector_config, self.rates, self.chunk_tokens,
                                   store_config.chunk_bytes * dep.sharding.rank_shards)
        self.saves = SavePlanner(self.chunk_tokens, self.block_size, tail_tokens, self.counters, events)
        self.params = RequestParams(connector_config.retain_s, connector_config.max_retain_s, self.counters)
        self.adapters = AdapterIdentities()
        self.epoch: str | None = None  # set by reset_cache: a salt beside every request's tenant
        self.profiler = Profiler(connector_config.profile_file) if connector_config.profile_file is not None else None

    # ---------------------------------------------------------------- the lookup view

    @property
    def rank_tiers(self) -> dict[int, list[Level]]:
        return self.views.by_rank

    @property
    def pool(self) -> Tier | None:
        return self.views.pool

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
                if self.epoch is not None:
                    salt = f"{self.namespace.tenant_salt if salt is None else salt}\x00reset:{self.epoch}"
                namespace = self.namespace if salt is None else self.namespace.with_salt(salt)
                ids = chunk_ids(namespace, request.prompt_token_ids if request.prompt_token_ids is not None else [],
                                extra)
                state = RequestState(ids, prompt_len, namespace, salt, extra, request=request,
                                     retain_s=self.params.retain_s(request))
            if self.profiler is not None:
                client_id = str(getattr(request, "external_req_id", None) or request.request_id)
                state.profile = self.profiler.arrived(request.request_id, client_id, prompt_len)
            self._requests[request.request_id] = state
        return state

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
        if self.connector_config.load_policy == "never" or self.disabled or not self.prefix.lookable(state):
            return 0, False
        lookup = state.lookup
        fresh = lookup is None or lookup.first > first
        if lookup is None or fresh:
            self.lookups.abandon(lookup)  # vLLM's own hit shrank below it: it looks from too far on
            lookup = self._start_lookup(state, first)
            if lookup is None:
                return 0, False  # too many lookups wait already (counted)
        self._wait(lookup, fresh)
        if not lookup.future.done():
            if time.monotonic() - lookup.started < self.connector_config.lookup_timeout_s:
                return None, False
            count(self.counters, "lookup_timeouts")
            self._decided(lookup, "timeout", state)
            log.warning("kvtier: lookup of %s took over %.1f s (lookup_timeout_s); scheduled without a hit",
                        request.request_id, self.connector_config.lookup_timeout_s)
            self.lookups.timed_out()
            self.lookups.abandon(lookup)
            state.lookup = None
            return 0, False
        if not lookup.decided:
            self.lookups.answered()
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
        end = min(found, self.prefix.usable(state))
        state.chunk_tiers = chunk_tiers
        ext = end - num_computed_tokens
        if ext <= 0:
            self._decided(lookup, "miss", state)
            return 0, False
        if ext < self.connector_config.min_load_tokens:
            self._decided(lookup, "short", state)
            return 0, False
        if not self.decide.pays_off(chunk_tiers, num_computed_tokens, end):
            self._decided(lookup, "recompute", state)
            return 0, False
        self._decided(lookup, "load", state)
        state.load, state.tail = (num_computed_tokens, end), tail
        state.background = self.decide.in_background(chunk_tiers, num_computed_tokens, end, self._idle)
        return ext, state.background

    def _start_lookup(self, state: RequestState, first: int) -> PendingLookup | None:
        """The request's lookup of chunks ``first..``, on a lookup thread (``PrefixFinder.find``)."""
        lookup = state.lookup = self.lookups.start(state, first)
        if lookup is not None and state.profile is not None:
            state.profile.lookup_started, state.profile.lookup_done = lookup.started, None
            lookup.future.add_done_callback(lookup.mark_done)
        return lookup

    def _wait(self, lookup: PendingLookup, fresh: bool) -> None:
        """Wait for a lookup as long as this call may: idle, the wait stalls no one (up to
        ``LOOKUP_IDLE_WAIT_S`` per pass, all calls together, until this pass schedules a request to
        compute: ``update_state_after_alloc``). Busy, only the call that started the lookup
        (``fresh``) waits, up to ``LOOKUP_BUSY_WAIT_S``: answering in this call saves the request an
        engine step (a lookup of local files takes well under a millisecond), and a slow pool's
        lookups, pending over many steps, never add up to a stall."""
        if lookup.future.done():
            return
        if self._idle and self._idle_wait_left > 0:
            t0 = time.monotonic()
            cf.wait([lookup.future], timeout=self._idle_wait_left)
            self._idle_wait_left -= time.monotonic() - t0
        elif fresh:
            cf.wait([lookup.future], timeout=LOOKUP_BUSY_WAIT_S)

    def _decided(self, lookup: PendingLookup, decision: str, state: RequestState) -> None:
        """Count a lookup's outcome once (``kvtier_load_decisions_total``)."""
        if not lookup.decided:
            lookup.decided = True
            count(self.counters, "decision", decision)
            if state.profile is not None:
                state.profile.decision, state.profile.answered = decision, time.monotonic()
                state.profile.lookup_done = lookup.done_at

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks and will have ``num_external_tokens`` loaded: the
        hit offered, or less where vLLM capped it (0.33+), or 0 (it skips external KV)."""
        state = self._state(request)
        state.block_ids = list(blocks.get_block_ids()[0])
        state.lookup = None  # scheduled: a later lookup (after a preemption) starts afresh
        if not (num_external_tokens and state.background):
            self._idle_wait_left = 0.0  # it computes in this step: waiting now would delay it
        if num_external_tokens <= 0 or state.load is None:
            state.load = None
            return
        start, end = state.load
        if start + num_external_tokens < end:
            count(self.counters, "capped_loads")
            state.load = (start, start + num_external_tokens)
        if state.background:
            # vLLM parks the request (WAITING_FOR_REMOTE_KVS) with these blocks until every
            # worker reports the load finished; it is not among the next step's scheduled ones.
            if getattr(request, "num_preemptions", 0):
                count(self.counters, "resumed_loads")
            count(self.counters, "async_loads")
            self._background_loads.append(self._emit_load(request.request_id, state, background=True))
            state.loading = True

    def may_load_async(self, request: Request) -> bool:
        """Whether this request's hit may be loaded in the background (vLLM 0.34, with
        ``--max-num-inflight-kv-loads``: such requests wait in a queue of their own, whose loads
        start even while the running batch is full). Called as the request enters the waiting
        queues, before its lookup: true when a load could be offered and ``load_mode`` allows
        the background. A false positive only holds that queue's next load until a slot is free."""
        config = self.connector_config
        if self.disabled or config.load_mode == "sync" or config.load_policy == "never":
            return False
        state = self._requests.get(request.request_id)
        if state is not None:
            return state.namespace is not None and not state.no_hit and self.prefix.lookable(state)
        if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
            return False
        tail = self.prefix.tail_tokens or self.chunk_tokens
        return len(request.prompt_token_ids) - 1 >= min(self.chunk_tokens, tail)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVTierMetadata:
        meta = KVTierMetadata(num_tokens=scheduler_output.total_num_scheduled_tokens)
        self._idle = meta.num_tokens == 0
        self._idle_wait_left = LOOKUP_IDLE_WAIT_S
        cached = scheduler_output.scheduled_cached_reqs
        resumed = resumed_ids(cached)
        scheduled = scheduler_output.num_scheduled_tokens
        if self.profiler is not None:
            self.profiler.step({new.req_id: scheduled.get(new.req_id, 0) for new in scheduler_output.scheduled_new_reqs}
                               | {r: scheduled.get(r, 0) for r in resumed})
        meta.loads, self._background_loads = self._background_loads, []
        meta.saves, self._finishing = self._finishing, []
        meta.finished = list(dict.fromkeys(t.req_id for t in meta.saves))  # (a request's chunks and tail)
        for new in scheduler_output.scheduled_new_reqs:
            # New, or (0.34; 0.33's runner V2) preempted and rescheduled: its blocks are all new.
            state = self._requests.get(new.req_id)
            if state is not None:
                preempted = bool(getattr(state.request, "num_preemptions", 0))
                self._scheduled(meta, new.req_id, state, list(new.block_ids[0]), new.num_computed_tokens,
                                scheduled.get(new.req_id, 0), preempted)
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:  # preempted and rescheduled (0.32 / 0.33): its blocks are all new
                blocks = list(new_blocks[0]) if new_blocks is not None else state.block_ids
            else:
                blocks = state.block_ids + (list(new_blocks[0]) if new_blocks is not None else [])
            self._scheduled(meta, req_id, state, blocks, cached.num_computed_tokens[i], scheduled.get(req_id, 0),
                            req_id in resumed)
        for req_id in scheduler_output.finished_req_ids:
            gone = self._requests.pop(req_id, None)
            self.lookups.abandon(gone.lookup if gone is not None else None)
            if self.profiler is not None:
                self.profiler.finished(req_id)
        return meta

    def _scheduled(self, meta: KVTierMetadata, req_id: str, state: RequestState, block_ids: list[int],
                   computed: int, num_tokens: int, preempted: bool) -> None:
        """A request this step runs, holding ``block_ids``, with ``computed`` tokens computed before
        the step and ``num_tokens`` computed in it: its synchronous load (a hit found for it this
        step must be loaded into these blocks, else vLLM runs over stale ones), its saves."""
        state.block_ids = block_ids
        state.loading = False
        if state.load is not None:
            if preempted:
                count(self.counters, "resumed_loads")
            meta.loads.append(self._emit_load(req_id, state, background=False))
            state.unverified = True
        self.saves.retain_had(meta, req_id, state)
        self.saves.recomputes_from(state, computed)
        self.saves.plan(meta, req_id, state, computed + num_tokens)

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
        return Load(req_id, ids, self.saves.blocks(state, start, end), background, state.salt,
                    found if len(found) == c1 - c0 else ())

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        """Queue the save of the finished request's generated tokens (``save_decode``).

        True when a save was queued: vLLM then holds ``block_ids`` until every worker reports
        the request in ``get_finished`` (after copying them), so no other request reuses them
        first. Only tokens whose KV was computed are saved (the last sampled token has none).
        """
        state = self._requests.pop(request.request_id, None)
        self.lookups.abandon(state.lookup if state is not None else None)
        if state is None or state.namespace is None or state.loading or state.unverified or self.disabled \
                or not self.connector_config.save_decode:
            return False  # (a request aborted while loading: its blocks are the load's until it ends)
        saves = self.saves.finished(request, state, block_ids)
        self._finishing.extend(saves)
        return bool(saves)

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

    def reset_cache(self) -> bool:
        """vLLM resets the connector's cache (``reset_prefix_cache(reset_connector=True)``, and
        vLLM 0.34's sleep by default), most often because new weights were loaded in place: KV
        cached before is stale, and the model's digest (of the files) cannot tell. From now on
        no chunk cached before is hit or saved: requests are keyed under a fresh epoch (a random
        salt beside their tenant's, sent to the workers with every load and save), and the
        requests known so far are forgotten. The old chunks stay in the tiers (other instances
        may still run the old weights) until evicted."""
        self.epoch = secrets.token_hex(8)
        self._requests.clear()
        count(self.counters, "cache_resets")
        log.warning("kvtier: vLLM reset the connector's cache: chunks cached before are no longer hit or saved "
                    "by this engine (epoch %s)", self.epoch)
        return True

    def lookups_in_flight(self) -> int:
        return sum(1 for s in self._requests.values() if s.lookup is not None and not s.lookup.future.done())

    def requests_left(self) -> int:  # 0: the engine has drained (every request it saw finished)
        return len(self._requests)

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
        self.lookups.shutdown()
        self.probe.close()
        self.guard.close()
        self.views.close()
