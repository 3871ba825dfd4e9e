"""Batch get/set GB/s of kvtier's SGLang HiCache backend, beside SGLang's HiCacheFile and the raw device.

Run in the SGLang venv (``bash scripts/sglang-venv.sh``)::

    .venv-sglang/bin/python benchmarks/sglang_backend.py --dir /var/tmp/sglbench --drop-caches [--torch-copy]

One SGLang host pool (``MHATokenToKVPoolHost``, layer_first, CPU, pinning off) of pages of
``--page-tokens`` tokens; each round writes ``--pages`` fresh pages (one HiCache storage batch
is 128) and reads them back into other host pages, through:

* ``kvtier-v1``: ``batch_set_v1`` / ``batch_get_v1`` (zero-copy: host pool indices), into a
  new pool, so most pages also create their shard directories (``ab/cd``: two mkdirs);
* ``kvtier-v1-shards``: the same into a pool whose 65,536 shard directories exist, as in a
  pool in use (one of a million chunks has them all); made once before the rounds, untimed;
* ``kvtier-generic``: ``batch_set`` / ``batch_get`` with flat page tensors, into a new pool;
* ``hicachefile``: SGLang's built-in file backend, the same generic calls;
* ``raw``: the same bytes with ``os.write`` / ``readinto`` of one file per page, no format;
* ``kvtier-v1-torchcopy`` (``--torch-copy``): ``kvtier-v1`` with the backend's page copies done
  by torch's ``copy_``, as before they moved to NumPy (docs/sglang.md).

Reads run after ``drop_caches`` when ``--drop-caches`` is given (root), else from the page
cache. Besides GB/s, each half's process CPU time (every thread's) per MiB: on a shared machine
the wall-clock figures move with the neighbours' load, the CPU cost much less. The first round
is a warm-up; the medians of the others are printed and written as JSON, with every sample,
the date and the machine's load and pressure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "hicache"))
import _hicache as hc
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from kvtier.integrations.sglang import KVTierHiCacheStorage
from kvtier.integrations.sglang import backend as backend_module
from kvtier.integrations.sglang.backend import copy_page
from kvtier.tiers.poolroot import scratch_pool


def config(extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="bench", extra_config=extra)


def drop_caches(enabled: bool) -> None:
    if enabled:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")


def machine_load() -> dict[str, object]:
    """The load average and the CPU and I/O pressure (PSI, avg60 of "some") as the run ends: the
    machine may be shared, and a busy disk or CPU moves every figure, raw included."""
    out: dict[str, object] = {"load_avg": os.getloadavg()}
    for kind in ("cpu", "io"):
        try:
            line = Path(f"/proc/pressure/{kind}").read_text().splitlines()[0]
            out[f"{kind}_pressure_some_avg60"] = float(line.split("avg60=")[1].split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return out


def make_shards(root: Path) -> None:
    """Every ``ab/cd`` shard directory of a pool at ``root`` (owner-only, as kvtier makes them)."""
    for a in range(256):
        top = root / f"{a:02x}"
        top.mkdir(mode=0o700, parents=True, exist_ok=True)
        for b in range(256):
            (top / f"{b:02x}").mkdir(mode=0o700, exist_ok=True)


@dataclass
class Round:
    """One round of one kind: bytes moved, and wall and process CPU seconds (all threads) of each half."""

    nbytes: int
    write_s: float
    write_cpu_s: float
    read_s: float
    read_cpu_s: float
    equal: bool


class Clock:
    """Wall and process CPU time (every thread's) since ``start``."""

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


IO_THREADS = 8


def backend_for(kind: str, root: Path):
    if kind.startswith("kvtier"):
        return KVTierHiCacheStorage(config({"pool_url": scratch_pool(root), "io_threads": IO_THREADS}))
    return HiCacheFile(config({"file_storage_path": str(root)}))


def round_trip(kind: str, root: Path, host, pages: int, page: int, seed: int, drop: bool) -> Round:
    """Write ``pages`` new pages through ``kind``, then read them back into other host pages."""
    src, dst = host.alloc(pages * page), host.alloc(pages * page)
    hc.fill_pages(host, src, seed)
    keys = [f"{seed:08x}{i:056x}" for i in range(pages)]
    nbytes = pages * host.get_data_page(0, flat=True).numel() * host.dtype.itemsize
    flat = [host.get_data_page(int(i), flat=True).contiguous() for i in src[::page]]
    clock = Clock()
    v1 = kind.startswith("kvtier-v1")
    if kind == "raw":
        root.mkdir(parents=True, exist_ok=True)
        clock.start()
        for key, value in zip(keys, flat, strict=True):
            with open(root / key, "wb", buffering=0) as fh:
                fh.write(value.view(torch.uint8).numpy())
        write = clock.stop()
        drop_caches(drop)
        outs = [host.get_dummy_flat_data_page() for _ in keys]
        clock.start()
        for key, out in zip(keys, outs, strict=True):
            with open(root / key, "rb", buffering=0) as fh:
                fh.readinto(out.view(torch.uint8).numpy())
        for i, out in zip(dst[::page].tolist(), outs, strict=True):
            host.set_from_flat_data_page(i, out)
        read = clock.stop()
    else:
        backend = backend_for(kind, root)
        backend.register_mem_pool_host(host)
        try:
            clock.start()
            ok = all(backend.batch_set_v1(keys, src)) if v1 else backend.batch_set(keys, flat)
            write = clock.stop()
            assert ok, f"{kind}: a write failed"
            drop_caches(drop)
            outs = [host.get_dummy_flat_data_page() for _ in keys]
            clock.start()
            if v1:
                assert all(backend.batch_get_v1(keys, dst))
            else:
                outs = backend.batch_get(keys, outs)
                assert all(o is not None for o in outs), f"{kind}: a read missed"
                for i, out in zip(dst[::page].tolist(), outs, strict=True):
                    host.set_from_flat_data_page(i, out)
            read = clock.stop()
        finally:
            if hasattr(backend, "close"):
                backend.close()
    equal = hc.pages_digest(host, src, pages) == hc.pages_digest(host, dst, pages)
    host.free(src)
    host.free(dst)
    return Round(nbytes, write[0], write[1], read[0], read[1], equal)


def torch_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def measure(kind: str, root: Path, host, args: argparse.Namespace, seed: int) -> Round:
    if kind == "kvtier-v1-torchcopy":  # the backend before its page copies moved off torch's copy_
        backend_module.copy_page = torch_copy
        try:
            return round_trip("kvtier-v1", root, host, args.pages, args.page_tokens, seed, args.drop_caches)
        finally:
            backend_module.copy_page = copy_page
    return round_trip(kind, root, host, args.pages, args.page_tokens, seed, args.drop_caches)


def main() -> int:
    global IO_THREADS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="scratch directory on the device to measure")
    ap.add_argument("--pages", type=int, default=128, help="pages per round (default: one storage batch, 128)")
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="measured rounds after the warm-up")
    ap.add_argument("--drop-caches", action="store_true", help="read cold (needs root)")
    ap.add_argument("--torch-copy", action="store_true",
                    help="add kvtier-v1-torchcopy: the v1 path with torch's copy_ for its page copies (before the fix)")
    ap.add_argument("--io-threads", type=int, default=IO_THREADS, help="kvtier's io_threads (default 8)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    IO_THREADS = args.io_threads
    hc.PAGE = args.page_tokens
    hc.LAYERS = args.layers
    hc.set_parallel()
    _, host = hc.host_pool(tokens=2 * args.pages * args.page_tokens + args.page_tokens, heads=args.heads)
    page_mib = host.get_data_page(0, flat=True).numel() * host.dtype.itemsize / 2**20
    kinds = ["raw", "kvtier-v1", "kvtier-v1-shards", "kvtier-generic", "hicachefile"]
    kinds += ["kvtier-v1-torchcopy"] if args.torch_copy else []
    shards = args.dir / "kvtier-v1-shards"
    make_shards(shards)
    samples: dict[str, list[Round]] = {k: [] for k in kinds}
    for r in range(args.repeats + 1):
        for kind in kinds:  # interleaved, so drift on a shared machine hits every kind alike
            root = shards if kind == "kvtier-v1-shards" else args.dir / f"{kind}-{r}"
            got = measure(kind, root, host, args, seed=r)
            assert got.equal, f"{kind}: read bytes differ from written"
            if r:
                samples[kind].append(got)
            if root == shards:
                for chunk in shards.glob("*/*/*.kvt"):
                    chunk.unlink()
            else:
                shutil.rmtree(root, ignore_errors=True)
            print(f"round {r} {kind:19s} write {got.nbytes / got.write_s / 1e9:6.2f} GB/s  "
                  f"read {got.nbytes / got.read_s / 1e9:6.2f} GB/s", file=sys.stderr, flush=True)
    shutil.rmtree(shards, ignore_errors=True)

    def med(kind: str, f) -> float:
        return statistics.median(f(x) for x in samples[kind])

    results: dict[str, dict[str, float]] = {}
    for kind in kinds:
        results[kind] = {"write_gbps": med(kind, lambda x: x.nbytes / x.write_s / 1e9),
                         "read_gbps": med(kind, lambda x: x.nbytes / x.read_s / 1e9),
                         "write_cpu_ms_per_mib": med(kind, lambda x: x.write_cpu_s * 1e3 / (x.nbytes / 2**20)),
                         "read_cpu_ms_per_mib": med(kind, lambda x: x.read_cpu_s * 1e3 / (x.nbytes / 2**20))}
    raw = results["raw"]
    for res in results.values():
        res["write_vs_raw"] = res["write_gbps"] / raw["write_gbps"]
        res["read_vs_raw"] = res["read_gbps"] / raw["read_gbps"]
    machine = machine_load()
    print(f"{args.pages} pages of {page_mib:.2f} MiB per round, medians of {args.repeats} rounds after a warm-up,"
          f" reads {'cold' if args.drop_caches else 'from the page cache'}; machine: {machine}")
    print(f"{'backend':19s} {'write GB/s':>10s} {'x raw':>6s} {'CPU ms/MiB':>10s} {'read GB/s':>10s} {'x raw':>6s} "
          f"{'CPU ms/MiB':>10s}")
    for kind, res in results.items():
        print(f"{kind:19s} {res['write_gbps']:10.2f} {res['write_vs_raw']:6.2f} {res['write_cpu_ms_per_mib']:10.3f} "
              f"{res['read_gbps']:10.2f} {res['read_vs_raw']:6.2f} {res['read_cpu_ms_per_mib']:10.3f}")
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "machine": machine, "page_mib": page_mib, "results": results,
            "samples": {k: [vars(x) for x in v] for k, v in samples.items()}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
