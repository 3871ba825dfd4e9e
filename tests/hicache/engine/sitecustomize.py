"""Test-only patches that let SGLang 0.5.23's CPU engine run HiCache here (see docs/sglang.md).

On ``PYTHONPATH`` for the engine test, so SGLang's scheduler and detokenizer processes (spawned)
load it too. Two gaps, each patched right after its module is imported:

* ``pool_host.common._cuda_host_register``: the HiCache host pool pins its memory with
  ``cudaHostRegister`` whatever the device; without CUDA that raises. Pinning is skipped.
* ``pool_host.mha.transfer_kv_direct`` (device <-> host page copies for ``--hicache-io-backend
  direct``): SGLang binds it only on CUDA, ROCm and XPU (from sgl-kernel). Here it is the same
  token-row copy in torch.
"""

import importlib.abc
import importlib.machinery
import sys

PATCHES = {}


def _after_import(module_name):
    def register(patch):
        PATCHES[module_name] = patch
        return patch
    return register


@_after_import("sglang.srt.mem_cache.pool_host.common")
def _no_pinning(module):
    module._cuda_host_register = lambda buffer, registration_granularity_bytes=None: None


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """``sgl_kernel.kvcacheio.transfer_kv_direct``: token rows ``src[src_indices]`` to ``dst[dst_indices]``."""
    import torch

    src_indices = src_indices.to("cpu", dtype=torch.long)
    dst_indices = dst_indices.to("cpu", dtype=torch.long)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices] = src[src_indices]


@_after_import("sglang.srt.mem_cache.pool_host.mha")
def _direct_transfers(module):
    module.transfer_kv_direct = transfer_kv_direct


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
