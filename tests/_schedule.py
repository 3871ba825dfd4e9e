"""How the full run (``scripts/test.sh``: pytest-xdist, ``-n 2 --dist loadfile
--no-loadscope-reorder``) shares the tests between its workers.

Each module is one unit of work (``loadfile``): its tests share module fixtures (engines started
once), so splitting a module would start them twice. Workers take units in collection order as
they free up, so the modules that start engines go first, longest first, and the quick modules
fill in behind them: neither worker is left alone with a long module at the end. Each worker
that runs GlusterFS tests starts its own volume (``scripts/glusterfs.sh`` runs instances side by
side).
"""

from __future__ import annotations

import pytest

# Seconds each module took in a full run on two workers on a 2-core machine (--durations=0,
# summed per module); only their order matters. A module not listed is weighed by its engine tests.
MEASURED_S: dict[str, float] = {
    "tests/integration/test_real_model.py": 1314,
    "tests/integration/test_vllm_deployment.py": 1032,
    "tests/faults/test_engine.py": 658,
    "tests/integration/test_vllm_connector.py": 637,
    "tests/integration/test_bench_suite.py": 499,
    "tests/integration/test_vllm_adversarial.py": 488,
    "tests/faults/test_gluster.py": 404,
    "tests/integration/test_vllm_fleet.py": 276,
    "tests/test_vllm_releases.py": 81,
}
ENGINE_TEST_S = 60.0


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def distributing(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker (the controller collects nothing)."""
    return hasattr(config, "workerinput")


def order_for_workers(items: list[pytest.Item]) -> None:
    """Sort the modules longest first, in place; a module's tests keep their order.

    The sort is stable and depends on the collection only: every worker must collect the same
    order, or xdist aborts the run."""
    weight: dict[str, float] = {}
    for item in items:
        engine = item.get_closest_marker("engine") or item.get_closest_marker("gluster")
        module = module_of(item)
        weight[module] = weight.get(module, 0.0) + (ENGINE_TEST_S if engine else 0.0)
    for module in weight:
        weight[module] = MEASURED_S.get(module, weight[module])
    items.sort(key=lambda item: -weight[module_of(item)])
