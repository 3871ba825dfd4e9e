"""Benchmark: where a warm load of one session's chunk files goes, step by step, in one run.

A resume of an 8k-token session of the tiny model reads 64 files of 256 KiB from the page cache
(32 chunks x 2 KV-head shards). The resume profile (``vllm_resume.py --profile``) puts that
load at about 21 ms; one thread reading the same files with no checks takes about 3 ms. This
splits the difference, every figure a median over ``--repeats`` in the same process:

* ``raw``: one thread, ``os.readv`` of each whole file into one buffer (no checks);
* ``tier_serial``: the pool tier's own ``load`` of each chunk in one thread (open, size and
  page-cache checks, read, header and checksum validation, the LRU touch);
* ``store_noop``: ``TieredStore.load_into`` as the connector calls it (``promote=False``),
  with a sink that copies nothing: the reader's hand-off to its I/O threads and back;
* ``store_copy``: the same with a sink that copies each chunk into a tensor (the scatter
  into vLLM's blocks stands in as one contiguous copy);
* ``scatter``: ``PagedKV.scatter`` of every chunk, already in memory, into a cache shaped as
  vLLM's CPU backend shapes it (per layer ``[blocks, 2 heads, 128 tokens, 2 x 64]`` bf16), each
  chunk into the two consecutive blocks of its head shard: the connector's copy, in one thread;
* ``store_scatter``: ``load_into`` with that scatter as the sink (the connector's load before
  reads in place);
* ``store_place``: ``load_into`` with a ``Placement`` on the same cache (the connector's load
  now): each warm file is read straight into its blocks (``PagedKV.page_views``), no scatter.
  The blocks are checked to hold what ``store_scatter`` put there;
* ``store_copy_cold`` (``--cold``): the same with the files dropped from the page cache first,
  so that reads go to the device (and, slower than ``FAST_READ_S``, spread over the I/O threads).

    python benchmarks/load_path.py --dir /var/tmp/load-path --chunks 32 --shards 2 --io-threads 1,2,4,8 --cold
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier import KVLayout, StoreConfig, TieredStore
from kvtier.integrations.paged import PagedKV, head_dim_of
from kvtier.probe.fs import drop_cache
from kvtier.reader import Placement
from kvtier.tiers.base import aligned_buffer
from kvtier.tiers.poolroot import scratch_pool


def _median_ms(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None) -> float:
    """Median ms of ``fn`` over ``repeats`` after a warm-up; ``before`` runs untimed before each."""
    fn()  # warm-up: thread start, first allocations
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)




def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="a directory on the device to measure (emptied)")
    ap.add_argument("--chunks", type=int, default=32, help="chunks of 256 tokens (default 32: an 8k prompt)")
    ap.add_argument("--shards", type=int, default=2, help="KV heads, one file each per chunk (default 2)")
    ap.add_argument("--io-threads", default="1,2,4", help="io_threads values to measure, comma-separated")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--cold", action="store_true",
                    help="also time load_into with the files dropped from the page cache before each repeat "
                         "(posix_fadvise DONTNEED: the pool reads them with O_DIRECT)")
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args()


def _populate(store: TieredStore, ids: list[Any], root: Path) -> list[Path]:
    """Write every chunk to the pool now; return its files (page cache warm from the writes)."""
    kv = torch.randn(4, 2, len(ids) * 256, 1, 64).to(torch.bfloat16)
    for i, cid in enumerate(ids):
        assert store.put_chunk_now(cid, kv[:, :, i * 256:(i + 1) * 256])
    files = sorted(root.rglob("*.kvt"))
    assert len(files) == len(ids), (len(files), len(ids))
    os.sync()  # clean pages: --cold drops them from the page cache before each repeat (drop_cache)
    return files


def _raw(files: list[Path], repeats: int) -> float:
    buf = aligned_buffer(files[0].stat().st_size)

    def run() -> None:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.readv(fd, [buf])
            finally:
                os.close(fd)

    return _median_ms(run, repeats)


def _tier_serial(store: TieredStore, ids: list[Any], repeats: int) -> float:
    pool = next(t for t in store.tiers if t.name == "pool")
    spec = store._spec(store._namespace(None))  # the spec load_into builds
    into = aligned_buffer(spec.file_bytes)

    def run() -> None:
        for cid in ids:
            assert pool.load(cid, spec, into).ok

    return _median_ms(run, repeats)


def _store(store: TieredStore, ids: list[Any], sink: Callable[[int, torch.Tensor], None], repeats: int,
           before: Callable[[], Any] | None = None, place: Placement | None = None) -> float:
    def run() -> None:
        got = store.load_into(ids, sink, promote=False, place=place)
        assert got.num_chunks == len(ids), got

    return _median_ms(run, repeats, before)


def _scatter_sink(chunks: int, shards: int) -> tuple[Callable[[int, torch.Tensor], None], Placement,
                                                     list[torch.Tensor]]:
    """A sink that scatters store chunk ``i`` (chunk ``i // shards``'s head ``i % shards``) into its
    two blocks of a vLLM-CPU-shaped cache (4 layers, ``shards`` KV heads, 128-token blocks), the
    ``Placement`` that reads it there instead, and the cache's tensors."""
    blocks = 2 * chunks + 64  # the chunks' blocks come after others, as in a running engine
    layers = [torch.zeros(blocks, shards, 128, 128, dtype=torch.bfloat16) for _ in range(4)]
    paged = PagedKV(layers, blocks, heads=shards, head_dims=[head_dim_of(t, shards) for t in layers])

    def scatter(i: int, data: torch.Tensor) -> None:
        chunk, shard = divmod(i, shards)
        paged.scatter(data, [64 + 2 * chunk, 65 + 2 * chunk], shard)

    def views(i: int) -> list[memoryview] | None:
        chunk, shard = divmod(i, shards)
        return paged.page_views([64 + 2 * chunk, 65 + 2 * chunk], shard)

    return scatter, Placement(views, lambda i: None), layers


def _scatter_only(store: TieredStore, ids: list[Any], scatter: Callable[[int, torch.Tensor], None],
                  repeats: int) -> float:
    chunks: list[torch.Tensor] = []
    store.load_into(ids, lambda i, d: chunks.append(d.clone()), promote=False)
    assert len(chunks) == len(ids)

    def run() -> None:
        for i, chunk in enumerate(chunks):
            scatter(i, chunk)

    return _median_ms(run, repeats)


def main() -> int:
    args = _args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    # The tiny test model's layout, one KV head per file: what one head shard of a chunk holds.
    layout = KVLayout(num_layers=4, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16)
    tokens = list(range(args.chunks * args.shards * 256))  # one "chunk" per shard file
    results: dict[str, Any] = {"files": args.chunks * args.shards, "repeats": args.repeats}
    for threads in [int(x) for x in args.io_threads.split(",")]:
        config = StoreConfig(model_id="load-path", layout=layout, chunk_tokens=256, host_bytes=0,
                             pool_url=scratch_pool(args.dir / "pool"), io_threads=threads)
        store = TieredStore(config)
        try:
            ids = list(store.chunk_ids(tokens))
            if "raw_ms" not in results:
                files = _populate(store, ids, args.dir / "pool")
                results["raw_ms"] = _raw(files, args.repeats)
                results["tier_serial_ms"] = _tier_serial(store, ids, args.repeats)
            dst = torch.empty(len(ids), 4, 2, 256, 64, dtype=torch.bfloat16)

            def copy(i: int, d: torch.Tensor, dst: torch.Tensor = dst) -> None:
                dst[i].copy_(d.view(4, 2, 256, 64))

            scatter, place, layers = _scatter_sink(args.chunks, args.shards)
            if "scatter_ms" not in results:
                results["scatter_ms"] = _scatter_only(store, ids, scatter, args.repeats)
            results[f"store_noop_ms_io{threads}"] = _store(store, ids, lambda i, d: None, args.repeats)
            results[f"store_scatter_ms_io{threads}"] = _store(store, ids, scatter, args.repeats)
            scattered = [t.clone() for t in layers]
            for t in layers:
                t.zero_()
            results[f"store_place_ms_io{threads}"] = _store(store, ids, lambda i, d: None, args.repeats, place=place)
            if not all(torch.equal(a, b) for a, b in zip(layers, scattered, strict=True)):
                raise SystemExit("store_place left other bytes in the blocks than store_scatter")
            results[f"store_copy_ms_io{threads}"] = _store(store, ids, copy, args.repeats)
            if args.cold:
                results[f"store_copy_cold_ms_io{threads}"] = _store(
                    store, ids, copy, args.repeats, before=lambda files=files: drop_cache(files))
                _raw(files, 1)  # warm again: the pool's O_DIRECT reads of cold files never fill the cache
        finally:
            store.close()
        print(json.dumps(results), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
