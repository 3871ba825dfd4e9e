"""Writers SIGKILLed mid-write: no partial chunk is ever visible, no acknowledged chunk is lost.

A forked writer publishes a stream of 512 KiB chunks (distinct keys) into one pool directory
and tells the parent each chunk's seed over a pipe only after ``store`` returned; the parent
kills it with SIGKILL a few to tens of milliseconds after it started, ``scale.kills`` times.
Forking from a parent that already imported kvtier (and torch) makes a kill cycle cost
milliseconds; a fresh interpreter per kill would cost seconds.

Afterwards the pool must hold every acknowledged chunk, bit-equal, and nothing else but
chunks that verify as sound (``kvtier.admin.verify``) and the temp files of interrupted
writes, which ``admin.gc`` removes. Temp file names carry the writer's pid, so the number of
kills that landed inside a publish is counted exactly.
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvtier import admin
from kvtier.fileio import TMP_SUFFIX
from kvtier.format import ChunkSpec
from kvtier.keys import ChunkId, Namespace, chunk_ids
from kvtier.layout import DTYPE_CODES, KVLayout
from kvtier.tiers.base import Chunk, Status
from kvtier.tiers.pool import PoolTier

from . import FaultRow, Scale, scenario

# 16 KiB of KV per token, 32 tokens: a 512 KiB payload, so a publish takes long enough
# (a few tenths of a millisecond into the page cache, milliseconds with fsync) that many kills
# land inside it, while 40 kills write well under a GiB.
LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
CHUNK_TOKENS = 32
NAMESPACE = Namespace("fault-crash", LAYOUT, CHUNK_TOKENS)
SPEC = ChunkSpec(NAMESPACE.digest, DTYPE_CODES[LAYOUT.dtype], LAYOUT.shape(CHUNK_TOKENS),
                 CHUNK_TOKENS * LAYOUT.bytes_per_token)
KILL_AFTER_S = (0.002, 0.030)
SEQ_BITS = 20  # seed = writer << SEQ_BITS | sequence number
# The budget sync (this writer's ledger rewritten, the others' read) runs every few chunks, so kills land there too.
SYNC_BYTES = 4 << 20

_RECORD = struct.Struct("<q")
_STARTED = -1
_FAILED = -2


# -- deterministic chunks ------------------------------------------------------------------------


class Payloads:
    """Chunk ``seed``: one random base payload, every 4 KiB page stamped with (seed, page).

    The stamps make every chunk distinct (a page from another chunk, or a stale page, shows)
    at the cost of one copy; the base is made once in the parent and shared copy-on-write.
    """

    def __init__(self, rng_seed: int = 0) -> None:
        self.base = np.random.default_rng(rng_seed).integers(0, 256, SPEC.payload_bytes, dtype=np.uint8)
        pages = SPEC.payload_bytes // 4096
        self._page_stamps = np.arange(pages, dtype=np.uint64)

    def expected(self, seed: int) -> np.ndarray:
        out = self.base.copy()
        self.restamp(out, seed)
        return out

    def restamp(self, buf: np.ndarray, seed: int) -> None:
        """Turn ``buf`` (a copy of ``base`` stamped for any seed) into chunk ``seed``."""
        buf.view(np.uint64)[::512] = np.uint64(seed << 32) | self._page_stamps

    @staticmethod
    def chunk_id(seed: int) -> ChunkId:
        return chunk_ids(NAMESPACE, np.full(CHUNK_TOKENS, seed, dtype=np.uint32))[0]


# -- forked children -----------------------------------------------------------------------------


def fork_child(body: Callable[[], None]) -> int:
    """Fork; the child runs ``body`` and leaves with ``os._exit`` (never returning into the
    parent's code: pytest, atexit handlers and buffered files stay the parent's). An exception
    is printed and exits 1, so the parent sees it as an unexpected exit."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        body()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _write_stream(pool: Path, fsync: bool, writer: int, payloads: Payloads, ack_fd: int) -> None:
    """Publish chunks ``writer << SEQ_BITS | n`` for n = 0, 1, ... until killed; acknowledge
    each one (an atomic 8-byte pipe write) only after ``store`` returned WRITTEN."""
    try:
        tier = PoolTier(pool, None, fsync=fsync, sync_bytes=SYNC_BYTES, create=True)
        # One buffer, restamped per chunk: store copies it into the file and keeps no
        # reference, and skipping a fresh allocation per chunk (page faults) keeps the
        # writer inside publish most of the time, where the kills should land.
        buf = payloads.base.copy()
        data = torch.from_numpy(buf).view(LAYOUT.dtype).view(SPEC.shape)
        os.write(ack_fd, _RECORD.pack(_STARTED))
        for n in range(1 << SEQ_BITS):
            seed = writer << SEQ_BITS | n
            payloads.restamp(buf, seed)
            result = tier.store(Chunk(payloads.chunk_id(seed), data), SPEC)
            if result.status is not Status.WRITTEN or result.error:
                raise RuntimeError(f"store returned {result.status.value}: {result.error}")
            os.write(ack_fd, _RECORD.pack(seed))
    except BaseException:
        os.write(ack_fd, _RECORD.pack(_FAILED))
        raise


