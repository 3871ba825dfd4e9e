"""``kvtier pool stats|verify|gc PATH``."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier import admin
from kvtier.cli.args import byte_size
from kvtier.cli.output import emit_json


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3f} GiB"


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    return time.strftime("%H:%M:%S", time.gmtime(s)) if s < 86400 else f"{s / 86400:.1f} d"


def add_parser(sub: Any) -> None:
    """The command's argparse sub-parser."""
    pool = sub.add_parser("pool", help="inspect and maintain a pool or disk-tier directory")
    pool_sub = pool.add_subparsers(dest="pool_command", required=True, metavar="ACTION")
    stats = pool_sub.add_parser("stats", help="chunks, bytes, namespaces and age")
    verify = pool_sub.add_parser("verify", help="check every chunk's header, size, checksum and key")
    verify.add_argument("--fix", action="store_true", help="remove the chunks that fail")
    gc = pool_sub.add_parser("gc", help="evict least recently used chunks down to --max-bytes exactly "
                                        "(retained ones last; the listing holds no lock), remove stale temp "
                                        "files, and re-count the pool's bytes for every instance")
    gc.add_argument("--max-bytes", type=byte_size, required=True, help="budget, e.g. 500GiB")
    gc.add_argument("--tmp-age", type=float, default=3600.0,
                    help="remove temp files older than this many seconds (default 3600)")
    for p in (stats, verify, gc):
        p.add_argument("path", help="the pool directory (the PATH of fs://PATH) or a disk_path")
        p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    out = Console()
    if args.pool_command == "stats":
        st = admin.stats(args.path)
        if args.json:
            emit_json(asdict(st))
            return 0
        out.print(f"[bold]{st.path}[/]: {st.chunks} chunks, {_gib(st.bytes)}, oldest {_age(st.oldest_age_s)} "
                  f"ago, newest {_age(st.newest_age_s)} ago, {st.temp_files} temp files")
        table = Table("namespace", "model", "layout", "chunk tokens", "chunks", "bytes")
        for ns, info in sorted(st.namespaces.items()):
            layout = info.get("layout", {})
            table.add_row(ns, str(info.get("model_id", "?")), str(layout), str(info.get("chunk_tokens", "?")),
                          str(info["chunks"]), _gib(int(info["bytes"])))  # type: ignore[call-overload]
        out.print(table)
        return 0
    if args.pool_command == "verify":
        err = Console(stderr=True)
        with err.status("verifying") as status:
            report = admin.verify(args.path, fix=args.fix,
                                  progress=lambda n: status.update(f"verified {n} chunks") if n % 100 == 0 else None)
        if args.json:
            emit_json(asdict(report))
        else:
            out.print(f"{report.path}: checked {report.checked}, ok {report.ok}, bad {len(report.bad)}, "
                      f"removed {report.removed}")
            for bad in report.bad[:50]:
                out.print(f"  {bad['fault']:18} {bad['path']}")
        return 0 if not report.bad or args.fix else 1
    if args.pool_command == "gc":
        gc = admin.gc(args.path, args.max_bytes, args.tmp_age)
        if args.json:
            emit_json(asdict(gc))
        else:
            out.print(f"{gc.path}: evicted {gc.evicted_chunks} chunks, {_gib(gc.bytes_after)} left, "
                      f"removed {gc.removed_temp_files} stale temp files")
        return 0
    return 1
