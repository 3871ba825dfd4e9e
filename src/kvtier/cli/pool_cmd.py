"""``kvtier pool stats|verify|gc PATH``."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from kvtier import admin
from kvtier.cli.output import emit_json


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3f} GiB"


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    return time.strftime("%H:%M:%S", time.gmtime(s)) if s < 86400 else f"{s / 86400:.1f} d"


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
