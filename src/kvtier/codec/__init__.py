"""KV codecs: fewer bytes per token on the disk tier and in the pool (setting ``kv_codec``).

``none`` stores the engine's bytes as they are; ``lossless`` (``codec.lossless``) splits each
element's bytes into planes and compresses them with zstd; ``fp8``, ``k8v4`` and ``k8v8``
(``codec.quant``) quantize, with scales per group; ``auto`` codes with ``k8v8`` only on tiers
where that reads back sooner (``codec.rates``). Host DRAM always holds the engine's own bytes:
a codec runs where a chunk is written to a file (the writer threads, off the engine's step) and
where it is read back (the read threads).

Contracts:

* A chunk names its codec, the codec's version and its parameters in its header (``CodecRecord``),
  so decoding needs nothing but the file. A chunk whose codec or version this kvtier does not
  know is a miss (``UnknownCodec``), never an error, and is left in place for the instances that
  can read it.
* A lossy codec is part of the namespace (``namespace_tag``): an instance that asked for exact KV
  never finds a lossy chunk. ``lossless`` is not: an instance with ``none`` reads ``lossless``
  chunks and the other way round.
* The payload checksum covers the stored (encoded) bytes; a payload that passes it but does not
  decode is corrupt (``CodecDataError``).
* A chunk that a codec would not make smaller by at least one 4 KiB file block is stored as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.codec.geometry import FLOAT_DTYPES, GeometryError, KVGeometry
from kvtier.codec.lossless import CodecDataError, Lossless
from kvtier.codec.quant import K8V4, K8V8, Fp8, Fp8Cast
from kvtier.codec.rates import CodecRates

__all__ = [
    "AUTO",
    "CODECS",
    "FLOAT_DTYPES",
    "Codec",
    "CodecDataError",
    "CodecRates",
    "CodecRecord",
    "Encoder",
    "GeometryError",
    "KVGeometry",
    "UnknownCodec",
    "by_code",
    "decode_into",
    "encoder_for",
    "namespace_tag",
    "parse_codec",
]


class Codec(Protocol):
    name: str
    code: int
    version: int
    lossy: bool
    grouped: bool
    """Scales per group of tokens or channels: the pages' orientation matters."""

    def groups(self, geom: KVGeometry) -> tuple[int, int]: ...

    def encode(self, raw: torch.Tensor, geom: KVGeometry) -> torch.Tensor: ...

    def decode(self, stored: torch.Tensor, geom: KVGeometry, kg: int, vg: int, out: torch.Tensor) -> None: ...


CODECS: dict[str, Codec] = {c.name: c for c in (Lossless(), Fp8(), K8V4(), K8V8(), Fp8Cast())}
AUTO = "auto"
"""``AUTO_CODEC`` where a tier's measured rates say decoding costs less than the bytes it saves,
the engine's bytes elsewhere (``codec.rates``); its namespace is ``AUTO_CODEC``'s."""
AUTO_CODEC = "k8v8"
"""What ``auto`` codes with: of the codecs about 2x smaller, the closest to exact KV on a real
model and the fastest to decode (docs/codecs.md)."""
LOSSLESS_RATIO = 1.5
"""What ``lossless`` saves on real KV, about (1.48-1.65 on SmolLM2's; docs/codecs.md)."""
NAMES = ("none", *CODECS, AUTO)


class UnknownCodec(Exception):
    """A chunk written with a codec (or codec version) this kvtier does not know: a miss."""


def by_code(code: int, version: int) -> Codec:
    for codec in CODECS.values():
        if codec.code == code and codec.version == version:
            return codec
    raise UnknownCodec(f"codec {code} version {version}")


def parse_codec(name: object) -> str:
    """The setting's value, checked: one of ``NAMES``."""
    value = str(name).strip().lower() if name is not None else "none"
    if value not in NAMES:
        raise ValueError(f"kv_codec: {name!r} is not one of {', '.join(NAMES)}")
    return value


def namespace_tag(name: str) -> str:
    """What a codec adds to the namespace: ``name/version`` for a lossy one, "" otherwise."""
    codec = CODECS.get(AUTO_CODEC if name == AUTO else name)
    return f"{codec.name}/{codec.version}" if codec is not None and codec.lossy else ""


