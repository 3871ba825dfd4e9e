"""``kvtier`` command line: probe, pool stats|verify|gc, serve, model make, bench, plan, demo.

Every command takes ``--json`` and then prints exactly one JSON object on stdout (progress
and logs go to stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from kvtier.cli.output import emit_json
from kvtier.config import parse_bytes


def _size(value: str) -> int:
    try:
        return parse_bytes(value if not value.isdigit() else int(value), "size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="KV-cache tiering for LLM engines: host DRAM, local disk and a shared pool.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    probe = sub.add_parser(
        "probe", help="measure read bandwidth of a path: raw device vs kvtier's read path",
        description="Write chunk files under PATH (removed afterwards) and measure cold and page-cache "
                    "read bandwidth: serial vs parallel, buffered vs O_DIRECT, and kvtier's own read "
                    "path (TieredStore.get from a pool tier) on the same files. Medians over repeats.")
    probe.add_argument("path", help="directory to probe (a scratch subdirectory is created in it), or a "
                                    "redis://, rediss:// or valkey:// server URL (scratch keys, removed after)")
    probe.add_argument("--total", type=_size, default="1GiB", help="data to write and read (default 1GiB)")
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

    pool = sub.add_parser("pool", help="inspect and maintain a pool or disk-tier directory")
    pool_sub = pool.add_subparsers(dest="pool_command", required=True, metavar="ACTION")
    stats = pool_sub.add_parser("stats", help="chunks, bytes, namespaces and age")
    verify = pool_sub.add_parser("verify", help="check every chunk's header, size, checksum and key")
    verify.add_argument("--fix", action="store_true", help="remove the chunks that fail")
    gc = pool_sub.add_parser("gc", help="evict least recently used chunks down to --max-bytes; "
                                        "remove stale temp files")
    gc.add_argument("--max-bytes", type=_size, required=True, help="budget, e.g. 500GiB")
    gc.add_argument("--tmp-age", type=float, default=3600.0,
                    help="remove temp files older than this many seconds (default 3600)")
    for p in (stats, verify, gc):
        p.add_argument("path", help="the pool directory (the PATH of fs://PATH) or a disk_path")
        p.add_argument("--json", action="store_true", help="print one JSON object")

    serve = sub.add_parser(
        "serve", help="start vLLM's OpenAI server with the kvtier connector",
        description="Start `python -m vllm.entrypoints.openai.api_server ARGS` with --kv-transfer-config "
                    "naming KVTierConnector, configured from a kvtier YAML file. Example: "
                    "kvtier serve --config kvtier.yaml -- --model DIR --port 8000")
    serve.add_argument("--config", default=None, help="kvtier settings (YAML: pool_url, host_bytes, disk_path, ...)")
    serve.add_argument("--print-command", action="store_true", help="print the command as JSON instead of running it")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments for vLLM's server, after --")

    model = sub.add_parser("model", help="build a small model directory locally")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    make = model_sub.add_parser(
        "make", help="write a tiny random-weight Llama (config, bf16 safetensors, a locally trained tokenizer)",
        description="Build a 4-layer random-weight Llama model directory with a locally trained BPE "
                    "tokenizer, for tests and demos where no model can be downloaded.")
    make.add_argument("dir", help="directory to write (created if missing)")
    make.add_argument("--seed", type=int, default=0, help="weights and tokenizer seed (default 0)")
    make.add_argument("--json", action="store_true", help="print one JSON object")

    from kvtier.cli.bench_cmd import add_parser as add_bench_parser

    add_bench_parser(sub)

    from kvtier.cli.plan_cmd import add_parser as add_plan_parser

    add_plan_parser(sub)

    demo = sub.add_parser("demo", help="the embedded default: probe a temp dir and run a store round trip",
                          description="With vLLM installed: the seed's cold-resume scenario (instance A "
                                      "prefills long sessions into a pool, a new instance B resumes them; TTFT "
                                      "of both). Then a probe of a temporary directory and a store round trip.")
    demo.add_argument("--dir", default=None, help="where to put the temporary data (default: system temp)")
    demo.add_argument("--no-engine", action="store_true", help="skip the vLLM scenario even when vLLM is installed")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kvtier.cli.bench_cmd import normalize

    args = build_parser().parse_args(normalize(list(sys.argv[1:] if argv is None else argv)))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "probe":
            from kvtier.cli.probe_cmd import run as run_probe_cmd

            return run_probe_cmd(args)
        if args.command == "pool":
            from kvtier.cli.pool_cmd import run as run_pool_cmd

            return run_pool_cmd(args)
        if args.command == "serve":
            from kvtier.cli.serve_cmd import run as run_serve_cmd

            return run_serve_cmd(args)
        if args.command == "model":
            from pathlib import Path

            from kvtier.model import make_model

            make_model(Path(args.dir), args.seed)
            if args.json:
                emit_json({"dir": args.dir, "seed": args.seed})
            else:
                print(f"wrote {args.dir}")
            return 0
        if args.command == "bench":
            from kvtier.cli.bench_cmd import run as run_bench_cmd

            return run_bench_cmd(args)
        if args.command == "plan":
            from kvtier.cli.plan_cmd import run as run_plan_cmd

            return run_plan_cmd(args)
        if args.command == "demo":
            from kvtier.cli.demo_cmd import run as run_demo_cmd

            return run_demo_cmd(args)
    except (ValueError, OSError) as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(exc)}))
        else:
            print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
