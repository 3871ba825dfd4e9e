"""Copy whole KV pages between an engine's paged KV cache and kvtier chunks.

An engine keeps KV in blocks of ``block_size`` tokens, one tensor per layer. kvtier stores a
chunk of ``chunk_tokens`` tokens (a multiple of the block size) as the raw bytes of its
blocks' pages, layer after layer: the engine's in-block layout (which on vLLM's CPU backend
depends on the CPU's instruction set, and on GPUs on the attention backend) is never
interpreted, only moved. The namespace's ``kv_format`` names that layout, so pages of one
format are never loaded into another.

Two per-layer tensor layouts are understood:

* block-major ``[num_blocks, ...]`` (vLLM CPU: ``[num_blocks, kv_heads, 2 * block_size,
  head_dim]`` viewed as ``[num_blocks, page]``): one page per block;
* K/V-major ``[2, num_blocks, ...]`` (vLLM GPU FlashAttention): a K page and a V page.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PagedKV:
    """The paged KV tensors of one worker, as pages ``[num_blocks, page_elems]``."""

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int, block_size: int) -> None:
        if not layers:
            raise ValueError("no KV cache tensors")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.views: list[torch.Tensor] = []
        for kv in layers:
            if kv.shape[0] == num_blocks:
                self.views.append(kv.view(num_blocks, -1))
            elif kv.dim() >= 2 and kv.shape[0] == 2 and kv.shape[1] == num_blocks:
                self.views.extend((kv[0].reshape(num_blocks, -1), kv[1].reshape(num_blocks, -1)))
            else:
                raise ValueError(f"unsupported KV cache tensor shape {tuple(kv.shape)} for {num_blocks} blocks")
        self.page_elems = self.views[0].shape[1]
        self.dtype = self.views[0].dtype
        self.device = self.views[0].device

    def chunk_elems(self, blocks_per_chunk: int) -> int:
        """Elements of one chunk's pages (all layers)."""
        return len(self.views) * blocks_per_chunk * self.page_elems

    def _as_pages(self, chunk: torch.Tensor, blocks_per_chunk: int) -> torch.Tensor:
        if chunk.numel() != self.chunk_elems(blocks_per_chunk) or chunk.dtype != self.dtype:
            raise ValueError(f"chunk of {chunk.numel()} {chunk.dtype} does not hold {blocks_per_chunk} "
                             f"blocks of {len(self.views)} x {self.page_elems} {self.dtype}")
        return chunk.view(len(self.views), blocks_per_chunk, self.page_elems)

    def gather(self, block_ids: Sequence[int], chunk: torch.Tensor) -> None:
        """Copy the pages of ``block_ids`` (one chunk's blocks, in order) into ``chunk``."""
        pages = self._as_pages(chunk, len(block_ids))
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for i, view in enumerate(self.views):
            if self.device == pages.device:
                torch.index_select(view, 0, idx, out=pages[i])
            else:  # e.g. GPU cache -> host slot: gather on the device, one copy over
                pages[i].copy_(view.index_select(0, idx))

    def scatter(self, chunk: torch.Tensor, block_ids: Sequence[int | None]) -> None:
        """Copy ``chunk``'s pages into ``block_ids``; a None entry skips that block."""
        pages = self._as_pages(chunk, len(block_ids))
        keep = [j for j, b in enumerate(block_ids) if b is not None]
        if not keep:
            return
        idx = torch.tensor([block_ids[j] for j in keep], dtype=torch.long, device=self.device)
        src_idx = torch.tensor(keep, dtype=torch.long)
        whole = len(keep) == len(block_ids)
        for i, view in enumerate(self.views):
            src = pages[i] if whole else pages[i].index_select(0, src_idx)
            view.index_copy_(0, idx, src.to(self.device, non_blocking=True))
