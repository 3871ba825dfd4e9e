"""How much storage a workload needs: bytes, files and inodes per tier, the budget with the
headroom the pool's eviction needs, host memory per rank; and hit rate and TTFT as functions
of the pool's size.

What the vLLM connector stores for one request of ``P`` prompt and ``O`` output tokens
(``integrations/vllm/saves.py``): the whole chunks of the prompt when its prefill completes,
then (``save_decode``, on by default) the whole chunks of the ``P + O - 1`` tokens whose KV was
computed when it finishes; with ``tail_chunks``, the tail of each of the two (its full blocks
after the last whole chunk, down to a multiple of ``keys.tail_step``), a tail's file holding a
full chunk's payload. A session's later turns extend the earlier ones, so their chunks are the
same files; a tail at the same place is the same file. Each of these objects is one file per
KV head (head shards, the same files at any TP size), each ``format.file_bytes_for`` its
payload: a 4 KiB header, the payload rounded up to 4 KiB. Directories: ``ROOT/ab/cd/``, 65,792
at most.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvtier.format import file_bytes_for
from kvtier.keys import tail_step
from kvtier.plan.parallel import run_all, turns_of
from kvtier.plan.spec import TIER_ORDER, HardwareSpec, ModelSpec, PlanConfig
from kvtier.plan.workload import Workload
from kvtier.tiers.listing import SUFFIX

FANOUT = (256, 256 * 256)  # ROOT/ab/ then ROOT/ab/cd/
HIT_TARGET = 0.95


@dataclass(frozen=True)
class StoreShape:
    """How a connector stores a session's KV: its chunk and block sizes, tails, decode saves."""

    chunk_tokens: int = 256
    block_tokens: int = 16
    tails: bool = True
    save_decode: bool = True

    @property
    def tail_step(self) -> int:
        return tail_step(self.chunk_tokens, self.block_tokens) if self.tails else 0

    def tail(self, tokens: int) -> tuple[int, int] | None:
        """``(start, tokens)`` of the tail saved for a sequence of ``tokens``, or None."""
        step = self.tail_step
        if not step:
            return None
        start = tokens // self.chunk_tokens * self.chunk_tokens
        n = (tokens - start) // self.block_tokens * self.block_tokens // step * step
        return (start, n) if n > 0 else None


