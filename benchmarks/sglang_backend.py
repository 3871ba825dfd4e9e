"""Batch get/set GB/s of kvtier's SGLang HiCache backend, beside SGLang's HiCacheFile and the raw device.

Run in the SGLang venv (``bash scripts/sglang-venv.sh``)::

    .venv-sglang/bin/python benchmarks/sglang_backend.py --dir /var/tmp/sglbench [--pages 128] [--repeats 3]

One SGLang host pool (``MHATokenToKVPoolHost``, layer_first, CPU, pinning off) of pages of
``--page-tokens`` tokens; each round writes ``--pages`` fresh pages (one HiCache storage batch
is 128) and reads them back into other host pages, through:

* ``kvtier-v1``: ``batch_set_v1`` / ``batch_get_v1`` (zero-copy: host pool indices);
* ``kvtier-generic``: ``batch_set`` / ``batch_get`` with flat page tensors;
* ``hicachefile``: SGLang's built-in file backend, the same generic calls;
* ``raw``: the same bytes with ``os.write`` / ``readinto`` of one file per page, no format.

Reads run after ``drop_caches`` when ``--drop-caches`` is given (root), else from the page
cache. The first round is a warm-up; the medians of the others are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "hicache"))
import _hicache as hc  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig  # noqa: E402

from kvtier.integrations.sglang import KVTierHiCacheStorage  # noqa: E402


def config(extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="bench", extra_config=extra)


def drop_caches(enabled: bool) -> None:
    if enabled:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")


def round_trip(kind: str, root: Path, host, pages: int, page: int, seed: int, drop: bool) -> tuple[float, float, bool]:
    """(write GB/s, read GB/s, bytes equal) of one round of ``pages`` new pages."""
    src, dst = host.alloc(pages * page), host.alloc(pages * page)
    hc.fill_pages(host, src, seed)
    keys = [f"{seed:08x}{i:056x}" for i in range(pages)]
    nbytes = pages * host.get_data_page(0, flat=True).numel() * host.dtype.itemsize
    flat = [host.get_data_page(int(i), flat=True).contiguous() for i in src[::page]]
    if kind == "raw":
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        for key, value in zip(keys, flat):
            with open(root / key, "wb", buffering=0) as fh:
                fh.write(value.view(torch.uint8).numpy())
        t1 = time.perf_counter()
        drop_caches(drop)
        outs = [host.get_dummy_flat_data_page() for _ in keys]
        t2 = time.perf_counter()
        for key, out in zip(keys, outs):
            with open(root / key, "rb", buffering=0) as fh:
                fh.readinto(out.view(torch.uint8).numpy())
        for i, out in zip(dst[::page].tolist(), outs):
            host.set_from_flat_data_page(i, out)
        t3 = time.perf_counter()
    else:
        backend = (KVTierHiCacheStorage(config({"pool_url": f"fs://{root}", "io_threads": 8}))
                   if kind.startswith("kvtier") else HiCacheFile(config({"file_storage_path": str(root)})))
        backend.register_mem_pool_host(host)
        try:
            t0 = time.perf_counter()
            ok = all(backend.batch_set_v1(keys, src)) if kind == "kvtier-v1" else backend.batch_set(keys, flat)
            t1 = time.perf_counter()
            assert ok, f"{kind}: a write failed"
            drop_caches(drop)
            t2 = time.perf_counter()
            if kind == "kvtier-v1":
                assert all(backend.batch_get_v1(keys, dst))
            else:
                outs = backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
                assert all(o is not None for o in outs), f"{kind}: a read missed"
                for i, out in zip(dst[::page].tolist(), outs):
                    host.set_from_flat_data_page(i, out)
            t3 = time.perf_counter()
        finally:
            if hasattr(backend, "close"):
                backend.close()
    equal = hc.pages_digest(host, src, pages) == hc.pages_digest(host, dst, pages)
    host.free(src)
    host.free(dst)
    return nbytes / (t1 - t0) / 1e9, nbytes / (t3 - t2) / 1e9, equal


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="scratch directory on the device to measure")
    ap.add_argument("--pages", type=int, default=128, help="pages per round (default: one storage batch, 128)")
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="measured rounds after the warm-up")
    ap.add_argument("--drop-caches", action="store_true", help="read cold (needs root)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    hc.PAGE = args.page_tokens
    hc.LAYERS = args.layers
    hc.set_parallel()
    _, host = hc.host_pool(tokens=2 * args.pages * args.page_tokens + args.page_tokens, heads=args.heads)
    page_mib = host.get_data_page(0, flat=True).numel() * 2 / 2**20
    kinds = ["raw", "kvtier-v1", "kvtier-generic", "hicachefile"]
    results: dict[str, dict[str, float]] = {}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for r in range(args.repeats + 1):
        for kind in kinds:  # interleaved, so drift on a shared machine hits every kind alike
            root = args.dir / f"{kind}-{r}"
            w, rd, equal = round_trip(kind, root, host, args.pages, args.page_tokens, seed=r, drop=args.drop_caches)
            assert equal, f"{kind}: read bytes differ from written"
            if r:
                samples[kind].append((w, rd))
            shutil.rmtree(root, ignore_errors=True)
            print(f"round {r} {kind:15s} write {w:6.2f} GB/s  read {rd:6.2f} GB/s", file=sys.stderr, flush=True)
    raw_w = statistics.median(s[0] for s in samples["raw"])
    raw_r = statistics.median(s[1] for s in samples["raw"])
    print(f"{args.pages} pages of {page_mib:.2f} MiB per round, medians of {args.repeats} rounds after a warm-up,"
          f" reads {'cold' if args.drop_caches else 'from the page cache'}")
    print(f"{'backend':15s} {'write GB/s':>10s} {'x raw':>6s} {'read GB/s':>10s} {'x raw':>6s}")
    for kind in kinds:
        w = statistics.median(s[0] for s in samples[kind])
        rd = statistics.median(s[1] for s in samples[kind])
        results[kind] = {"write_gbps": w, "read_gbps": rd, "write_vs_raw": w / raw_w, "read_vs_raw": rd / raw_r}
        print(f"{kind:15s} {w:10.2f} {w / raw_w:6.2f} {rd:10.2f} {rd / raw_r:6.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "page_mib": page_mib, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
