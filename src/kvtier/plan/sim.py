"""The planner's discrete-event simulator: one engine instance, its KV, and the tiers behind it.

The engine is modelled as vLLM schedules it: a loop of *steps*. Each step first gives every
decoding request one token, then admits waiting requests first-come-first-served into the rest of
a ``max_batched_tokens`` budget (chunked prefill). On admission a request gets, in this order:
the engine's own prefix cache (HBM, LRU over sessions, block-granular), then the longest
prefix the tiers hold (host, disk, pool: each tier LRU within its byte budget): whole chunks,
then, with ``tail_chunks``, the tail after them in steps of ``keys.tail_step`` tokens (a tail's
read costs a full chunk's bytes, as its file holds one),
and the load-or-recompute decision of ``kvtier.policy``, the rule the connector's scheduler
decides by: load only if ``bytes / tier bandwidth + latency`` is less than prefilling those
tokens (the connector's latency term is 0: the rates its workers measure already include it).
Loads follow the connector's ``load_mode`` (``EngineSpec``): in the step that admits the request,
which then lasts ``overhead + sum over tiers (bytes read / bandwidth + latency) + prefill +
decode`` (read-backs admitted together share a tier's bandwidth); or in the background, one
after another, while the engine steps the others. Runs of decode-only steps are advanced in bulk
up to the next event, which keeps 10,000 sessions to seconds. Newly prefilled full chunks (with
``tail_chunks``, and the prompt's tail) are written to every tier of the configuration; lower
tiers write in the background through a bounded queue, and a write that would wait more than
``write_queue_s`` is dropped (counted), as the connector's writer drops it (``plan.tiermodel``).

With ``instances = N`` one instance is simulated and the others are assumed to be its mirror
image: a shared tier gives it ``1/N`` of its bandwidth and capacity, and a session's later turn
lands on the same instance (where HBM, host and disk still hold its KV) with probability ``1/N``.

A request reaches the engine ``request_overhead_s`` (plus ``frontend_per_token_s`` per prompt
token) after the front end (one process: HTTP, tokenizer) is free: requests sent together queue
there first, one at a time. Where the front end shares the engine's cores (``shared_rate`` < 1:
vLLM's CPU build), both slow down while both work (``plan.frontend``).

What it ignores: network and tokenizer time other than ``request_overhead_s``, preemption,
speculative decoding, partial-chunk writes, per-chunk tier mixes within one tier order, and GPU/CPU
copy time separate from the tier read.

The engine model, its steps and the phases are one simulation; its state is ``_Simulation``
(across phases) and ``_PhaseRun`` (one phase); what it returns is ``simresult.SimResult``.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict, deque

import numpy as np

from kvtier.keys import tail_step
from kvtier.plan.frontend import FrontEnd
from kvtier.plan.simresult import SimResult
from kvtier.plan.spec import HardwareSpec, ModelSpec, PlanConfig
from kvtier.plan.tiermodel import LRUTier
from kvtier.plan.workload import Phase, Turn, Workload
from kvtier.policy import SYNC_IDLE_MAX_S, Read, pays_off, predicted_load_s


class _Req:
    __slots__ = ("admitted", "client_s", "computed", "end_s", "first_s", "hbm_tokens", "load_s", "load_state",
                 "loaded", "local", "measured", "output", "prompt", "ready_s", "remaining", "session", "turn",
                 "wanted_tokens", "worker")

    def __init__(self, turn: Turn, index: int, worker: int, client_s: float, local: bool) -> None:
        self.session = turn.session
        self.turn = index
        self.prompt = turn.prompt_tokens
        self.output = turn.output_tokens
        self.measured = turn.measured
        self.worker = worker
        self.client_s = client_s
        self.local = local
        self.admitted = False
        self.computed = 0
        self.hbm_tokens = 0
        self.loaded: dict[str, int] = {}
        self.load_s = 0.0
        self.load_state = 0  # a background load: 1 reading (until ready_s), 2 reported (schedulable)
        self.ready_s = 0.0
        self.wanted_tokens = 0
        self.first_s = math.nan
        self.end_s = math.nan
        self.remaining = 0


def simulate(model: ModelSpec, hw: HardwareSpec, config: PlanConfig, workload: Workload, *, seed: int = 0,
             arrival_stagger_s: float = 1e-3) -> SimResult:
    """Run ``workload`` on one instance with ``config``'s tiers; deterministic for a given ``seed``.

    ``arrival_stagger_s`` spaces the first requests of a closed-loop phase as a real client's are
    (they never reach the engine in the same instant, so the first step holds only the first one).
    """
    sim = _Simulation(model, hw, config, seed, arrival_stagger_s)
    for phase in workload:
        _PhaseRun(sim, phase).run()
    return sim.result()


class _Simulation:
    """What lasts across phases: the engine's KV (HBM), the tiers, the clock and the tallies."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, config: PlanConfig, seed: int,
                 arrival_stagger_s: float) -> None:
        self.eng = hw.engine
        self.bpt = model.bytes_per_token
        self.config = config
        self.instances = config.instances
        self.arrival_stagger_s = arrival_stagger_s
        self.lost: dict[str, int] = {}  # prefixes lost to tier capacity (evictions, dropped writes)
        self.lost_hbm: dict[str, int] = {}  # prefixes evicted from the engine's KV (a restart forgets these)
        self.tiers = [LRUTier(hw.tier(name), self.instances, self.bpt, self.lost) for name in config.tiers]
        self.kv_cap = math.inf if self.eng.hbm_kv_bytes is None else self.eng.hbm_kv_bytes // self.bpt
        self.chunk, self.block = self.eng.chunk_tokens, self.eng.block_tokens
        self.tail = tail_step(self.chunk, self.block) if self.eng.tail_chunks else 0
        self.rng = random.Random(seed)
        self.hbm: OrderedDict[str, int] = OrderedDict()  # session -> tokens the engine's prefix cache holds
        self.hbm_cached = 0  # tokens in ``hbm``
        self.hbm_running = 0  # tokens of admitted requests (prompt + output)
        self.busy = {"load": 0.0, "prefill": 0.0, "decode": 0.0, "overhead": 0.0}
        self.bytes_read = {t.spec.name: 0 for t in self.tiers}
        self.done: list[_Req] = []
        self.capacity_miss = 0
        self.now = 0.0
        self.front: FrontEnd[_Req] = FrontEnd(self.eng.shared_rate)
        self.idle = True  # the last step scheduled no tokens (the connector's test for loading in the step)
        self.loader_free = 0.0  # when the background loader is done with the loads it has
        self.load_cpu_s = 0.0  # background loads' CPU not yet taken from the engine's steps (shared cores)

    def decode_cost(self, decoding: list[_Req]) -> float:
        # Decode attention reads every decoding request's whole context once per step.
        eng = self.eng
        return (eng.decode_step_s + len(decoding) * eng.decode_per_seq_s
                + eng.decode_context_s * sum(r.prompt for r in decoding))

    def evict_hbm(self) -> None:
        while self.hbm and self.hbm_cached + self.hbm_running > self.kv_cap:
            victim, tokens = self.hbm.popitem(last=False)
            self.hbm_cached -= tokens
            self.lost_hbm[victim] = max(self.lost_hbm.get(victim, 0), tokens)

    def admit(self, r: _Req) -> dict[int, int]:
        """Give ``r`` its engine prefix-cache hit, then the tiers' hit if loading it pays off:
        the bytes to read, by tier index (empty: nothing to load)."""
        step_bytes: dict[int, int] = {}
        r.admitted = True
        block, chunk = self.block, self.chunk
        cap = (r.prompt - 1) // block * block
        cached = self.hbm.pop(r.session, 0) if r.local else 0
        self.hbm_cached -= cached
        hbm_hit = min(cached // block * block, cap)
        self.hbm_running += r.prompt + r.output
        self.evict_hbm()
        cover, segments = self._tier_cover(r, hbm_hit)
        ext = max(0, cover - hbm_hit)
        r.wanted_tokens = max(hbm_hit, cover)
        loaded = 0
        if ext > 0:
            tiers = self.tiers
            pad = -cover % chunk  # a tail (read last) costs a full chunk's bytes: its file holds one
            nbytes = [(i, (n + (pad if j == len(segments) - 1 else 0)) * self.bpt) for j, (i, n) in enumerate(segments)]
            predicted = predicted_load_s(Read(b, tiers[i].read_bytes_per_s, tiers[i].spec.latency_s) for i, b in nbytes)
            if pays_off(predicted, self.eng.prefill_s(ext, hbm_hit)):
                for i, b in nbytes:
                    step_bytes[i] = step_bytes.get(i, 0) + b
                for i, n in segments:
                    r.loaded[tiers[i].spec.name] = n
                loaded = ext
        prior = min(max(self.lost.pop(r.session, 0), self.lost_hbm.pop(r.session, 0)), cap)
        if r.measured and prior > max(cover, hbm_hit):
            self.capacity_miss += prior - max(cover, hbm_hit)
        r.hbm_tokens = hbm_hit
        r.computed = hbm_hit + loaded
        return step_bytes

    def load_s(self, nbytes: dict[int, int]) -> float:
        return predicted_load_s(Read(b, self.tiers[i].read_bytes_per_s, self.tiers[i].spec.latency_s)
                                for i, b in nbytes.items())

    def in_background(self, load_s: float) -> bool:
        """The connector's ``load_mode`` decision (``kvtier.integrations.vllm.decide``)."""
        mode = self.eng.load_mode
        return mode == "async" or (mode == "auto" and (not self.idle or load_s > SYNC_IDLE_MAX_S))

    def _usable(self, held: int, prompt: int) -> int:
        """Of the ``held`` tokens a tier stored for a session, those a lookup for ``prompt`` finds:
        whole chunks short of the prompt's last token (the engine computes at least one), then
        the tail stored after the last of them if it also ends short of it (only the tail of
        one length is stored after a chunk, so a longer one is not found at all)."""
        chunks = (prompt - 1) // self.chunk * self.chunk
        if not self.tail:
            return min(held, chunks)
        cap = chunks + ((prompt - 1) // self.block * self.block - chunks) // self.tail * self.tail
        return held if held <= cap else min(held // self.chunk * self.chunk, chunks)

    def _stored(self, tokens: int) -> int:
        """Of a prompt of ``tokens`` tokens, those a save stores: whole chunks, then its tail."""
        chunks = tokens // self.chunk * self.chunk
        return chunks + ((tokens - chunks) // self.tail * self.tail if self.tail else 0)

    def _tier_cover(self, r: _Req, hbm_hit: int) -> tuple[int, list[tuple[int, int]]]:
        """Tokens the tiers cover, and ``(tier index, tokens beyond HBM)`` read from each."""
        cover = 0
        segments: list[tuple[int, int]] = []
        for i, tier in enumerate(self.tiers):
            if not r.local and not tier.spec.shared:
                continue
            have = self._usable(tier.get(r.session), r.prompt)
            if have > cover:
                beyond = have - max(cover, hbm_hit)
                if beyond > 0:
                    segments.append((i, beyond))
                cover = have
        return cover, segments

    def store(self, r: _Req) -> None:
        tokens = self._stored(r.prompt)
        if tokens <= 0:
            return
        for tier in self.tiers:
            if r.local or tier.spec.shared:
                tier.put(r.session, tokens, self.now)

    def restart(self) -> None:
        """The engine restarts: its KV and every non-persistent tier are gone."""
        self.hbm.clear()
        self.lost_hbm.clear()
        self.hbm_cached = 0
        for tier in self.tiers:
            if not tier.spec.persistent:
                tier.clear()
            tier.write_free_at = 0.0

    def result(self) -> SimResult:
        measured = sorted((r for r in self.done if r.measured), key=lambda r: r.client_s)
        names = [t.spec.name for t in self.tiers]
        return SimResult(
            config=self.config.name,
            start_s=np.array([r.client_s for r in measured]),
            ttft_s=np.array([r.first_s - r.client_s for r in measured]),
            e2e_s=np.array([r.end_s - r.client_s for r in measured]),
            prompt_tokens=np.array([r.prompt for r in measured], dtype=np.int64),
            output_tokens=np.array([r.output for r in measured], dtype=np.int64),
            hbm_tokens=np.array([r.hbm_tokens for r in measured], dtype=np.int64),
            loaded_tokens={n: np.array([r.loaded.get(n, 0) for r in measured], dtype=np.int64) for n in names},
            load_s=np.array([r.load_s for r in measured]),
            capacity_miss_tokens=self.capacity_miss,
            busy_s=self.busy,
            bytes_read=self.bytes_read,
            evictions={t.spec.name: t.evictions for t in self.tiers},
            dropped_writes={t.spec.name: t.dropped_writes for t in self.tiers},
        )


class _PhaseRun:
    """One phase of the workload: its clients (closed loop or timed arrivals) and the step loop."""

    def __init__(self, sim: _Simulation, phase: Phase) -> None:
        self.sim, self.phase = sim, phase
        if phase.restart_before:
            sim.restart()
        self.counted = any(t.measured for s in phase.sessions for t in s)
        self.busy = dict.fromkeys(sim.busy, 0.0)
        self.origin = sim.now
        self.arrivals: list[tuple[float, int, _Req]] = []  # (at the engine, seq, request)
        self.seq = 0
        self.queue = deque(range(len(phase.sessions)))
        self.position = [0] * len(phase.sessions)
        self.session_index = {s[0].session: i for i, s in enumerate(phase.sessions) if s}
        self.waiting: deque[_Req] = deque()
        self.decoding: list[_Req] = []

    def launch(self, session_index: int, t: float, worker: int) -> None:
        """The client of ``session_index`` sends its next turn at ``t``."""
        sim, phase = self.sim, self.phase
        k = self.position[session_index]
        turn = phase.sessions[session_index][k]
        if phase.concurrency is None:
            t = max(t, self.origin + (turn.arrival_s or 0.0))
        local = k == 0 or sim.instances == 1 or sim.rng.random() < 1.0 / sim.instances
        r = _Req(turn, k, worker if worker >= 0 else session_index, t, local)
        eng = sim.eng
        sim.front.send(t, self.seq, eng.request_overhead_s + eng.frontend_per_token_s * r.prompt, r)
        self.seq += 1

    def engine_runs(self, work_s: float, *, shared: bool = True) -> None:
        """The engine works ``work_s`` seconds (alone) from now; requests the front end finishes
        meanwhile arrive at the engine. ``shared``: the work takes every core (``FrontEnd``)."""
        done: list[tuple[float, int, _Req]] = []
        self.sim.now = self.sim.front.run_engine(self.sim.now, work_s, done, shared=shared)
        self._arrive(done)

    def front_end(self) -> None:
        """The front end works, alone, up to now (the engine idle or between steps)."""
        done: list[tuple[float, int, _Req]] = []
        self.sim.front.advance(self.sim.now, 1.0, done)
        self._arrive(done)

    def _arrive(self, done: list[tuple[float, int, _Req]]) -> None:
        for item in done:
            heapq.heappush(self.arrivals, item)

    def next_event(self) -> float:
        """When the next request arrives at the engine, with the engine idle (inf: none left)."""
        return min(self.arrivals[0][0] if self.arrivals else math.inf, self.sim.front.next_done())

    def finish(self, r: _Req, t: float) -> None:
        """``r`` produced its last token: its KV stays in HBM, its client goes on."""
        sim = self.sim
        r.end_s = t
        sim.done.append(r)
        sim.hbm_running -= r.prompt + r.output
        if r.local or sim.instances == 1:
            sim.hbm[r.session] = (r.prompt + r.output) // sim.block * sim.block
            sim.hbm_cached += sim.hbm[r.session]
            sim.evict_hbm()
        index = self.session_index[r.session]
        self.position[index] += 1
        turns = self.phase.sessions[index]
        if self.position[index] < len(turns):
            self.launch(index, t + turns[self.position[index]].think_s, r.worker)
        elif self.phase.concurrency is not None and self.queue:
            self.launch(self.queue.popleft(), t, r.worker)

    def run(self) -> None:
        sim, phase = self.sim, self.phase
        if phase.concurrency is None:
            while self.queue:
                self.launch(self.queue.popleft(), self.origin, -1)
        else:
            for w in range(min(phase.concurrency, len(self.queue))):
                self.launch(self.queue.popleft(), self.origin + w * sim.arrival_stagger_s, w)
        while True:
            self.front_end()
            while self.arrivals and self.arrivals[0][0] <= sim.now:
                self.waiting.append(heapq.heappop(self.arrivals)[2])
            if not self.waiting and not self.decoding:
                if not self.arrivals and self.sim.front.next_done() == math.inf:
                    break
                sim.now, sim.idle = self.next_event(), True
            elif not self.waiting:
                self.decode_steps()
            else:
                self.step()
        if self.counted:
            for key, value in self.busy.items():
                sim.busy[key] += value

    def _advance(self, decoding: list[_Req], tokens: int) -> None:
        """Every decoding request gets ``tokens`` tokens; those that are done finish now."""
        still = []
        for r in decoding:
            r.remaining -= tokens
            if r.remaining <= 0:
                self.finish(r, self.sim.now)
            else:
                still.append(r)
        self.decoding = still

    def decode_steps(self) -> None:
        """A run of decode-only steps, in bulk, up to the next arrival or the first to finish."""
        sim, eng = self.sim, self.sim.eng
        dt = eng.step_overhead_s + sim.decode_cost(self.decoding)
        k = min(r.remaining for r in self.decoding)
        upcoming = self.next_event()
        if upcoming < math.inf and dt > 0:
            k = max(1, min(k, math.ceil((upcoming - sim.now) / dt)))
        self.engine_runs(k * dt, shared=False)  # scheduling and a decode token: one thread
        self.busy["overhead"] += k * eng.step_overhead_s
        self.busy["decode"] += k * (dt - eng.step_overhead_s)
        self._advance(self.decoding, k)
        sim.idle = not (self.waiting or self.decoding)

    def step(self) -> None:
        """One engine step with waiting requests: admit (and load) into the token budget, prefill,
        decode one token for every decoding request. A request whose load runs in the background
        (``EngineSpec.load_mode``) takes no budget until the step after the one that reports it."""
        sim, eng = self.sim, self.sim.eng
        decoding = self.decoding
        budget = eng.max_batched_tokens - len(decoding)
        step_bytes: dict[int, int] = {}
        admitted: list[_Req] = []
        prefilled: list[_Req] = []
        prefill = 0.0
        reported = False
        for r in self.waiting:
            if budget <= 0:
                break
            if r.load_state == 1:  # still reading, or read and reported by this step
                if r.ready_s <= sim.now:
                    r.load_state, reported = 2, True
                continue
            if not r.admitted:
                if sim.hbm_running > 0 and sim.hbm_running + r.prompt + r.output > sim.kv_cap:
                    break
                own = sim.admit(r)
                own_s = sim.load_s(own) if own else 0.0
                if own and sim.in_background(own_s):
                    self._load_in_background(r, own, own_s)
                    continue
                for i, nbytes in own.items():
                    step_bytes[i] = step_bytes.get(i, 0) + nbytes
                admitted.append(r)
            r.load_state = 0
            n = min(r.prompt - r.computed, budget)
            prefill += eng.prefill_s(n, r.computed)
            r.computed += n
            budget -= n
            if r.computed >= r.prompt:
                prefilled.append(r)
        if not (prefilled or prefill or decoding or reported):  # nothing to run: wait for a load
            ready = min((r.ready_s for r in self.waiting if r.load_state == 1), default=math.inf)
            if ready < math.inf:
                sim.now, sim.idle = max(sim.now, min(ready, self.next_event())), True
                return
        load = sim.load_s(step_bytes)
        self._count_read(step_bytes)
        decode = sim.decode_cost(decoding) if decoding else 0.0
        # Prefill runs on the engine's thread team and a load's reads and copies on the
        # connector's threads, so both take the cores the front end tokenizes on; scheduling
        # and a decode token run on one thread (a decode step beside the front end leaves its
        # pace unchanged in the bench runs: docs/planner.md, "What was missing, now modelled").
        self.engine_runs(eng.step_overhead_s + decode, shared=False)
        cpu, sim.load_cpu_s = sim.load_cpu_s, 0.0
        self.engine_runs(load + prefill + cpu)
        self.busy["overhead"] += eng.step_overhead_s
        self.busy["load"] += load
        self.busy["prefill"] += prefill
        self.busy["decode"] += decode
        for r in admitted:
            r.load_s = load if r.loaded else 0.0
        self._advance(decoding, 1)
        self._first_tokens(prefilled)
        # Idle: this step scheduled no tokens, or nothing is left for the next one to schedule.
        sim.idle = not (prefill or decoding) or not (self.waiting or self.decoding)

    def _load_in_background(self, r: _Req, nbytes: dict[int, int], load: float) -> None:
        """``r``'s read (``load`` seconds) joins the loader's queue (one load after another); the
        engine goes on."""
        sim = self.sim
        sim.loader_free = max(sim.now, sim.loader_free) + load
        r.ready_s, r.load_state, r.load_s = sim.loader_free, 1, sim.loader_free - sim.now
        if sim.eng.shared_rate < 1 and not sim.idle:  # its reads and copies take the busy engine's cores
            sim.load_cpu_s += load
        self.busy["load"] += load
        self._count_read(nbytes)

    def _count_read(self, nbytes: dict[int, int]) -> None:
        if self.counted:
            for i, b in nbytes.items():
                self.sim.bytes_read[self.sim.tiers[i].spec.name] += b

    def _first_tokens(self, prefilled: list[_Req]) -> None:
        """The requests whose prefill this step completed get their first token."""
        sim = self.sim
        if prefilled:
            gone = {id(r) for r in prefilled}
            self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        for r in prefilled:
            r.first_s = sim.now
            sim.store(r)
            r.remaining = r.output - 1
            if r.remaining <= 0:
                self.finish(r, sim.now)
            else:
                self.decoding.append(r)