def session_objects(turns: Iterable[tuple[int, int]], shape: StoreShape, *, answers_match: bool = False
                    ) -> tuple[int, int]:
    """``(chunks, tails)`` one session of ``(prompt, output)`` turns leaves in a tier.

    A turn's prompt starts with the previous turn's prompt, so the chunks inside that are the
    same files. Past it the previous answer comes back as text, and its tokens need not be the
    ones the engine generated: by default (the upper bound) the chunks a finished turn saved
    past its prompt and the next turn's chunks there are different files; ``answers_match``
    (the lower bound) counts them as the same, as when every answer re-tokenizes to the tokens
    generated.
    """
    chunks = 0
    tails: set[tuple[int, int, int]] = set()  # (turn that wrote it, start, tokens); turn 0 when answers match
    previous = 0  # tokens of the previous turn whose chunks this turn shares
    for k, (prompt, output) in enumerate(turns):
        computed = prompt + output - 1 if shape.save_decode else prompt
        chunks += max(0, computed // shape.chunk_tokens - min(previous, prompt) // shape.chunk_tokens)
        previous = max(previous, computed) if answers_match else prompt
        first = shape.tail(prompt)
        last = shape.tail(computed) if shape.save_decode else None
        writer = 0 if answers_match else k
        if first is not None:
            tails.add((writer, *first))
        if last is not None and (first is None or sum(last) > sum(first)):
            tails.add((writer, *last))
    return chunks, len(tails)


def expected_dirs(files: int) -> int:
    """Shard directories ``files`` randomly named files occupy (expected), the root's two levels."""
    return sum(round(n * (1.0 - math.exp(-files / n))) for n in FANOUT)


def footprint(sessions: Iterable[Sequence[tuple[int, int]]], model: ModelSpec, shape: StoreShape) -> dict[str, Any]:
    """Objects, files, inodes and bytes on disk that ``sessions`` leave in one chunk directory:
    the upper bound of ``session_objects``, with ``files_low`` / ``bytes_low`` the lower bound."""
    chunks = tails = count = low = 0
    for turns in sessions:
        c, t = session_objects(turns, shape)
        chunks, tails, count = chunks + c, tails + t, count + 1
        low += sum(session_objects(turns, shape, answers_match=True))
    shards = model.num_kv_heads
    per_file = file_bytes_for(shape.chunk_tokens * model.bytes_per_token // shards)
    files = (chunks + tails) * shards
    return {"sessions": count, "chunks": chunks, "tails": tails, "files": files,
            "inodes": files + expected_dirs(files), "bytes": files * per_file,
            "files_low": low * shards, "bytes_low": low * shards * per_file,
            "kv_bytes": (chunks + tails) * shape.chunk_tokens * model.bytes_per_token}


def workload_sessions(workload: Workload) -> list[list[tuple[int, int]]]:
    """Each session's ``(prompt, output)`` turns over every phase of ``workload``, in order."""
    by_session: dict[str, list[tuple[int, int]]] = {}
    for phase in workload:
        for turns in phase.sessions:
            for t in turns:
                by_session.setdefault(t.session, []).append((t.prompt_tokens, t.output_tokens))
    return list(by_session.values())


def pool_filesystem_bytes(budget: int, writers: int) -> int:
    """What the pool's filesystem must hold for ``budget``: the overshoot bound of
    ``tiers/pool.py`` with the default ``sync_bytes`` and ``writers`` publishing processes."""
    from kvtier.tiers.pool import default_sync_bytes, overshoot_bound

    return overshoot_bound(budget, default_sync_bytes(budget), max(1, writers))


def capacity(model: ModelSpec, hw: HardwareSpec, workload: Workload, *, instances: int = 1) -> dict[str, Any]:
    """Per kvtier tier of ``hw`` (host, disk, pool): what ``workload`` stores there (a
    persistent tier keeps every session; host DRAM is sized by its budget), the budget that
    keeps all of it, the filesystem size that budget needs, and host memory per rank."""
    eng = hw.engine
    shape = StoreShape(eng.chunk_tokens, eng.block_tokens, eng.tail_chunks)
    need = footprint(workload_sessions(workload), model, shape)
    writers = instances * model.parallel_size  # every TP rank of every engine publishes its heads
    out: dict[str, Any] = {"workload": need, "writers": writers, "tiers": {}}
    for tier in hw.tiers:
        if tier.name not in TIER_ORDER:  # another connector's tier (a calibrated peer): not kvtier's files
            continue
        if not tier.persistent:
            out["tiers"][tier.name] = {"budget_bytes": tier.capacity_bytes,
                                       "host_bytes_per_rank": tier.capacity_bytes // model.parallel_size,
                                       "holds_working_set": tier.capacity_bytes >= need["kv_bytes"]}
            continue
        budget = need["bytes"]
        row = {**need, "budget_bytes": budget, "configured_bytes": tier.capacity_bytes,
               "holds_working_set": tier.capacity_bytes >= budget}
        # The pool evicts in rounds behind its writers and may overshoot its budget (tiers/pool.py);
        # a disk tier evicts down to its budget before it writes.
        row["filesystem_bytes"] = pool_filesystem_bytes(budget, writers) if tier.shared else budget
        out["tiers"][tier.name] = row
    return out


def count_on_disk(root: str | os.PathLike[str]) -> dict[str, int]:
    """What a chunk directory (a pool, a disk tier) holds: chunk files, their bytes, directories."""
    files = nbytes = dirs = 0
    for _, dirnames, filenames in os.walk(root):
        dirs += len(dirnames)
        for name in filenames:
            if name.endswith(SUFFIX):
                files += 1
                nbytes += os.stat(os.path.join(_, name)).st_size
    return {"files": files, "bytes": nbytes, "dirs": dirs, "inodes": files + dirs}


CURVE_FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0, 1.1)


def _point(args: tuple[ModelSpec, HardwareSpec, PlanConfig, Workload, float, int]) -> dict[str, Any] | None:
    from kvtier.plan.sim import simulate

    model, hw, config, workload, tier_bytes, seed = args
    name = config.tiers[-1]
    tier = replace(hw.tier(name), capacity_bytes=int(tier_bytes))
    sized = replace(hw, tiers=tuple(tier if t.name == name else t for t in hw.tiers))
    row = simulate(model, sized, config, workload, seed=seed).summary()
    if not row.get("requests"):
        return None
    return {"tier_hit_rate": float(sum(v for k, v in row["hit_rate"].items() if k != "hbm")),
            "ttft_p50_s": row["ttft_p50_s"], "ttft_p90_s": row["ttft_p90_s"]}


def capacity_curve(model: ModelSpec, hw: HardwareSpec, config: PlanConfig, workload: Workload,
                   fractions: Sequence[float] = CURVE_FRACTIONS, *, seed: int = 0) -> dict[str, Any]:
    """Hit rate and TTFT p50 of ``config`` as its last (persistent) tier holds a fraction of
    what ``workload`` stores there. ``pool_bytes`` is that fraction of the footprint's bytes on
    disk; the simulator's tier holds the same fraction of the sessions' KV (at 100%, room for
    all of it). ``relative_hit`` is the tier hit rate over the one with room for everything
    (None where the tier serves no hit even then: a tier before it holds the sessions);
    ``bytes_for_95pct`` the smallest size on the grid that keeps it at 95% or more. Large
    workloads simulate their points in parallel (``plan.parallel``)."""
    eng = hw.engine
    sessions = workload_sessions(workload)
    need = footprint(sessions, model, StoreShape(eng.chunk_tokens, eng.block_tokens, eng.tail_chunks))
    tokens = sum(max(p + o for p, o in turns) for turns in sessions)
    grid = sorted({*fractions, 1.0})  # 100%: room for everything, the reference
    jobs = [(model, hw, config, workload, f * tokens * model.bytes_per_token, seed) for f in grid]
    results = run_all(_point, jobs, turns_of(workload))
    points = [{"fraction": f, "pool_bytes": int(f * need["bytes"]), **r} for f, r in zip(grid, results, strict=True)
              if r is not None]
    full = next((p["tier_hit_rate"] for p in points if p["fraction"] == 1.0), 0.0)
    for p in points:
        p["relative_hit"] = p["tier_hit_rate"] / full if full > 0 else None
    points = [p for p in points if p["fraction"] in fractions]
    enough = [p["pool_bytes"] for p in points if p["relative_hit"] is not None and p["relative_hit"] >= HIT_TARGET]
    return {"config": config.name, "tier": config.tiers[-1], "working_set_bytes": need["bytes"], "points": points,
            "bytes_for_95pct": min(enough) if enough else None,
            "note": None if full > 0 else f"the {config.tiers[-1]} tier serves no hit in this workload at any size"}
