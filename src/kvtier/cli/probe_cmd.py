"""``kvtier probe PATH``."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvtier.cli.args import byte_size
from kvtier.cli.output import emit_json
from kvtier.layout import KVLayout
from kvtier.probe import probe_table, run_probe


def add_parser(sub: Any) -> None:
    """The command's argparse sub-parser."""
    probe = sub.add_parser(
        "probe", help="measure read bandwidth of a path: raw device vs kvtier's read path",
        description="Write chunk files under PATH (removed afterwards) and measure cold and page-cache "
                    "read bandwidth: serial vs parallel, buffered vs O_DIRECT, and kvtier's own read "
                    "path (TieredStore.get from a pool tier) on the same files. Medians over repeats.")
    probe.add_argument("path", help="directory to probe (a scratch subdirectory is created in it), or a "
                                    "redis://, rediss:// or valkey:// server URL (scratch keys, removed after)")
    probe.add_argument("--total", type=byte_size, default="1GiB", help="data to write and read (default 1GiB)")
    probe.add_argument("--threads", type=int, default=8, help="parallel readers and kvtier io_threads (default 8)")
    probe.add_argument("--repeats", type=int, default=3, help="repeats per mode; medians reported (default 3)")
    probe.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (default 256)")
    probe.add_argument("--layers", type=int, default=32,
                       help="layers of the synthetic KV (default 32: an 8B-class model, 32 MiB chunks)")
    probe.add_argument("--kv-heads", type=int, default=8, help="KV heads per rank (default 8)")
    probe.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    probe.add_argument("--session-chunks", type=int, default=8,
                       help="chunks per session read by one TieredStore.get (default 8)")
    probe.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, torch.bfloat16)
    err = Console(stderr=True)
    with Progress(TextColumn("[bold]probe[/] {task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task("writing", total=1.0)
        result = run_probe(args.path, total_bytes=args.total, threads=args.threads, repeats=args.repeats,
                           layout=layout, chunk_tokens=args.chunk_tokens, session_chunks=args.session_chunks,
                           progress=lambda stage, frac: progress.update(task, description=stage, completed=frac))
    if args.json:
        emit_json(result.to_dict())
    else:
        Console().print(probe_table(result))
    return 0
