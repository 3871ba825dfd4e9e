"""SGLang's own HiCache pieces on CPU, driven as its scheduler drives them (test helper).

Real sglang 0.5.23 objects throughout: a device KV pool (``MHATokenToKVPool`` on CPU), its
paged allocator, the host pool (``MHATokenToKVPoolHost``, pinning off) and the
``HiCacheController`` with its L3 threads (backup, prefetch, prefetch I/O, prefetch sync),
which load the storage backend through ``StorageBackendFactory``. What SGLang's radix cache
does between the controller's queues (allocate host pages for a storage hit and hand the
operation to the I/O thread) is done here, in the same order.

Also a command line, so that a second process reads what a first wrote::

    python tests/hicache/_hicache.py write|read --backend kvtier|file --dir D --seed S ...

prints one JSON line: the page hashes, the tokens the controller reported, and a digest of
the bytes that landed in the host pool.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

from kvtier.admin import init_pool

PAGE, LAYERS, HEADS, HEAD_DIM = 16, 4, 2, 64
KVTIER = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
          "class_name": "KVTierHiCacheStorage"}


def set_parallel(tp_rank: int = 0, tp_size: int = 1) -> None:
    """What SGLang's launcher publishes before a scheduler builds its caches."""
    get_parallel().override_permanently(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0)


def host_pool(layout: str = "layer_first", tokens: int = 2048, dtype: torch.dtype = torch.bfloat16,
              heads: int = HEADS) -> tuple[PagedTokenToKVPoolAllocator, MHATokenToKVPoolHost]:
    device = MHATokenToKVPool(tokens, PAGE, dtype, heads, HEAD_DIM, LAYERS, "cpu", False,
                              start_layer=0, end_layer=LAYERS - 1)
    allocator = PagedTokenToKVPoolAllocator(tokens, PAGE, dtype, "cpu", device, False)
    info = device.get_device_pool_infos()[0].buffer_info
    host = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=device.size, start_layer=device.start_layer,
                                end_layer=device.end_layer)
    return allocator, host


def controller(allocator: Any, host: Any, backend: str, extra: dict[str, Any]) -> HiCacheController:
    """A controller with L3 storage attached, as SGLang's scheduler makes it at start."""
    name = "dynamic" if backend == "kvtier" else backend
    extra = {**KVTIER, **extra} if backend == "kvtier" else dict(extra)
    return HiCacheController(allocator, host, PAGE, tp_group=None, load_cache_event=threading.Event(),
                             write_policy="write_through", storage_backend=name, model_name="tiny-test",
                             storage_backend_extra_config=extra)


def tokens_for(seed: int, n_pages: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n_pages * PAGE,), generator=g).tolist()


def fill_pages(host: Any, indices: torch.Tensor, seed: int) -> None:
    """Deterministic KV in the host pool's pages at ``indices`` (as a device->host backup leaves it)."""
    g = torch.Generator().manual_seed(seed + 1)
    for start in indices[::PAGE].tolist():
        page = host.get_data_page(start, flat=False)
        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))


def pages_digest(host: Any, indices: torch.Tensor, n_pages: int) -> str:
    h = hashlib.sha256()
    for start in indices[::PAGE].tolist()[:n_pages]:
        h.update(host.get_data_page(start, flat=True).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class Fetched:
    hit_tokens: int
    loaded_tokens: int
    host_indices: torch.Tensor | None


def backup(ctrl: HiCacheController, host: Any, tokens: list[int], seed: int,
           timeout_s: float = 60.0) -> tuple[list[str], torch.Tensor, int]:
    """Fill host pages with KV and write them to storage through the backup thread."""
    indices = host.alloc(len(tokens))
    assert indices is not None
    fill_pages(host, indices, seed)
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    op_id = ctrl.write_storage(indices, tokens, hash_value=hashes)
    done = _wait(ctrl.ack_backup_queue, lambda op: op.id == op_id, timeout_s)
    return hashes, indices, done.completed_tokens


def prefetch(ctrl: HiCacheController, host: Any, tokens: list[int], timeout_s: float = 60.0) -> Fetched:
    """A storage prefetch, end to end: hit query, host allocation, transfer, completion."""
    op = ctrl.prefetch("req-1", tokens)
    hit_op = _wait(ctrl.prefetch_hit_queue, lambda o: o is op, timeout_s)
    hit = hit_op.storage_hit_count
    if hit == 0:
        return Fetched(0, 0, None)
    indices = host.alloc(hit)
    assert indices is not None
    op.hash_value = op.hash_value[: hit // PAGE]
    op.host_indices = indices
    ctrl.prefetch_buffer.put(op)
    loaded = 0
    deadline = time.monotonic() + timeout_s
    while True:
        ack = ctrl.ack_prefetch_queue.get(timeout=max(0.1, deadline - time.monotonic()))
        if ack.completed_tokens is not None:
            loaded = max(loaded, ack.completed_tokens)
        if getattr(ack, "completed_req", False):
            return Fetched(hit, loaded, indices)


def _wait(q: queue.Queue[Any], match: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        item = q.get(timeout=max(0.1, deadline - time.monotonic()))
        if match(item):
            return item


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["write", "read"])
    ap.add_argument("--backend", choices=["kvtier", "file"], default="kvtier")
    ap.add_argument("--dir", required=True, help="the pool (kvtier: fs:// of it) or HiCacheFile's directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pages", type=int, default=8)
    ap.add_argument("--layout", default="layer_first")
    ap.add_argument("--v1", type=int, default=1, help="interface_v1 (zero-copy) or the generic path")
    ap.add_argument("--extra", default="{}", help="more extra config (JSON)")
    args = ap.parse_args(argv)
    set_parallel()
    allocator, host = host_pool(args.layout)
    if args.backend == "kvtier":
        extra = {"pool_url": f"fs://{init_pool(args.dir, None)}", "interface_v1": args.v1, **json.loads(args.extra)}
    else:
        extra = {"file_storage_path": args.dir}
    ctrl = controller(allocator, host, args.backend, extra)
    tokens = tokens_for(args.seed, args.pages)
    try:
        if args.mode == "write":
            hashes, indices, done = backup(ctrl, host, tokens, args.seed)
            out = {"hashes": hashes, "written_tokens": done, "digest": pages_digest(host, indices, args.pages)}
        else:
            got = prefetch(ctrl, host, tokens)
            n = got.loaded_tokens // PAGE
            out = {"hit_tokens": got.hit_tokens, "loaded_tokens": got.loaded_tokens,
                   "digest": pages_digest(host, got.host_indices, n) if got.host_indices is not None else ""}
    finally:
        ctrl.storage_stop_event.set()
        backend = ctrl.storage_backend
        if backend is not None and hasattr(backend, "close"):
            backend.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
