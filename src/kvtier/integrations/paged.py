"""Copy whole KV pages between an engine's paged KV cache and kvtier chunks, as raw bytes.

An engine keeps KV in blocks of ``block_size`` tokens, in one or more tensors per layer whose
memory layout depends on the backend: vLLM's CPU backend hands ``[num_blocks, heads, tokens,
content]`` views, GPU backends strided views of a shared buffer in the resolved layout (NHD,
HND, block-outermost across layers), the older K/V-major ``[2, num_blocks, ...]``, fp8 caches
as ``uint8``, MLA's single latent "head". kvtier never interprets what a page holds; it finds,
from each tensor's shape and strides alone, the byte runs that make up one block, and moves
those bytes. The chunk's ``kv_format`` names the layout, so pages of one layout are never
loaded into another.

How a tensor becomes runs: the block dimension is dim 0 (or dim 0 split into kernel blocks,
``num_blocks * k`` rows), else dim 1 (``[2, num_blocks, ...]``). Of the other dimensions, the
ones that are dense in memory below the innermost stride form one contiguous run per block;
each index of the remaining ("outer") dimensions is a run of its own (K and V of a K/V-major
cache; heads of a head-outermost layout). A run is an ``as_strided`` byte view
``[num_blocks, run_bytes]`` over the engine's own storage: no ``reshape``, so never a silent
copy. A chunk holds its blocks' bytes run after run: ``[run][block of the chunk][run_bytes]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class LayoutError(ValueError):
    """A KV cache tensor whose blocks kvtier cannot address as byte runs."""


def block_runs(kv: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """Byte views ``[num_blocks, run_bytes]`` (uint8) that together hold every block of ``kv``.

    Raises LayoutError when no dimension indexes the blocks or the innermost dimension is not
    contiguous (then bytes of a block cannot be moved as runs).
    """
    if kv.dim() < 2:
        raise LayoutError(f"KV cache tensor of shape {tuple(kv.shape)}: expected at least 2 dims")
    if kv.stride(-1) != 1 and kv.shape[-1] != 1:
        raise LayoutError(f"KV cache tensor {tuple(kv.shape)} strides {kv.stride()}: innermost dim "
                          "not contiguous")
    raw = kv if kv.dtype == torch.uint8 else kv.view(torch.uint8)
    shape, strides = list(raw.shape), list(raw.stride())
    if shape[0] == num_blocks:
        block_dim = 0
    elif shape[0] > num_blocks and shape[0] % num_blocks == 0:
        # Kernel blocks: each manager block is split into k uniformly strided kernel blocks.
        k = shape[0] // num_blocks
        shape = [num_blocks, k, *shape[1:]]
        strides = [strides[0] * k, *strides]
        block_dim = 0
    elif len(shape) >= 3 and shape[1] == num_blocks:
        block_dim = 1
    else:
        raise LayoutError(f"KV cache tensor {tuple(kv.shape)}: no dimension of {num_blocks} blocks")
    block_stride = strides[block_dim]
    others = sorted(((strides[d], shape[d]) for d in range(len(shape)) if d != block_dim and shape[d] > 1),
                    reverse=True)
    run = 1
    while others and others[-1][0] == run:  # dense below: part of one contiguous run
        run *= others.pop()[1]
    outer = others  # each index combination of these is a run of its own
    offsets = [0]
    for stride, size in outer:
        offsets = [o + i * stride for o in offsets for i in range(size)]
    base = raw.storage_offset()
    return [torch.as_strided(raw, (num_blocks, run), (block_stride, 1), base + o) for o in offsets]


class PagedKV:
    """The paged KV tensors of one worker, as byte runs per block (see the module docstring)."""

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int) -> None:
        if not layers:
            raise LayoutError("no KV cache tensors")
        self.num_blocks = num_blocks
        self.device = layers[0].device
        self.runs: list[torch.Tensor] = []
        self.layer_block_bytes: list[int] = []
        for kv in layers:
            if kv.device != self.device:
                raise LayoutError(f"KV cache tensors on {kv.device} and {self.device}")
            runs = block_runs(kv, num_blocks)
            self.runs.extend(runs)
            self.layer_block_bytes.append(sum(r.shape[1] for r in runs))
        self._np_runs: list[Any] | None = None  # numpy views of ``runs`` (CPU), made on first use
        self.block_bytes = sum(self.layer_block_bytes)
        """Bytes of one block over all layers: a chunk of ``n`` blocks holds ``n * block_bytes``."""

    def _chunk_bytes(self, chunk: torch.Tensor, n_blocks: int) -> torch.Tensor:
        if not chunk.is_contiguous():
            raise ValueError("chunk buffer must be contiguous")
        flat = chunk.reshape(-1).view(torch.uint8)
        if flat.numel() != n_blocks * self.block_bytes:
            raise ValueError(f"chunk of {flat.numel()} bytes does not hold {n_blocks} blocks of "
                             f"{self.block_bytes} bytes")
        return flat

    def _pages(self, flat: torch.Tensor, n_blocks: int) -> list[torch.Tensor]:
        """The chunk's ``[n_blocks, run_bytes]`` piece for each run, in run order."""
        out, offset = [], 0
        for run in self.runs:
            size = n_blocks * run.shape[1]
            out.append(flat[offset:offset + size].view(n_blocks, run.shape[1]))
            offset += size
        return out

    def gather(self, block_ids: Sequence[int], chunk: torch.Tensor) -> None:
        """Copy the pages of ``block_ids`` (one chunk's blocks, in order) into ``chunk``."""
        flat = self._chunk_bytes(chunk, len(block_ids))
        idx = self._index(block_ids)
        for run, page in zip(self.runs, self._pages(flat, len(block_ids)), strict=True):
            if page.device == self.device:
                torch.index_select(run, 0, idx, out=page)
            else:  # e.g. GPU cache -> host slot: gather on the device, one copy over
                page.copy_(run.index_select(0, idx))

    def scatter(self, chunk: torch.Tensor, block_ids: Sequence[int | None]) -> None:
        """Copy ``chunk``'s pages into ``block_ids``; a None entry skips that block."""
        flat = self._chunk_bytes(chunk, len(block_ids))
        keep = [j for j, b in enumerate(block_ids) if b is not None]
        if not keep:
            return
        if self.device.type == "cpu" and flat.device.type == "cpu":
            # numpy copies, one memcpy per block and run: loads call this from I/O threads, where
            # torch's index_copy_ could start OpenMP teams that take the cores the engine's
            # forward pass is running on (measured: decode steps of other requests slowed).
            for run, page in zip(self._numpy_runs(), self._pages(flat, len(block_ids)), strict=True):
                src = page.numpy()
                for j in keep:
                    run[block_ids[j]] = src[j]
            return
        idx = self._index([block_ids[j] for j in keep])  # type: ignore[misc]
        src_idx = torch.tensor(keep, dtype=torch.long)
        whole = len(keep) == len(block_ids)
        for run, page in zip(self.runs, self._pages(flat, len(block_ids)), strict=True):
            src = page if whole else page.index_select(0, src_idx)
            # Asynchronous from page-locked memory; the caller orders and waits (transfer.PageMover).
            run.index_copy_(0, idx, src.to(self.device, non_blocking=True))

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Block ids as an index tensor on the cache's device. On an accelerator through
        page-locked memory and a non-blocking copy: ``torch.tensor(ids, device=cuda)`` copies
        synchronously, which stalls the engine thread of every saving step."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        if self.device.type == "cpu":
            return idx
        return idx.pin_memory().to(self.device, non_blocking=True)

    def _numpy_runs(self) -> list[Any]:
        if self._np_runs is None:
            self._np_runs = [run.numpy() for run in self.runs]
        return self._np_runs
