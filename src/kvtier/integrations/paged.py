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

Head shards (``head_runs``): to store KV independently of the tensor-parallel size, each KV head
is a chunk of its own. The runs of one head are ``as_strided`` views ``[num_blocks, *inner]``:
the head's slice of the dimensions below the block stride, in stride order (a strided view
when heads are interleaved with tokens, as in NHD), and one run per index of the dimensions
above it (K and V of a K/V-major cache). A head's bytes are thus the same whichever rank, of
whatever tensor-parallel size, holds it, as long as the layout is the same.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier.codec import FLOAT_DTYPES, KVGeometry


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


def head_dim_of(kv: torch.Tensor, heads: int) -> int | None:
    """The dimension of a per-layer KV tensor that indexes its ``heads`` KV heads, for the shapes
    vLLM 0.32 hands connectors: ``[blocks, heads, tokens, content]`` (any stride order, kernel
    blocks included), ``[blocks, 2, tokens, heads, head_size]`` (K and V in separate page halves)
    or the K/V-major ``[2, blocks, tokens, heads, head_size]``. None when ``heads`` is 1 (nothing
    to split) or the shape is none of these."""
    if heads == 1:
        return None
    if kv.dim() == 4 and kv.shape[1] == heads:
        return 1
    if kv.dim() == 5 and 2 in (kv.shape[0], kv.shape[1]) and kv.shape[3] == heads:
        return 3
    return None


def head_runs(kv: torch.Tensor, num_blocks: int, heads: int, head_dim: int | None) -> list[list[torch.Tensor]]:
    """Per KV head, the byte views ``[num_blocks, *inner]`` (uint8) that hold that head of every
    block of ``kv`` (see the module docstring). ``head_dim`` None: ``kv`` holds one head.

    Raises LayoutError as ``block_runs`` does, or when ``head_dim`` does not hold ``heads``.
    """
    if heads > 1 and (head_dim is None or not 0 <= head_dim < kv.dim() or kv.shape[head_dim] != heads):
        raise LayoutError(f"KV cache tensor {tuple(kv.shape)}: no dimension {head_dim} of {heads} heads")
    if kv.stride(-1) != 1 and kv.shape[-1] != 1:
        raise LayoutError(f"KV cache tensor {tuple(kv.shape)} strides {kv.stride()}: innermost dim "
                          "not contiguous")
    elem = kv.element_size()
    shape = [*kv.shape[:-1], kv.shape[-1] * elem]  # the innermost dim in bytes
    strides = [s * elem for s in kv.stride()[:-1]] + [1]
    if shape[0] == num_blocks:
        block_dim = 0
    elif shape[0] > num_blocks and shape[0] % num_blocks == 0:
        k = shape[0] // num_blocks  # kernel blocks: one more (inner) dimension
        shape, strides = [num_blocks, k, *shape[1:]], [strides[0] * k, *strides]
        block_dim = 0
        head_dim = None if head_dim is None else head_dim + 1
    elif len(shape) >= 3 and shape[1] == num_blocks:
        block_dim = 1
    else:
        raise LayoutError(f"KV cache tensor {tuple(kv.shape)}: no dimension of {num_blocks} blocks")
    block_stride = strides[block_dim]
    dims = [d for d in range(len(shape)) if d not in (block_dim, head_dim) and shape[d] > 1]
    outer = sorted((d for d in dims if strides[d] > block_stride), key=lambda d: -strides[d])
    inner = sorted((d for d in dims if strides[d] < block_stride), key=lambda d: -strides[d])
    offsets = [0]
    for d in outer:
        offsets = [o + i * strides[d] for o in offsets for i in range(shape[d])]
    raw = kv if kv.dtype == torch.uint8 else kv.view(torch.uint8)
    base = raw.storage_offset()
    size = (num_blocks, *(shape[d] for d in inner))
    stride = (block_stride, *(strides[d] for d in inner))
    head_stride = 0 if head_dim is None else strides[head_dim]
    return [[torch.as_strided(raw, size, stride, base + h * head_stride + o) for o in offsets]
            for h in range(heads)]


