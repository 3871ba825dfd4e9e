"""Hostile files (issue 5): a bad or planted pool file costs at most a miss.

Fuzzed headers, chunk images and whole files; keys as paths; file modes; symlinks and FIFOs
under chunk names; and the ``hostile files`` fault scenario at the ci scale. A few seconds.
"""

from __future__ import annotations

import logging
import os
import re
import resource
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _pool import new_pool
from kvtier import TieredStore, admin
from kvtier.config import load_settings
from kvtier.format import (
    HEADER_BYTES,
    HEADER_STRUCT_BYTES,
    MAGIC,
    PAYLOAD_OFFSET,
    ChunkError,
    ChunkFault,
    ChunkHeader,
    file_bytes_for,
    seal_header,
    unpack_header,
)
from kvtier.keys import FORMAT_VERSION, ChunkKey
from kvtier.layout import DTYPE_CODES
from kvtier.tiers.base import Status
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.files import ChunkFiles
from kvtier.tiers.pool import PoolTier

from .harness import SCALES
from .harness.hostile import KINDS, hostile_files

_fuzz = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _image(tiny: Any, seed: int = 0) -> tuple[Any, bytes]:
    """One chunk of the tiny model and the exact bytes ChunkFiles writes for it."""
    (chunk,) = tiny.chunks(1, seed=seed)
    return chunk, bytes(tiny.image(chunk))


_rechecksum = seal_header  # make the header's checksum match its (possibly mutated) fields again


mutations = st.lists(st.tuples(st.integers(0, 3 * HEADER_BYTES), st.integers(1, 255)), max_size=6)


def _mutate(image: bytes, edits: list[tuple[int, int]], length: int, rechecksum: bool) -> bytearray:
    out = bytearray(image)
    for pos, xor in edits:
        if pos < len(out):
            out[pos] ^= xor
    if rechecksum:
        _rechecksum(out)
    return out[:length] if length <= len(out) else out + bytes(length - len(out))


@contextmanager
def _reads_recorded() -> Iterator[list[tuple[int, int]]]:
    """(offset, length) of every pread/preadv in the block (kvtier.admin's reads)."""
    calls: list[tuple[int, int]] = []
    pread, preadv = os.pread, os.preadv

    def rec_pread(fd: int, n: int, offset: int) -> bytes:
        calls.append((offset, n))
        return pread(fd, n, offset)

    def rec_preadv(fd: int, buffers: list[Any], offset: int, *args: Any) -> int:
        calls.append((offset, sum(len(memoryview(b)) for b in buffers)))
        return preadv(fd, buffers, offset, *args)

    with mock.patch.object(admin.os, "pread", rec_pread), mock.patch.object(admin.os, "preadv", rec_preadv):
        yield calls


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()`` in a daemon thread: a hang fails the test instead of stalling it."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s (blocked on a FIFO?)"
    if "error" in result:
        raise result["error"]
    return result.get("value")


# -- fuzzed headers, images and files ----------------------------------------------------------


@_fuzz
@given(data=st.one_of(st.binary(max_size=HEADER_BYTES + 64),
                      st.binary(min_size=HEADER_STRUCT_BYTES - len(MAGIC), max_size=HEADER_BYTES).map(
                          lambda b: MAGIC + b)))
def test_unpack_header_on_arbitrary_bytes_returns_a_header_or_raises_chunk_error(data):
    try:
        assert isinstance(unpack_header(data), ChunkHeader)
    except ChunkError as exc:
        assert isinstance(exc.fault, ChunkFault)


@_fuzz
@given(edits=mutations, length=st.integers(0, HEADER_BYTES + 64), rechecksum=st.booleans())
def test_unpack_header_on_mutated_valid_headers(tiny, edits, length, rechecksum):
    _, image = _image(tiny)
    mutated = _mutate(image[:HEADER_BYTES], edits, length, rechecksum)
    try:
        header = unpack_header(mutated)
    except ChunkError:
        return
    assert isinstance(header, ChunkHeader)
    if not rechecksum:  # the checksum held: no byte it covers changed
        assert header == unpack_header(image)


@_fuzz
@given(edits=mutations, length=st.integers(0, 3 * HEADER_BYTES), rechecksum=st.booleans(),
       noise=st.one_of(st.none(), st.binary(max_size=3 * HEADER_BYTES)))
