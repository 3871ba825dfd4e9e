"""Benchmark and check: the worker's data path on an accelerator's paged KV cache (torch only, no vLLM).

Allocates KV caches in vLLM's CUDA layouts on the device, saves every chunk through the
worker's own data path (``kvtier.integrations.transfer.PageMover``: page-locked host DRAM, a
save stream ordered after the compute stream with events, slots published once their copy
completed), loads them back into other blocks (the load stream; from host DRAM, then from the
local disk tier with host DRAM dropped), checks every page bit-exactly, and reports
device-to-host and host-to-device GB/s beside a plain pinned ``copy_`` of the same bytes.

    python benchmarks/gpu_path.py                      # CUDA if present, else CPU tensors
    python benchmarks/gpu_path.py --device cpu --chunks 8 --out /tmp/gpu_path.json

Layouts (shape as allocated; the view handed to kvtier is vLLM's logical shape):

* ``flash-nhd``: FlashAttention, ``[2, blocks, block_size, heads, head_dim]`` per layer;
* ``flash-hnd``: the same with the HND stride order (``[2, blocks, heads, block_size, d]``
  in memory, permuted back);
* ``flashinfer``: ``[blocks, 2, block_size, heads, head_dim]`` per layer;
* ``cross-layer``: one buffer ``[blocks, layers, 2, heads, block_size, d]``, a strided view
  per layer (vLLM's block-outermost layout);
* ``mla-fp8``: ``[blocks, block_size, 576]`` uint8 (MLA's latent KV in fp8).

Exit status 1 when any page differs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier.integrations.paged import PagedKV
from kvtier.integrations.transfer import PageMover
from kvtier.layout import KVLayout
from kvtier.store import TieredStore


def make_layout(name: str, layers: int, blocks: int, bs: int, heads: int, d: int,
                device: torch.device) -> list[torch.Tensor]:
    dtype = torch.bfloat16
    if name == "flash-nhd":
        return [torch.empty(2, blocks, bs, heads, d, dtype=dtype, device=device) for _ in range(layers)]
    if name == "flash-hnd":
        return [torch.empty(2, blocks, heads, bs, d, dtype=dtype, device=device).permute(0, 1, 3, 2, 4)
                for _ in range(layers)]
    if name == "flashinfer":
        return [torch.empty(blocks, 2, bs, heads, d, dtype=dtype, device=device) for _ in range(layers)]
    if name == "cross-layer":
        whole = torch.empty(blocks, layers, 2, heads, bs, d, dtype=dtype, device=device)
        return [whole[:, i].permute(0, 1, 3, 2, 4) for i in range(layers)]
    if name == "mla-fp8":
        return [torch.empty(blocks, bs, 576, dtype=torch.uint8, device=device) for _ in range(layers)]
    raise ValueError(f"layout {name!r}")


LAYOUTS = ("flash-nhd", "flash-hnd", "flashinfer", "cross-layer", "mla-fp8")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def plain_copy_gbps(nbytes: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """(device->host, host->device) GB/s of one ``copy_`` of ``nbytes`` to/from pinned memory."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    d2h = statistics.median(timed(lambda: host.copy_(dev, non_blocking=True), device) for _ in range(repeats))
    h2d = statistics.median(timed(lambda: dev.copy_(host, non_blocking=True), device) for _ in range(repeats))
    return nbytes / d2h / 1e9, nbytes / h2d / 1e9


def check_layout(name: str, args: argparse.Namespace, device: torch.device, tmp: Path) -> dict[str, Any]:
    bs, chunk_tokens = args.block_size, args.chunk_tokens
    bpc = chunk_tokens // bs
    blocks = 2 * args.chunks * bpc + 1  # sources, then as many targets
    layers = make_layout(name, args.layers, blocks, bs, args.heads, args.head_dim, device)
    gen = torch.Generator(device=device).manual_seed(0)
    for kv in layers:
        raw = kv.view(torch.uint8) if kv.dtype != torch.uint8 else kv
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=device, generator=gen))
    paged = PagedKV(layers, blocks)
    layout = KVLayout(args.layers, 1, paged.layer_block_bytes[0] // (2 * bs), torch.uint8)
    chunk_bytes = bpc * paged.block_bytes
    total = args.chunks * chunk_bytes
    src = [list(range(c * bpc, (c + 1) * bpc)) for c in range(args.chunks)]
    dst = [list(range(args.chunks * bpc + c * bpc, args.chunks * bpc + (c + 1) * bpc)) for c in range(args.chunks)]
    src_all, dst_all = [b for c in src for b in c], [b for c in dst for b in c]
    tokens = list(range(args.chunks * chunk_tokens))
    out: dict[str, Any] = {"layout": name, "runs_per_block": len(paged.runs), "chunk_bytes": chunk_bytes,
                           "bytes": total}
    disk = tmp / name
    with TieredStore.open("gpu-path", layout, chunk_tokens, host_bytes=2 * total + (64 << 20),
                          disk_path=disk, disk_bytes=4 * total + (64 << 20)) as store:
        ids = store.chunk_ids(tokens)
        mover = PageMover(paged, store, bpc)
        out["host_memory_pinned"] = getattr(mover, "pinned", False)

        def save_all() -> None:
            for cid, b in zip(ids, src, strict=True):
                mover.save(cid, b)
            mover.poll_saves(wait=True)

        out["save_gbps"] = total / timed(save_all, device) / 1e9
        store.flush()

        def load_all() -> None:
            got = mover.load(ids, dst_all)
            assert got.num_chunks == len(ids), f"loaded {got.num_chunks} of {len(ids)} chunks"

        out["load_host_gbps"] = total / timed(load_all, device) / 1e9
        out["bit_exact_from_host"] = all(torch.equal(r[src_all], r[dst_all]) for r in paged.runs)
        for r in paged.runs:
            r[dst_all] = 0
        mover.close()
    # A fresh store on the same disk directory: no host DRAM, every chunk read from disk.
    with TieredStore.open("gpu-path", layout, chunk_tokens, host_bytes=0, disk_path=disk,
                          disk_bytes=4 * total + (64 << 20)) as store:
        mover = PageMover(paged, store, bpc)
        out["load_disk_gbps"] = total / timed(load_all, device) / 1e9
        out["bit_exact_from_disk"] = all(torch.equal(r[src_all], r[dst_all]) for r in paged.runs)
        mover.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated (default {','.join(LAYOUTS)})")
    ap.add_argument("--layers", type=int, default=32, help="layers (default 32)")
    ap.add_argument("--heads", type=int, default=8, help="KV heads per rank (default 8)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (default 256)")
    ap.add_argument("--chunks", type=int, default=16, help="chunks saved and loaded per layout (default 16)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats of the plain copy (median; default 5)")
    ap.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = ap.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-path-") as scratch:
        for name in args.layouts.split(","):
            r = check_layout(name, args, device, Path(scratch))
            results.append(r)
            print(f"{name}: {r}", file=sys.stderr, flush=True)
    nbytes = max(r["bytes"] for r in results)
    d2h, h2d = plain_copy_gbps(nbytes, device, args.repeats)
    summary = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
               else "cpu", "torch": torch.__version__, "plain_copy_d2h_gbps": d2h, "plain_copy_h2d_gbps": h2d,
               "layouts": results, "all_bit_exact": all(r["bit_exact_from_host"] and r["bit_exact_from_disk"]
                                                        for r in results)}
    for r in results:
        r["save_vs_plain_d2h"] = r["save_gbps"] / d2h
        r["load_host_vs_plain_h2d"] = r["load_host_gbps"] / h2d
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2))
    return 0 if summary["all_bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
