"""kvtier.tiers.redis against a real redis-server on loopback (random port, temporary directory).

Each server is started by the test that needs it, with the settings that test is about
(maxmemory, requirepass, cluster mode) and killed afterwards. Only a missing redis-server
binary skips these tests; redis-py is part of the ``test`` extra.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from kvtier import TierUnavailableError
from kvtier.config import load_settings
from kvtier.format import PAYLOAD_OFFSET
from kvtier.tiers.base import Chunk, Status, Tier
from kvtier.tiers.redis import RedisTier, is_redis_url, parse_redis_url

REDIS_SERVER = "redis-server"
FILE = 8192  # tiny chunk: 4096-byte header + 2048 payload bytes, padded


def _free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node, one <= 55535 whose bus port (+10000) is free too."""
    while True:
        with socket.socket() as s, socket.socket() as bus:
            try:
                s.bind(("127.0.0.1", random.randrange(20000, 55535) if cluster else 0))
                port = s.getsockname()[1]
                if cluster:
                    bus.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue  # a random port (or its bus port) was taken: draw another


class RedisServer:
    """One redis-server process on 127.0.0.1; ``restart`` keeps the port (and loses the data)."""

    def __init__(self, root: Path, args: tuple[str, ...], password: str | None = None,
                 tls_cert: Path | None = None) -> None:
        self.port = _free_port(cluster="--cluster-enabled" in args)
        self.dir = root / f"redis-{self.port}"
        self.dir.mkdir()
        self.password = password
        self.tls_cert = tls_cert
        self.ports = ("--port", str(self.port))
        if tls_cert is not None:  # TLS only; the key is beside the certificate
            self.ports = ("--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(tls_cert),
                          "--tls-key-file", str(tls_cert.with_suffix(".key")), "--tls-auth-clients", "no")
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def admin(self, timeout: float = 5) -> redis.Redis:
        tls = {} if self.tls_cert is None else {"ssl": True, "ssl_ca_certs": str(self.tls_cert)}
        return redis.Redis("127.0.0.1", self.port, password=self.password, socket_timeout=timeout, **tls)

    def start(self) -> None:
        log = open(self.dir / "server.log", "ab")
        self.proc = subprocess.Popen(
            [REDIS_SERVER, *self.ports, "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", "--appendonly", "no", "--loglevel", "warning", *self.args],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        log.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.admin(timeout=0.5).ping():
                    return
            except redis.ConnectionError as exc:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop(signal.SIGKILL)
                    log_text = (self.dir / "server.log").read_text()
                    raise RuntimeError(f"redis-server did not start: {log_text}") from exc
                time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if sig == signal.SIGTERM:
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process would never exit
            self.proc.send_signal(sig)
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture
def redis_server(tmp_path) -> Iterator[Any]:
    """``redis_server(*args, password=None)`` -> a started RedisServer, killed after the test."""
    if subprocess.run(["sh", "-c", f"command -v {REDIS_SERVER}"], capture_output=True).returncode:
        pytest.skip("redis-server is not installed (apt-get install redis-server; scripts/test.sh does)")
    servers: list[RedisServer] = []

    def factory(*args: str, password: str | None = None, tls_cert: Path | None = None) -> RedisServer:
        server = RedisServer(tmp_path, args, password, tls_cert)
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.stop(signal.SIGKILL)


@pytest.fixture
def open_tier() -> Iterator[Any]:
    tiers: list[RedisTier] = []

    def factory(url: str, **kw: Any) -> RedisTier:
        tier = RedisTier(url, **kw)
        tiers.append(tier)
        return tier

    yield factory
    for tier in tiers:
        tier.close()


class RoundTrips:
    """Counts requests put on the wire (one packed send per command or per pipeline)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sends = 0
        original = redis.connection.AbstractConnection.send_packed_command

        def counting(conn: Any, command: Any, check_health: bool = True) -> None:
            self.sends += 1
            original(conn, command, check_health)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)


def _calls(server: RedisServer, command: str) -> int:
    return server.admin().info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)


# -- URL and settings (no server) ----------------------------------------------------------------


@pytest.mark.parametrize(("url", "want"), [
    ("redis://cache:6380/2", ("cache", 6380, 2, None, None, False)),
    ("redis://cache", ("cache", 6379, 0, None, None, False)),
    ("rediss://kv:p%40ss@cache.internal:6390", ("cache.internal", 6390, 0, "kv", "p@ss", True)),
    ("valkey://:secret@10.0.0.5/1", ("10.0.0.5", 6379, 1, None, "secret", False)),
    ("valkeys://[::1]:7000", ("::1", 7000, 0, None, None, True)),
])
def test_parse_redis_url(url, want):
    u = parse_redis_url(url)
    assert (u.host, u.port, u.db, u.username, u.password, u.tls) == want
    assert is_redis_url(url)
    assert "secret" not in u.redacted() and "p@ss" not in u.redacted()


@pytest.mark.parametrize("url", ["redis://", "redis://h:notaport", "redis://h/x", "redis://h?ssl=1",
                                 "memcache://h"])
def test_parse_redis_url_rejects_naming_pool_url(url):
    with pytest.raises(ValueError, match="pool_url"):
        parse_redis_url(url)


BASE = {"model_id": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "pool_url": "redis://h:6379/0"}


@pytest.mark.parametrize(("change", "setting"), [
    ({"redis_timeout_s": 0}, "redis_timeout_s"), ({"redis_ttl_s": -5}, "redis_ttl_s"),
    ({"redis_cluster": "yes"}, "redis_cluster"), ({"redis_prefix": ""}, "redis_prefix"),
    ({"redis_options": "ssl"}, "redis_options"), ({"pool_bytes": "1GiB"}, "pool_bytes"),
    ({"redis_cluster": True, "pool_url": "redis://h/3"}, "pool_url"),
    ({"pool_url": "redis://h:x"}, "pool_url"),
])
def test_bad_redis_settings_name_the_setting(change, setting):
    with pytest.raises(ValueError, match=setting):
        load_settings({**BASE, **change}, environ={})


def test_redis_settings_from_environment():
    config = load_settings(BASE, environ={"KVTIER_REDIS_CLUSTER": "true", "KVTIER_REDIS_TTL_S": "60",
                                          "KVTIER_REDIS_PASSWORD": "pw",
                                          "KVTIER_REDIS_OPTIONS": '{"ssl_ca_certs": "/ca.pem"}'})
    assert (config.redis_cluster, config.redis_ttl_s, config.redis_password) == (True, 60.0, "pw")
    assert config.redis_options == {"ssl_ca_certs": "/ca.pem"}


def test_kvtier_imports_without_redis_py():
    code = ("import sys; sys.modules['redis'] = None\n"
            "import kvtier, torch\n"
            "layout = kvtier.KVLayout(2, 2, 8, torch.bfloat16)\n"
            "c = kvtier.StoreConfig(model_id='m', layout=layout, pool_url='redis://127.0.0.1:1/0')\n"
            "try:\n    kvtier.TieredStore(c)\n"
            "except kvtier.TierUnavailableError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "kvtier[redis]" in out.stdout


# -- against a real server ------------------------------------------------------------------------


def test_speaks_the_tier_protocol_and_uses_the_namespace(redis_server, open_tier, tiny):
    server = redis_server()
    tier = open_tier(server.url, prefix="team-a:", ttl_s=30)
    assert isinstance(tier, Tier)
    chunk = tiny.chunks(1)[0]
    assert tier.store(chunk, tiny.spec()).status is Status.WRITTEN
    assert tier.store(chunk, tiny.spec()).status is Status.EXISTS
    admin = server.admin()
    assert admin.keys("*") == [f"team-a:{chunk.id.key.hex()}".encode()]
    assert 0 < admin.pttl(f"team-a:{chunk.id.key.hex()}") <= 30_000
    assert len(admin.get(f"team-a:{chunk.id.key.hex()}")) == FILE  # exactly a chunk file
    assert tier.evict(0) == 0  # the server's maxmemory policy evicts
    assert admin.dbsize() == 1


@pytest.mark.parametrize("host_bytes", [0, 1 << 20])
def test_round_trip_through_tiered_store(redis_server, make_store, tiny, bits_equal, host_bytes):
    server = redis_server()
    tokens, kv = tiny.tokens(5 * 16 + 3), tiny.kv(5 * 16 + 3)
    writer = make_store(pool_url=server.url, host_bytes=host_bytes)
    assert writer.put(tokens, kv).stored_chunks == 5
    writer.flush()
    # A second instance (empty host DRAM) finds every chunk in redis and reads it bit-exact.
    reader = make_store(pool_url=server.url, host_bytes=host_bytes)
    found = reader.lookup(tokens)
    assert found.num_tokens == 80 and found.chunk_tiers == ("redis",) * 5
    bits_equal(reader.get(tokens[:80]), kv[:, :, :80])
    if host_bytes:  # promoted to host DRAM by that read
        assert reader.lookup(tokens).chunk_tiers == ("host",) * 5
    snap = reader.metrics_snapshot()["tiers"]["redis"]
    assert snap["bytes_read"] == 5 * FILE and snap["failed_reads"] == snap["corrupt_chunks"] == 0
    assert writer.metrics_snapshot()["tiers"]["redis"]["written_chunks"] == 5


def test_prefix_lookup_is_exact_and_one_round_trip(redis_server, open_tier, tiny, monkeypatch):
    server = redis_server()
    tier = open_tier(server.url)
    chunks = tiny.chunks(12)
    for i in (0, 1, 2, 3, 4, 5, 6, 8, 9):  # chunk 7 missing: the prefix ends there
        tier.store(chunks[i], tiny.spec())
    ids = [c.id for c in chunks]
    assert tier.lookup(ids[:1]) == 1  # connection made before counting
    exists, gets = _calls(server, "exists"), _calls(server, "get")
    trips = RoundTrips(monkeypatch)
    assert tier.lookup(ids) == 7
    assert tier.lookup(ids[8:]) == 2
    assert tier.lookup(ids[10:]) == 0
    assert tier.lookup([]) == 0  # no call at all
    assert trips.sends == 3  # one pipelined request per lookup, whatever the number of ids
    monkeypatch.undo()
    assert _calls(server, "exists") - exists == 12 + 4 + 2
    assert _calls(server, "get") == gets  # lookups never read values


def test_store_lookup_is_one_round_trip_when_the_prefix_ends_in_redis(redis_server, make_store, tiny, monkeypatch):
    server = redis_server()
    tokens, kv = tiny.tokens(6 * 16), tiny.kv(6 * 16)
    writer = make_store(pool_url=server.url, host_bytes=0)
    writer.put(tokens[:4 * 16], kv)
    writer.flush()
    reader = make_store(pool_url=server.url, host_bytes=1 << 20)
    assert reader.lookup(tokens[:16]).num_tokens == 16  # connection made before counting
    trips = RoundTrips(monkeypatch)
    found = reader.lookup(tokens)
    assert found.num_tokens == 4 * 16 and found.chunk_tiers == ("redis",) * 4
    assert trips.sends == 1  # redis is not asked again at the chunk where it said "missing"


def test_eviction_by_maxmemory_drops_old_chunks_and_lookup_stops_before_them(redis_server, open_tier, tiny):
    server = redis_server("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru",
                          "--maxmemory-samples", "64")
    tier = open_tier(server.url)
    spec = tiny.spec()
    chunks = tiny.chunks(160)
    old, new = chunks[:80], chunks[80:]
    assert all(tier.store(c, spec).status is Status.WRITTEN for c in old)
    time.sleep(1.1)  # the server's LRU clock ticks once a second: make the first 80 older
    assert all(tier.store(c, spec).status is Status.WRITTEN for c in new)
    admin = server.admin()
    assert admin.info("stats")["evicted_keys"] > 0
    present = [bool(admin.exists(tier.key(c.id))) for c in chunks]
    assert not all(present[:80]) and all(present[80:])  # the old ones went, the new ones stay
    assert tier.lookup([c.id for c in chunks]) == present.index(False)
    got = tier.load(new[-1].id, spec)
    assert got.ok
    snap = tier.metrics.snapshot()
    assert snap.failed_writes == snap.failed_reads == snap.timeouts == 0


def test_server_restarted_mid_run(redis_server, make_store, tiny, bits_equal):
    server = redis_server()
    store = make_store(pool_url=server.url, host_bytes=0)
    tokens, kv = tiny.tokens(64), tiny.kv(64)
    store.put(tokens, kv)
    store.flush()
    assert store.lookup(tokens).num_tokens == 64
    tier = store.tiers[0]
    server.restart()  # no persistence: the data is gone, pooled connections are dead
    assert store.lookup(tokens).num_tokens == 0  # a clean miss
    assert tier.load(store.chunk_ids(tokens)[0], tiny.spec()).status is Status.MISS
    with pytest.raises(KeyError):
        store.get(tokens)
    store.put(tokens, kv)  # writes succeed again
    store.flush()
    assert store.lookup(tokens).num_tokens == 64
    bits_equal(store.get(tokens), kv)
    snap = tier.metrics.snapshot()
    assert snap.failed_writes == snap.failed_reads == snap.timeouts == 0 and snap.written_chunks == 8


def test_server_killed_mid_run_costs_misses_not_stalls(redis_server, make_store, tiny, bits_equal):
    server = redis_server()
    store = make_store(pool_url=server.url, host_bytes=0, redis_timeout_s=0.5)
    tier = store.tiers[0]
    tokens, kv = tiny.tokens(64), tiny.kv(64)
    store.put(tokens, kv)
    store.flush()
    server.stop(signal.SIGKILL)
    t0 = time.monotonic()
    assert store.lookup(tokens).num_tokens == 0
    assert tier.load(store.chunk_ids(tokens)[0], tiny.spec()).status is Status.ERROR
    with pytest.raises(KeyError):
        store.get(tokens)
    other_tokens, other_kv = tiny.tokens(160, seed=1), tiny.kv(160, seed=1)
    assert store.put(other_tokens, other_kv).dropped_writes == 0
    store.flush()
    assert time.monotonic() - t0 < 1.0  # refused at once, then backing off: no timeout per chunk
    snap = tier.metrics.snapshot()
    assert snap.failed_writes == 10 and snap.failed_reads >= 2
    # Back on the same port (empty): the tier reconnects by itself once its back-off ends.
    server.start()
    deadline = time.monotonic() + 3
    while tier.store(tiny.chunks(1, seed=2)[0], tiny.spec()).status is not Status.WRITTEN:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    store.put(other_tokens, other_kv)
    store.flush()
    bits_equal(store.get(other_tokens), other_kv)


def test_slow_server_times_out_within_the_setting(redis_server, open_tier, tiny):
    server = redis_server()
    tier = open_tier(server.url, timeout_s=0.3)
    chunks = tiny.chunks(4)
    for c in chunks:
        tier.store(c, tiny.spec())
    ids = [c.id for c in chunks]
    server.pause()  # accepts nothing, answers nothing: a hung server
    try:
        t0 = time.monotonic()
        assert tier.lookup(ids) == 0
        assert tier.load(ids[0], tiny.spec()).status is Status.ERROR  # backing off: no wait
        assert all(tier.store(c, tiny.spec()).status is Status.FAILED for c in tiny.chunks(3, seed=1))
        assert time.monotonic() - t0 < 0.3 + 0.3
        snap = tier.metrics.snapshot()
        assert (snap.timeouts, snap.failed_reads, snap.failed_writes) == (1, 1, 3)
    finally:
        server.resume()
    time.sleep(0.3)  # the first back-off period
    assert tier.lookup(ids) == 4
    assert tier.load(ids[3], tiny.spec()).ok


def test_auth(redis_server, make_store, tiny, bits_equal):
    server = redis_server("--requirepass", "s3cret", password="s3cret")
    host_port = f"127.0.0.1:{server.port}"
    with pytest.raises(TierUnavailableError, match="needs a password"):
        make_store(pool_url=f"redis://{host_port}")
    with pytest.raises(TierUnavailableError, match="rejected the credentials") as err:
        make_store(pool_url=f"redis://:wrong@{host_port}")
    assert "wrong" not in str(err.value)  # never echo a password
    tokens, kv = tiny.tokens(32), tiny.kv(32)
    in_url = make_store(pool_url=f"redis://default:s3cret@{host_port}/0", host_bytes=0)
    in_url.put(tokens, kv)
    in_url.flush()
    in_setting = make_store(pool_url=f"redis://{host_port}", redis_password="s3cret", host_bytes=0)
    bits_equal(in_setting.get(tokens), kv)


def test_tls_with_ssl_options_passed_through(redis_server, make_store, tiny, bits_equal, tmp_path):
    if subprocess.run(["sh", "-c", "command -v openssl"], capture_output=True).returncode:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    cert = tmp_path / "server.pem"  # self-signed for 127.0.0.1: its own CA
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(cert.with_suffix(".key")), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    server = redis_server(tls_cert=cert)
    url = f"rediss://127.0.0.1:{server.port}/0"
    with pytest.raises(TierUnavailableError, match="TLS certificate not trusted"):
        make_store(pool_url=url)
    store = make_store(pool_url=url, host_bytes=0, redis_options={"ssl_ca_certs": str(cert)})
    tokens, kv = tiny.tokens(48), tiny.kv(48)
    store.put(tokens, kv)
    store.flush()
    bits_equal(store.get(tokens), kv)  # the zero-copy read path over TLS
    assert store.metrics_snapshot()["tiers"]["redis"]["bytes_read"] == 3 * FILE


def test_out_of_memory_writes_fail_counted(redis_server, open_tier, tiny, caplog):
    server = redis_server("--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
    with caplog.at_level("WARNING"):
        tier = open_tier(server.url)
    assert "noeviction" in caplog.text
    spec = tiny.spec()
    chunks = tiny.chunks(40)
    results = [tier.store(c, spec) for c in chunks]
    failed = [r for r in results if r.status is Status.FAILED]
    assert failed and all("OutOfMemoryError" in r.error and "maxmemory" in r.error for r in failed)
    written = sum(r.status is Status.WRITTEN for r in results)
    assert tier.metrics.snapshot().failed_writes == len(failed) == 40 - written
    assert tier.lookup([c.id for c in chunks]) == results.index(failed[0])
    assert results[-1].status is Status.FAILED
    server.admin().config_set("maxmemory", 0)  # OOM is no connection fault: no back-off
    assert tier.store(chunks[-1], spec).status is Status.WRITTEN


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_chunk"])
def test_corrupt_value_is_a_counted_miss_and_deleted(redis_server, open_tier, make_store, tiny, damage):
    server = redis_server()
    tier = open_tier(server.url)
    spec = tiny.spec()
    chunks = tiny.chunks(3)
    for c in chunks:
        tier.store(c, spec)
    admin = server.admin()
    key = tier.key(chunks[1].id)
    value = bytearray(admin.get(key))
    if damage == "flip":
        value[PAYLOAD_OFFSET + 100] ^= 0x40
    elif damage == "truncate":
        value = value[:FILE - 4096]
    else:
        value = bytearray(admin.get(tier.key(chunks[2].id)))
    admin.set(key, bytes(value))
    got = tier.load(chunks[1].id, spec)
    assert got.status is Status.CORRUPT and got.chunk is None
    assert tier.metrics.snapshot().corrupt_chunks == 1
    assert admin.exists(key) == 0  # deleted: the next lookup stops before it
    assert tier.lookup([c.id for c in chunks]) == 1
    assert tier.store(chunks[1], spec).status is Status.WRITTEN  # and it can be written anew
    assert tier.load(chunks[1].id, spec).ok


def test_read_paths_agree_and_error_replies_are_counted(redis_server, open_tier, tiny, bits_equal):
    server = redis_server()
    tier = open_tier(server.url)
    spec = tiny.spec()
    chunk, other = tiny.chunks(2)
    tier.store(chunk, spec)
    bits_equal(tier.load(chunk.id, spec).chunk.data, chunk.data)  # received straight into the buffer
    tier._fast_get = False
    bits_equal(tier.load(chunk.id, spec).chunk.data, chunk.data)  # through redis-py's parser
    tier._fast_get = True
    server.admin().rpush(tier.key(other.id), b"not a chunk")  # WRONGTYPE for GET
    got = tier.load(other.id, spec)
    assert got.status is Status.ERROR and "WRONGTYPE" in got.error
    assert tier.metrics.snapshot().failed_reads == 1
    assert tier.load(chunk.id, spec).ok  # the connection survived the error reply; no back-off


def test_corrupt_value_through_the_store(redis_server, make_store, tiny):
    server = redis_server()
    store = make_store(pool_url=server.url, host_bytes=0)
    tokens, kv = tiny.tokens(48), tiny.kv(48)
    store.put(tokens, kv)
    store.flush()
    key = store.tiers[0].key(store.chunk_ids(tokens)[2])
    server.admin().setrange(key, PAYLOAD_OFFSET, b"\xff" * 8)
    with pytest.raises(KeyError):
        store.get(tokens)  # never wrong bytes
    assert store.lookup(tokens).num_tokens == 32
    assert store.metrics_snapshot()["tiers"]["redis"]["corrupt_chunks"] == 1


def test_cluster_mode(redis_server, make_store, tiny, bits_equal, monkeypatch):
    servers = [redis_server("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
               for _ in range(3)]
    subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in servers),
                    "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=30)
    deadline = time.monotonic() + 10
    while not all(s.admin().cluster("info")["cluster_state"] == "ok" for s in servers):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    store = make_store(pool_url=servers[0].url, redis_cluster=True, host_bytes=0)
    tokens, kv = tiny.tokens(16 * 12), tiny.kv(16 * 12)
    store.put(tokens[:16 * 9], kv[:, :, :16 * 9])
    store.flush()
    assert all(s.admin().dbsize() > 0 for s in servers)  # chunks spread over every node
    assert store.lookup(tokens).num_tokens == 16 * 9  # (also warms the slot map and connections)
    trips = RoundTrips(monkeypatch)
    assert store.tiers[0].lookup(store.chunk_ids(tokens)) == 9
    assert trips.sends == 3  # one pipelined batch per node, sent together
    monkeypatch.undo()
    bits_equal(store.get(tokens[:16 * 9]), kv[:, :, :16 * 9])
    snap = store.metrics_snapshot()["tiers"]["redis"]
    assert snap["failed_reads"] == snap["failed_writes"] == snap["corrupt_chunks"] == 0


def test_probe_reports_bandwidth_and_cleans_up(redis_server, capsys):
    from kvtier.cli.main import main

    server = redis_server()
    rc = main(["probe", server.url, "--json", "--total", "16KiB", "--threads", "2", "--repeats", "1",
               "--chunk-tokens", "16", "--layers", "2", "--kv-heads", "2", "--head-dim", "8",
               "--session-chunks", "4"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["file_bytes"] == FILE and out["keys"] == 8 and out["total_bytes"] == 8 * FILE
    for k in ("serial_gbps", "parallel_gbps", "best_raw_gbps", "kvtier_read_gbps", "write_gbps"):
        assert out[k] > 0
    assert out["best_raw_gbps"] == max(out["serial_gbps"], out["parallel_gbps"])
    assert server.admin().dbsize() == 0  # scratch keys removed


def test_probe_of_unreachable_server_is_a_clear_error(capsys):
    from kvtier.cli.main import main

    rc = main(["probe", f"redis://127.0.0.1:{_free_port()}", "--json", "--total", "64KiB",
               "--chunk-tokens", "16", "--layers", "2", "--kv-heads", "2", "--head-dim", "8"])
    assert rc == 2
    assert "kept 0 of" in json.loads(capsys.readouterr().out)["error"]


def test_bits_survive_every_dtype_byte(redis_server, open_tier, tiny, bits_equal):
    """Values are binary: CR/LF and every byte value inside a payload round-trip unchanged."""
    server = redis_server()
    tier = open_tier(server.url)
    chunk = tiny.chunks(1)[0]
    raw = torch.arange(tiny.payload_bytes, dtype=torch.int32).remainder(256).to(torch.uint8)
    data = raw.view(tiny.layout.dtype).view(chunk.data.shape)
    tier.store(Chunk(chunk.id, data), tiny.spec())
    bits_equal(tier.load(chunk.id, tiny.spec()).chunk.data, data)
