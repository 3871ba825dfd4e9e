"""The shape of one model's KV cache, as kvtier stores it.

kvtier's canonical chunk layout is ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``
(2 = K then V), contiguous, in ``dtype``. Engine integrations convert to and from their own
paged layouts; everything that reaches a tier is in this layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Stable on-disk codes: never renumber, only append. Chunk headers carry the code, so a file
# written with one dtype can never be read back as another.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.uint8: 6,
    torch.int8: 7,
}
DTYPES_BY_CODE: dict[int, torch.dtype] = {code: dt for dt, code in DTYPE_CODES.items()}
DTYPES_BY_NAME: dict[str, torch.dtype] = {str(dt).removeprefix("torch."): dt for dt in DTYPE_CODES}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Accept ``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"``."""
    if isinstance(value, torch.dtype):
        if value not in DTYPE_CODES:
            raise ValueError(f"dtype {value} is not supported; use one of {sorted(DTYPES_BY_NAME)}")
        return value
    name = str(value).removeprefix("torch.")
    if name not in DTYPES_BY_NAME:
        raise ValueError(f"dtype {value!r} is not supported; use one of {sorted(DTYPES_BY_NAME)}")
    return DTYPES_BY_NAME[name]


@dataclass(frozen=True)
class KVLayout:
    """Dimensions and element type of one model's KV cache (per parallel rank)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_bytes

    def shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Canonical tensor shape for ``num_tokens`` tokens."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict[str, object]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype_name,
        }
