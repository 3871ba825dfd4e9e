"""Start and stop OpenAI-compatible servers (and helper processes) for the benchmark suite.

Each process runs in its own session (process group) with its output in a log file, so the
suite can stop it and everything it spawned (vLLM's engine-core and worker processes), and
can quote the log when it fails. Readiness is polled over HTTP (``/health`` for vLLM) or a
TCP connect; a process that exits while starting fails at once with the log's tail. A log
can be counted (:func:`log_findings`) and cut to its head and tail (:func:`cut_log`).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


class EngineError(RuntimeError):
    """A server did not start, or died; the message ends with the tail of its log."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, chars: int = 2500) -> str:
    try:
        data = path.read_bytes()[-chars:]
    except OSError:
        return "(no log)"
    return data.decode(errors="replace")


_EXCEPTION = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.*)$")


def root_cause(path: Path) -> str | None:
    """The first ``SomethingError: message`` line of the log's latest start (the root cause;
    vLLM logs the worker's error before the engine-core and front-end errors it causes)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if line.startswith("=== ") and " start: " in line]
    for line in lines[starts[-1] if starts else 0:]:
        m = _EXCEPTION.search(line)
        if m and "ulimit" not in line:
            return f"{m.group(1)}: {m.group(2)}"[:400]
    return None


@dataclass
class Process:
    """A server process. ``ready_url``: polled until it answers 200; else ``ready_port`` is dialled."""

    name: str
    argv: Sequence[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    ready_url: str | None = None
    ready_port: int | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 300.0) -> float:
        """Start and wait until ready; returns the seconds it took. Raises EngineError."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(self.log, "ab") as out:
            out.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(list(self.argv), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env={**os.environ, **self.env},
                                         start_new_session=True)
        deadline = t0 + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self.proc = None
                raise EngineError(f"{self.name} exited with status {code} while starting; log {self.log}:\n"
                                  f"{log_tail(self.log)}")
            if self._ready():
                return time.perf_counter() - t0
            if time.perf_counter() > deadline:
                self.stop()
                raise EngineError(f"{self.name} was not ready after {timeout_s:.0f} s; log {self.log}:\n"
                                  f"{log_tail(self.log)}")
            time.sleep(0.5)

    def _ready(self) -> bool:
        if self.ready_url is not None:
            try:
                return httpx.get(self.ready_url, timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False
        if self.ready_port is not None:
            try:
                socket.create_connection(("127.0.0.1", self.ready_port), timeout=1.0).close()
                return True
            except OSError:
                return False
        return True

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self) -> None:
        """Raise EngineError (with the log's root cause) if the server died or reports unhealthy.

        An engine whose core crashed may leave its HTTP front end up answering 500s: the health
        URL tells them apart.
        """
        if self.proc is None:
            return
        code = self.proc.poll()
        healthy = code is None and self._ready()
        if healthy:
            return
        state = f"exited with status {code}" if code is not None else "is up but reports unhealthy"
        cause = root_cause(self.log)
        raise EngineError(f"{self.name} {state}" + (f": {cause}" if cause else "") + f" (log: {self.log})")

    def stop(self, timeout_s: float = 60.0) -> Stopped:
        """SIGINT the server alone (vLLM then shuts its engine down in order: kvtier's worker
        flushes its writes), wait for the whole process group to exit; escalate to SIGTERM and
        SIGKILL of the group only past ``timeout_s``. Returns how it went (:class:`Stopped`).

        Signalling the whole group at once raced vLLM's own teardown: the engine core died
        before its connector shut down, and the group was killed as soon as the server exited,
        while a worker could still be flushing.
        """
        proc, self.proc = self.proc, None
        if proc is None:
            return Stopped()
        t0 = time.monotonic()
        try:
            proc.send_signal(signal.SIGINT)
        except ProcessLookupError:
            pass
        _wait_group(proc, t0 + timeout_s)
        seconds = time.monotonic() - t0
        killed = tuple(f"{process_role(pid)} ({pid})" for pid in group_pids(proc.pid, live_only=True))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not group_pids(proc.pid, live_only=True):
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            _wait_group(proc, time.monotonic() + 10.0)
        proc.poll()
        return Stopped(seconds, proc.returncode, killed)


@dataclass(frozen=True)
class Stopped:
    """How :meth:`Process.stop` went: ``seconds`` from the SIGINT until the group had exited or
    the grace period ended (None: nothing was running), the server's ``exit_status``, and the
    processes still alive after the grace period (``"role (pid)"``), which were then killed."""

    seconds: float | None = None
    exit_status: int | None = None
    killed: tuple[str, ...] = ()


def _wait_group(proc: subprocess.Popen[bytes], until: float) -> None:
    """Wait (until ``until``, monotonic) for every process of ``proc``'s group to exit, reaping
    the leader once it does, so it does not linger as a zombie."""
    while time.monotonic() < until and group_pids(proc.pid, live_only=True):
        proc.poll()
        time.sleep(0.2)


def process_role(pid: int) -> str:
    """A readable role for a process of an engine's group: vLLM titles its processes
    ``VLLM::EngineCore`` and so on (-> ``EngineCore``); the server is ``APIServer``; else the
    process's name (``comm``); ``?`` once it has gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    first = argv[0].decode(errors="replace") if argv else ""
    joined = b" ".join(argv).decode(errors="replace")
    if first.startswith("VLLM::"):
        return first.split()[0][6:]
    if "api_server" in joined or "kvtier.cli.main" in joined:
        return "APIServer"
    if "resource_tracker" in joined:
        return "resource_tracker"
    return comm


def log_findings(path: Path) -> dict[str, Any]:
    """Counts of ERROR and WARNING lines and of tracebacks in a log, its first ERROR lines and
    its distinct warnings (up to 5 and 10); ``{}`` when it cannot be read."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    errors = [line for line in lines if " ERROR " in line or line.startswith("ERROR")]
    warnings = [line for line in lines if " WARNING " in line]
    return {"error_lines": len(errors), "warning_lines": len(warnings),
            "tracebacks": sum("Traceback (most recent call last)" in line for line in lines),
            "first_errors": errors[:5],
            "distinct_warnings": sorted({w.split("] ", 1)[-1][:160] for w in warnings})[:10]}


def cut_log(path: Path, limit: int) -> None:
    """Keep a log's first third and last two thirds of ``limit`` bytes, with a marker between,
    when it is longer (for result folders that are committed); a missing log is left alone."""
    try:
        data = path.read_bytes()
    except OSError:
        return
    if len(data) <= limit:
        return
    head, tail = data[: limit // 3], data[-(2 * limit // 3):]
    marker = f"\n[... {len(data) - len(head) - len(tail)} bytes cut ...]\n".encode()
    path.write_bytes(head + marker + tail)


def proc_stats() -> Iterator[tuple[int, str, list[str]]]:
    """(pid, comm, fields after comm: state ppid pgrp ...) of every process in /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue  # exited since the listing
        yield int(entry), stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:].split()


def group_pids(pgid: int, live_only: bool = False) -> list[int]:
    """Processes of process group ``pgid``; ``live_only`` leaves out zombies (exited, not
    yet reaped: killpg still succeeds on those, so it cannot tell a group is done)."""
    return sorted(pid for pid, _, fields in proc_stats()
                  if int(fields[2]) == pgid and not (live_only and fields[0] in "ZX"))
