"""What a ``pool_url`` names, parsed: an fs pool's directory (``fs://PATH`` or a bare path) or a
Redis / Valkey server (``redis[s]://``, ``valkey[s]://``); and a URL made safe to log.

A leaf module (standard library only), so that ``config`` validates a URL when it is given and
``tiers.opening`` picks the tier it names, without ``config`` importing the tiers. The old names
(``tiers.pool.parse_pool_url``, ``tiers.redis.parse_redis_url`` ...) re-export these.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def parse_pool_url(url: str) -> str:
    """The absolute directory a pool URL names: ``fs:///abs/path`` or a bare ``/abs/path``.

    LMCache's shape ``fs://localhost:PORT/abs/path`` means ``/abs/path`` and is read so. Anything
    that would name a path relative to the working directory (``fs://mnt/pool``, one slash
    short; ``pool``) or a remote server (``fs://nas:0/pool``, ``nfs://...``) is a ValueError that
    says what to write: a relative pool is private to one working directory, not shared.
    """
    if url.startswith("fs://"):
        rest = url[len("fs://"):]
        if rest and not rest.startswith("/"):
            host, slash, tail = rest.partition("/")
            if slash and (host.rsplit(":", 1)[0] if ":" in host else host).lower() in _LOCAL_HOSTS:
                rest = "/" + tail  # LMCache: fs://localhost:0/mnt/pool is /mnt/pool
            elif slash and ":" in host:
                raise ValueError(f"pool_url {url!r} names the server {host.rsplit(':', 1)[0]!r}; kvtier reads a "
                                 f"mounted directory: mount the share and give fs:///its/mount/point")
            else:
                raise ValueError(f"pool_url {url!r}: fs:// takes an absolute path after its two slashes "
                                 f"(fs:///{rest}); {rest!r} would be relative to the working directory")
        path = rest
    elif "://" in url:
        scheme = url.split("://", 1)[0]
        raise ValueError(f"pool_url scheme {scheme!r} is not supported; use fs:///path/to/pool (a mounted "
                         "directory, NFS included) or redis://host:6379/0 (also rediss://, valkey://)")
    else:
        path = url
    if not path:
        raise ValueError("pool_url has no path; use fs:///path/to/pool")
    if not path.startswith("/"):
        raise ValueError(f"pool_url {url!r}: a relative path; give an absolute one such as fs:///mnt/pool")
    return path


REDIS_SCHEMES = {"redis": False, "rediss": True, "valkey": False, "valkeys": True}
"""URL scheme -> TLS on?"""


def is_redis_url(url: str) -> bool:
    return "://" in url and url.split("://", 1)[0].lower() in REDIS_SCHEMES


@dataclass(frozen=True)
class RedisURL:
    host: str
    port: int
    db: int
    username: str | None
    password: str | None
    tls: bool
    scheme: str

    def redacted(self) -> str:
        """The URL with its password replaced by ``***`` (for logs and reports)."""
        user = self.username or ""
        auth = f"{user}:***@" if self.password is not None else (f"{user}@" if user else "")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{auth}{host}:{self.port}/{self.db}"


def parse_redis_url(url: str) -> RedisURL:
    """``redis[s]://[[user]:password@]host[:port][/db]`` (also ``valkey[s]://``); ValueError
    naming ``pool_url`` when malformed. Options go in settings, not in a query string."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in REDIS_SCHEMES:
        raise ValueError(f"pool_url: scheme {scheme!r} is not one of {', '.join(REDIS_SCHEMES)}")
    where = url.split("@", 1)[-1] if "@" in url else url  # never echo a password
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"pool_url: bad port in {where!r}; use redis://host:6379/0") from None
    if not parts.hostname:
        raise ValueError(f"pool_url: no host in {where!r}; use redis://host:6379/0")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"pool_url: database {path!r} is not a number; use redis://host:6379/0")
    if parts.query or parts.fragment:
        raise ValueError("pool_url: query options are not read; give TLS and connection options in "
                         "the redis_options setting (e.g. {ssl_ca_certs: /path/ca.pem})")
    username = urllib.parse.unquote(parts.username) if parts.username else None
    password = urllib.parse.unquote(parts.password) if parts.password is not None else None
    return RedisURL(parts.hostname, port, int(path or 0), username, password, REDIS_SCHEMES[scheme], scheme)


def redact_url(url: str) -> str:
    """``url`` with the password of its user info replaced by ``***`` (``redis://u:***@host``)."""
    return re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://[^:/@]*):[^@/]*@", r"\1:***@", url)
