"""Redis / Valkey remote tier (``redis://``, ``rediss://``, ``valkey://``, ``valkeys://``).

Takes the shared pool's role behind host DRAM and local disk. Contract:

* A value is exactly the bytes of a chunk file (``kvtier.format``: 4096-byte header, payload,
  padding), stored under ``<prefix><key hex>`` (default prefix ``kvtier:v1:``). Every read is
  validated against the reader's ChunkSpec and chunk id, like the ``fs://`` pool; a value that
  fails is deleted and counted (``corrupt_chunks``), never returned.
* ``lookup`` costs one round trip whatever the number of ids: one pipeline (no MULTI) of
  ``EXISTS`` per key, counted up to the first miss. In cluster mode the pipeline is split by
  node, one batch per node sent together (redis-py's ClusterPipeline), so keys of any slot work.
* ``store`` is ``EXISTS`` then ``SET NX`` (``PX`` when ``ttl_s`` is set): the check saves
  sending a value another instance already wrote; NX makes concurrent writers of one chunk
  harmless (content-addressed keys: both would write the same bytes).
* ``evict`` does nothing and returns 0: the server's ``maxmemory`` with ``maxmemory-policy
  allkeys-lru`` (or ``volatile-lru`` with ``ttl_s``) evicts, as it must for a budget shared by
  every instance; a client-side LRU would need a server-side index and a scan per eviction.
* Faults are results, never exceptions: server down, restarted, slow or ``OOM command not
  allowed`` count ``failed_reads`` / ``failed_writes`` / ``timeouts`` and read as a miss.
  Sockets time out after ``timeout_s`` (connect and each read), redis-py retries are off, so
  one call never waits longer than that. After a connection error or timeout the tier backs
  off (0.25 s, doubling to 5 s while failures go on; no network calls meanwhile: lookups
  return 0, loads and stores fail at once and count), so a dead server costs one timeout per
  back-off period, not one per chunk. Connections are pooled and re-made by themselves.
* Opening raises TierUnavailableError for a missing or rejected password, an untrusted TLS
  certificate or a missing redis-py; an unreachable server only logs a warning (the tier
  starts backing off and connects when the server comes).

redis-py is imported only when a tier is opened: ``import kvtier`` never needs it.

Over 400 lines on purpose: the tier with its options (cluster, TLS, auth) and its zero-copy
read; they change together. Its URL is parsed in ``kvtier.urls`` (config validates it too).
"""

from __future__ import annotations

import builtins
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvtier.errors import TierUnavailableError
from kvtier.format import PAYLOAD_OFFSET, ChunkError, ChunkFault, ChunkSpec
from kvtier.keys import ChunkId
from kvtier.layout import DTYPES_BY_CODE
from kvtier.metrics import TierMetrics
from kvtier.tiers.base import Chunk, LoadResult, Status, StoreResult, TierBase, aligned_buffer
from kvtier.urls import REDIS_SCHEMES, RedisURL, is_redis_url, parse_redis_url

log = logging.getLogger(__name__)
__all__ = ["REDIS_SCHEMES", "RedisTier", "RedisURL", "client_kwargs", "is_redis_url", "parse_redis_url"]

DEFAULT_PREFIX = "kvtier:v1:"
BACKOFF_MIN_S = 0.25
BACKOFF_MAX_S = 5.0