class _Records:
    """8-byte records from a child's pipe; a pipe write that small is atomic, so a killed
    child leaves whole records only."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = b""
        self.eof = False

    def _fill(self, timeout_s: float | None) -> None:
        if timeout_s is not None and not select.select([self.fd], [], [], timeout_s)[0]:
            return
        data = os.read(self.fd, 1 << 16)
        self._buf += data
        self.eof = not data

    def next(self, timeout_s: float) -> int | None:
        """The next record, or None at EOF or after ``timeout_s`` without one."""
        deadline = time.monotonic() + timeout_s
        while len(self._buf) < _RECORD.size and not self.eof:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._fill(left)
        return self._pop()

    def rest(self) -> list[int]:
        """Every record up to EOF (the writer end is closed once the child is gone)."""
        while not self.eof:
            self._fill(None)
        out = []
        while (record := self._pop()) is not None:
            out.append(record)
        return out

    def _pop(self) -> int | None:
        if len(self._buf) < _RECORD.size:
            return None
        (record,), self._buf = _RECORD.unpack(self._buf[:_RECORD.size]), self._buf[_RECORD.size:]
        return int(record)


@dataclass
class _Kill:
    pid: int
    acked: list[int]
    expected_death: bool
    """Died of our SIGKILL, having started and reported no failure."""


def _run_and_kill(pool: Path, fsync: bool, writer: int, payloads: Payloads, delay_s: float) -> _Kill:
    read_fd, write_fd = os.pipe()

    def child() -> None:
        os.close(read_fd)
        _write_stream(pool, fsync, writer, payloads, write_fd)

    pid = fork_child(child)
    os.close(write_fd)
    try:
        records = _Records(read_fd)
        started = records.next(timeout_s=60.0) == _STARTED
        if started:
            time.sleep(delay_s)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        acked = records.rest()
    finally:
        os.close(read_fd)
    failed = _FAILED in acked
    acked = [r for r in acked if r >= 0]
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return _Kill(pid, acked, started and killed and not failed)


def _temp_pid(path: Path) -> int | None:
    """The writer pid in ``<name>.<pid>.<rand>.tmp``."""
    parts = path.name.split(".")
    try:
        return int(parts[-3])
    except (IndexError, ValueError):
        return None


def _cli_verify(pool: Path) -> tuple[int, dict[str, object]]:
    """``kvtier pool verify POOL --json`` in a fresh interpreter: (exit code, its JSON)."""
    script = Path(sys.executable).with_name("kvtier")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvtier.cli.main"]
    done = subprocess.run([*cmd, "pool", "verify", str(pool), "--json"], capture_output=True, text=True,
                          timeout=300, check=False)
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        return done.returncode, {"stdout": done.stdout[-2000:], "stderr": done.stderr[-2000:]}


def assert_nothing_lost(row: FaultRow) -> None:
    """A writer-kill row's verdict: every acknowledged chunk verifies, gc removes exactly the
    temp files the kills left (none after it), and ``kvtier pool verify`` checks every chunk."""
    row.check()
    x = row.extra
    assert row.requests == x["acknowledged"] > 0
    assert x["verify_bad"] == []
    assert x["gc_removed_temp_files"] == x["temp_files"] + x["root_temp_files"]
    assert x["temp_files_after_gc"] == 0
    assert (x["cli_verify_rc"], x["cli_verify_checked"]) == (0, x["chunks_in_pool"])


def kill_writers(pool: Path, kills: int, *, fsync: bool, seed: int = 0, cli: bool = True,
                 keep: bool = False, writer_pools: Sequence[Path] | None = None,
                 kill_after_s: tuple[float, float] = KILL_AFTER_S) -> FaultRow:
    """SIGKILL ``kills`` forked writers of ``pool`` mid-stream; then verify, read back, gc.

    ``writer_pools``: the same pool as each writer reaches it (writer k uses entry k modulo
    their number), e.g. through two mounts of a shared filesystem; the checks read ``pool``.
    ``kill_after_s``: the range of each writer's life (longer where a publish is slower).
    The pool (hundreds of MiB at the ci scale, GiBs at full) is removed afterwards when
    everything checked out, unless ``keep``; a pool that failed a check stays for a post-mortem.
    """
    t0 = time.perf_counter()
    rng = random.Random(seed)
    payloads = Payloads(seed)
    PoolTier(pool, None, create=True).close()  # creates the directory and its marker
    acked: list[int] = []
    killed_pids: set[int] = set()
    crashes = 0
    for k in range(kills):
        where = pool if not writer_pools else writer_pools[k % len(writer_pools)]
        outcome = _run_and_kill(where, fsync, k, payloads, rng.uniform(*kill_after_s))
        acked += outcome.acked
        if outcome.expected_death:
            killed_pids.add(outcome.pid)
        else:
            crashes += 1

    files = PoolTier(pool, None, create=True).files
    temps = [p for p, _ in files.temp_files()]
    root_temps = [p for p in pool.iterdir() if p.name.endswith(TMP_SUFFIX)]
    kills_with_temp = len({_temp_pid(p) for p in temps} & killed_pids)
    report = admin.verify(pool)

    reader = PoolTier(pool, None, create=True)
    served = identical = wrong = lost = 0
    for s in acked:
        try:
            got = reader.load(payloads.chunk_id(s), SPEC)
        except Exception:
            continue  # not served: load's contract is a result, never an exception
        served += 1
        if not got.ok or got.chunk is None:
            lost += 1  # acknowledged, then missing or unreadable
            continue
        same = np.array_equal(got.chunk.data.reshape(-1).view(torch.uint8).numpy(), payloads.expected(s))
        identical += same
        wrong += not same

    gc = admin.gc(pool, max_bytes=1 << 62, tmp_age_s=0)
    temps_after = sum(1 for _ in files.temp_files())
    cli_rc, cli_report = _cli_verify(pool) if cli else (0, {})
    usage_after = PoolTier(pool, None, create=True).sync()  # the locks and the accounting files survived the kills

    sound = not (wrong or lost or crashes or report.bad or temps_after or cli_rc)
    if sound and not keep:
        shutil.rmtree(pool, ignore_errors=True)

    fsync_name = "on" if fsync else "off"
    notes = (f"fsync {fsync_name}; {kills_with_temp} kills left a temp file; verify: {report.checked} checked, "
             f"{len(report.bad)} bad; gc removed {gc.removed_temp_files} temp files")
    return FaultRow(
        fault=f"writer SIGKILL mid-write (fsync {fsync_name})", injected=kills, requests=len(acked),
        served=served, identical=identical, wrong=wrong, lost=lost, crashes=crashes,
        seconds=time.perf_counter() - t0, notes=notes,
        extra={"fsync": fsync, "acknowledged": len(acked), "chunks_in_pool": report.checked,
               "published_unacknowledged": report.checked - len(acked) + lost,
               "kills_with_temp": kills_with_temp, "temp_files": len(temps), "root_temp_files": len(root_temps),
               "verify_bad": report.bad, "gc_removed_temp_files": gc.removed_temp_files,
               "gc_evicted": gc.evicted_chunks, "temp_files_after_gc": temps_after,
               "cli_verify_rc": cli_rc, "cli_verify_checked": cli_report.get("checked"),
               "usage_after": usage_after, "chunk_bytes": SPEC.file_bytes})


@scenario("writer SIGKILL mid-write")
def writer_sigkill(scale: Scale, path: Path) -> list[FaultRow]:
    """``scale.kills`` kills with fsync off, then as many with fsync on (each in its own pool)."""
    return [kill_writers(path / "pool-fsync-off", scale.kills, fsync=False, seed=1),
            kill_writers(path / "pool-fsync-on", scale.kills, fsync=True, seed=2)]
