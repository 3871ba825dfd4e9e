"""The chunk file format: a fixed 4096-byte binary header, then the payload, 4096-aligned.

Everything read back is untrusted: the header has a fixed layout parsed with ``struct``
(no pickle), every length is bounds-checked against the expectation of the reader, and both
header and payload carry an xxh3-64 checksum. The payload starts at byte 4096 and the file is
padded to a multiple of 4096, so a whole file can be read with O_DIRECT into an aligned buffer.

Header (little-endian)::

    magic 8s | version H | flags H | header_bytes I | namespace 32s | key 32s | parent 32s
    | tokens_digest 32s | extra_digest 32s | num_tokens I | dtype_code H | ndim H | shape 5I
    | payload_bytes Q | payload_xxh3 Q | header_xxh3 Q (of every byte before it)

With ``FLAG_CODEC`` the payload is coded (``kvtier.codec``) and a codec record follows::

    codec H | codec_version H | dtype_code B | layout B (KVGeometry.layout_bits) | k_group H | v_group H | layers I
    | pages I | rows I | row_elems I | raw_bytes Q | record_xxh3 Q (of header_xxh3 and the record)

``payload_bytes`` and ``payload_xxh3`` are then those of the stored (coded) bytes, and the file
is shorter than an uncoded one (``file_bytes_for(payload_bytes)``).
"""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass, field

import torch
import xxhash

from kvtier.codec import CodecDataError, CodecRates, CodecRecord, Encoder, UnknownCodec, by_code, decode_into
from kvtier.keys import DIGEST_BYTES, FORMAT_VERSION, ChunkId, ChunkKey

MAGIC = b"KVTIER\r\n"
ALIGN = 4096
HEADER_BYTES = ALIGN
PAYLOAD_OFFSET = HEADER_BYTES
FLAG_EXTRA = 1
FLAG_CODEC = 2

_FIELDS = struct.Struct("<8sHHI32s32s32s32s32sIHH5IQQ")
_CHECK = struct.Struct("<Q")
HEADER_STRUCT_BYTES = _FIELDS.size + _CHECK.size
_CODEC = struct.Struct("<HHBBHHIIIIQ")
CODEC_RECORD_END = HEADER_STRUCT_BYTES + _CODEC.size + _CHECK.size
FIELD_NAMES = ("magic", "version", "flags", "header_bytes", "namespace", "key", "parent", "tokens_digest",
               "extra_digest", "num_tokens", "dtype_code", "ndim", "dim0", "dim1", "dim2", "dim3", "dim4",
               "payload_bytes", "payload_xxh3")


def _field_offsets() -> dict[str, int]:
    """Byte offset of each header field (tools and tests that edit a header in place)."""
    offsets: dict[str, int] = {}
    names = iter(FIELD_NAMES)
    pos = 0
    for count, code in re.findall(r"(\d*)([a-zA-Z])", _FIELDS.format[1:]):
        n = 1 if code == "s" else int(count or 1)
        size = struct.calcsize("<" + (count if code == "s" else "") + code)
        for _ in range(n):
            offsets[next(names)] = pos
            pos += size
    return offsets


FIELD_OFFSETS = _field_offsets()
CHECKSUM_OFFSET = _FIELDS.size  # the header checksum (xxh3-64 of the fields) follows them


def seal_header(image: bytearray) -> None:
    """Make a header's checksum match its fields again, after editing them in place."""
    image[CHECKSUM_OFFSET:HEADER_STRUCT_BYTES] = _CHECK.pack(xxhash.xxh3_64_intdigest(bytes(image[:CHECKSUM_OFFSET])))


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def file_bytes_for(payload_bytes: int) -> int:
    """Size of a chunk file holding ``payload_bytes`` of payload."""
    return PAYLOAD_OFFSET + align_up(payload_bytes)


class ChunkFault(enum.Enum):
    """Why a chunk was rejected; every value is counted as a corrupt chunk."""

    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    VERSION = "version"
    HEADER_CHECKSUM = "header_checksum"
    NAMESPACE = "namespace"
    IDENTITY = "identity"
    LAYOUT = "layout"
    PAYLOAD_CHECKSUM = "payload_checksum"
    NOT_A_FILE = "not_a_file"
    """A symlink, FIFO, directory or device under a chunk's name: never followed or read."""
    CODEC = "codec"
    """A coded payload that passed its checksum but does not decode (or a bad codec record)."""
    UNKNOWN_CODEC = "unknown_codec"
    """A codec (or version) this kvtier does not know: a miss, and the file is left alone."""


class ChunkError(ValueError):
    """A chunk's bytes are not the chunk the reader asked for; treat as a miss."""

    def __init__(self, fault: ChunkFault, detail: str = "") -> None:
        super().__init__(f"{fault.value}: {detail}" if detail else fault.value)
        self.fault = fault


