"""``kvtier doctor POOL [--config F]``: what an instance with this config would hit, and why not."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.cli.args import byte_size
from kvtier.cli.output import emit_json

STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red"}


def add_parser(sub: Any) -> None:
    """The command's argparse sub-parser."""
    p = sub.add_parser(
        "doctor", help="explain what an instance with a config would hit in a pool, and why not",
        description="Compares the namespaces in POOL (model and weights, dtype, layout, chunk size, TP size where "
                    "shards are per rank, tenant, format) with what the config states, names every field that "
                    "differs, and checks permissions, locking, clock skew, the budget and the retained share. "
                    "Reads the headers of a sample of chunk files (--sample), so it costs the same on a pool of "
                    "millions. Exit status 0 only when the config would hit.")
    p.add_argument("path", help="the pool directory (the PATH of fs://PATH) or a disk_path")
    p.add_argument("--config", help="a kvtier YAML file (as kvtier serve takes): its model_id, chunk_tokens, "
                                    "tenant_salt, dtype, layout fields and pool_bytes are compared")
    p.add_argument("--model", help="the model as the engine names it (vLLM: its --model path or id); a directory's "
                                   "weights are compared with those the pool's namespaces record")
    p.add_argument("--model-digest", help="the engine's model digest (the model_digest of a namespace "
                                          "`kvtier pool stats --json` lists), compared as is")
    p.add_argument("--dtype", help="the KV cache's dtype, e.g. bfloat16")
    p.add_argument("--chunk-tokens", type=int, help="tokens per chunk (default of kvtier serve: 256)")
    p.add_argument("--tensor-parallel-size", type=int, help="the engine's TP size (matters only where shards "
                                                            "are per rank)")
    p.add_argument("--pool-bytes", type=byte_size, help="the pool's budget, e.g. 100TiB")
    p.add_argument("--sample", type=int, default=2000, help="chunk headers to read at most (default 2000)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvtier.config import parse_bytes, read_settings_file
    from kvtier.doctor import diagnose

    settings: dict[str, Any] = read_settings_file(args.config) if args.config else {}
    for key in ("model", "dtype", "chunk_tokens", "tensor_parallel_size", "model_digest"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    budget = args.pool_bytes
    if budget is None and settings.get("pool_bytes") is not None:
        budget = parse_bytes(settings["pool_bytes"], "pool_bytes")
    report = diagnose(args.path, settings, pool_bytes=budget, sample_files=args.sample)
    if args.json:
        emit_json(report.to_dict())
        return 0 if report.would_hit else 1
    out = Console()
    stated = ", ".join(f"{k}={v}" for k, v in report.stated.items()) or "nothing"
    out.print(f"[bold]{report.path}[/]: the config states {stated}")
    table = Table("namespace", "model", "dtype", "chunk tokens", "TP", "chunks seen", "differs from the config")
    for ns in sorted(report.namespaces, key=lambda n: -n.chunks_seen):
        f = ns.fields
        differs = "; ".join(f"{k}: pool {v[0]!r}, config {v[1]!r}" for k, v in ns.differs.items())
        table.add_row(ns.digest[:16], str(f.get("model")), str(f.get("dtype")), str(f.get("chunk_tokens")),
                      str(f.get("tensor_parallel_size")), str(ns.chunks_seen),
                      "[red]" + differs + "[/]" if differs else "[green]matches[/]")
    out.print(table)
    scope = "every chunk" if report.complete_scan else f"{report.sampled_files} chunks in {report.sampled_dirs} " \
                                                       "shard directories"
    out.print(f"read the headers of {scope}")
    for finding in report.findings:
        out.print(f"[{STYLE[finding.status]}]{finding.status:>4}[/] {finding.check}: {finding.detail}")
    out.print("[bold green]would hit[/]" if report.would_hit else "[bold red]would not hit[/]")
    return 0 if report.would_hit else 1
