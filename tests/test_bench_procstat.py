"""kvtier.bench.procstat: /proc samples of this test's own process, and the trend figures."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from kvtier.bench import procstat
from kvtier.bench.engines import Process


def test_sample_process_counts_fds_by_kind_rss_and_threads(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir()
    before = procstat.sample_process(os.getpid(), pool)
    assert before is not None
    stop = threading.Event()
    extra = threading.Thread(target=stop.wait, name="procstat-probe")
    extra.start()
    r, w = os.pipe()
    with open(pool / "chunk", "wb") as pooled, open(tmp_path / "other", "wb") as other, socket.socket() as sock:
        s = procstat.sample_process(os.getpid(), pool)
        names = procstat.thread_names(os.getpid())
    os.close(r)
    os.close(w)
    stop.set()
    extra.join()
    assert s is not None and pooled.name and other.name and sock
    assert s["pid"] == os.getpid() and s["state"] in "RS" and s["cpu_s"] > 0
    assert 0 < s["rss_anon_mib"] <= s["rss_mib"]
    assert s["fd_pool_files"] == before["fd_pool_files"] + 1 == 1
    assert s["fd_files"] == before["fd_files"] + 1
    assert s["fd_sockets"] == before["fd_sockets"] + 1
    assert s["fd_pipes"] == before["fd_pipes"] + 2
    kinds = sum(s[k] for k in ("fd_sockets", "fd_pipes", "fd_anon", "fd_pool_files", "fd_files"))
    assert 0 <= s["fds"] - kinds <= 1  # the listing's own fd is counted, then gone before its readlink
    assert s["threads"] == before["threads"] + 1 >= 2
    comm = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    assert names.get(comm, 0) >= 1 and sum(names.values()) == s["threads"]  # every thread, by its OS name
    assert procstat.sample_process(2**22 + 12345) is None  # no such pid: gone, not an error


def test_cpu_times_dir_usage_and_proc_cpu(tmp_path: Path) -> None:
    cpu = procstat.CpuTimes()
    sum(i * i for i in range(200_000))  # some CPU time between the two reads
    shares = cpu.delta()
    assert set(shares) == {"cpu_busy", "cpu_iowait", "cpu_steal"} and 0 <= shares["cpu_busy"] <= 1
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"12345")
    (tmp_path / "y").write_bytes(b"123")
    assert procstat.dir_usage(tmp_path) == (2, 8)
    state, seconds = procstat.proc_cpu(os.getpid(), threading.get_native_id())
    assert state == "R" and seconds >= 0
    # This process's group holds at least this process: each thread name's seconds at least its own.
    group = procstat.group_thread_cpu(os.getpgid(0))
    own = procstat.thread_cpu(os.getpid())
    assert own and all(group.get(name, -1.0) >= s - 0.05 for name, s in own.items())


def test_group_sampler_and_stall_recorder_on_a_real_group(tmp_path: Path) -> None:
    import sys

    # SIGINT is handled explicitly, as vLLM's server does: a child of a shell's background job
    # inherits SIGINT ignored, and Process.stop's SIGINT would not end it if it came before the
    # handler is in place: the test waits for that.
    sleeper = ("import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "print('ready', flush=True); time.sleep(60)")
    log = tmp_path / "sleeper.log"
    proc = Process("sleeper", [sys.executable, "-c", sleeper], log)
    proc.start(timeout_s=10)
    try:
        def ready() -> bool:  # a line of its own: the log's header quotes the command, 'ready' included
            return log.exists() and "ready" in log.read_text().splitlines()

        deadline = time.monotonic() + 30
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready(), log.read_text()
        assert proc.proc is not None
        pgid = proc.proc.pid
        group = procstat.GroupSampler(tmp_path)
        rows = group.sample(pgid, {"t_s": 0.0, **group.machine(pgid)})
        assert [r["pid"] for r in rows] == [pgid] and rows[0]["rss_mib"] > 0 and rows[0]["threads"] >= 1
        assert rows[0]["other_vllm_procs"] >= 0 and "pool_mib" in rows[0] and group.rows == rows
        group.sample(pgid, {"t_s": 10.0})
        assert len(group.rows) == 2 and len(group.threads[pgid]) == 1  # the same thread names: no new entry
        said: list[str] = []
        recorder = procstat.StallRecorder(tmp_path / "stalls.jsonl", proc, said.append)
        recorder(7.0, 7.0)
        recorder(8.0, 8.0)  # under 3 s after the last snapshot: none
        snaps = [json.loads(line) for line in (tmp_path / "stalls.jsonl").read_text().splitlines()]
        assert recorder.count == 1 and len(snaps) == 1 and len(said) == 1
        main = snaps[0]["processes"][0]
        assert main["pid"] == pgid and str(pgid) in main["stacks"] and sum(main["threads"].values()) >= 1
    finally:
        stopped = proc.stop(timeout_s=5)
    assert stopped.seconds is not None and stopped.killed == ()


def test_process_summary_slopes_and_fd_quarters() -> None:
    rows = [{"t_s": float(t), "pid": 1, "process": "Worker", "rss_mib": 100.0 + t / 60, "rss_anon_mib": 50.0,
             "fds": 10 + (t >= 300), "fd_sockets": 2, "fd_pool_files": 0, "threads": 4} for t in range(0, 601, 60)]
    rows.append({**rows[0], "pid": 2, "process": "helper"})  # one sample only: short-lived
    procs = procstat.process_summary(rows, warmup_s=60, end_s=600)
    worker, helper = procs
    assert worker["slope_mib_per_min"] == 1.0 and worker["anon_slope_mib_per_min"] == 0.0
    assert worker["rss_warm_mib"] == 101.0 and worker["rss_end_mib"] == 110.0 and worker["growth_mib"] == 9.0
    assert (worker["fds_first_quarter_max"], worker["fds_last_quarter_max"]) == (10, 11)
    assert "note" in helper
    group = procstat.group_rss(rows, warmup_s=60, end_s=600)
    assert group["group_rss_slope_mib_per_min"] == 1.0 and group["group_rss_end_mib"] == 110.0
    assert procstat.slope([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None
    table = procstat.process_table(procs, group)
    assert len(table) == 2 + len(procs) + 1 and table[-1].startswith("| group |")
