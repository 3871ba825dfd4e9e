"""Benchmark: what each step of kvtier's chunk read costs, cold and from the page cache.

Writes ``--total`` of chunk files in kvtier's format (8B-class layout: 32 MiB per 256-token
chunk) to a scratch pool under PATH, then times, file by file, in one thread:

* ``open+fstat``: the open (O_NOFOLLOW, O_DIRECT when cold) and the fstat of the file;
* ``cachestat``: asking the kernel whether the page cache holds the file whole (``holds_whole``:
  samples of a large file; ``cached_bytes`` of every page on a kvtier from before it);
* ``read``: the whole file into an aligned buffer (O_DIRECT when cold, buffered when warm);
* ``header``: unpacking and checking the header against the chunk's identity and layout;
* ``checksum``: xxh3 over the payload, just read;
* ``copy``: the payload into its place in a ``[layers, 2, tokens, heads, dim]`` tensor (a
  strided copy: one segment per layer and K/V), as ``TieredStore.get``'s sink does;
* ``in place``: the payload put straight into those segments, checksum included, as a read
  with a ``Placement`` does: warm, read there from the page cache (``read_in_place``); cold,
  copied there from the buffer just read (``copy_in_place``, where this kvtier has it).

and beside them the whole path: ``ChunkFiles.load`` (open to a validated chunk in a buffer)
and ``TieredStore.get`` with one I/O thread and with ``--threads``. Then the raw read of the
same files, so every figure has its yardstick. Medians over the files; GB/s count file bytes.

    python benchmarks/read_steps.py /var/tmp --total 512MiB --out docs/results/read-steps/after.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier import TieredStore
from kvtier.config import parse_bytes
from kvtier.format import PAYLOAD_OFFSET, payload_checksum, unpack_header
from kvtier.probe import DEFAULT_LAYOUT
from kvtier.probe.fs import drop_cache
from kvtier.tiers.base import Pages, aligned_buffer
from kvtier.tiers.pagecache import cached_bytes
from kvtier.tiers.poolroot import scratch_pool
from kvtier.tiers.reads import fill, read_in_place

try:
    from kvtier.tiers.reads import copy_in_place
except ImportError:  # a kvtier from before cold reads were copied in place (measured side by side)
    copy_in_place = None  # type: ignore[assignment]

try:
    from kvtier.tiers.pagecache import holds_whole
except ImportError:  # a kvtier from before the page-cache check was sampled (measured side by side)
    holds_whole = None  # type: ignore[assignment]


def cache_check(fd: int, size: int) -> object:
    """The page-cache check the read path makes: ``holds_whole``, or where this kvtier has none,
    ``cached_bytes`` (every page of the file)."""
    return cached_bytes(fd) if holds_whole is None else holds_whole(fd, size)


CHUNK_TOKENS = 256
SESSION_CHUNKS = 8


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _segments(out: torch.Tensor, index: int) -> list[memoryview]:
    """Chunk ``index``'s payload segments in ``out`` ([layers, 2, tokens, heads, dim]), in order."""
    part = out[:, :, index * CHUNK_TOKENS:(index + 1) * CHUNK_TOKENS]
    flat = part.reshape(-1, *part.shape[2:]) if part.is_contiguous() else None
    rows = flat if flat is not None else [part[i, j] for i in range(part.shape[0]) for j in range(2)]
    return [memoryview(r.view(torch.uint8).numpy()).cast("B") for r in rows]


def steps(store: TieredStore, ids: list[Any], files: list[str], cold: bool, out: torch.Tensor) -> dict[str, float]:
    """Seconds per step for each file (median), one thread."""
    spec = store._spec(store._namespace(None))  # a benchmark looks inside
    tier = store.tiers[0]
    times: dict[str, list[float]] = {k: [] for k in ("open+fstat", "cachestat", "read", "header", "checksum",
                                                       "copy", "in place", "load (whole)")}
    buf = aligned_buffer(spec.file_bytes)
    target = out.view(torch.uint8).numpy()
    flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECT if cold else 0)
    for i, (cid, path) in enumerate(zip(ids, files, strict=True)):
        index = i % SESSION_CHUNKS
        if cold:
            drop_cache([Path(path)])
        t, fd = _timed(lambda p=path: os.open(p, flags))
        t2, st = _timed(lambda fd=fd: os.fstat(fd))
        times["open+fstat"].append(t + t2)
        times["cachestat"].append(_timed(lambda fd=fd, n=st.st_size: cache_check(fd, n))[0])
        times["read"].append(_timed(lambda fd=fd: fill(fd, buf.data, cold))[0])
        os.close(fd)
        view = memoryview(buf)
        times["header"].append(_timed(lambda v=view, c=cid: spec.check(unpack_header(v), c))[0])
        payload = view[PAYLOAD_OFFSET:PAYLOAD_OFFSET + spec.payload_bytes]
        times["checksum"].append(_timed(lambda p=payload: payload_checksum(p))[0])
        src = buf[PAYLOAD_OFFSET:PAYLOAD_OFFSET + spec.payload_bytes].view(np.uint8)
        dst = target[:, :, index * CHUNK_TOKENS:(index + 1) * CHUNK_TOKENS]
        times["copy"].append(_timed(lambda s=src, d=dst: np.copyto(d, s.reshape(d.shape)))[0])
        pages = Pages(_segments(out, index), lambda: True, lambda: None)
        if not cold:
            fd = os.open(path, os.O_RDONLY)
            size = st.st_size
            times["in place"].append(_timed(lambda fd=fd, c=cid, p=pages, n=size: read_in_place(fd, n, spec, c, p))[0])
            os.close(fd)
        elif copy_in_place is not None:
            times["in place"].append(_timed(lambda v=view, c=cid, p=pages: copy_in_place(v, spec, c, p))[0])
        if cold:
            drop_cache([Path(path)])
        times["load (whole)"].append(_timed(lambda c=cid: tier.load(c, spec, buf))[0])
    return {k: statistics.median(v) for k, v in times.items() if v}