def test_decode_accepts_only_the_exact_chunk_and_returns_a_view_of_its_payload(tiny, edits, length, rechecksum,
                                                                               noise):
    chunk, image = _image(tiny)
    spec = tiny.spec()
    buf = bytes(noise) if noise is not None else bytes(_mutate(image, edits, length, rechecksum))
    try:
        payload = spec.decode(memoryview(buf), chunk.id)
    except ChunkError:
        return
    # Accepted: a view into ``buf`` of exactly the payload, equal to what was written (a
    # changed payload byte changes its checksum; a header that passes names this chunk).
    assert payload.obj is buf and payload.nbytes == spec.payload_bytes
    assert bytes(payload) == buf[PAYLOAD_OFFSET:PAYLOAD_OFFSET + spec.payload_bytes] == bytes(chunk.payload())


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _check_bounded(path: Path) -> ChunkFault | None:
    """check_file, asserting it read nothing past the file and in bounded pieces."""
    size = path.stat().st_size
    with _reads_recorded() as reads:
        fault = admin.check_file(path)
    assert all(n <= max(HEADER_BYTES, admin.HASH_PIECE_BYTES) for _, n in reads)
    assert all(offset + n <= max(size, HEADER_BYTES) for offset, n in reads), (reads, size)
    return fault


@_fuzz
@given(edits=mutations, length=st.integers(0, 3 * HEADER_BYTES), rechecksum=st.booleans(),
       noise=st.one_of(st.none(), st.binary(max_size=3 * HEADER_BYTES)))
def test_check_file_on_arbitrary_contents(tiny, fuzz_dir, edits, length, rechecksum, noise):
    chunk, image = _image(tiny)
    data = bytes(noise) if noise is not None else bytes(_mutate(image, edits, length, rechecksum))
    path = fuzz_dir / f"{chunk.id.key.hex()}.kvt"
    path.write_bytes(data)
    fault = _check_bounded(path)
    assert fault is None or isinstance(fault, ChunkFault)
    if fault is None:  # sound: only bytes no checksum covers (padding) may differ
        end = PAYLOAD_OFFSET + tiny.payload_bytes
        assert len(data) == len(image) and data[PAYLOAD_OFFSET:end] == image[PAYLOAD_OFFSET:end]


@_fuzz
@given(payload_bytes=st.integers(0, 2**64 - 1), shape=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=5),
       dtype_code=st.integers(0, 2**16 - 1), tail=st.integers(0, 2 * HEADER_BYTES), consistent=st.booleans())
def test_check_file_on_well_checksummed_headers_with_absurd_claims(tiny, fuzz_dir, payload_bytes, shape, dtype_code,
                                                                   tail, consistent):
    chunk, _ = _image(tiny)
    if consistent:  # the file is as long as the header says: check_file gets to the payload
        payload_bytes = min(payload_bytes, tail)
    header = ChunkHeader(FORMAT_VERSION, tiny.namespace().digest, chunk.id, 16, dtype_code, tuple(shape),
                         payload_bytes, 0)
    path = fuzz_dir / f"{chunk.id.key.hex()}.kvt"
    path.write_bytes(header.pack() + bytes(file_bytes_for(payload_bytes) - HEADER_BYTES if consistent else tail))
    t0 = time.perf_counter()
    fault = _check_bounded(path)
    assert isinstance(fault, ChunkFault)
    assert time.perf_counter() - t0 < 1.0


def _sparse_chunk(path: Path, payload_bytes: int, shape: tuple[int, ...], file_bytes: int, tiny: Any) -> None:
    """A header claiming ``payload_bytes`` of uint8 (checksum right), then a hole."""
    (chunk,) = tiny.chunks(1)
    header = ChunkHeader(FORMAT_VERSION, tiny.namespace().digest, chunk.id, 0, DTYPE_CODES[torch.uint8],
                         shape, payload_bytes, 12345)
    with open(path, "wb") as f:
        f.write(header.pack())
    os.truncate(path, file_bytes)


def test_check_file_on_a_sparse_gibibyte_stays_bounded_in_memory(tiny, tmp_path):
    big = 1 << 30
    consistent, absurd = tmp_path / "consistent.kvt", tmp_path / "absurd.kvt"
    # Sizes and shape agree: the payload is hashed (and fails its checksum).
    _sparse_chunk(consistent, big - HEADER_BYTES, (big - HEADER_BYTES,), big, tiny)
    # Claims 8 EiB (and a shape of 2**160 bytes): never read past the header.
    _sparse_chunk(absurd, 2**63, (2**32 - 1,) * 5, big, tiny)
    try:
        t0 = time.perf_counter()
        assert admin.check_file(absurd) is ChunkFault.TRUNCATED
        assert time.perf_counter() - t0 < 0.5
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        assert admin.check_file(consistent) is ChunkFault.PAYLOAD_CHECKSUM
        hashed_s = time.perf_counter() - t0
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kib) / 1024
        assert grown_mib < 64, f"peak RSS grew {grown_mib:.0f} MiB checking a 1 GiB file"
        assert hashed_s < 20
    finally:
        consistent.unlink()
        absurd.unlink()


