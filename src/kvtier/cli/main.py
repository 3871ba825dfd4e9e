"""``kvtier`` command line: probe, pool init|budget|stats|verify|gc, doctor, serve, model make, bench, plan, demo.

A command that takes ``--json`` (``kvtier COMMAND --help`` says; ``serve`` and ``bench
report`` do not) then prints exactly one JSON object on stdout, an error included (progress
and logs go to stderr).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kvtier import __version__

COMMANDS = ("probe", "pool", "doctor", "serve", "model", "bench", "plan", "demo")
"""Each is a module ``kvtier.cli.<name>_cmd`` with ``add_parser(sub)`` and ``run(args) -> exit code``;
one with actions may name ``SUBCOMMANDS`` and a ``DEFAULT_ACTION`` taken when none is given."""


def _command(name: str) -> Any:
    return importlib.import_module(f"kvtier.cli.{name}_cmd")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="KV-cache tiering for LLM engines: host DRAM, local disk and a shared pool.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level to stderr")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        _command(name).add_parser(sub)
    return parser


def with_default_action(argv: list[str]) -> list[str]:
    """``kvtier CMD ARGS`` -> ``kvtier CMD DEFAULT_ACTION ARGS`` for a command that has a default
    action and was given none (argparse has no optional sub-command with its own required options).

    Only the command itself (the first argument that is not an option) is looked at: a command's
    name elsewhere, e.g. ``kvtier serve -- --served-model-name bench``, is left alone.
    """
    i = next((j for j, a in enumerate(argv) if not a.startswith("-")), None)
    if i is None or argv[i] not in COMMANDS:
        return argv
    module = _command(argv[i])
    default = getattr(module, "DEFAULT_ACTION", None)
    rest = argv[i + 1:]
    if default is None or not rest or rest[0] in (*module.SUBCOMMANDS, "-h", "--help"):
        return argv
    return [*argv[:i + 1], default, *rest]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(with_default_action(list(sys.argv[1:] if argv is None else argv)))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(_command(args.command).run(args))
    except (ValueError, OSError) as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(exc)}))
        else:
            print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
