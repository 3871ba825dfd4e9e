"""The planner's discrete-event simulator: one engine instance, its KV, and the tiers behind it.

The engine is modelled as vLLM schedules it: a loop of *steps*. Each step first gives every
decoding request one token, then admits waiting requests first-come-first-served into the rest of
a ``max_batched_tokens`` budget (chunked prefill). On admission a request gets, in this order:
the engine's own prefix cache (HBM, LRU over sessions, block-granular), then the longest
chunk-granular prefix the tiers hold (host, disk, pool: each tier LRU within its byte budget),
and the connector's load-or-recompute decision (``KVTierConnector._pays_off``): load only if
``bytes / tier bandwidth + latency`` is less than prefilling those tokens. Loads are synchronous
in the step that admits the request, as kvtier's connector does them, so the step lasts
``overhead + sum over tiers (bytes read in this step / bandwidth + latency) + prefill + decode``:
read-backs admitted together share the tier's bandwidth, and every request in a step waits for
the whole step. Runs of decode-only steps are advanced in bulk up to the next event, which keeps
10,000 sessions to seconds. Newly prefilled full chunks are written to every tier of the
configuration; lower tiers write in the background through a bounded queue, and a write that
would wait more than ``write_queue_s`` is dropped (counted), as the connector's writer drops it.

With ``instances = N`` one instance is simulated and the others are assumed to be its mirror
image: a shared tier gives it ``1/N`` of its bandwidth and capacity, and a session's later turn
lands on the same instance (where HBM, host and disk still hold its KV) with probability ``1/N``.

What it ignores: network and tokenizer time other than ``request_overhead_s``, preemption,
speculative decoding, partial-chunk writes, per-chunk tier mixes within one tier order, GPU/CPU
copy time separate from the tier read, and any overlap of loads with compute.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.plan.spec import HardwareSpec, ModelSpec, PlanConfig, TierSpec
from kvtier.plan.workload import Phase, Turn, Workload


class _LRUTier:
    """Per-session prefixes (tokens) in one tier, LRU within ``capacity_bytes``."""

    def __init__(self, spec: TierSpec, instances: int, bytes_per_token: int, lost: dict[str, int]) -> None:
        share = instances if spec.shared else 1
        self.spec = spec
        self.capacity_bytes = spec.capacity_bytes // share
        self.read_bytes_per_s = spec.read_bytes_per_s / share
        self.write_bytes_per_s = spec.write_bytes_per_s / share
        self.bytes_per_token = bytes_per_token
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.used_bytes = 0
        self.write_free_at = 0.0
        self.evictions = 0
        self.dropped_writes = 0
        self.lost = lost  # session -> tokens it had before an eviction or a dropped write

    def get(self, session: str) -> int:
        tokens = self.entries.get(session, 0)
        if tokens:
            self.entries.move_to_end(session)
        return tokens

    def put(self, session: str, tokens: int, now: float) -> None:
        old = self.entries.get(session, 0)
        if tokens <= old:
            return
        nbytes = tokens * self.bytes_per_token
        if nbytes > self.capacity_bytes:
            return
        start = max(now, self.write_free_at)
        if start - now > self.spec.write_queue_s:
            self.dropped_writes += 1
            self.lost[session] = max(self.lost.get(session, 0), tokens)
            return
        self.write_free_at = start + (tokens - old) * self.bytes_per_token / self.write_bytes_per_s
        if old:
            del self.entries[session]
            self.used_bytes -= old * self.bytes_per_token
        while self.entries and self.used_bytes + nbytes > self.capacity_bytes:
            victim, evicted = self.entries.popitem(last=False)
            self.used_bytes -= evicted * self.bytes_per_token
            self.lost[victim] = max(self.lost.get(victim, 0), evicted)
            self.evictions += 1
        self.entries[session] = tokens
        self.used_bytes += nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.used_bytes = 0
        self.write_free_at = 0.0


class _Req:
    __slots__ = ("admitted", "client_s", "computed", "end_s", "first_s", "hbm_tokens", "load_s", "loaded",
                 "local", "measured", "output", "prompt", "remaining", "session", "turn", "wanted_tokens", "worker")

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
        self.wanted_tokens = 0
        self.first_s = math.nan
        self.end_s = math.nan
        self.remaining = 0


@dataclass
class SimResult:
    """Per-request arrays (measured requests only) and engine time accounting."""

    config: str
    start_s: np.ndarray
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    hbm_tokens: np.ndarray
    loaded_tokens: dict[str, np.ndarray]
    load_s: np.ndarray
    capacity_miss_tokens: int
    busy_s: dict[str, float]
    bytes_read: dict[str, int]
    evictions: dict[str, int] = field(default_factory=dict)
    dropped_writes: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The planner's row: hit rates, TTFT percentiles, throughput, read rate, bottleneck."""
        n = len(self.ttft_s)
        if n == 0:
            return {"config": self.config, "requests": 0}
        end = float(np.max(self.start_s + self.e2e_s))
        duration = end - float(np.min(self.start_s))
        prompt = float(self.prompt_tokens.sum())
        hit = {t: float(v.sum()) / prompt for t, v in self.loaded_tokens.items()}
        hbm = float(self.hbm_tokens.sum()) / prompt
        busy = self.busy_s
        total_busy = sum(busy.values()) or 1.0
        shares = {k: v / total_busy for k, v in busy.items()}
        capacity_share = self.capacity_miss_tokens / prompt
        if capacity_share > 0.2:
            bottleneck = "capacity"
        else:
            bottleneck = {"load": "storage bandwidth", "prefill": "prefill compute", "decode": "decode compute",
                          "overhead": "step overhead"}[max(shares, key=lambda k: shares[k])]
        return {
            "config": self.config,
            "requests": n,
            "ttft_p50_s": float(np.percentile(self.ttft_s, 50)),
            "ttft_p90_s": float(np.percentile(self.ttft_s, 90)),
            "ttft_p99_s": float(np.percentile(self.ttft_s, 99)),
            "e2e_p50_s": float(np.percentile(self.e2e_s, 50)),
            "output_tok_s": float(self.output_tokens.sum()) / duration if duration > 0 else None,
            "hit_rate": {"hbm": hbm, **hit},
            "recompute_share": 1.0 - hbm - sum(hit.values()),
            "read_bytes_per_s": sum(self.bytes_read.values()) / duration if duration > 0 else 0.0,
            "load_p50_s": float(np.percentile(self.load_s, 50)),
            "engine_time_share": shares,
            "capacity_miss_share": capacity_share,
            "bottleneck": bottleneck,
            "evictions": self.evictions,
            "dropped_writes": self.dropped_writes,
            "duration_s": duration,
        }


