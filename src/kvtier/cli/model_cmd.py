"""``kvtier model make DIR``: a tiny random-weight Llama built locally (no model hub needed)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvtier.cli.output import emit_json


def add_parser(sub: Any) -> None:
    """The command's argparse sub-parser."""
    model = sub.add_parser("model", help="build a small model directory locally")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    make = model_sub.add_parser(
        "make", help="write a tiny random-weight Llama (config, bf16 safetensors, a locally trained tokenizer)",
        description="Build a 4-layer random-weight Llama model directory with a locally trained BPE "
                    "tokenizer, for tests and demos where no model can be downloaded.")
    make.add_argument("dir", help="directory to write (created if missing)")
    make.add_argument("--seed", type=int, default=0, help="weights and tokenizer seed (default 0)")
    make.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.model import make_model

    make_model(Path(args.dir), args.seed)
    if args.json:
        emit_json({"dir": args.dir, "seed": args.seed})
    else:
        print(f"wrote {args.dir}")
    return 0
