"""The lossy codecs, as torch operations on the device that holds the chunk (CPU or GPU).

Each codec turns a chunk's raw bytes (``KVGeometry`` says where K and V are) into a stored
payload of a size fixed by the geometry, and back. Sections are concatenated as bytes, in the
order each class lists them. Every element is rebuilt from its own group's scale, so a stored
payload decodes to finite values of the right shape whatever it holds (a checksum guards its
bytes before a codec ever sees them).

* ``fp8``: float8 e4m3 with power-of-two scales (one signed byte each, the exponent): keys per
  channel over ``k_group`` (64) tokens, values per token over ``v_group`` (64) channels. A power
  of two only shifts the exponent, so the scale adds no rounding; each group's largest value
  lands in (224, 448], and nothing is clipped except non-finite input (and values past
  448 * 2**119, near bfloat16's largest).
* ``k8v4``: keys 8-bit, asymmetric, a float16 minimum and step per channel over ``k_group``
  (128) tokens; values 4-bit, asymmetric, a float16 minimum and step per token over ``v_group``
  (64) channels. Values past the float16 range are clamped to it.
* ``k8v8``: ``k8v4`` with 8-bit values (about 1.9x): fp8's size at uniform 8-bit precision.
* ``fp8_cast``: the baseline LMCache ships: a plain cast to e4m3, no scale, nothing clamped
  (values past +-448 become NaN). For comparison in ``benchmarks/codec_quality.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from kvtier.codec.geometry import KVGeometry

E4M3_MAX = 448.0
FP16_MAX = 65504.0


_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_E4M3_BY_DEVICE: dict[torch.device, torch.Tensor] = {}
# Scale exponents a chunk may carry: with e4m3's 2**-8 below (see _e4m3_half), 2**(e + 8) must
# stay a finite float32, so the largest is 119 (a group's largest value past 448 * 2**119, near
# bfloat16's own limit, is clipped to it).
_EXP_MIN, _EXP_MAX = -126, 119


def _e4m3(codes: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 codes (uint8) as float32: a 256-entry table, 13x faster on a CPU core than
    torch's float8 conversion, and the same values."""
    table = _E4M3_BY_DEVICE.get(codes.device)
    if table is None:
        table = _E4M3_BY_DEVICE.setdefault(codes.device, _E4M3_VALUES.to(codes.device))
    return table.index_select(0, codes.reshape(-1).int()).view(codes.shape)


def _e4m3_half(codes: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 codes (uint8) as float16 values 2**-8 times theirs, exactly, by moving bits.

    e4m3's sign, 4 exponent and 3 mantissa bits, shifted into float16's sign, low 4 exponent
    and top 3 mantissa bits, read as float16 2**(e - 15) * (1 + m/8) for a normal code (e4m3's
    2**(e - 7) * (1 + m/8), times 2**-8) and m/8 * 2**-14 for a subnormal one (e4m3's
    m/8 * 2**-6, times 2**-8). Integer shifts and one add, about 3x the table's rate; the two
    NaN codes, which the encoder never writes, read as +-480 * 2**-8."""
    h = codes.to(torch.int16)
    h <<= 7  # sign lands on bit 14, the magnitude on bits 7-13
    h += h & 0x4000  # bit 14 carried into bit 15, which was clear
    return h.view(torch.float16)


def _sections(stored: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, at = [], 0
    for n in sizes:
        out.append(stored[at:at + n])
        at += n
    return out


def _bytes(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])


def _kv_float(raw: torch.Tensor, geom: KVGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as contiguous float32 ``[layers, tokens, row_elems]``, whatever the pages'
    strides (a plain ``.float()`` would keep a transposed page's strides). A transposed page is
    put in order in its own dtype first, then widened: half the time of one transposing,
    widening copy."""
    shape = (geom.layers, geom.tokens, geom.row_elems)
    # A fresh copy always (a float32 chunk's .float() would be the chunk itself): encoders
    # overwrite it in place.
    k, v = (torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x.contiguous()).view(shape)
            for x in geom.split(raw))
    return k, v


