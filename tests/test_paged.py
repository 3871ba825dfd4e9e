"""PagedKV: whole KV pages between an engine's paged cache and kvtier chunks, byte-exact."""

from __future__ import annotations

import pytest
import torch

from kvtier.integrations.paged import PagedKV

BLOCKS, HEADS, BS, D, LAYERS = 10, 2, 4, 8, 3


def cpu_layout() -> list[torch.Tensor]:
    """vLLM CPU: per layer [num_blocks, kv_heads, 2 * block_size, head_dim]."""
    return [torch.randn(BLOCKS, HEADS, 2 * BS, D).to(torch.bfloat16) for _ in range(LAYERS)]


def kv_major_layout() -> list[torch.Tensor]:
    """vLLM GPU FlashAttention: per layer [2, num_blocks, block_size, kv_heads, head_dim]."""
    return [torch.randn(2, BLOCKS, BS, HEADS, D).to(torch.bfloat16) for _ in range(LAYERS)]


@pytest.mark.parametrize("make", [cpu_layout, kv_major_layout])
def test_gather_then_scatter_moves_exact_pages(make) -> None:  # type: ignore[no-untyped-def]
    src_layers = make()
    src = PagedKV(src_layers, BLOCKS, BS)
    chunk = torch.empty(LAYERS, 2, 2 * BS, HEADS, D, dtype=torch.bfloat16)  # 2 blocks per chunk
    src.gather([7, 2], chunk)
    dst_layers = [torch.zeros_like(t) for t in src_layers]
    dst = PagedKV(dst_layers, BLOCKS, BS)
    dst.scatter(chunk, [1, 5])
    for s, d in zip(src_layers, dst_layers, strict=True):
        if s.shape[0] == 2:
            s, d = s.transpose(0, 1), d.transpose(0, 1)  # index blocks first
        assert torch.equal(d[1].view(torch.uint8), s[7].view(torch.uint8))
        assert torch.equal(d[5].view(torch.uint8), s[2].view(torch.uint8))
        untouched = [b for b in range(BLOCKS) if b not in (1, 5)]
        assert not d[untouched].any()


def test_scatter_skips_blocks_marked_none() -> None:
    layers = cpu_layout()
    paged = PagedKV(layers, BLOCKS, BS)
    chunk = torch.empty(LAYERS, 2, 2 * BS, HEADS, D, dtype=torch.bfloat16)
    paged.gather([3, 4], chunk)
    before = [t.clone() for t in layers]
    paged.scatter(chunk, [None, 8])  # block 0 of the chunk is already computed: leave it
    for b, t in zip(before, layers, strict=True):
        assert torch.equal(t[8], b[4])
        assert torch.equal(t[[i for i in range(BLOCKS) if i != 8]], b[[i for i in range(BLOCKS) if i != 8]])


def test_a_chunk_of_the_wrong_size_or_dtype_is_refused() -> None:
    paged = PagedKV(cpu_layout(), BLOCKS, BS)
    with pytest.raises(ValueError, match="does not hold"):
        paged.gather([1, 2], torch.empty(LAYERS, 2, BS, HEADS, D, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not hold"):
        paged.gather([1, 2], torch.empty(LAYERS, 2, 2 * BS, HEADS, D, dtype=torch.float16))
    with pytest.raises(ValueError, match="unsupported KV cache tensor shape"):
        PagedKV([torch.empty(3, 7)], BLOCKS, BS)
