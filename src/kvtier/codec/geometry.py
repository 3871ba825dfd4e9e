"""Where K and V sit in a chunk's bytes, so a lossy codec can give each the grouping it needs.

A chunk's payload is ``layers`` layer segments in order. Within a layer, the K pages and V pages
(``rows`` tokens of ``row_elems`` elements each, ``pages`` of each per chunk) come either as all K
pages then all V pages (``interleaved`` False: kvtier's canonical ``[layers, 2, tokens, heads,
head_dim]`` and vLLM's K/V-major GPU caches) or page by page, each block's K page then its V page
(``interleaved`` True: vLLM's CPU cache, ``[blocks, heads, tokens, 2 * head_size]``, and the
``[blocks, 2, ...]`` GPU layouts).

A page stores its ``rows`` tokens either token by token (``[rows, row_elems]``: GPU caches,
vLLM's CPU values) or channel by channel (``[row_elems, rows]``: vLLM's CPU build stores keys
so, its ``vec`` kernels reading a channel across tokens). The engine's shapes do not tell
which, so ``oriented`` looks at the bytes: a channel's values share an offset (keys most of
all), so the grouping whose per-channel means spread the most is the one whose channels are
real. The choice is recorded in the chunk (``k_channels_first``, ``v_channels_first``).

A wrong geometry never corrupts a chunk: every codec reconstructs each element from its own
group's scale, whatever the grouping. It only groups elements that do not belong together,
which costs precision (measured by ``benchmarks/codec_quality.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvtier.layout import DTYPE_CODES, DTYPES_BY_CODE

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GeometryError(ValueError):
    """A geometry that does not describe the bytes it is applied to."""


@dataclass(frozen=True)
class KVGeometry:
    layers: int
    pages: int
    """K pages (and as many V pages) per layer in one chunk."""
    rows: int
    """Tokens (rows) per page."""
    row_elems: int
    """Elements per row: a head's ``head_dim``."""
    dtype: torch.dtype = torch.bfloat16
    interleaved: bool = False
    k_channels_first: bool = False
    """K pages hold ``[row_elems, rows]``: a channel's tokens side by side."""
    v_channels_first: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "pages", "rows", "row_elems"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 1 << 31:
                raise GeometryError(f"KVGeometry.{name}: {value!r} is not a positive int")
        if self.dtype not in FLOAT_DTYPES:
            raise GeometryError(f"KV elements of {self.dtype}: a codec needs bfloat16, float16 or float32 pages")

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def tokens(self) -> int:
        """Rows of K (and of V) per layer in one chunk."""
        return self.pages * self.rows

    @property
    def elements(self) -> int:
        return self.layers * 2 * self.tokens * self.row_elems

    @property
    def raw_bytes(self) -> int:
        return self.elements * self.element_bytes

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES[self.dtype]

    @property
    def layout_bits(self) -> int:
        """How pages are laid out, as a chunk header stores it: bit 0 ``interleaved``, bit 1
        ``k_channels_first``, bit 2 ``v_channels_first``."""
        return int(self.interleaved) | int(self.k_channels_first) << 1 | int(self.v_channels_first) << 2

    @classmethod
    def from_code(cls, layers: int, pages: int, rows: int, row_elems: int, dtype_code: int,
                  layout_bits: int) -> KVGeometry:
        """From a chunk header's fields (hostile: raises GeometryError on any bad value)."""
        dtype = DTYPES_BY_CODE.get(dtype_code)
        if dtype is None:
            raise GeometryError(f"unknown element dtype code {dtype_code}")
        if not 0 <= layout_bits < 8:
            raise GeometryError(f"unknown page layout bits {layout_bits:#x}")
        return cls(layers, pages, rows, row_elems, dtype, bool(layout_bits & 1), bool(layout_bits & 2),
                   bool(layout_bits & 4))

    def split(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``raw`` (the chunk's bytes, uint8) as views ``[layers, pages, rows,
        row_elems]`` each (strided: ``reshape(layers, tokens, row_elems)`` copies them)."""
        x = self._elements(raw)
        page = self.rows * self.row_elems
        if self.interleaved:
            x = x.view(self.layers, self.pages, 2, page)
            k, v = x[:, :, 0], x[:, :, 1]
        else:
            x = x.view(self.layers, 2, self.pages, page)
            k, v = x[:, 0], x[:, 1]
        return self._page(k, self.k_channels_first), self._page(v, self.v_channels_first)

    def _page(self, flat: torch.Tensor, channels_first: bool) -> torch.Tensor:
        lead = tuple(flat.shape[:-1])
        if channels_first:
            return flat.view(*lead, self.row_elems, self.rows).transpose(-1, -2)
        return flat.view(*lead, self.rows, self.row_elems)

    def oriented(self, raw: torch.Tensor) -> KVGeometry:
        """This geometry with each of K and V read the way ``raw``'s bytes say its channels lie
        (see the module's docstring); the same geometry when rows and channels cannot be told
        apart (a page of one row or one channel)."""
        if self.rows < 2 or self.row_elems < 2:
            return self
        tokens_first = replace(self, k_channels_first=False, v_channels_first=False)
        channels_first = replace(self, k_channels_first=True, v_channels_first=True)
        (k0, v0), (k1, v1) = tokens_first.split(raw), channels_first.split(raw)
        return replace(self, k_channels_first=_channel_spread(k1) > _channel_spread(k0),
                       v_channels_first=_channel_spread(v1) > _channel_spread(v0))

    def join(self, out: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k`` and ``v`` (``[layers, tokens, row_elems]``, any float dtype) into ``out``
        (the chunk's bytes, uint8) in this geometry's order."""
        ko, vo = self.split(out)
        for dst, src, channels_first in ((ko, k, self.k_channels_first), (vo, v, self.v_channels_first)):
            if channels_first and src.dtype != self.dtype:
                # Narrowed in order first: a transposing copy of float32 into bfloat16 took twice
                # as long as the narrowing and a transposing copy of bfloat16 together.
                src = src.to(self.dtype)
            dst.copy_(src.reshape(dst.shape))

    def _elements(self, raw: torch.Tensor) -> torch.Tensor:
        if raw.dtype != torch.uint8 or raw.dim() != 1 or not raw.is_contiguous():
            raise GeometryError("chunk bytes must be a contiguous 1-d uint8 tensor")
        if raw.numel() != self.raw_bytes:
            raise GeometryError(f"{raw.numel()} bytes, but this geometry describes {self.raw_bytes}")
        return raw.view(self.dtype)


def _channel_spread(pages: torch.Tensor) -> float:
    """How far the per-channel means of ``pages`` (``[..., rows, channels]``) spread, per page."""
    means = pages.mean(dim=-2, dtype=torch.float32)
    return float(means.var(dim=-1).mean())
