"""Child processes for the multi-process tests (run as ``python tests/_workers.py MODE ...``).

Each mode prints one JSON object on stdout; any failure exits non-zero with a traceback.
Data is derived from seeds with the conftest factories, so parent and children agree on it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from _pool import new_pool
from conftest import Tiny
from kvtier import TieredStore

SEQ_CHUNKS = 4


def _wait_for(path: Path, names: list[str], deadline: float) -> None:
    while not all((path / n).exists() for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"peers never became ready: {names}")
        time.sleep(0.01)


def disk_write(disk_path: str, seeds: list[int]) -> dict[str, object]:
    """Write one 2-chunk sequence per seed, oldest first, with distinct file mtimes."""
    tiny = Tiny()
    with TieredStore(tiny.config(host_bytes=0, disk_path=disk_path, disk_bytes=1 << 20)) as store:
        for seed in seeds:
            n = 2 * tiny.chunk_tokens
            store.put(tiny.tokens(n, seed), tiny.kv(n, seed))
            store.flush()
            time.sleep(0.03)  # > one kernel timestamp tick, so mtimes order the writes
        snap = store.metrics_snapshot()["tiers"]["disk"]
    return {"written_chunks": snap["written_chunks"]}


def pool_rw(pool: str, role: int, peers: int, rendezvous: str) -> dict[str, object]:
    """Write own sequences and a shared one, then read every peer's back and check the bytes."""
    tiny = Tiny()
    n = SEQ_CHUNKS * tiny.chunk_tokens
    own = [100 + 10 * role + k for k in range(4)]
    others = [100 + 10 * r + k for r in range(peers) if r != role for k in range(4)]
    shared = 999
    meet = Path(rendezvous)
    (meet / f"ready.{role}").touch()
    _wait_for(meet, [f"ready.{r}" for r in range(peers)], time.monotonic() + 60)
    checked = 0
    with TieredStore(tiny.config(host_bytes=0, pool_url=new_pool(pool), write_threads=2,
                                 io_threads=4)) as store:
        for seed in [shared, *own]:
            store.put(tiny.tokens(n, seed), tiny.kv(n, seed))
        store.flush()
        deadline = time.monotonic() + 60
        pending = [shared, *own, *others]
        while pending:
            seed = pending[0]
            tokens = tiny.tokens(n, seed)
            if store.lookup(tokens).num_tokens < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"sequence {seed} never fully appeared in the pool")
                time.sleep(0.005)
                continue
            got = store.get(tokens)
            want = tiny.kv(n, seed)
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                raise AssertionError(f"sequence {seed}: wrong bytes")
            pending.pop(0)
            checked += 1
        snap = store.metrics_snapshot()["tiers"]["pool"]
    return {"checked": checked, "corrupt": snap["corrupt_chunks"], "failed_writes": snap["failed_writes"]}


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "disk-write":
        result = disk_write(args[0], [int(s) for s in args[1:]])
    elif mode == "pool-rw":
        result = pool_rw(args[0], int(args[1]), int(args[2]), args[3])
    else:
        raise SystemExit(f"unknown mode {mode}")
    json.dump(result, sys.stdout)
