"""PagedKV: whole KV pages between an engine's paged cache and kvtier chunks, byte-exact.

The layouts are built the way vLLM 0.32 builds them (``create_kv_cache_views``: one flat byte
buffer, per-layer ``as_strided`` views of the logical ``[L, B, H, N, C]`` in a physical stride
order), on CPU tensors, so every layout a GPU backend can hand the connector is tested here.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvtier.integrations.paged import LayoutError, PagedKV, block_runs, head_dim_of

BLOCKS, HEADS, BS, D, LAYERS = 10, 2, 4, 8, 3

# vLLM's KVCacheLayout stride orders (logical dims L=0, B=1, H=2, N=3, C=4 in physical order).
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),  # HND, the CPU backend's and kvtier's required layout
    "LBNHC": (0, 1, 3, 2, 4),  # NHD, FlashAttention's default
    "LHBNC": (0, 2, 1, 3, 4),  # heads outermost within a layer
    "BLHNC": (1, 0, 2, 3, 4),  # block-outermost across layers (cross-layer blocks)
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def vllm_views(order: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, heads: int = HEADS,
               content: int = 2 * D, kernel_split: int = 1) -> list[torch.Tensor]:
    """Per-layer views as vLLM's create_kv_cache_views makes them, over random bytes."""
    elem = torch.empty((), dtype=dtype).element_size()
    blocks, tokens = BLOCKS * kernel_split, BS // kernel_split
    shape = (LAYERS, blocks, heads, tokens, content * elem)  # C in bytes
    strides, current = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = current
        current *= shape[dim]
    raw = torch.randint(0, 256, (current,), dtype=torch.uint8)
    view = torch.as_strided(raw, shape, strides)
    return [view[layer].view(dtype) for layer in range(LAYERS)]


def cpu_layout() -> list[torch.Tensor]:
    """vLLM CPU: per layer contiguous [num_blocks, kv_heads, block_size, 2 * head_dim]."""
    return [torch.randn(BLOCKS, HEADS, BS, 2 * D).to(torch.bfloat16) for _ in range(LAYERS)]


def kv_major_layout() -> list[torch.Tensor]:
    """Older FlashAttention: per layer [2, num_blocks, block_size, kv_heads, head_dim]."""
    return [torch.randn(2, BLOCKS, BS, HEADS, D).to(torch.bfloat16) for _ in range(LAYERS)]


def block_bytes(t: torch.Tensor, b: int) -> bytes:
    """Every byte of block ``b`` of a per-layer tensor, in logical order (the oracle)."""
    if t.shape[0] == 2 and t.dim() == 5:  # K/V-major
        return b"".join(t[i, b].contiguous().view(torch.uint8).numpy().tobytes() for i in range(2))
    if t.shape[0] != BLOCKS:  # kernel blocks
        k = t.shape[0] // BLOCKS
        return b"".join(t[b * k + i].contiguous().view(torch.uint8).numpy().tobytes() for i in range(k))
    return t[b].contiguous().view(torch.uint8).numpy().tobytes()


def chunk_for(paged: PagedKV, n_blocks: int) -> torch.Tensor:
    return torch.zeros(n_blocks * paged.block_bytes, dtype=torch.uint8)