def _pow2_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest e (int8) with amax / 2**e <= 448, or 0 for an all-zero group."""
    _, e = torch.frexp(amax / E4M3_MAX)  # amax / 448 = m * 2**e, 0.5 <= m < 1
    return torch.where(amax > 0, e, torch.zeros_like(e)).clamp(_EXP_MIN, _EXP_MAX).to(torch.int8)


class _ByLayers:
    """A grouped codec whose every section runs layer after layer: it decodes a few whole layers
    at a time (``_by_layers``), each group by its ``_decode``."""

    def sizes(self, geom: KVGeometry, kg: int, vg: int) -> list[int]:
        raise NotImplementedError

    def _decode(self, sections: list[torch.Tensor], geom: KVGeometry, kg: int, vg: int, out: torch.Tensor) -> None:
        raise NotImplementedError

    def decode(self, stored: torch.Tensor, geom: KVGeometry, kg: int, vg: int, out: torch.Tensor) -> None:
        _by_layers(lambda secs, g, o: self._decode(secs, g, kg, vg, o), _sections(stored, self.sizes(geom, kg, vg)),
                   geom, out)


class Fp8(_ByLayers):
    name, code, version, lossy, grouped = "fp8", 2, 2, True, True

    @staticmethod
    def groups(geom: KVGeometry) -> tuple[int, int]:
        """(k_group, v_group): 64 tokens per key scale, 64 channels per value scale, or fewer
        where a chunk or a row holds fewer (each divides its dimension)."""
        return _divisor(geom.tokens, 64), _divisor(geom.row_elems, 64)

    def sizes(self, geom: KVGeometry, kg: int, vg: int) -> list[int]:
        n = geom.layers * geom.tokens * geom.row_elems
        return [n, n, n // kg, n // vg]

    def encode(self, raw: torch.Tensor, geom: KVGeometry) -> torch.Tensor:
        # Version 1 coded each key's distance from its channel's mean over the group: with the
        # channels read right, that made the next-token KL worse than a plain cast's (e4m3's
        # error grows with the distance it codes, and a few outlying tokens move a mean far),
        # and a median cost 200 times a mean. e4m3 is relative: the scale only keeps each group
        # in range, so keys and values are coded as they are.
        kg, vg = self.groups(geom)
        k, v = _kv_float(raw, geom)
        L, T, C = k.shape
        kq, ke = _e4m3_groups(k.view(L, T // kg, kg, C), 2)
        vq, ve = _e4m3_groups(v.view(L, T, C // vg, vg), 3)
        return _bytes(kq, vq, ke, ve)

    def _decode(self, sections: list[torch.Tensor], geom: KVGeometry, kg: int, vg: int, out: torch.Tensor) -> None:
        L, T, C = geom.layers, geom.tokens, geom.row_elems
        kq, vq, ke, ve = sections
        k = _scaled(_e4m3_half(kq).view(L, T // kg, kg, C), ke, (L, T // kg, 1, C))
        v = _scaled(_e4m3_half(vq).view(L, T, C // vg, vg), ve, (L, T, C // vg, 1))
        if geom.dtype == torch.float16:  # e4m3's 256 * 2**8 rounds past float16's largest
            k.clamp_(-FP16_MAX, FP16_MAX)
            v.clamp_(-FP16_MAX, FP16_MAX)
        geom.join(out, k, v)


def _scaled(half: torch.Tensor, exps: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``half`` (e4m3 values times 2**-8) times 2**(e + 8) per group, as float32: a multiply by
    a power of two, so exact. A stored exponent past the encoder's range is clamped to it, so
    any byte decodes finite. (Widening first and multiplying in place takes a third of the time
    of one mixed-dtype multiply, which widens into temporaries of its own.)"""
    exps = exps.view(torch.int8).clamp(_EXP_MIN, _EXP_MAX).float()
    scale = torch.ldexp(torch.full((), 256.0, device=half.device), exps)
    return half.float().mul_(scale.view(shape))