@dataclass(frozen=True)
class CodecRecord:
    """A coded chunk's header fields (``format.ChunkHeader.codec``): hostile until ``geometry``."""

    code: int
    version: int
    dtype_code: int
    layout: int
    """``KVGeometry.layout_bits``."""
    k_group: int
    v_group: int
    layers: int
    pages: int
    rows: int
    row_elems: int
    raw_bytes: int

    def geometry(self) -> KVGeometry:
        """The geometry these fields state; GeometryError unless they are consistent."""
        geom = KVGeometry.from_code(self.layers, self.pages, self.rows, self.row_elems, self.dtype_code,
                                    self.layout)
        if geom.raw_bytes != self.raw_bytes:
            raise GeometryError(f"geometry of {geom.raw_bytes} bytes for a chunk of {self.raw_bytes}")
        for group, dim in ((self.k_group, geom.tokens), (self.v_group, geom.row_elems)):
            if group <= 0 or dim % group:
                raise GeometryError(f"group {group} does not divide {dim}")
        return geom


@dataclass(frozen=True)
class Encoder:
    """A pool's codec with the geometry of its chunks: what a writer needs to encode."""

    codec: Codec
    geometry: KVGeometry
    adaptive: bool = False
    """``auto``: each tier codes a chunk only while its rates say it pays (``worth_coding``)."""

    @property
    def ratio(self) -> float:
        """How many times fewer bytes a chunk stores coded (``auto``'s rule): exact for a codec
        of fixed sizes (fp8, k8v4, k8v8), the ``lossless`` figure measured on SmolLM2's KV otherwise."""
        sizes = getattr(self.codec, "sizes", None)
        if sizes is None:
            return LOSSLESS_RATIO
        stored: int = sum(sizes(self.geometry, *self.codec.groups(self.geometry)))
        return self.geometry.raw_bytes / stored

    def worth_coding(self, rates: CodecRates | None) -> bool:
        return not self.adaptive or rates is None or rates.worth_coding(self.ratio)

    def encode(self, raw: torch.Tensor) -> tuple[torch.Tensor, CodecRecord]:
        """The stored payload of ``raw`` (a chunk's bytes, 1-d uint8) and its header record.
        A codec that groups elements reads the pages the way the bytes say they lie
        (``KVGeometry.oriented``)."""
        codec, raw = self.codec, raw.reshape(-1)
        geom = self.geometry.oriented(raw) if codec.grouped else self.geometry
        kg, vg = codec.groups(geom)
        stored = codec.encode(raw, geom)
        return stored, CodecRecord(codec.code, codec.version, geom.dtype_code, geom.layout_bits, kg, vg,
                                   geom.layers, geom.pages, geom.rows, geom.row_elems, geom.raw_bytes)


def encoder_for(name: str, dtype: torch.dtype, layers: int, heads: int, head_dim: int, chunk_tokens: int,
                geometry: KVGeometry | None = None) -> Encoder | None:
    """The encoder of a store whose setting is ``name``; None for ``none``, or while the chunks'
    geometry is unknown (pages as bytes, before the engine integration states it: chunks are
    then written as they are). Without ``geometry``, kvtier's canonical layout ``[layers, 2,
    tokens, heads, head_dim]`` of ``dtype``."""
    codec = CODECS.get(AUTO_CODEC if name == AUTO else name)
    if codec is None:
        return None
    if geometry is None:
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return None
        geometry = KVGeometry(layers, 1, chunk_tokens * heads, head_dim, dtype, interleaved=False)
    return Encoder(codec, geometry, adaptive=name == AUTO)


def decode_into(record: CodecRecord, stored: torch.Tensor, out: torch.Tensor) -> None:
    """Decode ``stored`` into ``out`` (the chunk's bytes, 1-d uint8 of ``record.raw_bytes``).

    Raises UnknownCodec for a codec this kvtier does not know, CodecDataError (a ValueError) when
    the record or the bytes are inconsistent."""
    codec = by_code(record.code, record.version)
    try:
        geom = record.geometry()
    except GeometryError as exc:
        raise CodecDataError(str(exc)) from exc
    if out.numel() != record.raw_bytes:
        raise CodecDataError(f"a buffer of {out.numel()} bytes for a chunk of {record.raw_bytes}")
    sizes = getattr(codec, "sizes", None)
    if sizes is not None and stored.numel() != sum(sizes(geom, record.k_group, record.v_group)):
        raise CodecDataError(f"{stored.numel()} stored bytes; {codec.name} of this geometry stores "
                             f"{sum(sizes(geom, record.k_group, record.v_group))}")
    codec.decode(stored, geom, record.k_group, record.v_group, out)