def test_check_file_hashes_in_pieces_and_still_catches_one_flipped_bit(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(admin, "HASH_PIECE_BYTES", 1000)  # the tiny payload is 2048 B: three pieces
    chunk, image = _image(tiny)
    path = tmp_path / f"{chunk.id.key.hex()}.kvt"
    path.write_bytes(image)
    with _reads_recorded() as reads:
        assert admin.check_file(path) is None
    assert [n for _, n in reads] == [HEADER_BYTES, 1000, 1000, 48]
    flipped = bytearray(image)
    flipped[PAYLOAD_OFFSET + 1500] ^= 0x10
    path.write_bytes(flipped)
    assert admin.check_file(path) is ChunkFault.PAYLOAD_CHECKSUM


# -- keys, names and paths ------------------------------------------------------------------------


@_fuzz
@given(key=st.binary(max_size=80))
def test_no_key_forms_a_path_outside_the_pool(fuzz_dir, key):
    files = ChunkFiles(fuzz_dir / "pool", create=False)
    path = files.path_for(ChunkKey(key))
    root = os.path.realpath(files.root)
    resolved = os.path.realpath(path)
    assert os.path.commonpath([root, resolved]) == root and resolved != root
    assert all(re.fullmatch(r"[0-9a-f]*", part) for part in Path(resolved).relative_to(root).parts[:-1])
    assert re.fullmatch(r"[0-9a-f]*\.kvt", path.name)


def test_scan_lists_only_chunk_names_in_their_own_shard(tiny, tmp_path):
    pool = PoolTier(tmp_path / "pool", None, create=True)
    spec = tiny.spec()
    chunks = tiny.chunks(2)
    for c in chunks:
        pool.store(c, spec)
    files = pool.files
    real = files.path_for(chunks[0].id.key)
    h = chunks[0].id.key.hex()
    shard = real.parent
    # Names a chunk cannot have, planted beside a real one.
    for name in ("..kvt", "...kvt", f"{h.upper()}.kvt", f"{h[:62]}.kvt", f"{h[:60]}  {h[60:62]}.kvt",
                 f"{h}.kvt.x", f"{h[:-1]}g.kvt", f"{'..' * 32}.kvt"):
        (shard / name).write_bytes(real.read_bytes())
    # A real name in another chunk's shard, and a stray non-hex shard tree.
    wrong_shard = files.path_for(chunks[1].id.key).parent / real.name
    wrong_shard.write_bytes(real.read_bytes())
    (tmp_path / "pool" / "zz" / "zz").mkdir(parents=True)
    (tmp_path / "pool" / "zz" / "zz" / real.name).write_bytes(real.read_bytes())
    listed = sorted(f.path for f in files.scan())
    assert listed == sorted(files.path_for(c.id.key) for c in chunks)
    assert admin.verify(tmp_path / "pool").checked == 2


def test_scan_lists_a_symlink_with_its_own_size_and_verify_fix_removes_only_the_link(tiny, tmp_path):
    pool = PoolTier(tmp_path / "pool", None, create=True)
    spec = tiny.spec()
    a, b = tiny.chunks(2)
    pool.store(a, spec)
    huge = tmp_path / "huge"
    with open(huge, "wb"):
        pass
    os.truncate(huge, 1 << 40)  # a 1 TiB sparse file must not count against the pool's budget
    link = pool.files.path_for(b.id.key)
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(huge, link)
    sizes = {f.key: f.size for f in pool.files.scan()}
    assert sizes[a.id.key] == spec.file_bytes and sizes[b.id.key] < 4096
    report = admin.verify(tmp_path / "pool", fix=True)
    assert report.bad == [{"path": str(link), "fault": "not_a_file"}] and report.removed == 1
    assert not os.path.lexists(link) and huge.stat().st_size == 1 << 40


# -- file modes -------------------------------------------------------------------------------------


def _modes(*roots: Path) -> dict[str, set[int]]:
    """Permission bits (with setgid) of every directory and file under ``roots``, roots included."""
    out: dict[str, set[int]] = {"dirs": set(), "files": set()}
    for root in roots:
        for dirpath, _, names in os.walk(root):
            out["dirs"].add(stat.S_IMODE(os.stat(dirpath).st_mode))
            for name in names:
                out["files"].add(stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode))
    return out


@contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _fill(tiny: Any, tmp_path: Path, **overrides: Any) -> tuple[Path, Path]:
    disk, pool = tmp_path / "disk", tmp_path / "pool"
    pool_url = new_pool(pool, group_access=overrides.get("group_access", False))
    with TieredStore(tiny.config(disk_path=str(disk), pool_url=pool_url, **overrides)) as store:
        store.put(tiny.tokens(64), tiny.kv(64))
        store.flush()
    # Everything kvtier creates in a chunk directory is there to be checked.
    names = {p.name for p in pool.iterdir()}
    assert {".kvtier", ".lock", ".usage.d", "namespaces"} <= names  # .usage.d: this instance's ledger
    assert (disk / ".lock").exists() and list((pool / "namespaces").iterdir())
    return disk, pool


def test_files_and_directories_are_owner_only_even_with_umask_0(tiny, tmp_path):
    with _umask(0):
        disk, pool = _fill(tiny, tmp_path)
    assert _modes(disk, pool) == {"dirs": {0o700}, "files": {0o600}}


def test_group_access_makes_them_group_shared_even_with_umask_077(tiny, tmp_path):
    with _umask(0o077):
        disk, pool = _fill(tiny, tmp_path, group_access=True)
    assert _modes(disk, pool) == {"dirs": {0o2770}, "files": {0o660}}


