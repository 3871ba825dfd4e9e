"""kvtier.format: the chunk file layout, its round trip, and every ChunkFault."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.format import (
    _FIELDS,
    ALIGN,
    FIELD_OFFSETS,
    FLAG_CODEC,
    HEADER_BYTES,
    HEADER_STRUCT_BYTES,
    MAGIC,
    PAYLOAD_OFFSET,
    ChunkError,
    ChunkFault,
    ChunkHeader,
    file_bytes_for,
    payload_checksum,
    unpack_header,
)
from kvtier.keys import FORMAT_VERSION, chunk_ids
from kvtier.layout import DTYPE_CODES

_NDIM_OFFSET = FIELD_OFFSETS["ndim"]
_hyp = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _fault(fn) -> ChunkFault:
    with pytest.raises(ChunkError) as info:
        fn()
    return info.value.fault


def _decode_flipped(tiny, byte: int, mask: int) -> ChunkFault:
    """The fault decoding a one-chunk file image raises once ``image[byte] ^= mask``."""
    (chunk,) = tiny.chunks(1)
    image = tiny.image(chunk)
    image[byte] ^= mask
    return _fault(lambda: tiny.spec().decode(memoryview(image), chunk.id))


def test_sizes_are_aligned(tiny):
    spec = tiny.spec()
    assert spec.payload_bytes == 2048
    assert spec.file_bytes == 8192 == file_bytes_for(2048)
    assert file_bytes_for(4096) == 8192 and file_bytes_for(4097) == 12288 and file_bytes_for(0) == 4096
    assert HEADER_BYTES == PAYLOAD_OFFSET == ALIGN == 4096
    assert HEADER_STRUCT_BYTES == _FIELDS.size + 8 < HEADER_BYTES


def test_file_image_layout(tiny):
    (chunk,) = tiny.chunks(1)
    spec = tiny.spec()
    image = tiny.image(chunk)
    assert len(image) == spec.file_bytes
    assert image[:8] == MAGIC  # a fixed binary header, not a pickle
    assert image[PAYLOAD_OFFSET:PAYLOAD_OFFSET + 2048] == bytes(chunk.payload())
    assert image[HEADER_STRUCT_BYTES:HEADER_BYTES] == bytes(HEADER_BYTES - HEADER_STRUCT_BYTES)
    assert image[PAYLOAD_OFFSET + 2048:] == bytes(spec.file_bytes - PAYLOAD_OFFSET - 2048)


@pytest.mark.parametrize("extra", [b"", b"lora"])
def test_header_round_trip(tiny, extra):
    ns = tiny.namespace()
    cid = chunk_ids(ns, tiny.tokens(16), extra)[0]
    header = ChunkHeader(FORMAT_VERSION, ns.digest, cid, 16, DTYPE_CODES[tiny.layout.dtype],
                         tiny.layout.shape(16), 2048, 0x0123456789ABCDEF)
    packed = header.pack()
    assert len(packed) == HEADER_BYTES
    assert unpack_header(packed) == header
    assert unpack_header(memoryview(packed)[:HEADER_STRUCT_BYTES]) == header


def test_decode_round_trip(tiny):
    (chunk,) = tiny.chunks(1, seed=9)
    spec = tiny.spec()
    image = tiny.image(chunk)
    payload = spec.decode(memoryview(image), chunk.id)
    assert bytes(payload) == bytes(chunk.payload())
    header = unpack_header(image)
    assert header.num_tokens == 16
    assert header.shape == (2, 2, 16, 2, 8)
    assert header.payload_xxh3 == xxhash.xxh3_64_intdigest(bytes(chunk.payload()))


def test_truncated(tiny):
    (chunk,) = tiny.chunks(1)
    spec = tiny.spec()
    image = tiny.image(chunk)
    assert _fault(lambda: unpack_header(image[:HEADER_STRUCT_BYTES - 1])) is ChunkFault.TRUNCATED
    assert _fault(lambda: unpack_header(b"")) is ChunkFault.TRUNCATED
    short = memoryview(image[:PAYLOAD_OFFSET + 2047])
    assert _fault(lambda: spec.decode(short, chunk.id)) is ChunkFault.TRUNCATED


def test_bad_magic(tiny):
    assert _decode_flipped(tiny, 0, 0x01) is ChunkFault.BAD_MAGIC


@pytest.mark.parametrize("byte", [8, 20, 100, _FIELDS.size - 1, _FIELDS.size + 3])
def test_header_bit_flip(tiny, byte):
    assert _decode_flipped(tiny, byte, 0x10) is ChunkFault.HEADER_CHECKSUM


@pytest.mark.parametrize("byte", [PAYLOAD_OFFSET, PAYLOAD_OFFSET + 1000, PAYLOAD_OFFSET + 2047])
def test_payload_bit_flip(tiny, byte):
    assert _decode_flipped(tiny, byte, 0x80) is ChunkFault.PAYLOAD_CHECKSUM


def test_wrong_format_version(tiny):
    (chunk,) = tiny.chunks(1)
    spec = tiny.spec()
    future = dataclasses.replace(spec.header_for(chunk.id, chunk.payload()), version=FORMAT_VERSION + 1)
    image = bytearray(tiny.image(chunk))
    image[:HEADER_BYTES] = future.pack()  # a well-formed header of a format we do not know
    assert _fault(lambda: spec.decode(memoryview(image), chunk.id)) is ChunkFault.VERSION


def test_foreign_namespace(tiny):
    (chunk,) = tiny.chunks(1)
    theirs = tiny.spec(tiny.namespace(model_id="another-model"))
    image = tiny.image(chunk, theirs)
    assert _fault(lambda: tiny.spec().decode(memoryview(image), chunk.id)) is ChunkFault.NAMESPACE


def test_token_mismatch_is_identity_fault(tiny):
    a, b = tiny.chunks(2)
    image = tiny.image(b)  # chunk 1's file read when asking for chunk 0
    assert _fault(lambda: tiny.spec().decode(memoryview(image), a.id)) is ChunkFault.IDENTITY
    # Same key but different parent or token digest (a key collision) is caught too.
    forged = dataclasses.replace(a.id, tokens_digest=b.id.tokens_digest)
    assert _fault(lambda: tiny.spec().decode(memoryview(tiny.image(a)), forged)) is ChunkFault.IDENTITY


def test_foreign_layout_with_same_namespace(tiny):
    (chunk,) = tiny.chunks(1)
    spec = tiny.spec()
    for change in ({"dtype_code": DTYPE_CODES[tiny.layout.dtype] + 1}, {"shape": (2, 2, 16, 4, 4)},
                   {"payload_bytes": 1024}):
        header = dataclasses.replace(spec.header_for(chunk.id, chunk.payload()), **change)
        image = bytearray(tiny.image(chunk))
        image[:HEADER_BYTES] = header.pack()
        assert _fault(lambda image=image: spec.decode(memoryview(image), chunk.id)) is ChunkFault.LAYOUT


@pytest.mark.parametrize("ndim", [0, 6, 65535])
def test_bad_ndim_is_layout_fault(tiny, ndim):
    (chunk,) = tiny.chunks(1)
    body = bytearray(tiny.image(chunk)[:_FIELDS.size])
    struct.pack_into("<H", body, _NDIM_OFFSET, ndim)
    header = bytes(body) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body)))
    assert _fault(lambda: unpack_header(header)) is ChunkFault.LAYOUT


def test_payload_checksum_helper():
    assert payload_checksum(b"abc") == xxhash.xxh3_64_intdigest(b"abc")


# -- properties ---------------------------------------------------------------------------------


@_hyp
@given(data=st.binary(max_size=HEADER_STRUCT_BYTES + 64))
def test_header_parser_raises_only_chunk_error_on_random_bytes(data):
    try:
        unpack_header(data)
    except ChunkError:
        pass


@_hyp
@given(fields=st.binary(min_size=_FIELDS.size - 8, max_size=_FIELDS.size - 8),
       version=st.sampled_from([FORMAT_VERSION, FORMAT_VERSION + 1, 0]),
       header_bytes=st.sampled_from([HEADER_BYTES, 512]), ndim=st.integers(0, 7))
def test_header_parser_on_self_consistent_random_headers(fields, version, header_bytes, ndim):
    """Random fields with the right magic and a valid checksum get past the cheap checks."""
    body = bytearray(MAGIC + fields)
    struct.pack_into("<H", body, 8, version)
    struct.pack_into("<I", body, 12, header_bytes)
    struct.pack_into("<H", body, _NDIM_OFFSET, ndim)
    data = bytes(body) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body)))
    try:
        header = unpack_header(data)
    except ChunkError as exc:
        if version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
            assert exc.fault is ChunkFault.VERSION
        elif body[10] & FLAG_CODEC and 1 <= ndim <= 5:  # a codec record that is not there
            assert exc.fault in (ChunkFault.TRUNCATED, ChunkFault.HEADER_CHECKSUM)
        else:
            assert exc.fault is ChunkFault.LAYOUT and not 1 <= ndim <= 5
    else:
        assert (version, header_bytes) == (FORMAT_VERSION, HEADER_BYTES)
        assert len(header.shape) == ndim


@_hyp
@given(bit=st.integers(0, (HEADER_STRUCT_BYTES + 2048) * 8 - 1))
def test_any_bit_flip_in_checked_bytes_is_rejected(tiny, bit):
    byte = bit // 8 if bit // 8 < HEADER_STRUCT_BYTES else PAYLOAD_OFFSET + bit // 8 - HEADER_STRUCT_BYTES
    _decode_flipped(tiny, byte, 1 << (bit % 8))  # raises unless decode rejects it


@_hyp
@given(garbage=st.binary(min_size=0, max_size=9000))
def test_decode_of_random_file_images_raises_only_chunk_error(tiny, garbage):
    (chunk,) = tiny.chunks(1)
    with pytest.raises(ChunkError):
        tiny.spec().decode(memoryview(np.frombuffer(garbage, dtype=np.uint8)), chunk.id)
