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


def parse_pool_url(url: str) -> str:
    """``fs:///abs/path`` or ``fs://rel/path`` or a bare path -> the directory path."""
    if url.startswith("fs://"):
        path = url[len("fs://"):]
    elif "://" in url:
        scheme = url.split("://", 1)[0]
        raise ValueError(f"pool_url scheme {scheme!r} is not supported; use fs:///path/to/pool or "
                         "redis://host:6379/0 (also rediss://, valkey://)")
    else:
        path = url
    if not path:
        raise ValueError("pool_url has no path; use fs:///path/to/pool")
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