def _e4m3_groups(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of ``x`` and a power-of-two exponent per group over ``dim``; infinities
    clamped to the float16 range first, NaN coded as 0. ``x`` (the encoder's own float copy)
    is overwritten: in place, the encoder allocates no more than its output."""
    x = x.nan_to_num_(posinf=FP16_MAX, neginf=-FP16_MAX)
    amax = torch.maximum(x.amax(dim=dim, keepdim=True), x.amin(dim=dim, keepdim=True).neg_())
    e = _pow2_exponent(amax)
    # x * 2**-e, as torch.ldexp computes it: a power of two, so exact
    return x.mul_(torch.pow(2.0, -e.float())).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), e


class K8V4(_ByLayers):
    """Keys 8-bit per channel over ``k_group`` tokens, values ``v_bits``-bit per token over
    ``v_group`` channels, both asymmetric with a float16 minimum and step per group."""

    name, code, version, lossy, grouped = "k8v4", 3, 1, True, True
    v_bits = 4

    @staticmethod
    def groups(geom: KVGeometry) -> tuple[int, int]:
        return _divisor(geom.tokens, 128), _divisor(geom.row_elems, 64)

    def sizes(self, geom: KVGeometry, kg: int, vg: int) -> list[int]:
        n = geom.layers * geom.tokens * geom.row_elems
        v_codes = (n + 1) // 2 if self.v_bits == 4 else n
        return [n, 2 * (n // kg), 2 * (n // kg), v_codes, 2 * (n // vg), 2 * (n // vg)]

    def encode(self, raw: torch.Tensor, geom: KVGeometry) -> torch.Tensor:
        kg, vg = self.groups(geom)
        k, v = _kv_float(raw, geom)
        L, T, C = k.shape
        kq, klo, kstep = _uniform(k.view(L, T // kg, kg, C), 2, 255)
        vq, vlo, vstep = _uniform(v.view(L, T, C // vg, vg), 3, (1 << self.v_bits) - 1)
        vq = vq.view(-1)
        if self.v_bits == 4:
            if vq.numel() % 2:
                vq = torch.cat([vq, vq.new_zeros(1)])
            vq = vq[0::2] | (vq[1::2] << 4)
        return _bytes(kq, klo, kstep, vq, vlo, vstep)

    def _decode(self, sections: list[torch.Tensor], geom: KVGeometry, kg: int, vg: int, out: torch.Tensor) -> None:
        L, T, C = geom.layers, geom.tokens, geom.row_elems
        kq, klo, kstep, vq, vlo, vstep = sections
        k = _dequant(kq.view(L, T // kg, kg, C), klo, kstep, (L, T // kg, 1, C))
        if self.v_bits == 4:
            vq = torch.stack([vq & 15, vq >> 4], dim=1).view(-1)[:L * T * C]
        v = _dequant(vq.view(L, T, C // vg, vg), vlo, vstep, (L, T, C // vg, 1))
        geom.join(out, k, v)  # join narrows to the chunk's dtype as it copies


class K8V8(K8V4):
    """``k8v4`` with 8-bit values: about fp8's size, with uniform 8-bit steps in place of e4m3's
    three mantissa bits (docs/codecs.md compares the two)."""

    name, code, version, lossy, grouped = "k8v8", 5, 1, True, True
    v_bits = 8


def _uniform(x: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform codes 0..levels of ``x`` over ``dim``, with a float16 minimum and step
    per group; the codes are taken from the stored (rounded) minimum and step, so decoding gives
    what was measured here. Values past the float16 range are clamped to it. ``x`` (the
    encoder's own float copy) is overwritten."""
    x = x.nan_to_num_(posinf=FP16_MAX, neginf=-FP16_MAX).clamp_(-FP16_MAX, FP16_MAX)
    lo = x.amin(dim=dim, keepdim=True).to(torch.float16)
    span = x.amax(dim=dim, keepdim=True) - lo.float()
    # A hair over span / levels: the step is rounded to float16 and must still reach the maximum.
    step = torch.where(span > 0, span / (levels - 0.02), torch.ones_like(span)).clamp(max=FP16_MAX).to(torch.float16)
    q = x.sub_(lo.float()).div_(step.float()).round_().clamp_(0, levels).to(torch.uint8)
    return q, lo, step


def _dequant(q: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Codes ``q`` back to values; ``lo`` and ``step`` are their float16 sections as bytes."""
    return q.float().mul_(step.view(torch.float16).float().view(shape)).add_(lo.view(torch.float16).float().view(shape))


class Fp8Cast:
    name, code, version, lossy, grouped = "fp8_cast", 4, 1, True, False

    @staticmethod
    def groups(geom: KVGeometry) -> tuple[int, int]:
        return 1, 1

    def sizes(self, geom: KVGeometry, kg: int, vg: int) -> list[int]:
        return [geom.elements]

    def encode(self, raw: torch.Tensor, geom: KVGeometry) -> torch.Tensor:
        geom.split(raw)  # checks the size
        return raw.view(geom.dtype).to(torch.float8_e4m3fn).view(torch.uint8)

    def decode(self, stored: torch.Tensor, geom: KVGeometry, kg: int, vg: int, out: torch.Tensor) -> None:
        out.view(geom.dtype).copy_(_e4m3(stored))


SLICE_BYTES = 1 << 20
"""Decoders work on whole layers at a time, about this many decoded bytes: their temporaries
(about three times what they decode) stay a few MiB per I/O thread instead of about 100 MiB for
an 8B-class model's 32 MiB chunk, and each pass reads what the one before it wrote from the
CPU's cache. Measured on SmolLM2's 5.9 MB chunk, one core: 1.03-1.12x the whole chunk's decode
rate (``benchmarks/codec_speed.py --heads 3``); two threads decoding at once gained little
either way (the dispatch of each torch op holds the GIL). Smaller slices cost more in
dispatch than they save (256 KiB: half the rate)."""


def _by_layers(decode: Callable[[list[torch.Tensor], KVGeometry, torch.Tensor], None], sections: list[torch.Tensor],
               geom: KVGeometry, out: torch.Tensor) -> None:
    """``decode(sections, geom, out)`` over groups of whole layers of about ``SLICE_BYTES``.

    Both a chunk's bytes and each section of a grouped codec run layer after layer, so a
    group's part of each is one slice; a section that does not split evenly by layers (4-bit
    codes of an odd count per layer) decodes the chunk whole."""
    L = geom.layers
    if L == 1 or any(sec.numel() % L for sec in sections):
        decode(sections, geom, out)
        return
    per_layer = geom.raw_bytes // L
    step = max(1, SLICE_BYTES // per_layer)
    for first in range(0, L, step):
        last = min(L, first + step)
        decode([sec[first * (sec.numel() // L):last * (sec.numel() // L)] for sec in sections],
               replace(geom, layers=last - first), out[first * per_layer:last * per_layer])


def _divisor(n: int, most: int) -> int:
    """The largest divisor of ``n`` that is at most ``most``."""
    for d in range(min(n, most), 0, -1):
        if n % d == 0:
            return d
    return 1
