"""A directory of chunk files: naming, crash-safe publish, validated O_DIRECT reads.

Shared by the local disk tier and the shared pool. Layout::

    ROOT/.kvtier            marker: this directory is a kvtier chunk directory
    ROOT/ab/cd/<key>.kvt    one file per chunk, named by its key (hex)
    ROOT/ab/cd/<key>.kvt.<pid>.<rand>.tmp   a write in progress (or left by a crash)

Publishing writes a uniquely named temp file in the final directory, then ``os.replace``s it
(``fileio.write_atomic``): readers see a whole chunk or nothing, and two writers of one chunk
write the same bytes (names are content addresses), so the last rename wins harmlessly. A temp
file left by a killed writer is never read (wrong suffix) and is removed by ``kvtier pool gc``.

Over 400 lines on purpose: every byte a chunk directory writes or reads goes through here
(publish, validated reads, retention's mtime), so its safety rules live in one place. Listing
the directory is ``tiers/listing.py`` and lookups' presence checks ``tiers/presence.py``; both
are reached through ``ChunkFiles``.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import fcntl
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from kvtier.codec import CodecRates
from kvtier.fileio import TMP_SUFFIX, fsync_dir, set_direct, write_atomic
from kvtier.format import ALIGN, PAYLOAD_OFFSET, ChunkError, ChunkFault, ChunkSpec, file_bytes_for
from kvtier.keys import ChunkId, ChunkKey
from kvtier.layout import DTYPES_BY_CODE
from kvtier.metrics import TierMetrics
from kvtier.threads import ThreadInit
from kvtier.tiers import listing
from kvtier.tiers.base import Chunk, LoadResult, Pages, Status, aligned_buffer
from kvtier.tiers.listing import SUFFIX, ChunkFile
from kvtier.tiers.pagecache import cache_hits_are_local, holds_whole
from kvtier.tiers.presence import Presence
from kvtier.tiers.reads import DeviceWindow, LoadEnded, NotCached, copy_in_place, fill, read_in_place

log = logging.getLogger(__name__)
__all__ = ["MARKER", "SUFFIX", "ChunkFile", "ChunkFiles"]

NAMESPACE_MAX_BYTES = 64 << 10  # a namespace description is a few hundred bytes
MARKER = ".kvtier"
_ZEROS = bytes(PAYLOAD_OFFSET)
SHARD_RACE_TRIES = 4  # publish attempts while other clients create the same shard directory

OWNER_FILE_MODE, OWNER_DIR_MODE = 0o600, 0o700
# setgid on directories: files and subdirectories created inside inherit the group.
GROUP_FILE_MODE, GROUP_DIR_MODE = 0o660, 0o2770

# Never follow a symlink planted under a chunk's name; never block opening a FIFO.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
_warned_open_roots: set[str] = set()


class ChunkFiles:
    """File operations of one chunk directory; safe to share between threads and processes.

    Everything created here is owner-only (files 0o600, directories 0o700) unless
    ``group_access``: then files are 0o660 and directories 0o2770 (setgid, so the group is
    inherited), applied with an explicit chmod because the umask may strip group bits.
    """

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True, fsync: bool = False,
                 direct_io: bool = True, group_access: bool = False) -> None:
        self.root = Path(root)
        self._root_str = os.fspath(self.root)
        self.fsync = fsync
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        self.group_access = group_access
        self._local = cache_hits_are_local(self._root_str)  # page-cache hits are memory reads (LoadResult.from_cache)
        self.file_mode = GROUP_FILE_MODE if group_access else OWNER_FILE_MODE
        self.dir_mode = GROUP_DIR_MODE if group_access else OWNER_DIR_MODE
        self._presence = Presence()
        self.lookup_stats = self._presence.stats
        """File-metadata calls made by lookups (``leading_present``)."""
        self.codec_rates = CodecRates(self._root_str)
        """This directory's read and decode rates, learnt from its reads (``kv_codec: auto``)."""
        self.device_window = DeviceWindow() if self._local else DeviceWindow(0)
        if create:
            self._ensure_root()

    def _ensure_root(self) -> None:
        from kvtier.errors import TierUnavailableError

        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.make_dir(self.root)
            except FileExistsError:
                pass  # a file in its place fails the marker write below
            self._warn_if_open_to_others()
            marker = self.root / MARKER
            if not marker.exists():
                self.write_small(marker, json.dumps({"format": 1, "kind": "kvtier-chunks"}).encode())
            probe = self.root / f".probe.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise TierUnavailableError(
                f"cannot use {self.root} as a kvtier chunk directory: {exc.strerror or exc}; "
                "create it and make it writable by this user, or point the setting elsewhere"
            ) from exc

    def _warn_if_open_to_others(self) -> None:
        """One warning per root and process when "others" have any access to it: a pool that
        any local user can list or write is a prompt leak (or a poisoning) waiting to happen."""
        mode = os.stat(self._root_str).st_mode
        if mode & 0o007 and self._root_str not in _warned_open_roots:
            _warned_open_roots.add(self._root_str)
            log.warning("kvtier directory %s has mode %s: other local users can reach it; "
                        "chmod o-rwx it (kvtier creates its files and directories owner-only, or "
                        "group-only with group_access)", self._root_str, oct(stat.S_IMODE(mode)))

    def make_dir(self, path: str | os.PathLike[str]) -> None:
        """``mkdir`` with this directory's mode; raises FileExistsError when it exists."""
        os.mkdir(path, self.dir_mode)
        if self.group_access:
            # mkdir masks the mode with the umask and ignores setgid: set it for real.
            os.chmod(path, self.dir_mode)

    def create_file(self, path: str | os.PathLike[str], flags: int) -> int:
        """``os.open(path, flags | O_CREAT | O_NOFOLLOW)`` with this directory's file mode."""
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, self.file_mode)
        if self.group_access:
            try:
                # Only the owner may chmod; a file another member created keeps its own mode.
                if os.fstat(fd).st_uid == os.geteuid():
                    os.fchmod(fd, self.file_mode)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def write_small(self, path: Path, data: bytes) -> None:
        """Replace a small metadata file (marker, ``.usage``, namespaces) atomically; its mode
        is set exactly, whatever the umask (not a hot path)."""
        write_atomic(path, data, mode=self.file_mode, exact_mode=True)

    def path_for(self, key: ChunkKey) -> Path:
        return Path(self._path_str(key))

    def _path_str(self, key: ChunkKey) -> str:
        # Plain strings on the hot path: pathlib costs microseconds per join.
        h = key.hex()
        return f"{self._root_str}/{h[:2]}/{h[2:4]}/{h}{SUFFIX}"

    def stat_size(self, key: ChunkKey) -> int | None:
        """File size, or None when the chunk is absent (or the directory is gone)."""
        try:
            return os.stat(self._path_str(key)).st_size
        except OSError:
            return None

    def parallel_lookups(self, threads: int, negative_ttl_s: float, init: ThreadInit | None = None) -> None:
        """Make ``leading_present`` keep up to ``threads`` stats in flight and remember absent
        chunks for ``negative_ttl_s`` (for a directory on a network filesystem, where each stat
        is a round trip: the shared pool). ``publish`` forgets a chunk's absence at once.
        ``init`` runs first in each of those threads (``threads.py``)."""
        self._presence.parallel(threads, negative_ttl_s, init)

    def leading_present(self, ids: Sequence[ChunkId]) -> int:
        """How many of ``ids``, from the first on, have a published file (at most one stat each;
        ``presence.Presence.leading``)."""
        return self._presence.leading(ids, self.stat_size)

    # -- write ------------------------------------------------------------------------------

    def publish(self, chunk: Chunk, spec: ChunkSpec) -> int:
        """Write ``chunk`` atomically; return bytes written, 0 if it was already there.

        Raises OSError (ENOSPC, EACCES, ...) after removing its temp file.
        """
        final = self.path_for(chunk.id.key)
        if final.exists():
            return 0
        head, payload = spec.stored(chunk.id, chunk.payload(), self.codec_rates)  # coded on the writer's thread
        size = file_bytes_for(head.payload_bytes)
        buffers: list[bytes | memoryview] = [head.pack(), payload, _ZEROS[:size - PAYLOAD_OFFSET - len(payload)]]
        for attempt in range(SHARD_RACE_TRIES):
            try:
                write_atomic(final, buffers, mode=self.file_mode, exact_mode=self.group_access, fsync=self.fsync)
                break
            except OSError as exc:
                # The first chunk of its shard (or the root is gone). Another client creating the
                # same shard directory at that moment can make mkdir ESTALE, or the create after
                # EEXIST ENOENT, on a network filesystem (GlusterFS; there also, now and then, EIO:
                # seen once in the two-client publish race test): try again, a few times. A real
                # I/O error fails the same way each time, and is raised after the last try.
                if attempt + 1 == SHARD_RACE_TRIES or not (
                        isinstance(exc, FileNotFoundError) or exc.errno in (errno.ESTALE, errno.EIO)):
                    raise
                if attempt:
                    time.sleep(0.01 * 4 ** attempt)  # 40, 160 ms: the client's cached "no such directory" expires
                self._make_shard(final.parent)
        if self.fsync:
            fsync_dir(final.parent)
        self._presence.forget(chunk.id.key)
        return size

    def _make_shard(self, shard: Path) -> None:
        """Create ``ROOT/ab/cd`` but never ROOT itself: a pool directory that vanished (an
        unmounted share, an operator's ``rm -rf``) must not be silently recreated on the
        local disk beneath it. Raises FileNotFoundError when ROOT is gone."""
        if not os.path.isdir(self._root_str):
            raise FileNotFoundError(errno.ENOENT, f"chunk directory {self._root_str} is gone")
        for d in (shard.parent, shard):
            try:
                self.make_dir(d)
            except FileExistsError:
                try:
                    os.stat(d)  # made by another client: look it up, so this client's cache learns it
                except OSError:
                    pass
            except OSError as exc:
                # Another client making the same directories (GlusterFS): mkdir is ESTALE, or
                # ENOENT while this client has not yet seen the parent it just made. publish
                # tries again a little later.
                if exc.errno not in (errno.ESTALE, errno.ENOENT):
                    raise
                return

    # -- read -------------------------------------------------------------------------------

    def read(self, cid: ChunkId, spec: ChunkSpec, into: np.ndarray | None = None) -> Chunk:
        """Read and validate one chunk into ``into`` (4096-aligned, ``spec.file_bytes`` long;
        a fresh buffer when None); the returned chunk's data is a view of that buffer.

        With ``direct_io``, a file the page cache holds whole is copied from it (a memcpy) and
        any other is read with O_DIRECT, so cold chunks bypass the cache (the host tier keeps
        the copy that matters). One open per read: the O_DIRECT flag is dropped with fcntl
        when the file turns out warm. Raises FileNotFoundError when absent, ChunkError when
        the bytes are not this chunk (``NOT_A_FILE`` for a symlink, FIFO, directory or device
        under its name: never followed, never waited on), OSError for I/O faults. Nothing is
        allocated or read before the file's size equals ``spec.file_bytes``.
        """
        chunk = self._read(self._path_str(cid.key), cid, spec, into)[0]
        assert chunk is not None  # None only for a read in place
        return chunk

    def _read(self, path: str, cid: ChunkId, spec: ChunkSpec, into: np.ndarray | None,
              pages: Pages | None = None) -> tuple[Chunk | None, float, bool]:
        """``read``, also returning the file's mtime as its open descriptor saw it and whether the
        page cache of a local filesystem served it (``LoadResult.from_cache``; False when the kernel
        cannot tell, and on a network filesystem, where the open was a round trip anyway).

        With ``pages``, an uncoded chunk lands there and is validated there: the returned chunk
        is None. A file that the page cache of a local filesystem holds whole is read straight
        into them (``read_in_place``: ``preadv``, the header into a scratch buffer first), ``into``
        untouched; any other is read whole into ``into`` first, outside the gate, then copied
        (``copy_in_place``). Only memory copies run inside the gate, so the caller's memory is
        held for milliseconds at most, never for a device's or a server's answer. (A page evicted
        between the check and the read is not waited for there: ``RWF_NOWAIT`` fails, and the
        file is read whole outside the gate, as a cold one.)
        """
        fd = self._open_read(path)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ChunkError(ChunkFault.NOT_A_FILE, f"{os.path.basename(path)}: mode {oct(st.st_mode)}")
            size = st.st_size
            coded = size != spec.file_bytes
            if coded and not (PAYLOAD_OFFSET < size < spec.file_bytes and size % ALIGN == 0):  # nor a coded one
                fault = ChunkFault.TRUNCATED if size < spec.file_bytes else ChunkFault.LAYOUT
                raise ChunkError(fault, f"{os.path.basename(path)}: {size} B, expected {spec.file_bytes} B")
            from_cache = bool(holds_whole(fd, size)) if self.direct_io or self._local else False
            direct = self._use_direct(fd, from_cache)
            if pages is not None and from_cache and self._local and not coded:
                try:
                    t0 = time.perf_counter()
                    read_in_place(fd, size, spec, cid, pages)
                    self.codec_rates.observe_read(size, time.perf_counter() - t0)
                    return None, st.st_mtime, True
                except NotCached:  # dropped from the cache since the check: read it outside the gate
                    from_cache, direct = False, self._use_direct(fd, False)
            buf = aligned_buffer(spec.file_bytes) if into is None else into
            # A coded file is read into a buffer of its own, then decoded into the payload region.
            view = aligned_buffer(size).data if coded else buf.data
            with self.device_window.hold(0 if from_cache else size):  # a page-cache hit is a memory copy
                t0 = time.perf_counter()
                fill(fd, view, direct)
                self.codec_rates.observe_read(size, time.perf_counter() - t0)
        finally:
            os.close(fd)
        if pages is not None and not coded:  # read outside the gate; only the copy runs inside
            copy_in_place(view, spec, cid, pages)
            return None, st.st_mtime, from_cache and self._local
        data = torch.from_numpy(buf[PAYLOAD_OFFSET:PAYLOAD_OFFSET + spec.payload_bytes])
        if coded:
            t0 = time.perf_counter()
            spec.decode_coded(view, cid, data)
            self.codec_rates.observe_decode(spec.payload_bytes, time.perf_counter() - t0)
        else:
            spec.decode(view, cid)
        dtype = DTYPES_BY_CODE[spec.dtype_code]
        return Chunk(cid, data.view(dtype).view(spec.shape)), st.st_mtime, from_cache and self._local

    def load(self, cid: ChunkId, spec: ChunkSpec, into: np.ndarray | None, metrics: TierMetrics,
             touch_interval_s: float, pages: Pages | None = None) -> LoadResult:
        """``read`` as a tier's load: every fault becomes a counted result, never an exception.
        With ``pages`` a warm file's payload may land there (``_read``): an ``in_place`` HIT.

        A vanished file is a miss (``read_races``); a chunk that fails validation is removed,
        so the next lookup stops before it, and counted (``corrupt_chunks``); other I/O errors
        are ``failed_reads``. A hit refreshes the file's mtime (the LRU clock).
        """
        t0 = time.perf_counter()
        path = self._path_str(cid.key)
        try:
            got, mtime, from_cache = self._read(path, cid, spec, into, pages)
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError) and exc.errno != errno.ESTALE:
                metrics.add(failed_reads=1)
                return LoadResult(Status.ERROR, error=str(exc))
            # Gone since the lookup; on a network filesystem (NFS, GlusterFS) a file another client
            # removed or replaced is ESTALE for a while (the client's cached handle), not ENOENT.
            metrics.add(read_races=1)
            return LoadResult(Status.MISS)
        except ChunkError as exc:
            if exc.fault is ChunkFault.UNKNOWN_CODEC:  # a newer kvtier's chunk: a miss, left for it
                return LoadResult(Status.MISS, error=str(exc))
            try:
                self.remove(cid.key)
            except OSError as rm_exc:
                # A directory under the name, a read-only share: still a miss, never a crash.
                log.warning("could not remove bad chunk %s (%s): %s", cid.key.hex()[:12], exc, rm_exc)
            metrics.add(corrupt_chunks=1)
            return LoadResult(Status.CORRUPT, error=str(exc))
        except LoadEnded:
            # ``pages.enter`` refused: the load is over (its request aborted, or it returned at an
            # earlier miss) and nothing was read. Not a MISS: the disk tier would forget a chunk
            # whose file is intact, and no lookup would find it again until a restart.
            return LoadResult(Status.STOPPED)
        metrics.add(bytes_read=spec.payload_bytes if got is None else got.nbytes,
                    read_seconds=time.perf_counter() - t0)
        if time.time() - mtime > touch_interval_s:  # due by the read's own fstat (most hits are not)
            _touch(path, touch_interval_s)
        return LoadResult(Status.HIT, got, from_cache=from_cache, in_place=got is None)

    def time_read(self, key: ChunkKey, max_bytes: int) -> tuple[int, float] | None:
        """Read chunk file ``key`` whole from the device and return (bytes, seconds); None when
        it is absent, not a regular file, over ``max_bytes`` or unreadable, or when only the
        page cache could be timed (it holds the file whole and O_DIRECT is off or refused: a
        memory copy says nothing of the device, and a load decision that took it for the tier's
        rate would load in the step from a slow tier). The bytes are neither validated nor kept,
        and the file is never removed or touched: this only times the device (``RateProbe``),
        and a neighbour's file is judged by the loads that use it, not here."""
        path = self._path_str(key)
        t0 = time.perf_counter()
        try:
            fd = self._open_read(path)
        except (OSError, ChunkError):
            return None
        try:
            st = os.fstat(fd)
            size = st.st_size
            if not stat.S_ISREG(st.st_mode) or not 0 < size <= max_bytes:
                return None
            direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
            if not direct and holds_whole(fd, size):
                return None
            fill(fd, aligned_buffer(size).data, direct)
        except (OSError, ChunkError):
            return None
        finally:
            os.close(fd)
        return size, time.perf_counter() - t0

    def _use_direct(self, fd: int, from_cache: bool) -> bool:
        """Whether to read ``fd`` with O_DIRECT: with ``direct_io``, unless the page cache holds the
        file whole (``from_cache``: the flag is dropped, a memory copy beats a device read)."""
        if self.direct_io and from_cache:
            set_direct(fd, False)
        return self.direct_io and not from_cache

    def _open_read(self, path: str) -> int:
        """Open a chunk for reading without following a symlink or blocking on a FIFO.

        Raises ChunkError(NOT_A_FILE) for a symlink; the caller checks the file type.
        """
        try:
            if self.direct_io:
                try:
                    return os.open(path, _READ_FLAGS | os.O_DIRECT)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                fd = os.open(path, _READ_FLAGS)
                try:
                    regular = stat.S_ISREG(os.fstat(fd).st_mode)
                except BaseException:
                    os.close(fd)
                    raise
                if regular:
                    # tmpfs and some network filesystems refuse O_DIRECT: stop asking. (A FIFO
                    # or directory refuses it too, but says nothing about the filesystem.)
                    log.info("O_DIRECT not supported under %s; using buffered reads", self.root)
                    self.direct_io = False
                return fd
            return os.open(path, _READ_FLAGS)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
                raise ChunkError(ChunkFault.NOT_A_FILE, f"{os.path.basename(path)}: a symlink") from None
            raise

    # -- namespaces ---------------------------------------------------------------------------

    def describe_namespace(self, digest: bytes, info: dict[str, object]) -> None:
        """Write ``ROOT/namespaces/<digest>.json`` once, so `pool stats` can name models."""
        path = self.root / "namespaces" / f"{digest.hex()}.json"
        if path.exists():
            return
        try:
            try:
                self.make_dir(path.parent)
            except FileExistsError:
                pass
            self.write_small(path, json.dumps(info, sort_keys=True).encode())
        except OSError:
            pass  # descriptive only

    # -- maintenance ------------------------------------------------------------------------

    def remove(self, key: ChunkKey) -> int:
        """Unlink a chunk; return the bytes freed (0 if it was already gone)."""
        path = self.path_for(key)
        try:
            size = os.lstat(path).st_size  # lstat: a symlink is removed, its target untouched
            os.unlink(path)
            return size
        except FileNotFoundError:
            return 0

    def retain(self, key: ChunkKey, until: float) -> bool:
        """Set a chunk's mtime (the LRU clock) to ``until`` unless it is already later; False when
        the chunk is gone or its times cannot be set (not its owner, or a time the filesystem
        cannot hold)."""
        path = self._path_str(key)
        try:
            if os.stat(path, follow_symlinks=False).st_mtime < until:
                os.utime(path, (until, until), follow_symlinks=False)
            return True
        except (OSError, OverflowError, ValueError):
            return False

    def scan(self) -> Iterator[ChunkFile]:
        """Every published chunk file (never temp files), shard directory by shard directory.

        Only names a chunk can have are listed: 64 lowercase hex digits + ``.kvt`` in the
        shard directory its key names (``path_for(key)``); anything else planted there is
        ignored. Sizes and mtimes are the entry's own (``lstat``): a symlink is listed with
        its own size, so a link to a huge file cannot inflate the pool's total, and reading
        it fails as NOT_A_FILE so verify and load remove it.
        """
        for shard in self.shard_dirs():
            yield from self.scan_shard(shard)

    def shard_dirs(self, pool: cf.Executor | None = None) -> list[str]:
        """This directory's shard directories ``"ab/cd"`` (``listing.shard_dirs``)."""
        return listing.shard_dirs(self._root_str, pool)

    def scan_shard(self, shard: str) -> list[ChunkFile]:
        """The published chunk files of one shard directory (``listing.scan_shard``)."""
        return listing.scan_shard(self._root_str, shard)

    def prune_shard(self, shard: str) -> bool:
        """Remove the shard directory ``"ab/cd"`` if empty (``listing.prune_shard``)."""
        return listing.prune_shard(self._root_str, shard)

    def temp_files(self) -> Iterator[tuple[Path, float]]:
        """Temp files (writes in progress or left by crashed writers) and their mtimes."""
        return listing.temp_files(self._root_str, self.shard_dirs())


def _touch(path: str, older_than_s: float) -> None:
    """Mark a chunk recently used (mtime = now: the LRU clock; mtime, not atime, which is often
    off on shared filesystems) unless it was marked in the last ``older_than_s``. The mtime is
    read again right before the update, so that a retention set meanwhile (a later mtime) is
    kept. Best effort: a file gone or read-only meanwhile stays as it is."""
    try:
        if time.time() - os.stat(path).st_mtime > older_than_s:
            os.utime(path)
    except OSError:
        pass