CASES = {
    "cpu": cpu_layout,
    "kv-major": kv_major_layout,
    **{name: (lambda order=order: vllm_views(order)) for name, order in LAYOUTS.items()},
    "fp8-as-uint8-NHD": lambda: vllm_views(LAYOUTS["LBNHC"], dtype=torch.uint8),
    "fp8-e4m3-HND": lambda: vllm_views(LAYOUTS["LBHNC"], dtype=torch.float8_e4m3fn),
    "mla-latent": lambda: vllm_views(LAYOUTS["LBHNC"], heads=1, content=72),
    "mla-fp8-cross-layer": lambda: vllm_views(LAYOUTS["BLHNC"], dtype=torch.uint8, heads=1, content=72),
    "kernel-blocks-HND": lambda: vllm_views(LAYOUTS["LBHNC"], kernel_split=2),
    "kernel-blocks-NHD": lambda: vllm_views(LAYOUTS["LBNHC"], kernel_split=2),
    "kernel-blocks-cross-layer": lambda: vllm_views(LAYOUTS["BLHNC"], kernel_split=2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gather_then_scatter_moves_exact_pages(case: str) -> None:
    src_layers = CASES[case]()
    src = PagedKV(src_layers, BLOCKS)
    assert src.block_bytes == sum(len(block_bytes(t, 0)) for t in src_layers)
    chunk = chunk_for(src, 2)
    src.gather([7, 2], chunk)
    dst_layers = CASES[case]()
    before = [[block_bytes(t, b) for b in range(BLOCKS)] for t in dst_layers]
    dst = PagedKV(dst_layers, BLOCKS)
    dst.scatter(chunk, [1, 5])
    for s, d, old in zip(src_layers, dst_layers, before, strict=True):
        assert block_bytes(d, 1) == block_bytes(s, 7)
        assert block_bytes(d, 5) == block_bytes(s, 2)
        for b in set(range(BLOCKS)) - {1, 5}:
            assert block_bytes(d, b) == old[b], b  # nothing else written, not even a neighbour


@pytest.mark.parametrize("case", sorted(CASES))
def test_runs_of_consecutive_blocks_move_as_one_copy_and_land_exactly(case: str) -> None:
    # The CPU path merges consecutive block ids into one copy per run: mixed spans, a skipped
    # block between two spans and a span that goes backwards must still land page for page.
    src_layers = CASES[case]()
    src = PagedKV(src_layers, BLOCKS)
    chunk = chunk_for(src, 6)
    src.gather([2, 3, 4, 8, 9, 0], chunk)
    dst_layers = CASES[case]()
    before = [[block_bytes(t, b) for b in range(BLOCKS)] for t in dst_layers]
    PagedKV(dst_layers, BLOCKS).scatter(chunk, [5, 6, 7, None, 1, 0])
    moved = {5: 2, 6: 3, 7: 4, 1: 9, 0: 0}
    for s, d, old in zip(src_layers, dst_layers, before, strict=True):
        for b in range(BLOCKS):
            assert block_bytes(d, b) == (block_bytes(s, moved[b]) if b in moved else old[b]), b


@pytest.mark.parametrize("case", ["LBNHC", "BLHNC", "kv-major"])
def test_runs_are_views_of_the_engines_storage_never_copies(case: str) -> None:
    layers = CASES[case]()
    for t in layers:
        for run in block_runs(t, BLOCKS):
            assert run.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    paged = PagedKV(layers, BLOCKS)
    chunk = torch.arange(paged.block_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    paged.scatter(chunk, [4])
    back = chunk_for(paged, 1)
    PagedKV(layers, BLOCKS).gather([4], back)
    assert torch.equal(back, chunk)


def test_run_counts_follow_the_layout() -> None:
    assert len(block_runs(vllm_views(LAYOUTS["LBHNC"])[0], BLOCKS)) == 1  # one dense page per block
    assert len(block_runs(vllm_views(LAYOUTS["LBNHC"])[0], BLOCKS)) == 1
    assert len(block_runs(vllm_views(LAYOUTS["LHBNC"])[0], BLOCKS)) == HEADS  # a run per head
    assert len(block_runs(kv_major_layout()[0], BLOCKS)) == 2  # K and V


def test_scatter_skips_blocks_marked_none() -> None:
    layers = cpu_layout()
    paged = PagedKV(layers, BLOCKS)
    chunk = chunk_for(paged, 2)
    paged.gather([3, 4], chunk)
    before = [t.clone() for t in layers]
    paged.scatter(chunk, [None, 8])  # block 0 of the chunk is already computed: leave it
    for b, t in zip(before, layers, strict=True):
        assert torch.equal(t[8], b[4])
        rest = [i for i in range(BLOCKS) if i != 8]
        assert torch.equal(t[rest], b[rest])


def test_a_chunk_of_the_wrong_size_is_refused() -> None:
    paged = PagedKV(cpu_layout(), BLOCKS)
    with pytest.raises(ValueError, match="does not hold"):
        paged.gather([1, 2], torch.empty(paged.block_bytes, dtype=torch.uint8))


@pytest.mark.parametrize("tensor", [torch.empty(3, 7), torch.empty(BLOCKS, 4, 6).transpose(1, 2),
                                    torch.empty(7)])
def test_a_tensor_without_addressable_blocks_raises_layout_error(tensor: torch.Tensor) -> None:
    with pytest.raises(LayoutError):
        PagedKV([tensor], BLOCKS)


def test_every_layout_pair_of_views_covers_disjoint_bytes() -> None:
    """Across all layers and runs, no byte of the buffer is addressed twice (no aliasing)."""
    for order in LAYOUTS.values():
        layers = vllm_views(order)
        paged = PagedKV(layers, BLOCKS)
        seen: set[int] = set()
        for run in paged.runs:
            base = run.storage_offset()
            for b, j in itertools.product(range(BLOCKS), (0, run.shape[1] - 1)):
                addr = base + b * run.stride(0) + j
                assert addr not in seen
                seen.add(addr)


# -- head shards: a head's bytes do not depend on how many heads the tensor holds ------------------

def one_head_of(layers: list[torch.Tensor], head: int, order: tuple[int, ...] | None,
                dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """The same layout holding only ``head`` (what a rank at tensor parallel HEADS holds)."""
    if order is None:  # [2, B, N, H, D] or [B, 2, N, H, D]
        return [t[:, :, :, head:head + 1].contiguous() for t in layers]
    out = vllm_views(order, dtype=dtype, heads=1)
    for dst, src in zip(out, layers, strict=True):
        dst.copy_(src[:, head:head + 1])
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes viewed as bf16 hold NaNs, which ``torch.equal`` calls unequal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def split_halves_layout() -> list[torch.Tensor]:
    """K and V in separate page halves: per layer [num_blocks, 2, block_size, kv_heads, head_dim]."""
    return [torch.randn(BLOCKS, 2, BS, HEADS, D).to(torch.bfloat16) for _ in range(LAYERS)]


HEAD_CASES = {**{name: (order, lambda order=order: vllm_views(order)) for name, order in LAYOUTS.items()},
              "cpu": (LAYOUTS["LBHNC"], cpu_layout), "kv-major": (None, kv_major_layout),
              "split-halves": (None, split_halves_layout)}


@pytest.mark.parametrize("case", sorted(HEAD_CASES))
def test_a_heads_shard_is_the_same_bytes_at_any_tensor_parallel_size(case: str) -> None:
    order, make = HEAD_CASES[case]
    whole_layers = make()
    dims = [head_dim_of(t, HEADS) for t in whole_layers]
    assert None not in dims
    whole = PagedKV(whole_layers, BLOCKS, heads=HEADS, head_dims=dims)
    for head in range(HEADS):
        part_layers = one_head_of(whole_layers, head, order)
        part = PagedKV(part_layers, BLOCKS, heads=1, head_dims=[head_dim_of(t, 1) for t in part_layers])
        assert part.block_bytes == whole.block_bytes == sum(len(block_bytes(t, 0)) for t in part_layers)
        a, b = chunk_for(whole, 2), chunk_for(part, 2)
        whole.gather([6, 1], a, shard=head)
        part.gather([6, 1], b)
        assert torch.equal(a, b), head
        # and back: the one-head chunk lands in the right head of the right blocks, nothing else
        dst_layers = [torch.zeros_like(t) for t in whole_layers] if order is None else \
            vllm_views(order, heads=HEADS)
        before = [t.clone() for t in dst_layers]
        dst = PagedKV(dst_layers, BLOCKS, heads=HEADS, head_dims=dims)
        dst.scatter(b, [3, None], shard=head)
        hd = dims[0]
        for t, old, src in zip(dst_layers, before, whole_layers, strict=True):
            got = t.select(hd, head)
            want = src.select(hd, head)
            blocks_dim = 1 if case == "kv-major" else 0
            assert same_bytes(got.select(blocks_dim, 3), want.select(blocks_dim, 6))
            others = torch.tensor([i for i in range(HEADS) if i != head])
            assert same_bytes(t.index_select(hd, others), old.index_select(hd, others))
            rest = torch.tensor([i for i in range(BLOCKS) if i != 3])
            assert same_bytes(got.index_select(blocks_dim, rest), old.select(hd, head).index_select(blocks_dim, rest))


def test_head_shards_of_kernel_blocks_and_mla() -> None:
    layers = vllm_views(LAYOUTS["LBNHC"], kernel_split=2)
    paged = PagedKV(layers, BLOCKS, heads=HEADS, head_dims=[head_dim_of(t, HEADS) for t in layers])
    assert paged.block_bytes * HEADS == PagedKV(layers, BLOCKS).block_bytes
    mla = vllm_views(LAYOUTS["LBHNC"], heads=1, content=72)
    one = PagedKV(mla, BLOCKS, heads=1, head_dims=[None] * LAYERS)
    legacy = PagedKV(mla, BLOCKS)
    a, b = chunk_for(one, 1), chunk_for(legacy, 1)
    one.gather([2], a)
    legacy.gather([2], b)
    assert torch.equal(a, b)  # one head: the same bytes as the whole page


def test_a_head_dimension_that_is_not_there_is_a_layout_error() -> None:
    layers = cpu_layout()
    assert head_dim_of(torch.empty(BLOCKS, 3, 3), HEADS) is None
    with pytest.raises(LayoutError, match="heads"):
        PagedKV(layers, BLOCKS, heads=3, head_dims=[1] * LAYERS)


def _fill(views: list[memoryview], chunk: torch.Tensor) -> None:
    """What a read in place does: the chunk's bytes into ``views``, in order."""
    data, offset = chunk.numpy().tobytes(), 0
    for view in views:
        view[:] = data[offset:offset + view.nbytes]
        offset += view.nbytes
    assert offset == len(data)


def _paged_of(case: str, layers: list[torch.Tensor], shards: bool) -> PagedKV:
    if not shards:
        return PagedKV(layers, BLOCKS)
    return PagedKV(layers, BLOCKS, heads=HEADS, head_dims=[head_dim_of(t, HEADS) for t in layers])


@pytest.mark.parametrize(("case", "shards"), [*((c, False) for c in sorted(CASES)),
                                              *((c, True) for c in sorted(HEAD_CASES))])
def test_page_views_filled_in_order_are_the_scatter_of_the_chunk(case: str, shards: bool) -> None:
    # A read in place fills ``page_views`` with a chunk file's payload, in order: the blocks
    # must then hold exactly what ``scatter`` of that payload puts there, for every layout it
    # offers views of (and it must offer them for vLLM's CPU layout, whole or per head).
    make = HEAD_CASES[case][1] if shards else CASES[case]
    src_layers = make()
    src = _paged_of(case, src_layers, shards)
    chunk = chunk_for(src, 3)
    src.gather([2, 3, 8], chunk, shard=shards * (HEADS - 1))
    a_layers, b_layers = make(), make()
    for a, b in zip(a_layers, b_layers, strict=True):
        b.view(torch.uint8).copy_(a.view(torch.uint8))
    a, b = _paged_of(case, a_layers, shards), _paged_of(case, b_layers, shards)
    views = b.page_views([4, 5, 0], shards * (HEADS - 1))
    if case == "cpu":
        assert views is not None
    if views is None:
        return
    assert all(v.readonly is False and v.contiguous for v in views)
    a.scatter(chunk, [4, 5, 0], shards * (HEADS - 1))
    _fill(views, chunk)
    for x, y in zip(a_layers, b_layers, strict=True):
        assert same_bytes(x, y)


def test_page_views_refuse_what_a_read_cannot_fill() -> None:
    layers = cpu_layout()
    paged = PagedKV(layers, BLOCKS, heads=HEADS, head_dims=[head_dim_of(t, HEADS) for t in layers])
    assert paged.page_views([1, None, 3]) is None  # a block the engine already holds: keep it
    nhd = vllm_views(LAYOUTS["LBNHC"])
    heads = PagedKV(nhd, BLOCKS, heads=HEADS, head_dims=[head_dim_of(t, HEADS) for t in nhd])
    assert heads.page_views([1, 2]) is None  # one head of an NHD page is strided
    whole = PagedKV(layers, BLOCKS).page_views([1, 2])
    assert whole is not None and len(whole) == LAYERS  # consecutive whole blocks: one view per layer
