"""Benchmark: what the ``fsync`` setting costs a chunk publish, off and on side by side.

With ``fsync: false`` (the default) a publish is write + rename: the chunk is safe from a
process crash the moment ``publish`` returns, but lives in the page cache until the kernel
writes it back. With ``fsync: true`` the file's data is fsynced before the rename and its
directory after it, so the chunk survives a machine crash too. This measures the price.

Two levels, each with fsync off and on, interleaved over ``--repeats`` (the order flips every
repeat, and ``os.sync()`` runs before each timed batch so one mode's dirty pages are not
written back on the other's clock; one small unmeasured batch per mode warms up first):

* ``publish``: ``ChunkFiles.publish`` of ``--count`` chunks of ``--chunk-mib`` MiB, one after
  the other, each into a fresh directory: MB/s of the batch, and per-chunk latency p50/p99.
* ``store``: ``TieredStore.put`` of the same chunks into a disk tier (no host tier), then
  ``flush`` (the background write queue drained): MB/s from the first put to the drain.

    python benchmarks/durability.py --dir /var/tmp --chunk-mib 4 --count 32 --repeats 5 --json

Prints the filesystem type of ``--dir`` (from /proc/mounts): on tmpfs fsync is a no-op and
the comparison means nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier import KVLayout, StoreConfig, TieredStore
from kvtier.format import ChunkSpec
from kvtier.keys import Namespace, chunk_ids
from kvtier.layout import DTYPE_CODES
from kvtier.tiers.base import Chunk
from kvtier.tiers.files import ChunkFiles

# Llama-3-8B's KV per token: 32 layers x K,V x 8 heads x 128 x bf16 = 128 KiB.
LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
MODES = (False, True)


def mount_of(path: Path) -> dict[str, str]:
    """The /proc/mounts entry holding ``path``: device, mount point, type, options."""
    best: dict[str, str] = {"device": "?", "mount": "/", "type": "?", "options": ""}
    real = os.path.realpath(path)
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        dev, mnt, fstype, opts, *_ = line.split()
        mnt = mnt.replace("\\040", " ")
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best["mount"]):
            best = {"device": dev, "mount": mnt, "type": fstype, "options": opts}
    return best


def chunks_for(chunk_mib: int, count: int, run: int) -> tuple[Namespace, ChunkSpec, list[Chunk]]:
    """``count`` chunks of ``chunk_mib`` MiB with keys unique to ``run`` (one shared payload:
    the bytes do not matter to the disk, the checksum is computed per chunk all the same)."""
    tokens = chunk_mib * (1 << 20) // LAYOUT.bytes_per_token
    if tokens < 1 or tokens * LAYOUT.bytes_per_token != chunk_mib << 20:
        raise SystemExit(f"--chunk-mib must be a whole number of {LAYOUT.bytes_per_token >> 10} KiB tokens")
    namespace = Namespace("durability-bench", LAYOUT, tokens)
    spec = ChunkSpec(namespace.digest, DTYPE_CODES[LAYOUT.dtype], LAYOUT.shape(tokens), tokens * LAYOUT.bytes_per_token)
    payload = np.random.default_rng(run).integers(0, 1 << 16, spec.payload_bytes // 2, dtype=np.uint16) & 0xBFFF
    data = torch.from_numpy(payload).view(LAYOUT.dtype).view(spec.shape)
    ids = chunk_ids(namespace, np.arange(count * tokens, dtype=np.uint32) + run * count * tokens)
    return namespace, spec, [Chunk(cid, data) for cid in ids]


def publish_batch(root: Path, fsync: bool, spec: ChunkSpec, chunks: list[Chunk]) -> tuple[float, list[float]]:
    """(seconds for the batch, per-chunk seconds) of publishing ``chunks`` one by one."""
    files = ChunkFiles(root, fsync=fsync)
    lat = []
    t0 = time.perf_counter()
    for chunk in chunks:
        t = time.perf_counter()
        files.publish(chunk, spec)
        lat.append(time.perf_counter() - t)
    return time.perf_counter() - t0, lat


def store_batch(root: Path, fsync: bool, namespace: Namespace, chunks: list[Chunk]) -> float:
    """Seconds from the first ``put`` to the drained write queue, disk tier only."""
    config = StoreConfig(model_id=namespace.model_id, layout=LAYOUT, chunk_tokens=namespace.chunk_tokens,
                         host_bytes=0, disk_path=str(root), disk_bytes=1 << 50, fsync=fsync,
                         write_queue_chunks=len(chunks))
    with TieredStore(config) as store:
        t0 = time.perf_counter()
        for chunk in chunks:
            store.put_chunk(chunk.id, chunk.data)
        store.flush()
        seconds = time.perf_counter() - t0
        written = store.metrics_snapshot()["tiers"]["disk"]["written_chunks"]
    if written != len(chunks):
        raise RuntimeError(f"store wrote {written} of {len(chunks)} chunks")
    return seconds


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run(base: Path, chunk_mib: int, count: int, repeats: int, store: bool,
        log: Callable[[str], None]) -> dict[str, Any]:
    mib = chunk_mib * count
    results: dict[str, dict[str, list[float]]] = {
        name: {"mbps": [], "lat": [], "store_mbps": []} for name in ("off", "on")}
    # Warm-up, not measured: the first batch pays for imports, page faults and new directories.
    for fsync in MODES:
        _, spec, chunks = chunks_for(chunk_mib, min(count, 4), 1000 + fsync)
        publish_batch(base / f"warmup-{fsync}", fsync, spec, chunks)
        shutil.rmtree(base / f"warmup-{fsync}")
    for r in range(repeats):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for fsync in order:
            name = "on" if fsync else "off"
            namespace, spec, chunks = chunks_for(chunk_mib, count, 2 * r + fsync)
            root = base / f"publish-{r}-{name}"
            os.sync()
            seconds, lat = publish_batch(root, fsync, spec, chunks)
            results[name]["mbps"].append(mib * (1 << 20) / seconds / 1e6)
            results[name]["lat"] += lat
            shutil.rmtree(root)
            line = f"repeat {r} fsync {name:3}: publish {results[name]['mbps'][-1]:8.1f} MB/s"
            if store:
                root = base / f"store-{r}-{name}"
                os.sync()
                seconds = store_batch(root, fsync, namespace, chunks)
                results[name]["store_mbps"].append(mib * (1 << 20) / seconds / 1e6)
                shutil.rmtree(root)
                line += f", store put+flush {results[name]['store_mbps'][-1]:8.1f} MB/s"
            log(line)
    summary: dict[str, Any] = {}
    for name, res in results.items():
        summary[f"fsync_{name}"] = {
            "publish_mbps_median": statistics.median(res["mbps"]),
            "publish_mbps": res["mbps"],
            "chunk_ms_p50": pct(res["lat"], 0.50) * 1e3,
            "chunk_ms_p99": pct(res["lat"], 0.99) * 1e3,
            "chunk_ms_max": max(res["lat"]) * 1e3,
            **({"store_mbps_median": statistics.median(res["store_mbps"]), "store_mbps": res["store_mbps"]}
               if store else {}),
        }
    off, on = summary["fsync_off"], summary["fsync_on"]
    summary["publish_slowdown"] = off["publish_mbps_median"] / on["publish_mbps_median"]
    summary["chunk_p50_ratio"] = on["chunk_ms_p50"] / off["chunk_ms_p50"]
    if store:
        summary["store_slowdown"] = off["store_mbps_median"] / on["store_mbps_median"]
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                    help="where to write (a scratch directory is made inside and removed); default /var/tmp")
    ap.add_argument("--chunk-mib", type=int, default=4, help="chunk size in MiB (4 = 32 tokens of Llama-8B)")
    ap.add_argument("--count", type=int, default=32, help="chunks per batch")
    ap.add_argument("--repeats", type=int, default=5, help="batches per mode, interleaved")
    ap.add_argument("--no-store", action="store_true", help="skip the TieredStore put+flush measurement")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout (progress on stderr)")
    args = ap.parse_args()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    mount = mount_of(args.dir)
    log(f"{args.dir}: {mount['type']} on {mount['device']} (mounted at {mount['mount']}, {mount['options']})")
    if mount["type"] in ("tmpfs", "ramfs"):
        log("warning: a RAM filesystem: fsync does nothing here; pass --dir on a real disk")
    base = Path(tempfile.mkdtemp(prefix="kvtier-durability-", dir=args.dir))
    try:
        summary = run(base, args.chunk_mib, args.count, args.repeats, not args.no_store, log)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = {"dir": str(args.dir), "filesystem": mount, "chunk_mib": args.chunk_mib, "count": args.count,
           "repeats": args.repeats, **summary}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    store_head = "" if args.no_store else f" {'store MB/s':>11}"
    print(f"{'':10} {'publish MB/s':>13} {'p50 ms':>8} {'p99 ms':>8}{store_head}")
    for name in ("off", "on"):
        s = out[f"fsync_{name}"]
        print(f"fsync {name:4} {s['publish_mbps_median']:13.1f} {s['chunk_ms_p50']:8.2f} {s['chunk_ms_p99']:8.2f}"
              + (f" {s['store_mbps_median']:11.1f}" if not args.no_store else ""))
    print(f"fsync on is {out['publish_slowdown']:.2f}x slower per publish"
          + (f", {out['store_slowdown']:.2f}x through the store" if not args.no_store else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
