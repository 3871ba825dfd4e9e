"""Never wrong, never stuck: real vLLM engines (CPU build) against what users and operators do.

* A synchronous load that falls short (chunks gone between lookup and read) must not make the
  engine save the chunks it then computed over unfilled blocks: a third, clean engine reading
  the pool answers exactly as recompute does.
* An operator replaces the weights behind the model's path: the old weights' KV is never
  served for the new ones.
* A hostile API client sends nonsense retention (``retain_s: 1e20``): the server keeps
  writing chunks, and stops cleanly.
* Secrets in the kvtier config file (``tenant_salt``, a ``${VAR}`` password) never reach any
  process's command line or the server's log.

The reference is the same engine with the connector loaded but never loading (``load_policy:
never``; see test_vllm_connector.py), compared with the near-tie rule of ``_runs.mismatches``.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from _pool import new_pool
from integration import _runs

pytestmark = pytest.mark.engine  # starts vLLM engines: left out of the fast loop (-m "not engine")

if os.environ.get("KVTIER_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

BLOCK, CHUNK = 128, 256
ALWAYS = {"load_policy": "always", "chunk_tokens": CHUNK, "host_bytes": "64MiB"}


def _prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 31000) for _ in range(tokens)] for _ in range(n)]


def _pool_files(pool: Path, settled: bool = True) -> int:
    """Chunks in the pool: each is one file per KV head (head shards). ``settled``: no write is
    in flight (the engine has stopped), so every chunk has all its heads' files."""
    from kvtier.bench.model import KV_HEADS

    files = len(list(pool.glob("??/??/*.kvt")))
    assert not settled or files % KV_HEADS == 0, files
    return files // KV_HEADS


def test_a_sync_load_that_falls_short_never_poisons_the_pool(model: Path, tmp_path: Path) -> None:
    """A clean engine stores the first 2 chunks of 4 prompts; an engine in ``load_mode: sync``
    whose every pool read misses (as if each chunk were evicted between lookup and read) runs
    the whole prompts (5 chunks), so each of its loads fails after the step computed over the
    unfilled blocks; a third engine resumes the whole prompts from the pool alone."""
    prompts = _prompts(4, 5 * CHUNK + 40, seed=21)
    pool = {**ALWAYS, "pool_url": new_pool(tmp_path / "pool")}
    reference, _ = _runs.run_engine(model, tmp_path, "reference", prompts,
                                    {**pool, "pool_url": new_pool(tmp_path / 'empty'), "load_policy": "never"})
    _runs.run_engine(model, tmp_path, "prefixes", [p[:2 * CHUNK + 10] for p in prompts], pool, max_tokens=1)
    assert _pool_files(tmp_path / "pool") == 4 * 2
    misses = {"pool": {"miss_prob": 1.0, "ops": ["load"]}}
    sync, metrics = _runs.run_engine(model, tmp_path, "sync-misses", prompts,
                                     {**pool, "load_mode": "sync", "inject_faults": misses})
    sched, worker = metrics["scheduler"]["connector"], metrics["worker"]["connector"]
    assert worker["failed_blocks"] == 4 * 2 * CHUNK // BLOCK  # every loaded block failed
    assert sched["unverified_saves"] >= 4  # each request's load step saved nothing
    assert _runs.mismatches(sync, reference) == []  # vLLM recomputed what the loads missed
    assert _pool_files(tmp_path / "pool") == 4 * 5  # the chunks it computed afterwards are there
    reader, metrics = _runs.run_engine(model, tmp_path, "reader", prompts, pool)
    assert all(r["cached"] == (len(p) - 1) // BLOCK * BLOCK // CHUNK * CHUNK for r, p in zip(reader, prompts,
                                                                                           strict=True))
    assert metrics["worker"]["connector"]["loaded_tokens"] == 4 * 5 * CHUNK
    assert _runs.mismatches(reader, reference) == []