def raw_read(files: list[str], file_bytes: int, cold: bool) -> float:
    """Seconds per file of a plain read into one buffer (O_DIRECT when cold), median."""
    buf = aligned_buffer(file_bytes)
    got = []
    for path in files:
        if cold:
            drop_cache([Path(path)])
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if cold else 0))
        got.append(_timed(lambda fd=fd: fill(fd, buf.data, cold))[0])
        os.close(fd)
    return statistics.median(got)


def gets(store: TieredStore, sessions: list[np.ndarray], files: list[str], out: torch.Tensor, cold: bool) -> float:
    """Seconds per chunk of ``store.get`` over every session (cold: the page cache dropped first)."""
    if cold:
        drop_cache([Path(f) for f in files])
    t0 = time.perf_counter()
    for tokens in sessions:
        store.get(tokens, out=out)
    return (time.perf_counter() - t0) / (len(sessions) * SESSION_CHUNKS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="a directory on the device to measure (a scratch pool is made under it)")
    ap.add_argument("--total", default="512MiB", help="bytes of chunk files to write (default 512MiB)")
    ap.add_argument("--threads", type=int, default=8, help="I/O threads of the parallel get (default 8)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the whole measurement (default 3)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = ap.parse_args()
    layout = DEFAULT_LAYOUT
    chunk_bytes = CHUNK_TOKENS * layout.bytes_per_token
    n_sessions = max(1, parse_bytes(args.total, "--total") // (chunk_bytes * SESSION_CHUNKS))
    root = Path(args.path) / f"kvtier-read-steps-{os.getpid()}"
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    sessions = [rng.integers(0, 32000, SESSION_CHUNKS * CHUNK_TOKENS).astype(np.uint32) for _ in range(n_sessions)]
    common = {"model_id": "read-steps", "layout": layout, "chunk_tokens": CHUNK_TOKENS, "host_bytes": 0,
              "pool_url": scratch_pool(root)}
    shape = layout.shape(SESSION_CHUNKS * CHUNK_TOKENS)
    rounds: list[dict[str, Any]] = []
    try:
        with TieredStore.open(**common, write_queue_chunks=SESSION_CHUNKS + 1) as w:  # type: ignore[arg-type]
            kv = torch.randint(0, 256, (math.prod(shape) * 2,), dtype=torch.uint8).view(layout.dtype).view(shape)
            for tokens in sessions:
                w.put(tokens, kv)
                w.flush()
        os.sync()
        out = torch.zeros(shape, dtype=layout.dtype)
        with TieredStore.open(**common, io_threads=1) as serial, \
                TieredStore.open(**common, io_threads=args.threads) as parallel:  # type: ignore[arg-type]
            ids = [cid for tokens in sessions for cid in serial.chunk_ids(tokens)]
            files = [str(serial.tiers[0].files.path_for(cid.key)) for cid in ids]  # type: ignore[attr-defined]
            file_bytes = os.path.getsize(files[0])
            for r in range(args.repeats):
                fig: dict[str, Any] = {}
                for mode, cold in (("cold", True), ("page cache", False)):
                    if not cold:
                        for f in files:  # warm every file
                            with open(f, "rb") as fh:
                                fh.read()
                    fig[mode] = {"steps_s": steps(serial, ids, files, cold, out),
                                 "raw_s": raw_read(files, file_bytes, cold),
                                 "get_serial_s": gets(serial, sessions, files, out, cold),
                                 "get_parallel_s": gets(parallel, sessions, files, out, cold)}
                rounds.append(fig)
                print(f"round {r + 1}/{args.repeats} done", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = _summary(rounds, file_bytes)
    _print(summary)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "rounds": rounds, "file_bytes": file_bytes,
                                        "files": len(files), "threads": args.threads}, indent=2))
    return 0


def _summary(rounds: list[dict[str, Any]], file_bytes: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per mode and step: the median over rounds, in microseconds per chunk and GB/s of file bytes."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for mode in rounds[0]:
        names = [*rounds[0][mode]["steps_s"], "raw", "get_serial", "get_parallel"]
        out[mode] = {}
        for name in names:
            vals = [(r[mode]["steps_s"][name] if name in r[mode]["steps_s"] else r[mode][f"{name}_s"]) for r in rounds]
            s = statistics.median(vals)
            out[mode][name] = {"us": round(s * 1e6, 1), "gbps": round(file_bytes / s / 1e9, 2)}
    return out


def _print(summary: dict[str, dict[str, dict[str, float]]]) -> None:
    for mode, rows in summary.items():
        print(f"\n{mode}: per 32 MiB chunk file")
        print(f"  {'step':<14}{'us':>10}{'GB/s':>9}")
        for name, v in rows.items():
            print(f"  {name:<14}{v['us']:>10.1f}{v['gbps']:>9.2f}")


if __name__ == "__main__":
    sys.exit(main())