@dataclass(frozen=True)
class ChunkHeader:
    version: int
    namespace: bytes
    chunk: ChunkId
    num_tokens: int
    dtype_code: int
    shape: tuple[int, ...]
    payload_bytes: int
    payload_xxh3: int
    codec: CodecRecord | None = None

    def pack(self) -> bytes:
        """The full 4096-byte header region."""
        dims = tuple(self.shape) + (0,) * (5 - len(self.shape))
        flags = (FLAG_EXTRA if self.chunk.extra_digest else 0) | (FLAG_CODEC if self.codec else 0)
        body = _FIELDS.pack(
            MAGIC, self.version, flags, HEADER_BYTES, self.namespace, self.chunk.key,
            self.chunk.parent, self.chunk.tokens_digest,
            self.chunk.extra_digest or bytes(DIGEST_BYTES), self.num_tokens, self.dtype_code,
            len(self.shape), *dims, self.payload_bytes, self.payload_xxh3,
        )
        body += _CHECK.pack(xxhash.xxh3_64_intdigest(body))
        if self.codec is not None:
            c = self.codec
            record = body[-_CHECK.size:] + _CODEC.pack(c.code, c.version, c.dtype_code, c.layout, c.k_group,
                                                       c.v_group, c.layers, c.pages, c.rows, c.row_elems, c.raw_bytes)
            body += record[_CHECK.size:] + _CHECK.pack(xxhash.xxh3_64_intdigest(record))
        return body + bytes(HEADER_BYTES - len(body))


def unpack_header(buf: bytes | memoryview) -> ChunkHeader:
    """Parse and self-check a header; raises ChunkError, never anything else on bad bytes."""
    if len(buf) < HEADER_STRUCT_BYTES:
        raise ChunkError(ChunkFault.TRUNCATED, f"header needs {HEADER_STRUCT_BYTES} bytes, got {len(buf)}")
    body = bytes(buf[: _FIELDS.size])
    (magic, version, flags, header_bytes, namespace, key, parent, tokens_digest, extra_digest,
     num_tokens, dtype_code, ndim, *rest) = _FIELDS.unpack(body)
    dims, payload_bytes, payload_xxh3 = rest[:5], rest[5], rest[6]
    if magic != MAGIC:
        raise ChunkError(ChunkFault.BAD_MAGIC)
    (stored_check,) = _CHECK.unpack(bytes(buf[_FIELDS.size:HEADER_STRUCT_BYTES]))
    if stored_check != xxhash.xxh3_64_intdigest(body):
        raise ChunkError(ChunkFault.HEADER_CHECKSUM)
    if version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
        raise ChunkError(ChunkFault.VERSION, f"format {version} (header {header_bytes} B)")
    if not 1 <= ndim <= 5:
        raise ChunkError(ChunkFault.LAYOUT, f"ndim {ndim}")
    chunk = ChunkId(ChunkKey(key), parent, tokens_digest, extra_digest if flags & FLAG_EXTRA else b"")
    codec = _unpack_codec(buf) if flags & FLAG_CODEC else None
    return ChunkHeader(version, namespace, chunk, num_tokens, dtype_code, tuple(dims[:ndim]),
                       payload_bytes, payload_xxh3, codec)


def _unpack_codec(buf: bytes | memoryview) -> CodecRecord:
    if len(buf) < CODEC_RECORD_END:
        raise ChunkError(ChunkFault.TRUNCATED, f"codec record needs {CODEC_RECORD_END} bytes, got {len(buf)}")
    record = bytes(buf[HEADER_STRUCT_BYTES - _CHECK.size:CODEC_RECORD_END - _CHECK.size])
    (stored_check,) = _CHECK.unpack(bytes(buf[CODEC_RECORD_END - _CHECK.size:CODEC_RECORD_END]))
    if stored_check != xxhash.xxh3_64_intdigest(record):
        raise ChunkError(ChunkFault.HEADER_CHECKSUM, "codec record")
    return CodecRecord(*_CODEC.unpack(record[_CHECK.size:]))


def payload_checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


