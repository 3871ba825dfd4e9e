"""Lookup of a long prompt in a shared pool at tensor parallel 1 and 8, and the loads after it.

Issue 22's target: on a GlusterFS mount, looking up a 128k-token prompt at a simulated TP=8
costs at most 2x the TP=1 lookup, and the loads that follow issue no second lookup per chunk.

What runs is the connector's own scheduler role (``SchedulerRole.locate``, the code vLLM's
scheduler calls) over a pool of head-shard files of a model with 8 KV heads: at TP=1 one rank
holds all 8 heads, at TP=8 each rank one. vLLM's config objects are small stand-ins (no engine
starts). For each TP size the prompt is looked up ``--repeats`` times after a warm-up, each
time as a new request, with the kernel's dentry and attribute caches dropped before it when
``--drop-caches`` is given (root; else a FUSE mount answers repeated stats from its 1 s
attribute cache). Reported: median seconds, pool ``stat`` calls per lookup, and the same for
the pre-0.2 algorithm that asked the pool once per rank (``per_rank``, one stat per chunk per
rank). Then every TP=8 rank loads the prompt's chunks with the tiers the lookup found; the
loads must deliver every chunk with zero lookups of their own (``load_lookups``, stats).

    python benchmarks/pool_lookup.py --dir /mnt/gluster/pool [--tokens 131072] [--drop-caches]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvtier.format import ChunkSpec
from kvtier.integrations.vllm.config import ConnectorConfig, deployment, store_config
from kvtier.integrations.vllm.scheduler import SchedulerRole
from kvtier.keys import shard_id
from kvtier.layout import DTYPE_CODES
from kvtier.store import TieredStore
from kvtier.tiers.base import Chunk
from kvtier.tiers.files import ChunkFiles
from kvtier.tiers.poolroot import scratch_pool

HEADS, BLOCK, HEAD_SIZE, LAYERS, CHUNK = 8, 16, 8, 2, 256


def vllm_config(tp: int, pool: Path) -> Any:
    """The fields of vLLM's config the connector reads (a stand-in: no engine)."""
    extra = {"pool_url": scratch_pool(pool), "host_bytes": 0, "chunk_tokens": CHUNK, "load_policy": "always"}
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute", kv_connector_extra_config=extra),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                        decode_context_parallel_size=1, rank=0),
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_layout=None, block_size=BLOCK),
        device_config=SimpleNamespace(device_type="cuda"), attention_config=None,
        model_config=SimpleNamespace(model="bench-lookup", get_total_num_kv_heads=lambda: HEADS))


def role_for(tp: int, pool: Path) -> SchedulerRole:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS // tp, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_layout="LBHNC",
                       kv_cache_groups=[KVCacheGroupSpec([f"l{i}" for i in range(LAYERS)], spec)])
    config = vllm_config(tp, pool)
    dep = deployment(config, kv)
    cfg, rest = ConnectorConfig.split(config.kv_transfer_config.kv_connector_extra_config)
    return SchedulerRole(cfg, store_config(cfg, rest, config, dep, None), dep, {})


def request(tokens: list[int], n: int) -> Any:
    return SimpleNamespace(request_id=f"r{n}", prompt_token_ids=tokens, prompt_embeds=None, lora_request=None,
                           mm_features=[], cache_salt=None)


def populate(role: SchedulerRole, pool: Path, tokens: list[int]) -> int:
    """Every head shard of every chunk of ``tokens``, as TP=8 writers leave them; returns the files."""
    config = role.store_config
    spec = ChunkSpec(config.namespace().digest, DTYPE_CODES[config.layout.dtype],
                     config.layout.shape(CHUNK), config.chunk_bytes)
    files = ChunkFiles(pool)
    data = torch.zeros(config.layout.shape(CHUNK), dtype=config.layout.dtype)
    n = 0
    for c in role._state(request(tokens, -1)).chunk_ids:
        for s in range(HEADS):
            files.publish(Chunk(shard_id(c, s, HEADS), data), spec)
            n += 1
    return n


def drop_caches(enabled: bool) -> None:
    if enabled:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("2\n")  # dentries and inodes


