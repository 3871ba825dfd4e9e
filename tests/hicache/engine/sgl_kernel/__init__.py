"""A test-only stand-in for sgl-kernel's CPU build, which PyPI does not have (see docs/sglang.md).

SGLang 0.5.23's CPU engine imports nine names from ``sgl_kernel`` at start (``copy_all_layer_kv_cache_cpu``,
``assign_req_to_token_pool_cpu``, speculative-decoding helpers) and, with ``--attention-backend
torch_native`` on a CPU without AMX, calls none of them while serving a Llama model. Every name
resolves to a function that raises NotImplementedError naming the op, so a code path that does
need a real kernel fails loudly instead of computing something else.
"""

__version__ = "0.0.0+kvtier-test-standin"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: the test stand-in has no CPU implementation of it")

    missing.__name__ = name
    return missing
