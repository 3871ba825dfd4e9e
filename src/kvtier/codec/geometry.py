"""Where K and V sit in a chunk's bytes, so a lossy codec can give each the grouping it needs.

A chunk's payload is ``layers`` layer segments in order. Within a layer, the K pages and V pages
(``rows`` tokens of ``row_elems`` elements each, ``pages`` of each per chunk) come either as all K
pages then all V pages (``interleaved`` False: kvtier's canonical ``[layers, 2, tokens, heads,
head_dim]`` and vLLM's K/V-major GPU caches) or page by page, each block's K page then its V page
(``interleaved`` True: vLLM's CPU cache, ``[blocks, heads, tokens, 2 * head_size]``, and the
``[blocks, 2, ...]`` GPU layouts).

A wrong geometry never corrupts a chunk: every codec reconstructs each element from its own
group's scale, whatever the grouping. It only groups elements that do not belong together,
which costs precision (measured by ``benchmarks/codec_quality.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @classmethod
    def from_code(cls, layers: int, pages: int, rows: int, row_elems: int, dtype_code: int,
                  interleaved: bool) -> KVGeometry:
        """From a chunk header's fields (hostile: raises GeometryError on any bad value)."""
        dtype = DTYPES_BY_CODE.get(dtype_code)
        if dtype is None:
            raise GeometryError(f"unknown element dtype code {dtype_code}")
        return cls(layers, pages, rows, row_elems, dtype, interleaved)

    def split(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``raw`` (the chunk's bytes, uint8) as views ``[layers, pages, rows,
        row_elems]`` each (strided: ``reshape(layers, tokens, row_elems)`` copies them)."""
        x = self._elements(raw)
        if self.interleaved:
            x = x.view(self.layers, self.pages, 2, self.rows, self.row_elems)
            return x[:, :, 0], x[:, :, 1]
        x = x.view(self.layers, 2, self.pages, self.rows, self.row_elems)
        return x[:, 0], x[:, 1]

    def join(self, out: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k`` and ``v`` (``[layers, tokens, row_elems]``, any float dtype) into ``out``
        (the chunk's bytes, uint8) in this geometry's order."""
        ko, vo = self.split(out)
        ko.copy_(k.reshape(ko.shape))
        vo.copy_(v.reshape(vo.shape))

    def _elements(self, raw: torch.Tensor) -> torch.Tensor:
        if raw.dtype != torch.uint8 or raw.dim() != 1 or not raw.is_contiguous():
            raise GeometryError("chunk bytes must be a contiguous 1-d uint8 tensor")
        if raw.numel() != self.raw_bytes:
            raise GeometryError(f"{raw.numel()} bytes, but this geometry describes {self.raw_bytes}")
        return raw.view(self.dtype)