def test_new_weights_behind_the_same_path_never_read_the_old_weights_kv(model: Path, tmp_path: Path) -> None:
    """``/models/current`` points at one model, an engine fills the pool; the operator puts
    another seed's model of the same shape there; the next engine must answer as the new
    model does, never from the old one's KV (before: 10 of 10 prompts answered otherwise)."""
    from kvtier.bench.model import make_model

    current = tmp_path / "current"
    shutil.copytree(model, current)
    prompts = _prompts(6, 3 * CHUNK + 20, seed=22)
    pool = {**ALWAYS, "pool_url": new_pool(tmp_path / "pool")}
    _runs.run_engine(current, tmp_path, "old-weights", prompts, pool, max_tokens=1)
    assert _pool_files(tmp_path / "pool") == 6 * 3
    shutil.rmtree(current)
    make_model(current, seed=1)
    reference, _ = _runs.run_engine(current, tmp_path, "new-reference", prompts,
                                    {**pool, "pool_url": new_pool(tmp_path / 'empty'), "load_policy": "never"})
    got, metrics = _runs.run_engine(current, tmp_path, "new-weights", prompts, pool)
    assert [r["cached"] for r in got] == [0] * 6  # a namespace of its own: nothing of the old model's
    assert metrics["worker"]["connector"]["loaded_tokens"] == 0
    assert _runs.mismatches(got, reference) == []
    # It stored its own chunks beside the old ones, in a namespace of its own.
    assert _pool_files(tmp_path / "pool") == 2 * 6 * 3
    assert len(list((tmp_path / "pool" / "namespaces").glob("*.json"))) == 2


SALT = "tenant-salt-LITERAL-7f3a9"
PASSWORD = "redis-pw-FROM-ENV-c41d"


def _cmdlines() -> dict[int, str]:
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
    return out


def test_a_hostile_client_and_config_secrets_against_a_real_kvtier_serve(model: Path, tmp_path: Path) -> None:
    from kvtier.bench.engines import Process, free_port

    pool = tmp_path / "pool"
    cfg = tmp_path / "kvtier.yaml"
    # A literal secret in the file and one read from the environment by the connector.
    cfg.write_text(f"pool_url: {new_pool(pool)}\nchunk_tokens: {CHUNK}\nhost_bytes: 64MiB\n"
                   f"tenant_salt: {SALT}\nredis_password: ${{TEST_KVTIER_REDIS_PASSWORD}}\n")
    port = free_port()
    argv = [sys.executable, "-m", "kvtier.cli.main", "serve", "--config", str(cfg), "--", "--model", str(model),
            "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
            "--max-model-len", "4096", "--max-num-batched-tokens", "4096", "--enable-prefix-caching", "--seed", "0"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0",
           "TEST_KVTIER_REDIS_PASSWORD": PASSWORD}
    log = tmp_path / "server.log"
    server = Process("server", argv, log, env, ready_url=f"http://127.0.0.1:{port}/health")
    server.start(timeout_s=600)
    try:
        leaked = [pid for pid, line in _cmdlines().items() if SALT in line or PASSWORD in line]
        assert leaked == [], f"a secret is on the command line of {leaked}"

        def complete(prompt: list[int], **extra: Any) -> dict[str, Any]:
            body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0.0, **extra}
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()  # type: ignore[no-any-return]

        hostile = [1e20, -1, "forever", [1], 1e308]
        for i, value in enumerate(hostile):
            complete(_prompts(1, 2 * CHUNK + 5, seed=100 + i)[0], kv_transfer_params={"kvtier": {"retain_s": value}})
        before = _pool_files(pool, settled=False)
        assert before >= 2  # (the first hostile request's own chunks, at least)
        for i in range(3):  # the writers survived: new prompts still reach the pool
            complete(_prompts(1, 2 * CHUNK + 5, seed=200 + i)[0])
        deadline = time.monotonic() + 30
        while _pool_files(pool, settled=False) < before + 6 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _pool_files(pool, settled=False) >= before + 6
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        rejected = [line for line in metrics.splitlines() if line.startswith("kvtier_rejected_request_params_total")]
        assert rejected and float(rejected[0].rsplit(" ", 1)[1]) == len(hostile)
    finally:
        stopped = server.stop()
    assert stopped.killed == (), f"shutdown hung: {stopped}"  # flush() returned, nothing was killed
    text = log.read_text(errors="replace")
    assert SALT not in text and PASSWORD not in text
    # kvtier's INFO lines reach the server's log (vLLM configures only its own logger), and
    # the connector's settings line, which names the salt and the password, redacts them.
    banners = [line for line in text.splitlines() if "kvtier connector (" in line]
    assert any("(SCHEDULER" in b for b in banners) and any("(WORKER" in b for b in banners), banners
    assert all(b.startswith("(") and " pid=" in b and ") INFO " in b for b in banners), banners
    assert "retain_s" in text  # the rejection was logged (without failing the request)