@dataclass(frozen=True)
class ChunkSpec:
    """What a reader expects of a chunk: its namespace, identity and exact layout."""

    namespace: bytes
    dtype_code: int
    shape: tuple[int, ...]
    payload_bytes: int
    encoder: Encoder | None = field(default=None, compare=False)
    """The codec files of this namespace are written with (None: the engine's bytes as they are)."""

    @property
    def file_bytes(self) -> int:
        """Size of an uncoded chunk file: the largest a file of this spec can be."""
        return file_bytes_for(self.payload_bytes)

    def stored(self, chunk: ChunkId, payload: memoryview,
               rates: CodecRates | None = None) -> tuple[ChunkHeader, bytes | memoryview]:
        """The header and payload bytes a file of ``chunk`` holds: coded with ``encoder`` when
        that saves at least one 4 KiB file block (and, for ``auto``, when the tier's ``rates``
        say it pays), else ``payload`` itself."""
        if self.encoder is not None and self.encoder.worth_coding(rates):
            coded, record = self.encoder.encode(torch.frombuffer(payload, dtype=torch.uint8))
            if file_bytes_for(coded.numel()) < self.file_bytes:
                data = coded.cpu().numpy().data
                return ChunkHeader(FORMAT_VERSION, self.namespace, chunk, self._num_tokens, self.dtype_code,
                                   self.shape, coded.numel(), payload_checksum(data), record), data
        return self.header_for(chunk, payload), payload

    @property
    def _num_tokens(self) -> int:
        return self.shape[2] if len(self.shape) == 5 else 0

    def header_for(self, chunk: ChunkId, payload: bytes | memoryview) -> ChunkHeader:
        return ChunkHeader(FORMAT_VERSION, self.namespace, chunk, self._num_tokens, self.dtype_code, self.shape,
                           self.payload_bytes, payload_checksum(payload))

    def check(self, header: ChunkHeader, chunk: ChunkId) -> None:
        """Raise ChunkError unless ``header`` describes exactly ``chunk`` in this spec."""
        if header.namespace != self.namespace:
            raise ChunkError(ChunkFault.NAMESPACE)
        if header.chunk != chunk:
            raise ChunkError(ChunkFault.IDENTITY, "key, parent or token digest differ")
        if header.codec is not None:
            # Coded: the decoded size is the spec's, and the file is shorter than an uncoded one.
            stored_ok = 0 < header.payload_bytes and file_bytes_for(header.payload_bytes) < self.file_bytes
            if (header.dtype_code, header.shape, header.codec.raw_bytes) != (
                    self.dtype_code, self.shape, self.payload_bytes) or not stored_ok:
                raise ChunkError(ChunkFault.LAYOUT, f"coded: dtype {header.dtype_code} shape {header.shape} "
                                 f"{header.payload_bytes} B stored for {header.codec.raw_bytes}")
        elif (header.dtype_code, header.shape, header.payload_bytes) != (
                self.dtype_code, self.shape, self.payload_bytes):
            raise ChunkError(ChunkFault.LAYOUT, f"dtype {header.dtype_code} shape {header.shape}")

    def decode(self, buf: memoryview, chunk: ChunkId) -> memoryview:
        """Validate a whole chunk file image in ``buf``; return a view of its payload."""
        header = unpack_header(buf)
        self.check(header, chunk)
        _uncoded(header)
        return _checked_payload(buf, header, self.payload_bytes)

    def payload_digest(self, head: bytes | memoryview, chunk: ChunkId) -> PayloadDigest:
        """For a chunk file read in pieces: check its header region ``head`` against ``chunk``
        (raises ChunkError as ``decode`` does), and return the checksum to feed the payload's
        pieces to, in order, before ``verify``."""
        header = unpack_header(head)
        self.check(header, chunk)
        _uncoded(header)
        return PayloadDigest(header.payload_xxh3)

    def decode_coded(self, buf: memoryview, chunk: ChunkId, out: torch.Tensor) -> None:
        """Validate a coded chunk file's image in ``buf`` (its length the file's) and decode its
        payload into ``out`` (1-d uint8, ``payload_bytes`` long). Raises ChunkError: a fault of
        ``UNKNOWN_CODEC`` for a codec this kvtier cannot read (a miss: leave the file alone),
        ``CODEC`` for a payload that passed its checksum but does not decode."""
        header = unpack_header(buf)
        self.check(header, chunk)
        if header.codec is None:
            raise ChunkError(ChunkFault.LAYOUT, f"uncoded chunk in a file of {len(buf)} bytes")
        try:
            by_code(header.codec.code, header.codec.version)
        except UnknownCodec as exc:
            raise ChunkError(ChunkFault.UNKNOWN_CODEC, str(exc)) from exc
        stored = _checked_payload(buf, header, header.payload_bytes)
        try:
            decode_into(header.codec, torch.frombuffer(stored, dtype=torch.uint8), out)
        except (CodecDataError, RuntimeError) as exc:  # RuntimeError: torch refusing a view or shape
            raise ChunkError(ChunkFault.CODEC, str(exc)) from exc


class PayloadDigest:
    """A payload's checksum computed piece by piece (the same xxh3 as over the whole at once)."""

    def __init__(self, expected: int) -> None:
        self._expected = expected
        self._digest = xxhash.xxh3_64()

    def update(self, piece: bytes | memoryview) -> None:
        self._digest.update(piece)

    def verify(self) -> None:
        """Raise ChunkError(PAYLOAD_CHECKSUM) unless the pieces fed add up to the header's checksum."""
        if self._digest.intdigest() != self._expected:
            raise ChunkError(ChunkFault.PAYLOAD_CHECKSUM)


def _checked_payload(buf: memoryview, header: ChunkHeader, nbytes: int) -> memoryview:
    """The ``nbytes`` of payload after the header in ``buf``, checked against the header's checksum."""
    end = PAYLOAD_OFFSET + nbytes
    if len(buf) < end:
        raise ChunkError(ChunkFault.TRUNCATED, f"{len(buf)} of {end} bytes")
    payload = buf[PAYLOAD_OFFSET:end]
    if payload_checksum(payload) != header.payload_xxh3:
        raise ChunkError(ChunkFault.PAYLOAD_CHECKSUM)
    return payload


def _uncoded(header: ChunkHeader) -> None:
    if header.codec is not None:
        raise ChunkError(ChunkFault.LAYOUT, "a coded chunk in a file of an uncoded chunk's size")
