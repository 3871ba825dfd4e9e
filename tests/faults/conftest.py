"""What the fault rows share."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def engine_bench(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One ``Bench`` (the tiny model, the prompts and their reference run) for every engine row,
    local or on GlusterFS: the reference is an engine run of its own (about 35 s on CI) whose
    tokens do not depend on the row."""
    if os.environ.get("KVTIER_REQUIRE_VLLM") != "1":
        pytest.importorskip("vllm")
    from .harness import SCALES
    from .harness.engine import Bench

    bench = Bench(tmp_path_factory.mktemp("engine-faults"), SCALES["ci"].engine_prompts)
    bench.reference()
    return bench