def client_kwargs(url: RedisURL, *, timeout_s: float, username: str | None = None,
                  password: str | None = None, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """redis-py keyword arguments: settings win over the URL, ``options`` over both."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw: dict[str, Any] = {
        "host": url.host, "port": url.port,
        "username": username if username is not None else url.username,
        "password": password if password is not None else url.password,
        "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "socket_keepalive": True,
        "retry": Retry(NoBackoff(), 0),  # our back-off replaces redis-py's retries (stalls)
    }
    if url.tls:
        kw["ssl"] = True
    kw.update(options or {})
    return kw


class _Fallback(Exception):
    """The zero-copy GET gives up on this reply; args: (value length,) when that was the reason."""


class RedisTier(TierBase):
    """Chunks as values of a Redis / Valkey server or cluster. See module docstring."""

    name = "redis"

    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX, ttl_s: float | None = None,
                 timeout_s: float = 1.0, cluster: bool = False, username: str | None = None,
                 password: str | None = None, options: Mapping[str, Any] | None = None) -> None:
        self.url = parse_redis_url(url)
        if cluster and self.url.db:
            raise ValueError("pool_url: Redis Cluster has database 0 only; drop the /db part")
        self.prefix = prefix
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.timeout_s = timeout_s
        self.cluster = cluster
        self.metrics = TierMetrics(self.name)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff_s = BACKOFF_MIN_S
        try:
            import redis  # noqa: F401
        except ImportError as exc:
            raise TierUnavailableError(
                f"pool_url {self.url.redacted()} needs redis-py: pip install 'kvtier[redis]'") from exc
        self._kwargs = client_kwargs(self.url, timeout_s=timeout_s, username=username, password=password,
                                     options=options)
        self._client: Any = None
        self._fast_get = True
        self._check_server()

    # -- protocol ---------------------------------------------------------------------------

    def lookup(self, ids: Sequence[ChunkId]) -> int:
        if not ids or (client := self._ready()) is None:
            return 0
        try:
            pipe = client.pipeline(transaction=False)
            for cid in ids:
                pipe.exists(self.key(cid))
            found = pipe.execute()
        except Exception as exc:  # any fault is a miss (see _fault)
            self._fault(exc, "lookup", read=True)
            return 0
        self._recovered()
        n = 0
        for present in found:
            if not present:
                break
            n += 1
        return n

    def load(self, chunk: ChunkId, spec: ChunkSpec, into: np.ndarray | None = None) -> LoadResult:
        if (client := self._ready()) is None:
            self.metrics.add(failed_reads=1)
            return LoadResult(Status.ERROR, error="redis unreachable; backing off")
        t0 = time.perf_counter()
        key = self.key(chunk)
        buf = aligned_buffer(spec.file_bytes) if into is None else into
        try:
            size = self.get_into(key, buf, client)
        except Exception as exc:
            status, error = self._fault(exc, "read", read=True)
            return LoadResult(status, error=error)
        self._recovered()
        if size < 0:
            self.metrics.add(read_races=1)  # evicted, expired or flushed since lookup
            return LoadResult(Status.MISS)
        try:
            if size != spec.file_bytes:
                fault = ChunkFault.TRUNCATED if size < spec.file_bytes else ChunkFault.LAYOUT
                raise ChunkError(fault, f"{size} B, expected {spec.file_bytes} B")
            spec.decode(buf.data, chunk)
        except ChunkError as exc:
            # Useless to every instance, and SET NX would never replace it: delete it.
            self._delete(key)
            self.metrics.add(corrupt_chunks=1)
            return LoadResult(Status.CORRUPT, error=str(exc))
        data = torch.from_numpy(buf[PAYLOAD_OFFSET:PAYLOAD_OFFSET + spec.payload_bytes])
        self.metrics.add(bytes_read=spec.file_bytes, read_seconds=time.perf_counter() - t0)
        data = data.view(DTYPES_BY_CODE[spec.dtype_code]).view(spec.shape)
        return LoadResult(Status.HIT, Chunk(chunk, data))

    def store(self, chunk: Chunk, spec: ChunkSpec) -> StoreResult:
        if (client := self._ready()) is None:
            self.metrics.add(failed_writes=1)
            return StoreResult(Status.FAILED, "redis unreachable; backing off")
        key = self.key(chunk.id)
        try:
            if client.exists(key):
                self._recovered()
                return StoreResult(Status.EXISTS)
            payload = chunk.payload()
            header = spec.header_for(chunk.id, payload).pack()
            pad = spec.file_bytes - PAYLOAD_OFFSET - len(payload)
            value = b"".join((header, payload, bytes(pad)))
            written = client.set(key, value, nx=True, px=self.ttl_ms)
        except Exception as exc:
            status, error = self._fault(exc, "write", read=False)
            return StoreResult(status, error)
        self._recovered()
        if not written:
            return StoreResult(Status.EXISTS)
        self.metrics.add(bytes_written=len(value), written_chunks=1)
        return StoreResult(Status.WRITTEN)

    def evict(self, target_bytes: int) -> int:
        """No-op: the server's maxmemory policy evicts (see module docstring)."""
        return 0

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a dead connection is not an error
                pass

    # -- helpers ------------------------------------------------------------------------------

    def key(self, chunk: ChunkId) -> str:
        return f"{self.prefix}{chunk.key.hex()}"

    def get_into(self, key: str, into: np.ndarray, client: Any = None) -> int:
        """``GET key`` into ``into`` when the value is exactly ``len(into)`` bytes long.

        Returns the value's length (``into`` is filled only when it matches), -1 when absent.
        Raises redis-py's exceptions or OSError. The value is received straight into ``into``
        (redis-py's parser would copy it four times); anything unusual (an error reply, a
        MOVED redirect, a changed redis-py) falls back to a plain ``client.get``.
        """
        client = self.client if client is None else client
        if self._fast_get:
            try:
                return self._get_into_fast(client, key, into.data.cast("B"))
            except _Fallback:
                pass
            except AttributeError as exc:  # redis-py internals changed: stop trying
                log.info("redis: zero-copy GET unavailable (%s); using redis-py's", exc)
                self._fast_get = False
        value = client.get(key)
        if value is None:
            return -1
        if len(value) == len(into):
            into[:] = np.frombuffer(value, dtype=np.uint8)
        return len(value)

    def _get_into_fast(self, client: Any, key: str, view: memoryview) -> int:
        if self.cluster:
            client = client.get_redis_connection(client.get_node_from_key(key))
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_command("GET", key)
            sock = conn._sock
            head = bytearray(64)
            n = 0
            while (end := head.find(b"\r\n", 0, n)) < 0:
                if n == len(head) or not (got := sock.recv_into(memoryview(head)[n:])):
                    raise _Fallback  # a long error line, or the server closed the connection
                n += got
            if head[0:1] != b"$":
                raise _Fallback  # error reply (MOVED, WRONGTYPE, ...): let redis-py parse it
            size = int(head[1:end])
            if size < 0:
                return -1
            if size != len(view):
                raise _Fallback(size)
            body = head[end + 2:n]  # the first bytes of the value (and maybe its CRLF)
            take = min(len(body), size)
            view[:take] = body[:take]
            done = take
            while done < size:
                got = sock.recv_into(view[done:])
                if not got:
                    raise ConnectionError("redis closed the connection mid-value")
                done += got
            tail = bytearray(2)
            have = len(body) - take
            tail[:have] = body[take:]
            while have < 2:
                got = sock.recv_into(memoryview(tail)[have:])
                if not got:
                    raise ConnectionError("redis closed the connection mid-value")
                have += got
            return size
        except BaseException as exc:
            conn.disconnect()  # the reply may be half read: never reuse this connection
            if isinstance(exc, _Fallback) and exc.args:
                return int(exc.args[0])  # wrong length: not this chunk, no need to read it
            raise
        finally:
            pool.release(conn)

    @property
    def client(self) -> Any:
        """The redis-py client (``redis.Redis`` or ``redis.cluster.RedisCluster``); may raise."""
        with self._lock:
            if self._client is None:
                if self.cluster:
                    from redis.cluster import RedisCluster

                    # Connects to fetch the slot map: fails while the cluster is unreachable.
                    self._client = RedisCluster(**self._kwargs)
                else:
                    import redis

                    self._client = redis.Redis(db=self.url.db, **self._kwargs)
            return self._client

    def _ready(self) -> Any:
        """The client, or None while backing off after a connection fault."""
        if time.monotonic() < self._down_until:
            return None
        try:
            return self.client
        except Exception as exc:
            self._fault(exc, "connect", read=True, count=False)
            return None

    def _recovered(self) -> None:
        if self._backoff_s > BACKOFF_MIN_S:
            with self._lock:
                self._backoff_s = BACKOFF_MIN_S
            log.info("redis %s reachable again", self.url.redacted())

    def _fault(self, exc: Exception, what: str, *, read: bool, count: bool = True) -> tuple[Status, str]:
        """Count a failed call and start backing off if the server looks unreachable."""
        from redis import exceptions as rx

        timeout = isinstance(exc, (rx.TimeoutError, builtins.TimeoutError))
        unreachable = timeout or isinstance(exc, (rx.ConnectionError, OSError, rx.RedisClusterException,
                                                  rx.ClusterError))
        if count:
            if timeout and read:
                self.metrics.add(timeouts=1)
            else:
                self.metrics.add(**{"failed_reads" if read else "failed_writes": 1})
        if unreachable:
            with self._lock:
                self._down_until = time.monotonic() + self._backoff_s
                backoff, self._backoff_s = self._backoff_s, min(BACKOFF_MAX_S, self._backoff_s * 2)
            log.warning("redis %s: %s failed (%s: %s); backing off %.2fs", self.url.redacted(), what,
                        type(exc).__name__, exc, backoff)
        else:
            log.info("redis %s: %s failed: %s", self.url.redacted(), what, exc)
        status = Status.TIMEOUT if timeout else Status.ERROR if read else Status.FAILED
        return status, f"{type(exc).__name__}: {exc}"

    def _delete(self, key: str) -> None:
        try:
            self.client.delete(key)
        except Exception as exc:
            log.info("redis %s: could not delete corrupt %s: %s", self.url.redacted(), key, exc)

    def _check_server(self) -> None:
        """PING once: a rejected password raises now; an unreachable server only warns."""
        from redis.exceptions import AuthenticationError, AuthorizationError, NoPermissionError, ResponseError

        try:
            self.client.ping()
        except (AuthenticationError, AuthorizationError, NoPermissionError, ResponseError) as exc:
            auth = not isinstance(exc, ResponseError) or isinstance(exc, NoPermissionError) or any(
                word in str(exc) for word in ("NOAUTH", "WRONGPASS"))
            if not auth:
                self._fault(exc, "ping", read=True, count=False)
                return
            self.close()
            if self._kwargs.get("password") is None:
                raise TierUnavailableError(
                    f"redis {self.url.redacted()} needs a password ({exc}): put it in pool_url "
                    "(redis://:PASSWORD@host:port) or redis_password") from exc
            raise TierUnavailableError(f"redis {self.url.redacted()} rejected the credentials ({exc}); "
                                       "check the user and password in pool_url or redis_password") from exc
        except Exception as exc:
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                self.close()
                raise TierUnavailableError(
                    f"redis {self.url.redacted()}: TLS certificate not trusted ({exc}); give the CA in "
                    "redis_options (ssl_ca_certs: /path/ca.pem)") from exc
            self._fault(exc, "connect", read=True, count=False)
            return
        try:
            conf = self.client.config_get("maxmemory*")  # (per node in a cluster: no warning then)
        except Exception:  # CONFIG is often disabled on managed servers
            return
        limit, policy = conf.get("maxmemory"), conf.get("maxmemory-policy")
        if self.ttl_ms is None and (limit == "0" or policy == "noeviction"):
            log.warning("redis %s: maxmemory %s, maxmemory-policy %s: chunks pile up until writes fail; "
                        "set maxmemory and maxmemory-policy allkeys-lru (or give redis_ttl_s)",
                        self.url.redacted(), limit, policy)