def test_group_access_setting_from_yaml_env_and_its_validation(tiny, tmp_path):
    base = {"model_id": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
    assert load_settings(base, environ={}).group_access is False
    assert load_settings({**base, "group_access": True}, environ={}).group_access is True
    yaml = tmp_path / "kvtier.yaml"
    yaml.write_text("model_id: m\nnum_layers: 2\nnum_kv_heads: 2\nhead_dim: 8\ngroup_access: true\n")
    assert load_settings(yaml, environ={}).group_access is True
    assert load_settings(yaml, environ={"KVTIER_GROUP_ACCESS": "off"}).group_access is False
    assert load_settings(base, environ={"KVTIER_GROUP_ACCESS": "yes"}).group_access is True
    with pytest.raises(ValueError, match="KVTIER_GROUP_ACCESS"):
        load_settings(base, environ={"KVTIER_GROUP_ACCESS": "maybe"})
    with pytest.raises(ValueError, match="group_access"):
        tiny.config(group_access="yes")


def test_a_root_other_users_can_reach_is_warned_about_once(tmp_path, caplog):
    open_root, closed_root = tmp_path / "open", tmp_path / "closed"
    open_root.mkdir()
    os.chmod(open_root, 0o777)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.files"):
        PoolTier(open_root, None, create=True)
        PoolTier(open_root, None, create=True)
        PoolTier(closed_root, None, create=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.endswith(".files")]
    assert len(warnings) == 1
    assert str(open_root) in warnings[0] and "0o777" in warnings[0]


# -- symlinks, FIFOs and directories under chunk names --------------------------------------------


def test_symlink_to_another_keys_chunk_is_a_counted_miss_and_only_the_link_goes(tiny, tmp_path, make_store):
    """The target is a sound chunk file of another key, outside the pool: never read or removed."""
    elsewhere = PoolTier(tmp_path / "elsewhere", None, create=True)
    (other,) = tiny.chunks(1, seed=7)
    elsewhere.store(other, tiny.spec())
    target = elsewhere.files.path_for(other.id.key)
    before = target.read_bytes()
    tokens = tiny.tokens(2 * tiny.chunk_tokens)
    store = make_store(pool_url=new_pool(tmp_path / "pool"), host_bytes=0)  # no host copy to hide the file
    store.put(tokens, tiny.kv(len(tokens)))
    store.flush()
    pool = store.tiers[0]
    assert isinstance(pool, PoolTier)
    first = store.chunk_ids(tokens)[0]
    link = pool.files.path_for(first.key)
    link.unlink()
    os.symlink(target, link)
    assert store.lookup(tokens).num_chunks == 2  # lookup is metadata only: it sees a name
    with pytest.raises(KeyError):
        _within(10, lambda: store.get(tokens))
    assert pool.metrics.snapshot().corrupt_chunks == 1
    assert not os.path.lexists(link) and target.read_bytes() == before
    assert store.lookup(tokens).num_chunks == 0
    result = pool.load(first, tiny.spec())
    assert result.status is Status.MISS  # gone now, not corrupt again


@pytest.mark.parametrize("tier_kind", ["pool", "disk"])
def test_fifo_under_a_chunk_name_never_blocks_and_is_removed(tiny, tmp_path, tier_kind):
    tier: PoolTier | DiskTier = PoolTier(tmp_path / "t", None, create=True) if tier_kind == "pool" else \
        DiskTier(tmp_path / "t", 1 << 20)
    try:
        spec = tiny.spec()
        (chunk,) = tiny.chunks(1)
        tier.store(chunk, spec)
        path = tier.files.path_for(chunk.id.key)
        direct = tier.files.direct_io
        path.unlink()
        os.mkfifo(path)
        result = _within(10, lambda: tier.load(chunk.id, spec))
        assert result.status is Status.CORRUPT and "not_a_file" in result.error
        assert not os.path.lexists(path)
        assert tier.metrics.snapshot().corrupt_chunks == 1
        assert tier.files.direct_io == direct  # a FIFO refusing O_DIRECT says nothing of the filesystem
    finally:
        tier.close()


def test_a_directory_under_a_chunk_name_is_a_miss_every_time_never_an_exception(tiny, tmp_path):
    pool = PoolTier(tmp_path / "pool", None, create=True)
    spec = tiny.spec()
    (chunk,) = tiny.chunks(1)
    pool.store(chunk, spec)
    path = pool.files.path_for(chunk.id.key)
    path.unlink()
    path.mkdir()
    (path / "x").write_bytes(b"x")  # not empty: cannot be removed as a file
    for _ in range(2):
        result = pool.load(chunk.id, spec)
        assert result.status is Status.CORRUPT and "not_a_file" in result.error
    assert admin.check_file(path) is ChunkFault.NOT_A_FILE


def test_stats_and_verify_never_follow_or_block(tiny, tmp_path):
    pool = PoolTier(tmp_path / "pool", None, create=True)
    spec = tiny.spec()
    a, b, c = tiny.chunks(3)
    for chunk in (a, b, c):
        pool.store(chunk, spec)
    outside = tmp_path / "outside.kvt"
    link, fifo = pool.files.path_for(b.id.key), pool.files.path_for(c.id.key)
    os.replace(link, outside)  # a sound chunk, moved out: following the link would pass it
    os.symlink(outside, link)
    fifo.unlink()
    os.mkfifo(fifo)
    st_ = _within(10, lambda: admin.stats(tmp_path / "pool"))
    assert (st_.chunks, st_.unreadable_headers) == (3, 2)
    report = _within(10, lambda: admin.verify(tmp_path / "pool", fix=True))
    assert sorted(bad["fault"] for bad in report.bad) == ["not_a_file", "not_a_file"] and report.removed == 2
    assert report.ok == 1 and outside.is_file() and admin.check_file(outside) is ChunkFault.IDENTITY


# -- the fault scenario -------------------------------------------------------------------------------

_EXPECTED_FAULTS = {
    "bit flips in header or payload": {"bad_magic", "header_checksum", "payload_checksum"},
    "truncated files": {"truncated"},
    "zero-length files": {"truncated"},
    "chunk of another model or tenant": {"namespace"},
    "chunk of another layout or dtype": {"namespace", "layout"},
    "header of another format version": {"version"},
    "another key's chunk renamed": {"identity"},
    "right key, other tokens' digest": {"identity"},
    "symlink under a chunk's name": {"not_a_file"},
    "FIFO under a chunk's name": {"not_a_file"},
}


def test_hostile_files_scenario_at_ci_scale(tmp_path):
    scale = SCALES["ci"]
    rows = _within(120, lambda: hostile_files(scale, tmp_path))
    assert [r.fault for r in rows] == [name for name, _ in KINDS] == list(_EXPECTED_FAULTS)
    for row in rows:
        row.check()
        x = row.extra
        assert row.injected == row.requests == scale.corrupt_files
        assert x["corrupt_chunks"] == x["removed"] == row.injected, row.notes
        assert x["lookup_stops_before_bad"] == row.requests
        assert x["served_past_bad"] == x["short_prefixes"] == 0
        assert set(x["faults"]) <= _EXPECTED_FAULTS[row.fault], (row.fault, x["faults"])
        assert x["verify_bad"] == 0 and x["verify_checked"] > 0
        assert x["symlink_targets_intact"] == x["symlink_targets"]
    assert rows[-2].extra["symlink_targets"] == scale.corrupt_files