class PagedKV:
    """The paged KV tensors of one worker, as byte runs per block (see the module docstring).

    With ``heads`` (the KV heads each layer's tensor holds, found at ``head_dims``) each head is
    a shard of its own (``head_runs``): ``gather`` and ``scatter`` move one shard's pages, and
    ``block_bytes`` is one shard's. Without, one shard holds the whole block (``block_runs``).
    """

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int, *, heads: int = 1,
                 head_dims: Sequence[int | None] | None = None) -> None:
        if not layers:
            raise LayoutError("no KV cache tensors")
        self.num_blocks = num_blocks
        self.device = layers[0].device
        self.dtype = layers[0].dtype
        """The engine's element type (``uint8`` for an fp8 cache)."""
        self.shards = heads if head_dims is not None else 1
        self.shard_runs: list[list[torch.Tensor]] = [[] for _ in range(self.shards)]
        self.layer_block_bytes: list[int] = []
        for i, kv in enumerate(layers):
            if kv.device != self.device:
                raise LayoutError(f"KV cache tensors on {kv.device} and {self.device}")
            per_shard = [block_runs(kv, num_blocks)] if head_dims is None else \
                head_runs(kv, num_blocks, heads, head_dims[i])
            for runs, shard in zip(per_shard, self.shard_runs, strict=True):
                shard.extend(runs)
            self.layer_block_bytes.append(sum(_run_bytes(r) for r in per_shard[0]))
        self.runs = self.shard_runs[0]
        self._np_runs: list[list[Any]] | None = None  # numpy views of ``shard_runs`` (CPU), made on first use
        self._regions: list[list[tuple[memoryview, int, int]] | None] | None = None  # ``_page_regions``
        # Per shard, each run's (bytes per block, shape of one block's piece): the chunk's layout,
        # computed once (a torch view per run and call cost more than the copies themselves).
        self._run_shapes = [[(_run_bytes(r), tuple(r.shape[1:])) for r in runs] for runs in self.shard_runs]
        self.block_bytes = sum(self.layer_block_bytes)
        """Bytes of one block of one shard over all layers: a chunk of ``n`` blocks holds
        ``n * block_bytes``."""

    def kv_geometry(self, layers: int, block_size: int, chunk_blocks: int) -> KVGeometry | None:
        """Where K and V sit in a chunk of ``chunk_blocks`` blocks of one shard, for a KV codec:
        rows of one head's ``head_size`` elements, a page per block for each of K and V, K before
        V. One run per layer holds each block's K page then its V page (vLLM's CPU cache, the
        ``[blocks, 2, ...]`` layouts); two runs per layer hold all K pages, then all V pages (the
        K/V-major caches). None for pages that are not floating point (an fp8 cache)."""
        dtype = self.dtype
        if dtype not in FLOAT_DTYPES or len(self.runs) % layers or self.block_bytes % layers:
            return None
        elem = torch.empty((), dtype=dtype).element_size()
        row_elems, rest = divmod(self.block_bytes // layers, 2 * block_size * elem)
        if rest or not row_elems:
            return None
        return KVGeometry(layers, chunk_blocks, block_size, row_elems, dtype,
                          interleaved=len(self.runs) // layers == 1)

    def _chunk_bytes(self, chunk: torch.Tensor, n_blocks: int) -> torch.Tensor:
        if not chunk.is_contiguous():
            raise ValueError("chunk buffer must be contiguous")
        flat = chunk.reshape(-1).view(torch.uint8)
        if flat.numel() != n_blocks * self.block_bytes:
            raise ValueError(f"chunk of {flat.numel()} bytes does not hold {n_blocks} blocks of "
                             f"{self.block_bytes} bytes")
        return flat

    def _pages(self, flat: Any, n_blocks: int, shard: int) -> list[Any]:
        """The chunk's ``[n_blocks, *run shape]`` piece for each run of ``shard``, in run order:
        views of ``flat``, a torch tensor or (CPU: numpy slices cost a fraction of torch views)
        its numpy array. ``flat`` is contiguous (``_chunk_bytes``), so no piece is a copy."""
        numpy = isinstance(flat, np.ndarray)
        out, offset = [], 0
        for run_bytes, shape in self._run_shapes[shard]:
            piece = flat[offset:offset + n_blocks * run_bytes]
            out.append(piece.reshape(n_blocks, *shape) if numpy else piece.view(n_blocks, *shape))
            offset += n_blocks * run_bytes
        return out

    def gather(self, block_ids: Sequence[int], chunk: torch.Tensor, shard: int = 0) -> None:
        """Copy the pages of ``block_ids`` (one chunk's blocks, in order) of ``shard`` into ``chunk``."""
        flat = self._chunk_bytes(chunk, len(block_ids))
        if self.device.type == "cpu" and flat.device.type == "cpu":
            # numpy copies, one per run and span of consecutive blocks (as scatter): torch's
            # index_select costs about 4x as much per chunk here, on the engine's own thread.
            spans = _spans(block_ids, range(len(block_ids)))
            pages = self._pages(flat.numpy(), len(block_ids), shard)
            for run, page in zip(self._numpy_runs()[shard], pages, strict=True):
                for j, b, n in spans:
                    page[j:j + n] = run[b:b + n]
            return
        idx = self._index(block_ids)
        for run, page in zip(self.shard_runs[shard], self._pages(flat, len(block_ids), shard), strict=True):
            if page.device == self.device:
                torch.index_select(run, 0, idx, out=page)
            else:  # e.g. GPU cache -> host slot: gather on the device, one copy over
                page.copy_(run.index_select(0, idx))

    def scatter(self, chunk: torch.Tensor, block_ids: Sequence[int | None], shard: int = 0) -> None:
        """Copy ``chunk``'s pages into ``block_ids`` of ``shard``; a None entry skips that block."""
        flat = self._chunk_bytes(chunk, len(block_ids))
        keep = [j for j, b in enumerate(block_ids) if b is not None]
        if not keep:
            return
        if self.device.type == "cpu" and flat.device.type == "cpu":
            # numpy copies, one per run and span of consecutive blocks (a fresh request's blocks
            # mostly are): per-block torch views and copies cost 17x the memcpy of the same bytes
            # (8 ms against 0.45 ms for an 8k load of the tiny model), and torch's index_copy_
            # needs an OpenMP team on the engine's cores.
            spans = _spans(block_ids, keep)
            pages = self._pages(flat.numpy(), len(block_ids), shard)
            for run, page in zip(self._numpy_runs()[shard], pages, strict=True):
                for j, b, n in spans:
                    run[b:b + n] = page[j:j + n]
            return
        idx = self._index([block_ids[j] for j in keep])  # type: ignore[misc]
        src_idx = torch.tensor(keep, dtype=torch.long)
        whole = len(keep) == len(block_ids)
        for run, page in zip(self.shard_runs[shard], self._pages(flat, len(block_ids), shard), strict=True):
            src = page if whole else page.index_select(0, src_idx)
            # Asynchronous from page-locked memory; the caller orders and waits (transfer.PageMover).
            run.index_copy_(0, idx, src.to(self.device, non_blocking=True))

    def page_views(self, block_ids: Sequence[int | None], shard: int = 0) -> list[memoryview] | None:
        """Writable byte views of the pages of ``block_ids`` (one chunk's blocks, in order) of
        ``shard``, in the chunk's byte order (``[run][block][run_bytes]``): reading a chunk's
        payload into them in order is ``scatter`` without the copy. Consecutive blocks whose
        pages are adjacent in memory share one view. None where that cannot be: an accelerator
        cache, a None entry, or a page that is not one contiguous piece (heads interleaved
        with tokens, as in NHD). The views are valid while this object lives.
        """
        if any(b is None for b in block_ids):
            return None
        regions = self._page_regions(shard)
        if regions is None:
            return None
        spans = _spans(block_ids, range(len(block_ids)))
        views: list[memoryview] = []
        for region, stride, size in regions:
            for _, b, n in spans:
                start = b * stride
                if stride == size:  # the span's pages are adjacent: one view
                    views.append(region[start:start + n * size])
                else:
                    views.extend(region[i:i + size] for i in range(start, start + n * stride, stride))
        return views

    def _page_regions(self, shard: int) -> list[tuple[memoryview, int, int]] | None:
        """Per run of ``shard``: a byte view of the memory its blocks span (from block 0), its
        block stride and one block's piece size in bytes; None on an accelerator or when a
        block's piece is not contiguous. Made once per shard: slicing a memoryview costs a
        fraction of a numpy or torch view per page."""
        if self._regions is None:
            self._regions = [self._regions_of(runs) for runs in self.shard_runs]
        return self._regions[shard]

    def _regions_of(self, runs: list[torch.Tensor]) -> list[tuple[memoryview, int, int]] | None:
        if self.device.type != "cpu":
            return None
        out = []
        for run in runs:
            piece = run[0]
            if not piece.is_contiguous():
                return None
            size, stride = piece.numel(), run.stride(0)
            span = (self.num_blocks - 1) * stride + size
            # A view over the engine's own memory (the run's tensors keep it alive, as ``self`` does).
            region = (ctypes.c_ubyte * span).from_address(run.data_ptr())
            out.append((memoryview(region).cast("B"), stride, size))
        return out

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Block ids as an index tensor on the cache's device. On an accelerator through
        page-locked memory and a non-blocking copy: ``torch.tensor(ids, device=cuda)`` copies
        synchronously, which stalls the engine thread of every saving step."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        if self.device.type == "cpu":
            return idx
        return idx.pin_memory().to(self.device, non_blocking=True)

    def _numpy_runs(self) -> list[list[Any]]:
        if self._np_runs is None:
            self._np_runs = [[run.numpy() for run in runs] for runs in self.shard_runs]
        return self._np_runs


def _spans(block_ids: Sequence[int | None], keep: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(j, b, n)``: chunk blocks ``j..j+n-1`` go to engine blocks ``b..b+n-1``, for the
    positions ``keep`` (ascending; their block ids not None), consecutive ones merged."""
    spans: list[tuple[int, int, int]] = []
    for j in keep:
        b = block_ids[j]
        assert b is not None
        if spans:
            j0, b0, n = spans[-1]
            if j == j0 + n and b == b0 + n:
                spans[-1] = (j0, b0, n + 1)
                continue
        spans.append((j, b, 1))
    return spans


def _run_bytes(run: torch.Tensor) -> int:
    """Bytes of one block of a run (``[num_blocks, *inner]`` uint8)."""
    return run[0].numel()
