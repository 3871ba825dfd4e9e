"""``kvtier doctor POOL``: what an instance with a given config would hit in a pool, and why not.

An instance finds only chunks of its own namespace (``keys.Namespace``: model and weights,
dtype, KV layout, chunk size, tensor-parallel size where shards are per rank, tenant, format
version). A mismatch is a 0% hit rate that is correct but silent; the doctor names the field.
It compares the namespaces described in the pool (``ROOT/namespaces/*.json``, and the headers
of a sample of chunk files, which say how many chunks each namespace has) with what the
config states (any subset of the fields: the doctor compares only what it is told), and checks
what else decides whether chunks are read: permissions, whether ``flock`` works, clock skew
between this machine and the filesystem's mtimes (the LRU clock and retention), the budget
and the share of retained chunks.

It writes nothing but one temp file (removed) and takes ``.lock`` for an instant; it reads
4 KiB headers of at most ``sample_files`` chunk files from randomly chosen shard directories,
so it costs the same on a pool of millions of files.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import re
import stat
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from blake3 import blake3

from kvtier.admin import _open_regular, _read_header_and_close, open_existing
from kvtier.fileio import TMP_SUFFIX
from kvtier.format import ChunkFault
from kvtier.identity import content_digest, has_weights
from kvtier.keys import FORMAT_VERSION
from kvtier.layout import DTYPES_BY_CODE
from kvtier.tiers.files import NAMESPACE_MAX_BYTES
from kvtier.tiers.ledger import read_usage
from kvtier.tiers.listing import described_namespaces

SKEW_WARN_S = 5.0
UNREADABLE = "unreadable"  # sampled files this user may not read (their namespace is unknown)
SHARD_DIRS = 256 * 256
# kvtier.integrations.vllm.config.kv_format: ...-bs{block}-{cache dtype}-{page dtype}[-q{mode}]-{Spec}-page{n}[-tp{n}]
WEIGHTS_FIELDS = ("weights_digest", "model_digest")
"""Fields that differ when only the weights do (compared only where the pool records them)."""
_VLLM_FORMAT = re.compile(r"^vllm-(?P<device>[^-]+)-.*-(?P<layout>[A-Z]{4,6}|unresolved)-bs(?P<block>\d+)"
                          r"-(?P<cache_dtype>[^-]+)-(?P<dtype>[^-]+?)(?:-q[^-]+)?-(?P<spec>\w+)-page(?P<page>\d+)"
                          r"(?:-tp(?P<tp>\d+))?$")


@dataclass
class Finding:
    check: str
    status: str  # "ok", "warn" (hits happen, something else is wrong) or "fail" (no hits)
    detail: str


@dataclass
class NamespaceReport:
    digest: str
    fields: dict[str, Any]
    chunks_seen: int = 0
    bytes_seen: int = 0
    differs: dict[str, list[Any]] = field(default_factory=dict)
    """field -> [in the pool, in the config], for each field the config states and this namespace differs in."""


@dataclass
class DoctorReport:
    path: str
    would_hit: bool = False
    stated: dict[str, Any] = field(default_factory=dict)
    namespaces: list[NamespaceReport] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    sampled_files: int = 0
    sampled_dirs: int = 0
    estimated_bytes: int = 0
    """The pool's bytes as the sample suggests (exact when ``complete_scan``)."""
    accounted_bytes: int | None = None
    """The pool's bytes as its instances account them (base plus ledgers); None before the first count."""
    complete_scan: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def stated_fields(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The namespace fields a config (kvtier settings, YAML keys or ``doctor`` flags) states, by
    the names the report compares: model, chunk_tokens, dtype, tensor_parallel_size, tenant,
    layout fields, kv_format."""
    s = dict(settings)
    out: dict[str, Any] = {}
    model = s.get("model_id") or s.get("model") or s.get("model_name")
    if model:
        out["model"] = str(model)
    chunk = s.get("chunk_tokens", s.get("chunk_size"))
    if chunk is not None:
        out["chunk_tokens"] = int(chunk)
    if s.get("dtype"):
        out["dtype"] = str(s["dtype"]).removeprefix("torch.")
    tp = s.get("tensor_parallel_size", s.get("world_size"))
    if tp is not None:
        out["tensor_parallel_size"] = int(tp)
    if s.get("tenant_salt"):
        out["tenant"] = blake3(str(s["tenant_salt"]).encode()).hexdigest()[:16]
    for key in ("num_layers", "num_kv_heads", "head_dim", "kv_format", "model_digest"):
        if s.get(key) is not None:
            out[key] = s[key]
    if model and os.path.isdir(str(model)) and has_weights(str(model)):
        out["weights_digest"] = content_digest(str(model))
    return out


def namespace_fields(info: Mapping[str, Any]) -> dict[str, Any]:
    """A described namespace (``Namespace.describe()``) in the report's field names."""
    layout = info.get("layout") if isinstance(info.get("layout"), Mapping) else {}
    assert isinstance(layout, Mapping)
    fmt = str(info.get("kv_format", "kvtier"))
    out: dict[str, Any] = {"model": info.get("model_id"), "chunk_tokens": info.get("chunk_tokens"),
                           "tenant": info.get("tenant", ""), "kv_format": fmt,
                           "format_version": info.get("format_version"), "model_digest": info.get("model_digest", ""),
                           "weights_digest": info.get("weights_digest", "")}
    engine = _VLLM_FORMAT.match(fmt)
    if engine is None:  # kvtier's own layout: the KV shape is the model's
        out.update(dtype=layout.get("dtype"), num_layers=layout.get("num_layers"),
                   num_kv_heads=layout.get("num_kv_heads"), head_dim=layout.get("head_dim"),
                   tensor_parallel_size=info.get("world_size"))
    else:  # an engine's pages: the dtype and the TP split are in the format
        cache = engine["cache_dtype"]
        out.update(dtype=engine["dtype"] if cache == "auto" else cache, num_layers=layout.get("num_layers"),
                   block_size=int(engine["block"]), kv_layout=engine["layout"],
                   tensor_parallel_size=int(engine["tp"]) if engine["tp"] else "any (head shards)")
    return out


def _differs(pool: Mapping[str, Any], stated: Mapping[str, Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for name, want in stated.items():
        have = pool.get(name)
        if name in WEIGHTS_FIELDS and not have:
            continue  # described before kvtier recorded it: unknown, not different
        if name == "tensor_parallel_size" and have == "any (head shards)":
            continue  # head shards are read at any TP size
        if name == "dtype" and have is not None and str(have).startswith(f"{want}_"):
            continue  # e.g. "fp8" stated, "fp8_e4m3" cache
        if have != want:
            out[name] = [have, want]
    if pool.get("format_version") != FORMAT_VERSION:
        out["format_version"] = [pool.get("format_version"), FORMAT_VERSION]
    return out


def diagnose(path: str | os.PathLike[str], settings: Mapping[str, Any] | None = None, *,
             pool_bytes: int | None = None, sample_files: int = 2000, seed: int | None = None) -> DoctorReport:
    """Everything the module docstring says, as a report; ``would_hit`` when a namespace in the
    pool matches every stated field, chunks of it were seen, and they can be read."""
    files = open_existing(path)
    root = files.root
    report = DoctorReport(str(root), stated=stated_fields(settings or {}))
    described = described_namespaces(files.root, NAMESPACE_MAX_BYTES)
    seen, dirs, complete = _sample(root, sample_files, random.Random(seed))
    report.sampled_dirs, report.complete_scan = dirs, complete
    report.sampled_files = sum(n for n, _, _ in seen.values())
    sampled_bytes = sum(b for _, b, _ in seen.values())
    report.estimated_bytes = sampled_bytes if complete or not dirs else int(sampled_bytes * SHARD_DIRS / dirs)
    for digest in sorted(set(described) | {d for d in seen if d not in ("?", UNREADABLE)}):
        n, nbytes, _ = seen.get(digest, (0, 0, 0))
        fields = namespace_fields(described.get(digest, {}))
        report.namespaces.append(NamespaceReport(digest, fields, n, nbytes, _differs(fields, report.stated)))
    matching = [ns for ns in report.namespaces if not ns.differs]
    if not report.stated:
        report.findings.append(Finding("namespace", "warn", "no config given (--config / --model ...): every "
                                       "namespace is listed, none is compared"))
    elif not matching:
        closest = min(report.namespaces, key=lambda ns: len(ns.differs), default=None)
        if closest is not None and set(closest.differs) <= set(WEIGHTS_FIELDS):
            detail = (f"namespace {closest.digest[:16]} ({closest.chunks_seen} chunks seen) matches the config in "
                      "everything but the weights: it holds KV of other weights served under this model name (a new "
                      "checkpoint behind the same path, another download); an engine with these weights would not "
                      "hit it")
        else:
            detail = "no namespace in the pool matches the config" + (
                "" if closest is None else f"; the closest ({closest.digest[:16]}, {closest.chunks_seen} chunks "
                "seen) differs in " + ", ".join(f"{k} (pool {v[0]!r}, config {v[1]!r})"
                                                for k, v in closest.differs.items()))
        report.findings.append(Finding("namespace", "fail", detail))
    else:
        best = max(matching, key=lambda ns: ns.chunks_seen)
        where = "in the whole pool" if complete else f"in a sample of {dirs} shard directories"
        status = "ok" if best.chunks_seen else "fail"
        report.findings.append(Finding("namespace", status, f"namespace {best.digest[:16]} matches the config; "
                                       f"{best.chunks_seen} of its chunks seen {where}"))
    invalid = seen.get("?", (0, 0, 0))[0]
    if invalid:
        report.findings.append(Finding("headers", "warn", f"{invalid} sampled files have no valid chunk header "
                                       "(run kvtier pool verify)"))
    report.findings += _permissions(root, seen.get(UNREADABLE, (0, 0, 0))[0], report.sampled_files)
    report.findings.append(_locking(root))
    report.findings.append(_clock(root))
    retained = sum(r for _, _, r in seen.values())
    if sampled_bytes:
        share = retained / sampled_bytes
        report.findings.append(Finding("retention", "warn" if share > 0.5 else "ok",
                                       f"{share:.0%} of the sampled bytes are retained (mtime in the future): "
                                       "they are evicted only after every unretained chunk"))
    accounted = read_usage(root).total  # the instances' own accounting (tiers/ledger.py), when anchored
    report.accounted_bytes = accounted
    if pool_bytes is not None:
        size = accounted if accounted is not None else report.estimated_bytes
        how = "as the instances account it" if accounted is not None else \
            "counted" if complete else "estimated from the sample"
        over = size > pool_bytes
        report.findings.append(Finding("budget", "warn" if over else "ok",
                                       f"{size / 2**30:.2f} GiB in the pool ({how}), budget "
                                       f"{pool_bytes / 2**30:.2f} GiB" + (": over it (evictions run; kvtier pool "
                                                                          "gc enforces it exactly)" if over else "")))
    report.would_hit = bool(report.stated) and all(f.status != "fail" for f in report.findings)
    return report


def _sample(root: Path, max_files: int, rng: random.Random) -> tuple[dict[str, tuple[int, int, int]], int, bool]:
    """Per namespace digest (``"?"``: no valid header; ``UNREADABLE``: this user may not read it)
    (files, bytes, retained bytes),
    over shard directories visited in random order until ``max_files`` chunk files were read;
    the number of directories visited, and whether that was all of them."""
    now = time.time()
    seen: dict[str, list[int]] = {}
    tops = sorted(e.name for e in _scandir(root) if _is_shard(e))
    rng.shuffle(tops)
    dirs, files = 0, 0
    subs: list[tuple[str, str]] = []
    for top in tops:
        subs += [(top, e.name) for e in _scandir(root / top) if _is_shard(e)]
    rng.shuffle(subs)
    for top, sub in subs:
        if files >= max_files:
            return _freeze(seen), dirs, False
        dirs += 1
        for entry in _scandir(root / top / sub):
            if not entry.name.endswith(".kvt") or entry.name.endswith(TMP_SUFFIX):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            files += 1
            if not os.access(entry.path, os.R_OK):
                row = seen.setdefault(UNREADABLE, [0, 0, 0])
                row[0], row[1] = row[0] + 1, row[1] + st.st_size
                continue
            opened = _open_regular(Path(entry.path))
            header = opened if isinstance(opened, ChunkFault) else _read_header_and_close(opened)
            digest = "?" if isinstance(header, ChunkFault) or header.dtype_code not in DTYPES_BY_CODE \
                else header.namespace.hex()
            row = seen.setdefault(digest, [0, 0, 0])
            row[0] += 1
            row[1] += st.st_size
            row[2] += st.st_size if st.st_mtime > now + SKEW_WARN_S else 0
    return _freeze(seen), dirs, True


def _freeze(seen: dict[str, list[int]]) -> dict[str, tuple[int, int, int]]:
    return {k: (v[0], v[1], v[2]) for k, v in seen.items()}


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(path))
    except OSError:
        return []


def _is_shard(entry: os.DirEntry[str]) -> bool:
    return len(entry.name) == 2 and entry.is_dir(follow_symlinks=False)


def _permissions(root: Path, unreadable: int, sampled: int) -> list[Finding]:
    out: list[Finding] = []
    if not os.access(root, os.R_OK | os.X_OK):
        out.append(Finding("permissions", "fail", f"{root} cannot be listed by this user (uid {os.geteuid()})"))
        return out
    mode = stat.S_IMODE(os.stat(root).st_mode)
    if not os.access(root, os.W_OK):
        out.append(Finding("permissions", "warn", f"{root} is not writable by this user: it reads but never saves"))
    if unreadable:
        out.append(Finding("permissions", "fail", f"{unreadable} of {sampled} sampled chunk files are not readable "
                           f"by this user (uid {os.geteuid()}): owner-only files of another user; run every instance "
                           "as one user, or share a group with group_access: true"))
    elif not out:
        group = " (group pool: setgid)" if mode & stat.S_ISGID else ""
        out.append(Finding("permissions", "ok", f"{root} mode {oct(mode)}{group}: readable and writable"))
    if mode & 0o007:
        out.append(Finding("permissions", "warn", f"{root} mode {oct(mode)}: other users can reach the pool"))
    return out


def _locking(root: Path) -> Finding:
    lock = root / ".lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return Finding("locking", "ok", "no .lock yet (an instance creates it)")
        return Finding("locking", "warn", f"cannot open {lock}: {exc.strerror}; the budget is kept without the lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return Finding("locking", "ok", "flock works on .lock")
    except BlockingIOError:
        return Finding("locking", "ok", "flock works on .lock (held by an instance right now)")
    except OSError as exc:
        return Finding("locking", "warn", f"flock on {lock} fails ({errno.errorcode.get(exc.errno or 0, exc)}): "
                       "instances keep the budget without the lock and may overshoot it (NFS: run lockd)")
    finally:
        os.close(fd)


def _clock(root: Path) -> Finding:
    probe = root / f".doctor.{os.getpid()}{TMP_SUFFIX}"
    try:
        before = time.time()
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.write(fd, b"x")
        mtime = os.fstat(fd).st_mtime
        os.close(fd)
        after = time.time()
    except OSError as exc:
        return Finding("clock", "warn", f"cannot write a probe file to compare clocks: {exc.strerror}")
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    skew = 0.0 if before - 1 <= mtime <= after + 1 else mtime - (before + after) / 2
    status = "warn" if abs(skew) > SKEW_WARN_S else "ok"
    return Finding("clock", status, f"the filesystem's mtime is {skew:+.1f} s from this machine's clock"
                   + (": LRU order and retention across instances follow mtimes, so skewed clocks evict the "
                      "wrong chunks first (run NTP)" if status == "warn" else ""))
