"""Encode and decode rates of each KV codec, on one CPU core and (when there is one) on a GPU.

    python benchmarks/codec_speed.py [--layers 30] [--heads 1] [--head-dim 64] [--tokens 256]
                                     [--repeats 20] [--threads 1] [--device cpu,cuda] [--json FILE]

A chunk is one head shard of SmolLM2-135M by default (30 layers, 256 tokens, head_dim 64, bf16:
1.97 MB), laid out as vLLM's CPU cache (each block's K page then its V page, blocks of 128; K
pages channel by channel, ``--keys channels``, as the CPU build stores them; ``--keys tokens``
lays them token by token, as GPU caches do).
Its values are real-looking: keys with per-channel offsets and an outlier channel. Rates count
the chunk's raw bytes per second (median of ``--repeats`` after two warm-ups). On CUDA both
directions run on the GPU (``lossless`` copies to the host: zstd has no GPU path here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from kvtier.codec import CODECS, Encoder, KVGeometry, decode_into


def kv_chunk(geom: KVGeometry, device: str) -> torch.Tensor:
    """The chunk's bytes in ``geom``'s layout: K and V ``[layers, tokens, channels]`` of random
    values, with per-channel offsets and one outlying channel, as real keys have."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(geom.elements, generator=g).view(geom.layers, -1, geom.row_elems)
    x = x + torch.randn(1, 1, geom.row_elems, generator=g) * 4
    x[..., 0] *= 40
    x = x.to(geom.dtype)
    half = x.shape[1] // 2
    raw = torch.empty(geom.raw_bytes, dtype=torch.uint8)
    geom.join(raw, x[:, :half], x[:, half:])
    return raw.to(device)


def timed(fn: Any, device: str, repeats: int) -> float:
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(geom: KVGeometry, device: str, repeats: int) -> list[dict[str, Any]]:
    raw = kv_chunk(geom, device)
    rows = []
    for name, codec in CODECS.items():
        enc = Encoder(codec, geom)
        stored, record = enc.encode(raw)
        out = torch.empty_like(raw)
        enc_s = timed(lambda enc=enc: enc.encode(raw), device, repeats)
        dec_s = timed(lambda record=record, stored=stored, out=out: decode_into(record, stored, out), device, repeats)
        copy_s = timed(lambda out=out: out.copy_(raw), device, repeats)
        rows.append({"codec": name, "device": device, "ratio": raw.numel() / stored.numel(),
                     "encode_gbps": raw.numel() / enc_s / 1e9, "decode_gbps": raw.numel() / dec_s / 1e9,
                     "memcpy_gbps": raw.numel() / copy_s / 1e9})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: per core)")
    parser.add_argument("--device", default="cpu,cuda", help="where to run (cuda is skipped without a GPU)")
    parser.add_argument("--keys", choices=("channels", "tokens"), default="channels",
                        help="how a K page lies: channel by channel (vLLM's CPU build) or token by token (GPU)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    geom = KVGeometry(args.layers, args.tokens // args.block, args.block, args.heads * args.head_dim,
                      torch.bfloat16, interleaved=True, k_channels_first=args.keys == "channels")
    rows = []
    for device in args.device.split(","):
        if device == "cuda" and not torch.cuda.is_available():
            print("no CUDA device: skipped")
            continue
        rows += measure(geom, device, args.repeats)
    print(f"chunk {geom.raw_bytes / 1e6:.2f} MB, keys by {args.keys[:-1]}; CPU threads {args.threads}")
    print(f"{'codec':>9} {'device':>6} {'ratio':>6} {'encode GB/s':>12} {'decode GB/s':>12} {'memcpy GB/s':>12}")
    for r in rows:
        print(f"{r['codec']:>9} {r['device']:>6} {r['ratio']:6.2f} {r['encode_gbps']:12.2f} {r['decode_gbps']:12.2f} "
              f"{r['memcpy_gbps']:12.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows,
                       "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
