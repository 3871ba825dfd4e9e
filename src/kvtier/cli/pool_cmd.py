"""``kvtier pool init|budget|stats|verify|gc PATH``."""

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
from kvtier.tiers.poolroot import mount_of


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3f} GiB"


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    return time.strftime("%H:%M:%S", time.gmtime(s)) if s < 86400 else f"{s / 86400:.1f} d"


def add_parser(sub: Any) -> None:
    """The command's argparse sub-parser."""
    pool = sub.add_parser("pool", help="create, budget, inspect and maintain a pool or disk-tier directory")
    pool_sub = pool.add_subparsers(dest="pool_command", required=True, metavar="ACTION")
    init = pool_sub.add_parser(
        "init", help="create and mark a shared pool directory, and record its budget",
        description="Create PATH (and missing parents) as a kvtier pool: engines open only a directory "
                    "marked this way, so a share that is not mounted yet is refused instead of becoming "
                    "a private pool on the root disk. Run it once per pool, on the shared filesystem; "
                    "it prints the filesystem and device PATH is on. An existing pool keeps its chunks.")
    init.add_argument("path", help="the pool directory (the PATH of pool_url fs://PATH); must be absolute")
    init.add_argument("--max-bytes", type=byte_size, default=None,
                      help="the pool's budget, read by every instance, e.g. 500GiB (leave headroom on the "
                           "filesystem: docs/operations.md); without it the pool grows until the disk is full")
    init.add_argument("--group", action="store_true",
                      help="group-shared: directories 2770 and files 660 (as the group_access setting)")
    init.add_argument("--json", action="store_true", help="print one JSON object")
    budget = pool_sub.add_parser("budget", help="change the budget recorded in a pool (every instance reads it "
                                                "within 10 s)")
    budget.add_argument("path", help="the pool directory")
    budget.add_argument("size", type=byte_size, help="the new budget, e.g. 500GiB")
    budget.add_argument("--json", action="store_true", help="print one JSON object")
    stats = pool_sub.add_parser("stats", help="chunks, bytes, namespaces and age")
    verify = pool_sub.add_parser("verify", help="check every chunk's header, size, checksum and key")
    verify.add_argument("--fix", action="store_true", help="remove the chunks that fail")
    gc = pool_sub.add_parser("gc", help="evict least recently used chunks down to --max-bytes exactly "
                                        "(retained ones last; the listing holds no lock), remove stale temp "
                                        "files, and re-count the pool's bytes for every instance")
    gc.add_argument("--max-bytes", type=byte_size, default=None,
                    help="budget, e.g. 500GiB (default: the budget recorded in the pool)")
    gc.add_argument("--tmp-age", type=float, default=3600.0,
                    help="remove temp files older than this many seconds (default 3600)")
    for p in (stats, verify, gc):
        p.add_argument("path", help="the pool directory (the PATH of fs://PATH) or a disk_path")
        p.add_argument("--json", action="store_true", help="print one JSON object")


def _init(args: argparse.Namespace) -> int:
    if not args.path.startswith("/"):
        raise ValueError(f"pool init: {args.path!r} is relative; give the absolute path engines will use")
    root = admin.init_pool(args.path, args.max_bytes, group_access=args.group)
    mount = mount_of(root)
    budget = admin.read_budget(root)
    if args.json:
        emit_json({"path": str(root), "budget_bytes": budget, **asdict(mount)})
        return 0
    out, err = Console(), Console(stderr=True)
    out.print(f"{root}: a kvtier pool, budget {_gib(budget) if budget else 'none'}, on {mount.fstype} "
              f"{mount.source} (mounted at {mount.mount_point}, device {mount.device})")
    if mount.on_root_device:
        err.print(f"[yellow]warning[/]: {root} is on the same device as / : if it should be on a shared "
                  "filesystem, that filesystem is not mounted there")
    if budget is None:
        err.print("[yellow]warning[/]: no budget; set one with `kvtier pool budget PATH SIZE`")
    return 0


def run(args: argparse.Namespace) -> int:
    out = Console()
    if args.pool_command == "init":
        return _init(args)
    if args.pool_command == "budget":
        admin.set_budget(args.path, args.size)
        if args.json:
            emit_json({"path": args.path, "budget_bytes": args.size})
        else:
            out.print(f"{args.path}: budget {_gib(args.size)}; running instances read it within 10 s")
        return 0
    if args.pool_command == "stats":
        st = admin.stats(args.path)
        if args.json:
            emit_json(asdict(st))
            return 0
        budget = _gib(st.budget_bytes) if st.budget_bytes is not None else "none recorded"
        out.print(f"[bold]{st.path}[/]: {st.chunks} chunks, {_gib(st.bytes)} (budget {budget}), oldest "
                  f"{_age(st.oldest_age_s)} ago, newest {_age(st.newest_age_s)} ago, {st.temp_files} temp files")
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
        max_bytes = args.max_bytes if args.max_bytes is not None else admin.read_budget(args.path)
        if max_bytes is None:
            raise ValueError(f"pool gc: {args.path} records no budget; give --max-bytes SIZE")
        gc = admin.gc(args.path, max_bytes, args.tmp_age)
        if args.json:
            emit_json(asdict(gc))
        else:
            out.print(f"{gc.path}: evicted {gc.evicted_chunks} chunks, {_gib(gc.bytes_after)} left, "
                      f"removed {gc.removed_temp_files} stale temp files")
        return 0
    return 1
