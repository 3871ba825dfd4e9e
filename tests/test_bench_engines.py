"""kvtier.bench.engines: server processes started, polled, checked and stopped for real."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvtier.bench.engines import EngineError, Process, free_port, root_cause


def test_a_server_that_dies_while_starting_fails_with_its_log(tmp_path: Path) -> None:
    proc = Process("crashy", [sys.executable, "-c", "import sys; print('ValueError: no model here'); sys.exit(3)"],
                   tmp_path / "crashy.log", ready_url="http://127.0.0.1:9/health")
    with pytest.raises(EngineError, match="status 3") as err:
        proc.start(timeout_s=20)
    assert "no model here" in str(err.value)


def test_ready_check_stop_and_a_death_noticed_by_check(tmp_path: Path) -> None:
    port = free_port()
    proc = Process("http", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                   tmp_path / "http.log", ready_url=f"http://127.0.0.1:{port}/")
    took = proc.start(timeout_s=30)
    assert proc.alive() and took < 30
    proc.check()  # healthy: no error
    assert proc.proc is not None
    os.killpg(proc.proc.pid, signal.SIGKILL)
    proc.proc.wait()
    with pytest.raises(EngineError, match="exited"):
        proc.check()
    proc.stop()
    assert not proc.alive()


def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    child_pid = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(child_pid)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    proc = Process("parent", [sys.executable, "-c", script], tmp_path / "parent.log")
    proc.start(timeout_s=10)
    for _ in range(100):
        if child_pid.exists() and child_pid.read_text():
            break
        time.sleep(0.05)
    pid = int(child_pid.read_text())
    proc.stop(timeout_s=5)
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        try:  # a zombie until init reaps it counts as gone
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                break
        except OSError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the child outlived stop()")


def test_root_cause_is_the_first_error_of_the_latest_start(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("=== 10:00:00 start: old\nKeyError: old run\n=== 10:05:00 start: vllm ...\n"
                   "WARNING ulimit ... OSError: [Errno 24] Too many open files\n"
                   "(Worker pid=1) ERROR [x.py:1] RuntimeError: shape mismatch\n"
                   "(EngineCore pid=2) ERROR EngineDeadError: EngineCore encountered an issue\n")
    assert root_cause(log) == "RuntimeError: shape mismatch"
    assert root_cause(tmp_path / "missing.log") is None