def lookups(role: SchedulerRole, tokens: list[int], repeats: int, drop: bool, per_rank: bool) -> dict[str, Any]:
    """Time ``repeats`` lookups of ``tokens`` as new requests (after one warm-up)."""
    assert role.pool is not None
    stats = role.pool.files.lookup_stats  # type: ignore[attr-defined]
    seconds, calls, found = [], [], 0
    for i in range(repeats + 1):
        state = role._state(request(tokens, 1000 * per_rank + i))
        drop_caches(drop)
        before = stats.value
        t0 = time.perf_counter()
        if per_rank:  # what the scheduler did before: each rank asked the pool for its own shards
            step = HEADS // role.dep.sharding.world_size
            found = min(role.pool.lookup(role.views.shard_ids(state.shard_ids, state.chunk_ids, s))
                        for s in range(0, HEADS, step))
        else:
            found = len(role.prefix.locate(state))
        if i:  # the first is a warm-up
            seconds.append(time.perf_counter() - t0)
            calls.append(stats.value - before)
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
            "stats_per_lookup": statistics.median(calls), "chunks_found": found}


def loads(role: SchedulerRole, tokens: list[int]) -> dict[str, Any]:
    """Every TP=8 rank loads the chunks with the tiers the lookup found: lookups of their own, counted."""
    state = role._state(request(tokens, 99))
    found = role.prefix.locate(state)
    dep, config = role.dep, role.store_config
    delivered, load_lookups, stats = [], 0, 0
    for rank in range(dep.sharding.world_size):
        shards = dep.sharding.shards_of(rank)
        ids = [shard_id(c, s, HEADS) for c in state.chunk_ids for s in shards]
        tiers = [t for t in found for _ in shards]
        with TieredStore(config) as store:
            files = store.tiers[0].files  # type: ignore[attr-defined]
            before = files.lookup_stats.value
            got = store.load_into(ids, lambda i, d: None, tiers=tiers, promote=False)
            delivered.append(got.num_chunks)
            load_lookups += store.metrics_snapshot()["store"]["load_lookups"]
            stats += files.lookup_stats.value - before
    return {"ranks": dep.sharding.world_size, "chunks_delivered_per_rank": delivered,
            "load_lookups": load_lookups, "pool_stats_during_loads": stats}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="pool directory (e.g. on a GlusterFS mount); emptied")
    ap.add_argument("--tokens", type=int, default=131072, help="prompt length (default 128k)")
    ap.add_argument("--repeats", type=int, default=5, help="timed lookups per configuration, after one warm-up")
    ap.add_argument("--drop-caches", action="store_true", help="drop dentries and inodes before each lookup (root)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    tokens = np.random.default_rng(0).integers(100, 30000, args.tokens + 1).tolist()
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    roles = {tp: role_for(tp, args.dir) for tp in (1, 8)}
    files = populate(roles[8], args.dir, tokens)
    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "files": files,
                           "populate_s": time.perf_counter() - t0, "chunks": args.tokens // CHUNK}
    for tp, role in roles.items():
        out[f"tp{tp}"] = lookups(role, tokens, args.repeats, args.drop_caches, per_rank=False)
        out[f"tp{tp}_per_rank"] = lookups(role, tokens, args.repeats, args.drop_caches, per_rank=True)
    out["tp8_vs_tp1"] = out["tp8"]["median_s"] / out["tp1"]["median_s"]
    out["tp8_per_rank_vs_tp1"] = out["tp8_per_rank"]["median_s"] / out["tp1"]["median_s"]
    out["loads_tp8"] = loads(roles[8], tokens)
    for role in roles.values():
        role.close()
    print(json.dumps(out, indent=2))
    print(f"\nlookup of {args.tokens} tokens ({out['chunks']} chunks): TP=1 {out['tp1']['median_s'] * 1e3:.1f} ms, "
          f"TP=8 {out['tp8']['median_s'] * 1e3:.1f} ms ({out['tp8_vs_tp1']:.2f}x; target <= 2x), one stat per rank "
          f"per chunk {out['tp8_per_rank']['median_s'] * 1e3:.1f} ms ({out['tp8_per_rank_vs_tp1']:.2f}x); loads "
          f"after it: {out['loads_tp8']['load_lookups']} lookups, {out['loads_tp8']['pool_stats_during_loads']} stats",
          file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