def simulate(model: ModelSpec, hw: HardwareSpec, config: PlanConfig, workload: Workload, *, seed: int = 0,
             arrival_stagger_s: float = 1e-3) -> SimResult:
    """Run ``workload`` on one instance with ``config``'s tiers; deterministic for a given ``seed``.

    ``arrival_stagger_s`` spaces the first requests of a closed-loop phase as a real client's are
    (they never reach the engine in the same instant, so the first step holds only the first one).
    """
    eng = hw.engine
    bpt = model.bytes_per_token
    instances = config.instances
    lost: dict[str, int] = {}  # prefixes lost to tier capacity (evictions, dropped writes)
    lost_hbm: dict[str, int] = {}  # prefixes evicted from the engine's KV (a restart forgets these)
    tiers = [_LRUTier(hw.tier(name), instances, bpt, lost) for name in config.tiers]
    kv_cap = math.inf if eng.hbm_kv_bytes is None else eng.hbm_kv_bytes // bpt
    chunk, block = eng.chunk_tokens, eng.block_tokens
    rng = random.Random(seed)
    hbm: OrderedDict[str, int] = OrderedDict()
    hbm_state = [0, 0]  # cached tokens, running tokens
    busy = {"load": 0.0, "prefill": 0.0, "decode": 0.0, "overhead": 0.0}
    bytes_read = {t.spec.name: 0 for t in tiers}
    done: list[_Req] = []
    capacity_miss = [0]
    now = 0.0

    def decode_cost(decoding: list[_Req]) -> float:
        # Decode attention reads every decoding request's whole context once per step.
        return (eng.decode_step_s + len(decoding) * eng.decode_per_seq_s
                + eng.decode_context_s * sum(r.prompt for r in decoding))

    def evict_hbm() -> None:
        while hbm and hbm_state[0] + hbm_state[1] > kv_cap:
            victim, tokens = hbm.popitem(last=False)
            hbm_state[0] -= tokens
            lost_hbm[victim] = max(lost_hbm.get(victim, 0), tokens)

    def admit(r: _Req, step_bytes: dict[int, int]) -> None:
        r.admitted = True
        cap = (r.prompt - 1) // block * block
        cached = hbm.pop(r.session, 0) if r.local else 0
        hbm_state[0] -= cached
        hbm_hit = min(cached // block * block, cap)
        hbm_state[1] += r.prompt + r.output
        evict_hbm()
        tier_cap = (r.prompt - 1) // chunk * chunk
        cover = 0
        segments: list[tuple[int, int]] = []  # (tier index, tokens beyond HBM)
        for i, tier in enumerate(tiers):
            if not r.local and not tier.spec.shared:
                continue
            have = min(tier.get(r.session), tier_cap)
            if have > cover:
                beyond = have - max(cover, hbm_hit)
                if beyond > 0:
                    segments.append((i, beyond))
                cover = have
        ext = max(0, cover - hbm_hit)
        r.wanted_tokens = max(hbm_hit, cover)
        loaded = 0
        if ext > 0:
            predicted = sum(n * bpt / tiers[i].read_bytes_per_s + tiers[i].spec.latency_s for i, n in segments)
            if predicted < eng.prefill_s(ext, hbm_hit):
                for i, n in segments:
                    step_bytes[i] = step_bytes.get(i, 0) + n * bpt
                    r.loaded[tiers[i].spec.name] = n
                loaded = ext
        prior = min(max(lost.pop(r.session, 0), lost_hbm.pop(r.session, 0)), cap)
        if r.measured and prior > max(cover, hbm_hit):
            capacity_miss[0] += prior - max(cover, hbm_hit)
        r.hbm_tokens = hbm_hit
        r.computed = hbm_hit + loaded

    def store(r: _Req) -> None:
        tokens = r.prompt // chunk * chunk
        if tokens <= 0:
            return
        for tier in tiers:
            if r.local or tier.spec.shared:
                tier.put(r.session, tokens, now)

    def run_phase(phase: Phase) -> None:
        nonlocal now
        if phase.restart_before:
            hbm.clear()
            lost_hbm.clear()
            hbm_state[0] = 0
            for tier in tiers:
                if not tier.spec.persistent:
                    tier.clear()
                tier.write_free_at = 0.0
        counted = any(t.measured for s in phase.sessions for t in s)
        phase_busy = dict.fromkeys(busy, 0.0)
        origin = now
        arrivals: list[tuple[float, int, _Req]] = []
        seq = 0
        queue = deque(range(len(phase.sessions)))
        position = [0] * len(phase.sessions)

        def launch(session_index: int, t: float, worker: int) -> None:
            nonlocal seq
            k = position[session_index]
            turn = phase.sessions[session_index][k]
            if phase.concurrency is None:
                t = max(t, origin + (turn.arrival_s or 0.0))
            local = k == 0 or instances == 1 or rng.random() < 1.0 / instances
            r = _Req(turn, k, worker if worker >= 0 else session_index, t, local)
            heapq.heappush(arrivals, (t + eng.request_overhead_s, seq, r))
            seq += 1

        if phase.concurrency is None:
            while queue:
                launch(queue.popleft(), origin, -1)
        else:
            for w in range(min(phase.concurrency, len(queue))):
                launch(queue.popleft(), origin + w * arrival_stagger_s, w)

        _session_index = {(id(phase), s[0].session): i for i, s in enumerate(phase.sessions) if s}

        def finish(r: _Req, t: float) -> None:
            r.end_s = t
            done.append(r)
            hbm_state[1] -= r.prompt + r.output
            if r.local or instances == 1:
                hbm[r.session] = (r.prompt + r.output) // block * block
                hbm_state[0] += hbm[r.session]
                evict_hbm()
            index = r.worker
            session_index = _session_index[(id(phase), r.session)]
            position[session_index] += 1
            turns = phase.sessions[session_index]
            if position[session_index] < len(turns):
                launch(session_index, t + turns[position[session_index]].think_s, index)
            elif phase.concurrency is not None and queue:
                launch(queue.popleft(), t, index)

        waiting: deque[_Req] = deque()
        decoding: list[_Req] = []
        while True:
            while arrivals and arrivals[0][0] <= now:
                waiting.append(heapq.heappop(arrivals)[2])
            if not waiting and not decoding:
                if not arrivals:
                    break
                now = arrivals[0][0]
                continue
            if not waiting:
                dt = eng.step_overhead_s + decode_cost(decoding)
                k = min(r.remaining for r in decoding)
                if arrivals and dt > 0:
                    k = max(1, min(k, math.ceil((arrivals[0][0] - now) / dt)))
                now += k * dt
                phase_busy["overhead"] += k * eng.step_overhead_s
                phase_busy["decode"] += k * (dt - eng.step_overhead_s)
                still = []
                for r in decoding:
                    r.remaining -= k
                    if r.remaining <= 0:
                        finish(r, now)
                    else:
                        still.append(r)
                decoding = still
                continue
            budget = eng.max_batched_tokens - len(decoding)
            step_bytes: dict[int, int] = {}
            admitted: list[_Req] = []
            prefill = 0.0
            completed = 0
            for r in waiting:
                if budget <= 0:
                    break
                if not r.admitted:
                    if hbm_state[1] > 0 and hbm_state[1] + r.prompt + r.output > kv_cap:
                        break
                    admit(r, step_bytes)
                    admitted.append(r)
                n = min(r.prompt - r.computed, budget)
                prefill += eng.prefill_s(n, r.computed)
                r.computed += n
                budget -= n
                if r.computed >= r.prompt:
                    completed += 1
            load = 0.0
            for i, nbytes in step_bytes.items():
                load += nbytes / tiers[i].read_bytes_per_s + tiers[i].spec.latency_s
                bytes_read[tiers[i].spec.name] += nbytes if counted else 0
            decode = decode_cost(decoding) if decoding else 0.0
            now += eng.step_overhead_s + load + prefill + decode
            phase_busy["overhead"] += eng.step_overhead_s
            phase_busy["load"] += load
            phase_busy["prefill"] += prefill
            phase_busy["decode"] += decode
            for r in admitted:
                r.load_s = load if r.loaded else 0.0
            still = []
            for r in decoding:
                r.remaining -= 1
                if r.remaining <= 0:
                    finish(r, now)
                else:
                    still.append(r)
            decoding = still
            for _ in range(completed):
                r = waiting.popleft()
                r.first_s = now
                store(r)
                r.remaining = r.output - 1
                if r.remaining <= 0:
                    finish(r, now)
                else:
                    decoding.append(r)
        if counted:
            for key, value in phase_busy.items():
                busy[key] += value

    for phase in workload:
        run_phase(phase)
    measured = [r for r in done if r.measured]
    measured.sort(key=lambda r: r.client_s)
    names = [t.spec.name for t in tiers]
    return SimResult(
        config=config.name,
        start_s=np.array([r.client_s for r in measured]),
        ttft_s=np.array([r.first_s - r.client_s for r in measured]),
        e2e_s=np.array([r.end_s - r.client_s for r in measured]),
        prompt_tokens=np.array([r.prompt for r in measured], dtype=np.int64),
        output_tokens=np.array([r.output for r in measured], dtype=np.int64),
        hbm_tokens=np.array([r.hbm_tokens for r in measured], dtype=np.int64),
        loaded_tokens={n: np.array([r.loaded.get(n, 0) for r in measured], dtype=np.int64) for n in names},
        load_s=np.array([r.load_s for r in measured]),
        capacity_miss_tokens=capacity_miss[0],
        busy_s=busy,
        bytes_read=bytes_read,
        evictions={t.spec.name: t.evictions for t in tiers},
        dropped_writes={t.spec.name: t.dropped_writes for t in tiers},
    )
